import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

final class StructLayoutTests: XCTestCase {
    func testParamStructSizes() {
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_vec_params>.size, 40)
        XCTAssertEqual(MemoryLayout<pyfa_attn_reduce_params>.size, 16)
    }

    func testDTypeCodesMatchHeader() {
        XCTAssertEqual(DType.f32.rawValue, PYFA_DTYPE_F32)
        XCTAssertEqual(DType.bf16.rawValue, PYFA_DTYPE_BF16)
        XCTAssertEqual(DType.i32.rawValue, PYFA_DTYPE_I32)
    }
}
