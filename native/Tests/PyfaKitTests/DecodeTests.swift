import XCTest
import PyfaKit

final class DecodeTests: XCTestCase {
    let device = try! Device(backend: "cpu")

    /// Float64 decode of every (sequence, head): out [B*H*D], lse [B*H].
    func reference(q: Buffer, k: Buffer, v: Buffer, kvLen: [Int], ringStart: [Int], window: Int? = nil,
                   scale: Double, softcap: Double = 0) throws -> ([Double], [Double]) {
        let D = q.shape.last!, cap = k.shape[k.shape.count - 2], Hkv = k.shape[k.shape.count - 3]
        let H = q.shape[q.shape.count - 2], B = q.count / (H * D)
        let (qs, ks, vs) = (Ref.rows(try q.floats(), D), Ref.rows(try k.floats(), D), Ref.rows(try v.floats(), D))
        var out: [Double] = [], lse: [Double] = []
        for b in 0..<B {
            for h in 0..<H {
                let base = (b * Hkv + h / (H / Hkv)) * cap
                // Slot s holds logical position (s - ringStart) mod cap, one of the kvLen positions
                // when that is below kvLen; a window keeps the last `window`.
                let visible = (0..<cap).map { s -> Bool in
                    let pos = (s - ringStart[b] + cap) % cap
                    return pos < kvLen[b] && (window.map { pos >= kvLen[b] - $0 } ?? true)
                }
                let (o, l) = Ref.row(q: qs[b * H + h], keys: Array(ks[base..<base + cap]),
                                     values: Array(vs[base..<base + cap]), scale: scale, softcap: softcap,
                                     visible: visible)
                out += o
                lse.append(l)
            }
        }
        return (out, lse)
    }

    func testBatchedGQAWithPerSequenceLengthsMatchesReference() throws {
        let (B, H, Hkv, cap, D) = (2, 4, 2, 40, 64)
        let q = try filled(device, [B, H, D], seed: 1)
        let k = try filled(device, [B, Hkv, cap, D], seed: 2), v = try filled(device, [B, Hkv, cap, D], seed: 3)
        let result = try decodeAttention(q: q, k: k, v: v, kvLen: [40, 17], options: DecodeOptions(returnLSE: true))
        XCTAssertEqual(result.out.shape, [B, H, D])
        XCTAssertEqual(result.lse?.shape, [B, H])
        let (out, lse) = try reference(q: q, k: k, v: v, kvLen: [40, 17], ringStart: [0, 0], scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 2e-5, "out")
        assertClose(try result.lse!.floats(), lse, tol: 2e-5, "lse")
    }

    func testWindowSoftcapScaleAndRingStartMatchReference() throws {
        let (H, Hkv, cap, D) = (2, 1, 24, 128)
        let q = try filled(device, [H, D], seed: 4)
        let k = try filled(device, [Hkv, cap, D], seed: 5), v = try filled(device, [Hkv, cap, D], seed: 6)
        let options = DecodeOptions(scale: 0.3, window: 10, softcap: 2, ringStart: [7], returnLSE: true)
        let result = try decodeAttention(q: q, k: k, v: v, kvLen: cap, options: options)
        XCTAssertEqual(result.out.shape, [H, D])
        let (out, lse) = try reference(q: q, k: k, v: v, kvLen: [cap], ringStart: [7], window: 10, scale: 0.3, softcap: 2)
        assertClose(try result.out.floats(), out, tol: 2e-5, "out")
        assertClose(try result.lse!.floats(), lse, tol: 2e-5, "lse")
    }

    /// The same API on a second backend: Metal (a GPU on a Mac, the MSL
    /// executor on Linux), where it opens.
    func testDecodeOnTheMetalBackendMatchesReference() throws {
        let metal: Device
        do {
            metal = try Device(backend: "metal")
        } catch let error as PyfaError where error.code == .backendUnavailable {
            throw XCTSkip("no Metal device: \(error.message)")
        }
        XCTAssertEqual(metal.backend, "metal")
        let q = try filled(metal, [2, 2, 64], seed: 1)
        let k = try filled(metal, [2, 1, 16, 64], .float16, seed: 2), v = try filled(metal, [2, 1, 16, 64], .float16, seed: 3)
        let result = try decodeAttention(q: q, k: k, v: v, kvLen: [16, 9], options: DecodeOptions(returnLSE: true))
        let (out, lse) = try reference(q: q, k: k, v: v, kvLen: [16, 9], ringStart: [0, 0], scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 1e-4, "out")
        assertClose(try result.lse!.floats(), lse, tol: 1e-4, "lse")
    }

    func testHalfCachesAndOutputDType() throws {
        let (H, cap, D) = (4, 32, 64)
        let q = try filled(device, [H, D], .bfloat16, seed: 7)
        let k = try filled(device, [2, cap, D], .float16, seed: 8), v = try filled(device, [2, cap, D], .float16, seed: 9)
        let result = try decodeAttention(q: q, k: k, v: v, kvLen: 30, options: DecodeOptions(outDType: .float32))
        XCTAssertEqual(result.out.dtype, .float32)
        XCTAssertNil(result.lse)
        let (out, _) = try reference(q: q, k: k, v: v, kvLen: [30], ringStart: [0], scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 1e-4, "out")
        let rounded = try decodeAttention(q: q, k: k, v: v, kvLen: 30)
        XCTAssertEqual(rounded.out.dtype, .bfloat16)
        assertClose(try rounded.out.floats(), out, tol: 1e-2, "bf16 out")
    }

    // ---- bad input: one test per rule ----

    func testKvLenAboveCapacityIsInvalid() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "kv_len[0]: 9 must be in 1...kv_capacity (8)") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 9)
        }
        assertPyfaError(.invalidArgument, "kv_len[0]: 0") { try decodeAttention(q: q, k: k, v: k, kvLen: 0) }
    }

    func testKvLenNeedsOneValuePerSequence() throws {
        let q = try filled(device, [2, 2, 64], seed: 1), k = try filled(device, [2, 1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "kvLen: 1 values, expected one per sequence (2)") {
            try decodeAttention(q: q, k: k, v: k, kvLen: [4])
        }
    }

    func testKvLenMustFitInt32() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "kvLen[0]") { try decodeAttention(q: q, k: k, v: k, kvLen: Int.max) }
    }

    func testUnsupportedHeadDimIsInvalid() throws {
        let q = try filled(device, [2, 48], seed: 1), k = try filled(device, [1, 8, 48], seed: 2)
        assertPyfaError(.invalidArgument, "head_dim: 48 is not supported") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8)
        }
    }

    func testQueryRankIsChecked() throws {
        let q = try filled(device, [64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "q: expected [B, H, D] or [H, D]") { try decodeAttention(q: q, k: k, v: k, kvLen: 8) }
    }

    func testCacheShapeMustMatchQuery() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 128], seed: 2)
        assertPyfaError(.invalidArgument, "k: shape [1, 8, 128] does not match q's [2, 64]") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8)
        }
        let k4 = try filled(device, [1, 1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "k: expected [H_kv, capacity, D]") { try decodeAttention(q: q, k: k4, v: k4, kvLen: 8) }
    }

    func testValuesMustMatchKeys() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        let vShape = try filled(device, [1, 4, 64], seed: 3), vType = try filled(device, [1, 8, 64], .float16, seed: 3)
        assertPyfaError(.invalidArgument, "v: shape") { try decodeAttention(q: q, k: k, v: vShape, kvLen: 4) }
        assertPyfaError(.invalidArgument, "v: dtype f16 differs from k's f32") { try decodeAttention(q: q, k: k, v: vType, kvLen: 4) }
    }

    func testHeadsMustBeAMultipleOfKVHeads() throws {
        let q = try filled(device, [3, 64], seed: 1), k = try filled(device, [2, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "num_heads: 3 must be a multiple of num_kv_heads (2)") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8)
        }
    }

    func testWindowMustBePositive() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "window: must be nil or >= 1, got 0") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8, options: DecodeOptions(window: 0))
        }
    }

    func testScaleMustBeFinite() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "scale: must be finite") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8, options: DecodeOptions(scale: .nan))
        }
    }

    func testSoftcapMustBeNonNegative() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "softcap: must be finite and >= 0") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8, options: DecodeOptions(softcap: -1))
        }
    }

    /// kv_len positions from slot ring_start, wrapping at the capacity: a run shorter than the
    /// cache may start anywhere (slots 6, 7, 0, 1, 2 here); a start outside the cache is refused.
    func testRingStartBeginsARunOfPositions() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        let v = try filled(device, [1, 8, 64], seed: 3)
        let result = try decodeAttention(q: q, k: k, v: v, kvLen: 5, options: DecodeOptions(ringStart: [6]))
        let (out, _) = try reference(q: q, k: k, v: v, kvLen: [5], ringStart: [6], scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 2e-5, "out")
        assertPyfaError(.invalidArgument, "ring_start[0]: 8 must be in 0..<kv_capacity (8)") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8, options: DecodeOptions(ringStart: [8]))
        }
    }

    func testOutputDTypeMustBeAFloat() throws {
        let q = try filled(device, [2, 64], seed: 1), k = try filled(device, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "out") {
            try decodeAttention(q: q, k: k, v: k, kvLen: 8, options: DecodeOptions(outDType: .int32))
        }
    }

    func testBuffersMustShareOneDevice() throws {
        let other = try Device(backend: "cpu")
        let q = try filled(device, [2, 64], seed: 1), k = try filled(other, [1, 8, 64], seed: 2)
        assertPyfaError(.invalidArgument, "k: belongs to another device") { try decodeAttention(q: q, k: k, v: k, kvLen: 8) }
    }
}
