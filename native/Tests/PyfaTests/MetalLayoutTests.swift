import XCTest
import CPyfa
import PyfaShaderCommon

/// metal_layout.h: the threadgroup memory every supported Metal
/// specialisation asks for fits Apple's 32 KiB limit (which the MSL executor
/// enforces too), so no valid call fails at dispatch for its geometry.
final class MetalLayoutTests: XCTestCase {
    static let threadgroupLimit: UInt32 = 32 * 1024

    private func list(_ what: String) -> [UInt32] {
        String(cString: pyfa_supported(what)).split(separator: ",").compactMap { UInt32($0) }
    }

    func testDecodeAndTurboQuantThreadgroupMemoryFits() {
        let groups: [UInt32] = [1, 2, 3, 4, 5, 7, 8, 16, 64]
        for d in list("head_dims") {
            for g in groups {
                XCTAssertLessThanOrEqual(pyfa_metal_vec_threadgroup_bytes(d, g), Self.threadgroupLimit, "D \(d) G \(g)")
            }
        }
        for d in list("tq_head_dims") {
            XCTAssertLessThanOrEqual(pyfa_metal_tq_rows_threadgroup_bytes(d), Self.threadgroupLimit)
            XCTAssertLessThanOrEqual(pyfa_metal_tq_reduce_undo_threadgroup_bytes(d), Self.threadgroupLimit)
            for kb in list("tq_bits") {
                for vb in list("tq_bits") {
                    for g in groups {
                        XCTAssertLessThanOrEqual(pyfa_metal_vec_tq_threadgroup_bytes(d, g, kb, vb), Self.threadgroupLimit,
                                                 "D \(d) G \(g) bits \(kb)/\(vb)")
                    }
                }
            }
        }
    }
}
