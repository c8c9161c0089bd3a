import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

final class StructLayoutTests: XCTestCase {
    func testParamStructSizes() {
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_vec_params>.size, 40)
        XCTAssertEqual(MemoryLayout<pyfa_attn_reduce_params>.size, 16)
        XCTAssertEqual(MemoryLayout<pyfa_kv_append_params>.size, 24)
        XCTAssertEqual(MemoryLayout<pyfa_kv_state>.size, 16)
        XCTAssertEqual(MemoryLayout<pyfa_kv_advance_params>.size, 16)
        XCTAssertEqual(MemoryLayout<pyfa_tq_quantize_params>.size, 48)
        XCTAssertEqual(MemoryLayout<pyfa_tq_dequantize_params>.size, 40)
        XCTAssertEqual(MemoryLayout<pyfa_tq_fwht_params>.size, 24)
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_vec_tq_params>.size, 64)
        XCTAssertEqual(MemoryLayout<pyfa_tq_reduce_undo_params>.size, 32)
        XCTAssertEqual(MemoryLayout<pyfa_kv_pages>.size, 16)
    }

    func testDTypeCodesMatchHeader() {
        XCTAssertEqual(DType.f32.rawValue, PYFA_DTYPE_F32)
        XCTAssertEqual(DType.bf16.rawValue, PYFA_DTYPE_BF16)
        XCTAssertEqual(DType.i32.rawValue, PYFA_DTYPE_I32)
    }
}
