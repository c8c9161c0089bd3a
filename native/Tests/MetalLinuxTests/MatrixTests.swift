import Metal
import XCTest

/// simdgroup_float8x8: load, multiply-accumulate, store against a plain
/// matmul, and Apple's lane layout of thread_elements().
final class MatrixTests: MetalTestCase {
    static let source = """
    kernel void mma(device const float *a [[buffer(0)]], device const float *b [[buffer(1)]],
                    device const float *c [[buffer(2)]], device float *d [[buffer(3)]],
                    device float *bt [[buffer(4)]], device float *elements [[buffer(5)]],
                    uint lane [[thread_index_in_simdgroup]]) {
        simdgroup_float8x8 ma, mb, mc, mt;
        simdgroup_load(ma, a, 8);
        simdgroup_load(mb, b + 8, 16);               // columns 8..15 of a 8x16 row-major matrix
        simdgroup_load(mc, c, 8);
        simdgroup_multiply_accumulate(mc, ma, mb, mc); // d = a * b + c
        simdgroup_store(mc, d, 8);
        simdgroup_load(mt, a, 8, ulong2(0, 0), true);   // transposed
        simdgroup_store(mt, bt, 8);
        elements[lane * 2] = ma.thread_elements()[0];
        elements[lane * 2 + 1] = ma.thread_elements()[1];
    }
    """

    func testMultiplyAccumulateAndLaneLayout() throws {
        let state = try pipeline(Self.source, "mma")
        let a = (0..<64).map { Float(($0 * 13) % 17) - 8 }
        let b16 = (0..<128).map { Float(($0 * 5) % 11) - 5 }   // 8 rows x 16 columns
        let c = (0..<64).map { Float($0 % 7) }
        let d = buffer(zeros: 64, of: Float.self)
        let transposed = buffer(zeros: 64, of: Float.self)
        let elements = buffer(zeros: 64, of: Float.self)
        assertCompleted(run(state, buffers: [buffer(a), buffer(b16), buffer(c), d, transposed, elements],
                            groups: size(1), threads: size(32)))
        var expected = c
        for i in 0..<8 {
            for j in 0..<8 {
                for k in 0..<8 { expected[i * 8 + j] += a[i * 8 + k] * b16[k * 16 + 8 + j] }
            }
        }
        XCTAssertEqual(read(d, as: Float.self), expected, "simdgroup_multiply_accumulate")
        XCTAssertEqual(read(transposed, as: Float.self), (0..<64).map { a[($0 % 8) * 8 + $0 / 8] },
                       "simdgroup_load transposed")
        let got = read(elements, as: Float.self)
        for lane in 0..<32 {
            let q = lane / 4
            let row = (q & 4) + (lane / 2) % 4
            let col = (q & 2) * 2 + (lane % 2) * 2
            XCTAssertEqual(got[lane * 2], a[row * 8 + col], "lane \(lane) element 0 is (\(row), \(col))")
            XCTAssertEqual(got[lane * 2 + 1], a[row * 8 + col + 1], "lane \(lane) element 1 is (\(row), \(col + 1))")
        }
    }
}
