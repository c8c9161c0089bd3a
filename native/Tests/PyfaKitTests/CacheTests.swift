import XCTest
import PyfaKit

final class CacheTests: XCTestCase {
    let device = try! Device(backend: "cpu")

    /// Float64 decode of q [H, D] over the rows (oldest first) of [n, Hkv, D] tokens.
    func reference(q: [Float], tokens k: [Float], _ v: [Float], H: Int, Hkv: Int, D: Int,
                   scale: Double) -> ([Double], [Double]) {
        let n = k.count / (Hkv * D)
        var out: [Double] = [], lse: [Double] = []
        for h in 0..<H {
            let hk = h / (H / Hkv)
            let rows = { (a: [Float]) in (0..<n).map { t in a[(t * Hkv + hk) * D..<(t * Hkv + hk + 1) * D].map(Double.init) } }
            let (o, l) = Ref.row(q: q[h * D..<(h + 1) * D].map(Double.init), keys: rows(k), values: rows(v), scale: scale)
            out += o
            lse.append(l)
        }
        return (out, lse)
    }

    func testDenseCacheAppendsAndAttends() throws {
        let (H, Hkv, D) = (4, 2, 64)
        let cache = try KVCache(device, numKVHeads: Hkv, headDim: D, capacity: 16, dtype: .float32)
        let k1 = try filled(device, [3, Hkv, D], seed: 1), v1 = try filled(device, [3, Hkv, D], seed: 2)
        let k2 = try filled(device, [5, Hkv, D], .float16, seed: 3), v2 = try filled(device, [5, Hkv, D], .float16, seed: 4)
        try cache.append(k: k1, v: v1)
        try cache.append(k: k2, v: v2)
        XCTAssertEqual(cache.count, 8)
        let q = try filled(device, [H, D], seed: 5)
        let result = try cache.attend(q: q, options: CacheAttendOptions(returnLSE: true))
        let (out, lse) = reference(q: try q.floats(), tokens: try k1.floats() + k2.floats(), try v1.floats() + v2.floats(),
                                   H: H, Hkv: Hkv, D: D, scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 2e-5, "out")
        assertClose(try result.lse!.floats(), lse, tol: 2e-5, "lse")
    }

    func testSlidingWindowRingKeepsTheLastTokens() throws {
        let (H, D, cap, window) = (2, 64, 8, 6)
        let cache = try KVCache(device, numKVHeads: 1, headDim: D, capacity: cap, dtype: .float32, slidingWindow: window)
        var allK: [Float] = [], allV: [Float] = []
        // 13 tokens, then 11 in one append (more than the capacity): 24 in all.
        for (n, seed) in [(13, UInt64(10)), (11, 20)] {
            let k = try filled(device, [n, 1, D], seed: seed), v = try filled(device, [n, 1, D], seed: seed + 1)
            try cache.append(k: k, v: v)
            allK += try k.floats()
            allV += try v.floats()
        }
        XCTAssertEqual(cache.count, cap)
        let q = try filled(device, [H, D], seed: 30)
        let result = try cache.attend(q: q)
        let last = { (a: [Float]) -> [Float] in Array(a[((24 - window) * D)...]) }
        let (out, _) = reference(q: try q.floats(), tokens: last(allK), last(allV), H: H, Hkv: 1, D: D, scale: 1 / 8)
        assertClose(try result.out.floats(), out, tol: 2e-5, "out")
    }

    func testEmptyCacheGivesZerosAndMinusInfinity() throws {
        let cache = try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4)
        let result = try cache.attend(q: try filled(device, [2, 64], seed: 1), options: CacheAttendOptions(returnLSE: true))
        XCTAssertEqual(try result.out.floats(), [Float](repeating: 0, count: 128))
        XCTAssertEqual(try result.lse!.floats(), [-.infinity, -.infinity])
    }

    func testTurboQuantCacheMatchesAttentionOverItsDequantizedRows() throws {
        let (H, Hkv, D) = (4, 2, 128)
        let cache = try TurboQuantKVCache(device, numKVHeads: Hkv, headDim: D, capacity: 32, kBits: 8, vBits: 4, seed: 7)
        let k = try filled(device, [20, Hkv, D], seed: 1), v = try filled(device, [20, Hkv, D], seed: 2)
        try cache.append(k: k, v: v)
        XCTAssertEqual(cache.count, 20)
        XCTAssertEqual(cache.nbytes, Hkv * 32 * (D + D / 2) + 2 * Hkv * 32 * 4)
        let (dk, dv) = try cache.dequantize()
        XCTAssertEqual(dk.shape, [20, Hkv, D])
        // 8-bit codes reconstruct each row to about 1% of its norm.
        let (kf, dkf) = (try k.floats(), try dk.floats())
        let err = zip(kf, dkf).map { Double($0 - $1) * Double($0 - $1) }.reduce(0, +)
        XCTAssertLessThan((err / kf.map { Double($0 * $0) }.reduce(0, +)).squareRoot(), 0.02)
        // The rotation is orthogonal: attention over the codes is attention over the decoded rows.
        let q = try filled(device, [H, D], seed: 3)
        let result = try cache.attend(q: q, options: CacheAttendOptions(returnLSE: true))
        let (out, lse) = reference(q: try q.floats(), tokens: dkf, try dv.floats(), H: H, Hkv: Hkv, D: D,
                                   scale: 1 / Double(D).squareRoot())
        assertClose(try result.out.floats(), out, tol: 1e-4, "out")
        assertClose(try result.lse!.floats(), lse, tol: 1e-4, "lse")
    }

    // ---- bad input: one test per rule ----

    func testAppendPastCapacityIsRefusedAndChangesNothing() throws {
        let cache = try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4)
        let rows = try filled(device, [3, 1, 64], seed: 1)
        try cache.append(k: rows, v: rows)
        assertPyfaError(.invalidArgument, "append: 3 tokens would exceed capacity 4 (3 stored)") {
            try cache.append(k: rows, v: rows)
        }
        XCTAssertEqual(cache.count, 3)
    }

    func testAppendRowShapeIsChecked() throws {
        let cache = try KVCache(device, numKVHeads: 2, headDim: 64, capacity: 4)
        let rows = try filled(device, [3, 1, 64], seed: 1)
        assertPyfaError(.invalidArgument, "k: expected shape [n >= 1, numKVHeads=2, headDim=64], got [3, 1, 64]") {
            try cache.append(k: rows, v: rows)
        }
    }

    func testAppendNeedsOneVRowPerKRow() throws {
        let cache = try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4)
        let k = try filled(device, [3, 1, 64], seed: 1), v = try filled(device, [2, 1, 64], seed: 2)
        assertPyfaError(.invalidArgument, "v: 2 tokens, k has 3") { try cache.append(k: k, v: v) }
    }

    func testAttendQueryShapeIsChecked() throws {
        let cache = try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4)
        assertPyfaError(.invalidArgument, "q: expected shape [H, headDim=64]") {
            try cache.attend(q: try filled(device, [2, 128], seed: 1))
        }
    }

    func testAttendOptionsAreCheckedOnAnEmptyCache() throws {
        let cache = try KVCache(device, numKVHeads: 2, headDim: 64, capacity: 4)
        assertPyfaError(.invalidArgument, "num_heads: 3 must be a multiple of num_kv_heads (2)") {
            try cache.attend(q: try filled(device, [3, 64], seed: 1))
        }
        assertPyfaError(.invalidArgument, "scale: must be finite") {
            try cache.attend(q: try filled(device, [2, 64], seed: 1), options: CacheAttendOptions(scale: .infinity))
        }
    }

    func testCacheSizesAreChecked() throws {
        assertPyfaError(.invalidArgument, "capacity: must be in 1...") { try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 0) }
        assertPyfaError(.invalidArgument, "capacity: 4 must be >= slidingWindow (8)") {
            try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4, slidingWindow: 8)
        }
        assertPyfaError(.invalidArgument, "dtype: u8 must be f32, f16 or bf16") {
            try KVCache(device, numKVHeads: 1, headDim: 64, capacity: 4, dtype: .uint8)
        }
    }

    func testDenseCacheUnsupportedHeadDimIsRefusedByAttend() throws {
        let cache = try KVCache(device, numKVHeads: 1, headDim: 48, capacity: 4)
        assertPyfaError(.invalidArgument, "head_dim: 48 is not supported") {
            try cache.attend(q: try filled(device, [1, 48], seed: 1))
        }
    }

    func testTurboQuantHeadDimMustBeAPowerOfTwo() {
        assertPyfaError(.invalidArgument, "headDim: 80 is not supported by TurboQuant") {
            try TurboQuantKVCache(device, numKVHeads: 1, headDim: 80, capacity: 4)
        }
    }

    func testTurboQuantBitsAreChecked() {
        assertPyfaError(.invalidArgument, "vBits: 5 is not a TurboQuant bit width") {
            try TurboQuantKVCache(device, numKVHeads: 1, headDim: 64, capacity: 4, vBits: 5)
        }
    }
}
