import XCTest
import PyfaKit

final class PrefillTests: XCTestCase {
    let device = try! Device(backend: "cpu")

    struct Case {
        var B = 1, H = 2, Hkv = 1, qLen = 5, kvLen = 7, D = 64
        var causal = false, qOffset: Int? = nil, window: Int? = nil, softcap = 0.0, scale = 0.125
        var layout = Layout.bhsd
        /// mask[b][h][i][j]: nil = none; true/false (bool) or a bias (additive).
        var visible: ((Int, Int, Int, Int) -> Bool)? = nil
        var bias: ((Int, Int, Int, Int) -> Double)? = nil
    }

    /// Element index of (b, h, row, d) in a contiguous tensor of `layout`.
    func index(_ c: Case, _ layout: Layout, heads: Int, rows: Int, _ b: Int, _ h: Int, _ i: Int, _ d: Int) -> Int {
        layout == .bhsd ? ((b * heads + h) * rows + i) * c.D + d : ((b * rows + i) * heads + h) * c.D + d
    }

    /// Float64 prefill: out in q's layout, lse [B, H, qLen].
    func reference(_ c: Case, q: [Float], k: [Float], v: [Float]) -> ([Double], [Double]) {
        var out = [Double](repeating: 0, count: q.count), lse: [Double] = []
        let offset = c.qOffset ?? c.kvLen - c.qLen
        for b in 0..<c.B {
            for h in 0..<c.H {
                let hk = h / (c.H / c.Hkv)
                let vec = { (a: [Float], heads: Int, rows: Int, hh: Int, i: Int) in
                    (0..<c.D).map { Double(a[self.index(c, c.layout, heads: heads, rows: rows, b, hh, i, $0)]) }
                }
                let keys = (0..<c.kvLen).map { vec(k, c.Hkv, c.kvLen, hk, $0) }
                let values = (0..<c.kvLen).map { vec(v, c.Hkv, c.kvLen, hk, $0) }
                for i in 0..<c.qLen {
                    let p = offset + i
                    let visible = (0..<c.kvLen).map { j in
                        (!c.causal || j <= p) && (c.window.map { p - j < $0 } ?? true) && (c.visible?(b, h, i, j) ?? true)
                    }
                    let bias = c.bias.map { f in (0..<c.kvLen).map { f(b, h, i, $0) } }
                    let (o, l) = Ref.row(q: vec(q, c.H, c.qLen, h, i), keys: keys, values: values, scale: c.scale,
                                         softcap: c.softcap, visible: visible, bias: bias)
                    for d in 0..<c.D { out[index(c, c.layout, heads: c.H, rows: c.qLen, b, h, i, d)] = o[d] }
                    lse.append(l)
                }
            }
        }
        return (out, lse)
    }

    func shape(_ c: Case, heads: Int, rows: Int) -> [Int] {
        c.layout == .bhsd ? [c.B, heads, rows, c.D] : [c.B, rows, heads, c.D]
    }

    func check(_ c: Case, mask: Buffer? = nil, tol: Double = 2e-5) throws {
        let q = try filled(device, shape(c, heads: c.H, rows: c.qLen), seed: 11)
        let k = try filled(device, shape(c, heads: c.Hkv, rows: c.kvLen), seed: 12)
        let v = try filled(device, shape(c, heads: c.Hkv, rows: c.kvLen), seed: 13)
        let options = AttentionOptions(scale: Float(c.scale), causal: c.causal, qOffset: c.qOffset, mask: mask,
                                       window: c.window, softcap: Float(c.softcap), layout: c.layout, returnLSE: true)
        let result = try attention(q: q, k: k, v: v, options: options)
        XCTAssertEqual(result.out.shape, q.shape)
        XCTAssertEqual(result.lse?.shape, [c.B, c.H, c.qLen])
        let (out, lse) = reference(c, q: try q.floats(), k: try k.floats(), v: try v.floats())
        assertClose(try result.out.floats(), out, tol: tol, "out")
        assertClose(try result.lse!.floats(), lse, tol: tol, "lse")
    }

    func testCausalGQAMatchesReference() throws {
        try check(Case(B: 2, H: 4, Hkv: 2, qLen: 9, kvLen: 9, causal: true))
    }

    func testBSHDWithWindowSoftcapAndQOffsetMatchesReference() throws {
        // qOffset -2: the first rows sit before position 0 and see no key (zeros, -inf).
        try check(Case(H: 2, Hkv: 2, qLen: 6, kvLen: 11, D: 128, causal: true, qOffset: -2, window: 3, softcap: 1.5,
                       layout: .bshd))
    }

    func testBoolMaskMatchesReference() throws {
        // Wide enough in keys that the tile pre-pass runs on the CPU's tiles.
        var c = Case(qLen: 8, kvLen: 300)
        let rule = { (_: Int, _: Int, i: Int, j: Int) in (i + j) % 3 != 0 && j < 200 }
        c.visible = rule
        let bytes = (0..<c.qLen).flatMap { i in (0..<c.kvLen).map { j in UInt8(rule(0, 0, i, j) ? 1 : 0) } }
        let mask = try Buffer(device, shape: [c.qLen, c.kvLen], dtype: .uint8)
        try mask.write(bytes: bytes)
        try check(c, mask: mask)
    }

    func testAdditiveMaskPerBatchAndHeadMatchesReference() throws {
        var c = Case(B: 2, H: 2, Hkv: 1, qLen: 4, kvLen: 6)
        // One blocked key per row, the others a bias of (j - i) / 4.
        let bias = { (b: Int, h: Int, i: Int, j: Int) -> Double in
            if j == (b + h + i) % 6 { return -Double.infinity }
            return Double(j - i) * 0.25
        }
        c.bias = bias
        var values: [Float] = []
        for b in 0..<2 { for h in 0..<2 { for i in 0..<4 { for j in 0..<6 { values.append(Float(bias(b, h, i, j))) } } } }
        try check(c, mask: try Buffer(device, shape: [2, 2, 4, 6], dtype: .float32, values: values))
    }

    func testHalfInputsWithFloat32Output() throws {
        let q = try filled(device, [1, 2, 5, 64], .float16, seed: 1), k = try filled(device, [1, 2, 5, 64], .float16, seed: 2)
        let result = try attention(q: q, k: k, v: k, options: AttentionOptions(outDType: .float32))
        XCTAssertEqual(result.out.dtype, .float32)
        let (out, _) = reference(Case(H: 2, Hkv: 2, qLen: 5, kvLen: 5), q: try q.floats(), k: try k.floats(), v: try k.floats())
        assertClose(try result.out.floats(), out, tol: 1e-4, "out")
    }

    // ---- merge ----

    func testMergeOfTwoKeyRangesEqualsAttentionOverAll() throws {
        let q = try filled(device, [1, 2, 4, 64], seed: 1)
        let k = try filled(device, [1, 2, 10, 64], seed: 2), v = try filled(device, [1, 2, 10, 64], seed: 3)
        let kv = (try k.floats(), try v.floats())
        func part(_ r: Range<Int>) throws -> AttentionOutput {
            // Keys r of each of the 2 heads ([1, 2, 10, 64] -> [1, 2, r.count, 64]).
            func slice(_ a: [Float]) -> [Float] {
                var rows: [Float] = []
                for h in 0..<2 {
                    let lo = (h * 10 + r.lowerBound) * 64, hi = (h * 10 + r.upperBound) * 64
                    rows += a[lo..<hi]
                }
                return rows
            }
            let kp = try Buffer(device, shape: [1, 2, r.count, 64], dtype: .float32, values: slice(kv.0))
            let vp = try Buffer(device, shape: [1, 2, r.count, 64], dtype: .float32, values: slice(kv.1))
            return try attention(q: q, k: kp, v: vp, options: AttentionOptions(returnLSE: true))
        }
        let (a, b) = (try part(0..<3), try part(3..<10))
        let merged = try mergeAttentionStates(oA: a.out, lseA: a.lse!, oB: b.out, lseB: b.lse!)
        let (out, lse) = reference(Case(H: 2, Hkv: 2, qLen: 4, kvLen: 10), q: try q.floats(), k: kv.0, v: kv.1)
        assertClose(try merged.out.floats(), out, tol: 2e-5, "out")
        assertClose(try merged.lse.floats(), lse, tol: 2e-5, "lse")
    }

    func testMergeOfDecodeOutputsEqualsDecodeOverBoth() throws {
        let q = try filled(device, [2, 64], seed: 4)
        let k = try filled(device, [1, 16, 64], seed: 5), v = try filled(device, [1, 16, 64], seed: 6)
        let whole = try decodeAttention(q: q, k: k, v: v, kvLen: 16, options: DecodeOptions(returnLSE: true))
        // Keys 0..<6 and 6..<16 as two caches.
        let (kf, vf) = (try k.floats(), try v.floats())
        let first = try decodeAttention(q: q, k: try Buffer(device, shape: [1, 6, 64], dtype: .float32, values: Array(kf[..<384])),
                                        v: try Buffer(device, shape: [1, 6, 64], dtype: .float32, values: Array(vf[..<384])),
                                        kvLen: 6, options: DecodeOptions(returnLSE: true))
        let second = try decodeAttention(q: q, k: try Buffer(device, shape: [1, 10, 64], dtype: .float32, values: Array(kf[384...])),
                                         v: try Buffer(device, shape: [1, 10, 64], dtype: .float32, values: Array(vf[384...])),
                                         kvLen: 10, options: DecodeOptions(returnLSE: true))
        let merged = try mergeAttentionStates(oA: first.out, lseA: first.lse!, oB: second.out, lseB: second.lse!)
        XCTAssertEqual(merged.out.shape, [2, 64])
        XCTAssertEqual(merged.lse.shape, [2])
        assertClose(try merged.out.floats(), try whole.out.floats().map(Double.init), tol: 2e-5, "out")
        assertClose(try merged.lse.floats(), try whole.lse!.floats().map(Double.init), tol: 2e-5, "lse")
    }

    // ---- bad input: one test per rule ----

    func testPrefillRankIsChecked() throws {
        let q = try filled(device, [2, 5, 64], seed: 1)
        assertPyfaError(.invalidArgument, "q: expected [B, H, L, D] (layout bhsd)") { try attention(q: q, k: q, v: q) }
    }

    func testPrefillKeysMustHaveQueryDType() throws {
        let q = try filled(device, [1, 2, 5, 64], seed: 1), k = try filled(device, [1, 2, 5, 64], .float16, seed: 2)
        assertPyfaError(.invalidArgument, "k: dtype f16 differs from q's f32") { try attention(q: q, k: k, v: k) }
    }

    func testPrefillHeadDimsMustAgree() throws {
        let q = try filled(device, [1, 2, 5, 64], seed: 1), k = try filled(device, [1, 2, 5, 128], seed: 2)
        assertPyfaError(.invalidArgument, "k: head_dim 128 differs from q's head_dim 64") { try attention(q: q, k: k, v: k) }
    }

    func testPrefillUnsupportedHeadDimIsInvalid() throws {
        let q = try filled(device, [1, 1, 3, 40], seed: 1)
        assertPyfaError(.invalidArgument, "head_dim: 40 is not supported") { try attention(q: q, k: q, v: q) }
    }

    func testMaskShapeIsChecked() throws {
        let q = try filled(device, [1, 2, 5, 64], seed: 1)
        let mask = try Buffer(device, shape: [5, 4], dtype: .uint8)
        assertPyfaError(.invalidArgument, "mask: expected shape [q_len, kv_len] = [5, 5]") {
            try attention(q: q, k: q, v: q, options: AttentionOptions(mask: mask))
        }
    }

    func testMaskDTypeIsChecked() throws {
        let q = try filled(device, [1, 2, 5, 64], seed: 1)
        let mask = try Buffer(device, shape: [5, 5], dtype: .int32)
        assertPyfaError(.invalidArgument, "mask") { try attention(q: q, k: q, v: q, options: AttentionOptions(mask: mask)) }
    }

    func testPrefillOutputIsQDTypeOrFloat32() throws {
        let q = try filled(device, [1, 2, 5, 64], seed: 1)
        assertPyfaError(.invalidArgument, "out") {
            try attention(q: q, k: q, v: q, options: AttentionOptions(outDType: .float16))
        }
    }

    func testMergeLSEShapeIsChecked() throws {
        let o = try filled(device, [1, 2, 3, 64], seed: 1), lse = try filled(device, [1, 2, 4], seed: 2)
        assertPyfaError(.invalidArgument, "lseA: expected shape [1, 2, 3], got [1, 2, 4]") {
            try mergeAttentionStates(oA: o, lseA: lse, oB: o, lseB: lse)
        }
    }

    func testMergeLSEMustBeFloat32() throws {
        let o = try filled(device, [2, 64], seed: 1), lse = try filled(device, [2], .float16, seed: 2)
        assertPyfaError(.invalidArgument, "lseA: dtype f16 must be f32") {
            try mergeAttentionStates(oA: o, lseA: lse, oB: o, lseB: lse)
        }
    }

    func testMergeStatesMustMatch() throws {
        let a = try filled(device, [2, 64], seed: 1), b = try filled(device, [4, 64], seed: 2)
        let lse = try filled(device, [2], seed: 3)
        assertPyfaError(.invalidArgument, "oB: shape [4, 64] differs from oA's [2, 64]") {
            try mergeAttentionStates(oA: a, lseA: lse, oB: b, lseB: lse)
        }
    }
}
