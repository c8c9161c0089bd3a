import Metal
import XCTest

/// SIMD-group functions over two SIMD-groups of 32 lanes, against the MSL
/// definitions computed here.
final class SimdTests: MetalTestCase {
    static let source = """
    kernel void simd_ops(device const float *x [[buffer(0)]], device float *out [[buffer(1)]],
                         device ulong *ballots [[buffer(2)]],
                         uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {
        float v = x[tid];
        device float *r = out + tid * 10;
        r[0] = simd_sum(v);
        r[1] = simd_max(v);
        r[2] = simd_min(v);
        r[3] = simd_prefix_exclusive_sum(v);
        r[4] = simd_shuffle(v, (lane * 7 + 3) % 32);
        r[5] = simd_shuffle_xor(v, 5);
        r[6] = simd_shuffle_up(v, 3);
        r[7] = simd_shuffle_down(v, 3);
        r[8] = simd_broadcast(v, 7);
        r[9] = simd_prefix_inclusive_sum(v);
        ulong ballot = static_cast<ulong>(simd_ballot(v > 10.0f));
        if (lane == 0) ballots[sg] = ballot;
    }
    """

    func testSimdGroupFunctions() throws {
        let state = try pipeline(Self.source, "simd_ops")
        let x = (0..<64).map { Float(($0 * 37) % 101) - 50 }
        let out = buffer(zeros: 64 * 10, of: Float.self)
        let ballots = buffer(zeros: 2, of: UInt64.self)
        assertCompleted(run(state, buffers: [buffer(x), out, ballots], groups: size(1), threads: size(64)))
        let got = read(out, as: Float.self)
        let names = ["simd_sum", "simd_max", "simd_min", "simd_prefix_exclusive_sum", "simd_shuffle",
                     "simd_shuffle_xor", "simd_shuffle_up", "simd_shuffle_down", "simd_broadcast",
                     "simd_prefix_inclusive_sum"]
        for sg in 0..<2 {
            let v = Array(x[sg * 32..<sg * 32 + 32])
            var expectedBallot: UInt64 = 0
            for lane in 0..<32 {
                let expected: [Float] = [
                    v.reduce(0, +), v.max()!, v.min()!, v[..<lane].reduce(0, +),
                    v[(lane * 7 + 3) % 32], v[lane ^ 5],
                    lane < 3 ? v[lane] : v[lane - 3],     // the lowest lanes keep their value
                    lane >= 29 ? v[lane] : v[lane + 3],   // the highest lanes keep their value
                    v[7], v[...lane].reduce(0, +),
                ]
                if v[lane] > 10 { expectedBallot |= 1 << UInt64(lane) }
                let tid = sg * 32 + lane
                for (k, name) in names.enumerated() where got[tid * 10 + k] != expected[k] {
                    XCTFail("\(name) lane \(lane) of SIMD-group \(sg): got \(got[tid * 10 + k]), expected \(expected[k])")
                }
            }
            XCTAssertEqual(read(ballots, as: UInt64.self)[sg], expectedBallot, "simd_ballot of SIMD-group \(sg)")
        }
    }

    func testReductionsOverAPartialSimdGroup() throws {
        // 40 threads: the second SIMD-group has 8 lanes; its reductions cover those only.
        let source = """
        kernel void partial(device const int *x [[buffer(0)]], device int *out [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]]) {
            out[tid * 2] = simd_sum(x[tid]);
            out[tid * 2 + 1] = simd_max(x[tid]);
        }
        """
        let state = try pipeline(source, "partial")
        let x = (0..<40).map { Int32($0 * 3 - 20) }
        let out = buffer(zeros: 80, of: Int32.self)
        assertCompleted(run(state, buffers: [buffer(x), out], groups: size(1), threads: size(40)))
        let got = read(out, as: Int32.self)
        for tid in 0..<40 {
            let group = tid < 32 ? x[0..<32] : x[32..<40]
            XCTAssertEqual(got[tid * 2], group.reduce(0, +), "simd_sum of thread \(tid)")
            XCTAssertEqual(got[tid * 2 + 1], group.max()!, "simd_max of thread \(tid)")
        }
    }
}
