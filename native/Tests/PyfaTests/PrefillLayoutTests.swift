import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

final class PrefillLayoutTests: XCTestCase {
    func testPrefillParamStructSizes() {
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_prefill_params>.size, 184)
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_prefill_params>.offset(of: \.q_strides), 64)
        XCTAssertEqual(MemoryLayout<pyfa_merge_attn_params>.size, 40)
    }

    /// The plan fills the tile fields and sizes blk per mask plane.
    func testPlanFillsTileAndBlkBytes() throws {
        let device = try Device.open("cpu")
        var p = pyfa_flash_attn_prefill_params()
        p.batch = 2; p.num_heads = 4; p.num_kv_heads = 2; p.head_dim = 128
        p.q_len = 100; p.kv_len = 300; p.scale = 1
        p.mask_strides = (0, 100 * 300, 300)  // per head, shared over the batch
        let (g, blkBytes) = try FlashAttnPrefill.plan(device, &p, dtype: .bf16)
        XCTAssertEqual(p.block_q, g.blockQ)
        XCTAssertEqual(p.num_q_blocks, (100 + g.blockQ - 1) / g.blockQ)
        XCTAssertEqual(p.num_k_blocks, (300 + g.blockK - 1) / g.blockK)
        XCTAssertEqual(blkBytes, 4 * Int(p.num_q_blocks) * Int(p.num_k_blocks))
    }
}
