import XCTest
import CPyfa
import PyfaShaderCommon
import Pyfa

final class PrefillLayoutTests: XCTestCase {
    func testPrefillParamStructSizes() {
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_prefill_params>.size, 184)
        XCTAssertEqual(MemoryLayout<pyfa_flash_attn_prefill_params>.offset(of: \.q_strides), 64)
        XCTAssertEqual(MemoryLayout<pyfa_merge_attn_params>.size, 40)
        XCTAssertEqual(MemoryLayout<pyfa_prefill_split>.size, 16)
        XCTAssertEqual(MemoryLayout<pyfa_prefill_persist>.size, 4)
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

    /// The Metal prefill tiles of metal_layout.h, for every head_dim and
    /// element size: within 32 KiB, whole 8x8 tiles dealt evenly, within
    /// the kernel's register arrays, K/V chunks that divide head_dim.
    func testMetalPrefillGeometry() {
        let sg = UInt32(PYFA_METAL_PREFILL_SIMDGROUPS), threads = UInt32(PYFA_METAL_PREFILL_THREADS)
        XCTAssertEqual(threads, 32 * sg)
        for d: UInt32 in [64, 80, 96, 128, 192, 256, 512] {
            for bytes: UInt32 in [2, 4] {
                let bq = pyfa_metal_prefill_block_q(d, bytes), bk = pyfa_metal_prefill_block_k(d, bytes)
                let kc = pyfa_metal_prefill_kv_cols(d, bytes)
                XCTAssertLessThanOrEqual(pyfa_metal_prefill_threadgroup_bytes(d, bytes), 32768, "D=\(d) x\(bytes)")
                XCTAssertTrue(bq % 8 == 0 && bk % 8 == 0 && d % kc == 0 && kc % 8 == 0, "D=\(d) x\(bytes)")
                XCTAssertEqual((bq / 8) * (d / 8) % sg, 0, "output tiles dealt evenly, D=\(d) x\(bytes)")
                XCTAssertLessThanOrEqual((bq / 8) * (d / 8) / sg, UInt32(PYFA_METAL_PREFILL_MAX_ACC))
                XCTAssertLessThanOrEqual(((bq / 8) * (bk / 8) + sg - 1) / sg, UInt32(PYFA_METAL_PREFILL_MAX_SCORE_TILES))
                XCTAssertTrue(threads % bq == 0 && 32 % (threads / bq) == 0, "a softmax row within one SIMD-group")
                XCTAssertLessThanOrEqual(bk / (threads / bq), 8, "keys per softmax thread (PYFA_PREFILL_KEYS_PER_THREAD)")
            }
        }
    }

    /// The CUDA rule for the warpgroup-MMA prefill (cuda_layout.h): sm_90a,
    /// 16-bit inputs, head dims up to 256 and 512 (the split path), unless the
    /// knob is 0; its tiles fit the H100/H200 shared memory (227 KiB a block),
    /// split into whole k-steps, give every thread the same number of 16-byte
    /// copies, and the split path's tile differs from the mma.sync path's
    /// D = 512 tile (the kernel tells the paths apart by the tile).
    func testCudaWgmmaPrefillRuleAndGeometry() {
        let dims = (pyfa_supported("head_dims").map { String(cString: $0) } ?? "").split(separator: ",").compactMap { Int32($0) }
        XCTAssertTrue(dims.contains(512) && dims.contains(64))
        for d in dims {
            let served: Int32 = d <= 256 || d == 512 ? 1 : 0
            XCTAssertEqual(pyfa_cuda_prefill_uses_wgmma(1, 1, 2, d), served, "D \(d) forced")
            XCTAssertEqual(pyfa_cuda_prefill_uses_wgmma(1, -1, 2, d), served, "D \(d) by the rule")
            XCTAssertEqual(pyfa_cuda_prefill_uses_wgmma(0, 1, 2, d), 0, "not sm_90a")
            XCTAssertEqual(pyfa_cuda_prefill_uses_wgmma(1, 0, 2, d), 0, "knob off")
            XCTAssertEqual(pyfa_cuda_prefill_uses_wgmma(1, 1, 4, d), 0, "f32 stays on the SIMT path")
            guard served == 1 else { continue }
            let split = d > 256
            let rect = Int32(PYFA_PREFILL_KV_RECT), varlen = Int32(PYFA_PREFILL_KV_VARLEN), paged = Int32(PYFA_PREFILL_KV_PAGED)
            let bk = pyfa_cuda_prefill_wgmma_block_k(d, rect)
            let stages = Int32(PYFA_CUDA_PREFILL_WGMMA_KV_STAGES)
            XCTAssertEqual(d % 16, 0)
            // TMA's swizzled stages (a 128-, 64- or 32-byte span): whole spans a row.
            XCTAssertEqual(pyfa_cuda_prefill_wgmma_tma(d), d >= 64 ? 1 : 0, "D \(d)")
            let span = pyfa_cuda_prefill_wgmma_swizzle_bytes(d)
            XCTAssertEqual(span, d % 64 == 0 ? 128 : d % 32 == 0 ? 64 : 32, "swizzle span, D \(d)")
            XCTAssertEqual(d * 2 % span, 0, "whole spans a row, D \(d)")
            // The producer warpgroup: rectangular mode with TMA stages, D <= 256.
            let producer = d >= 64 && d <= 256
            XCTAssertEqual(pyfa_cuda_prefill_wgmma_producer(d, rect), producer ? 1 : 0, "D \(d)")
            // Key tiles: beside the producer (rectangular mode) 128 at D 64 (beside 192 query rows),
            // 96 at D 192; elsewhere 128 at D 80-128, 64 at D 64 and beyond D 128.
            let producerBk: [Int32: Int32] = [64: 128, 80: 128, 96: 128, 128: 128, 192: 96, 256: 64]
            if producer { XCTAssertEqual(bk, producerBk[d, default: 0], "D \(d)") }
            for mode in [rect, varlen, paged] {
                let modeBk = pyfa_cuda_prefill_wgmma_block_k(d, mode), keys = pyfa_cuda_prefill_wgmma_stage_keys(d, mode)
                let withProducer = producer && mode == rect
                XCTAssertEqual(pyfa_cuda_prefill_wgmma_producer(d, mode), withProducer ? 1 : 0, "D \(d) mode \(mode)")
                // The query tile by TMA beside the producer: from D 80, and at D 64 in causal calls and
                // persistent blocks only.
                for causal: Int32 in [0, 1] {
                    for persistent: Int32 in [0, 1] {
                        XCTAssertEqual(pyfa_cuda_prefill_wgmma_q_tma(d, mode, causal, persistent),
                                       withProducer && (d != 64 || causal == 1 || persistent == 1) ? 1 : 0,
                                       "D \(d) mode \(mode) causal \(causal) persistent \(persistent)")
                    }
                }
                XCTAssertEqual(modeBk, withProducer ? producerBk[d, default: 0] : d > 128 || d <= 64 ? 64 : 128, "D \(d) mode \(mode)")
                // Query rows: 64 a consumer warpgroup; three of them at D 64 beside the producer,
                // two elsewhere; the split path's two share 64 rows.
                let bq = pyfa_cuda_prefill_wgmma_block_q(d, mode), consumers = pyfa_cuda_prefill_wgmma_consumers(d, mode)
                XCTAssertEqual(bq, split ? 64 : withProducer && d == 64 ? 192 : Int32(PYFA_CUDA_PREFILL_WGMMA_BLOCK_Q))
                XCTAssertEqual(consumers, split ? 2 : bq / 64)
                let threads = 128 * consumers
                XCTAssertEqual(pyfa_cuda_prefill_wgmma_block_threads(d, mode),
                               threads + (withProducer ? Int32(PYFA_CUDA_PREFILL_WGMMA_PRODUCER_THREADS) : 0))
                XCTAssertLessThanOrEqual(pyfa_cuda_prefill_wgmma_block_threads(d, mode), Int32(PYFA_CUDA_PREFILL_WGMMA_MAX_THREADS))
                if withProducer {
                    // The registers the producer hands over fit what the block launches with
                    // (whole 8-register steps of 64K / threads); setmaxnreg takes multiples of 8.
                    let all = pyfa_cuda_prefill_wgmma_block_threads(d, mode), atLaunch = 65536 / all / 8 * 8
                    let producerRegs = pyfa_cuda_prefill_wgmma_producer_regs(consumers)
                    let consumerRegs = pyfa_cuda_prefill_wgmma_consumer_regs(consumers)
                    XCTAssertLessThanOrEqual(Int32(PYFA_CUDA_PREFILL_WGMMA_PRODUCER_THREADS) * producerRegs + threads * consumerRegs,
                                             atLaunch * all, "D \(d)")
                    XCTAssertEqual(producerRegs % 8, 0)
                    XCTAssertEqual(consumerRegs % 8, 0)
                    XCTAssertGreaterThan(consumerRegs, atLaunch)
                }
                XCTAssertEqual(keys, split ? modeBk / 2 : modeBk)
                XCTAssertEqual(pyfa_cuda_prefill_wgmma_smem_bytes(d, mode),
                               (bq + 2 * stages * keys) * d * 2 + (split ? 2 * bq * keys * 4 : 0))
                XCTAssertLessThanOrEqual(pyfa_cuda_prefill_wgmma_smem_bytes(d, mode), 225 * 1024,
                                         "D \(d), beside 2 KiB of static shared memory")
                XCTAssertTrue([32, 64, 96, 128, 192].contains(keys), "a stage with a shared-memory wgmma wrapper (gen_wgmma.py)")
                XCTAssertEqual(bq * d / 8 % threads, 0, "Q copies per thread, D \(d)")
                // K / V copies per thread: the same number, but at D 64 beside the producer, whose
                // copies by the threads (no tensor map) leave threads out of the last round.
                if !(withProducer && consumers == 3) {
                    XCTAssertEqual(keys * d / 8 % threads, 0, "K / V copies per thread, D \(d)")
                }
                if pyfa_cuda_prefill_wgmma_tma(d) != 0 {  // every stage 1 KiB aligned, a box of <= 256 keys
                    XCTAssertEqual(bq * d * 2 % 1024, 0, "Q ahead of the stages, D \(d)")
                    XCTAssertEqual(keys * d * 2 % 1024, 0, "a stage, D \(d)")
                    XCTAssertLessThanOrEqual(keys, 256)
                }
                // Persistent blocks: the split's kernels (D <= 128 beside the producer), whose Q TMA
                // brings in every call, with a second Q tile after the V stages, 1 KiB aligned.
                let persists = withProducer && d <= 128
                XCTAssertEqual(pyfa_cuda_prefill_persists(d, mode), persists ? 1 : 0, "D \(d) mode \(mode)")
                if persists {
                    XCTAssertEqual(pyfa_cuda_prefill_persistent_smem_bytes(d, mode),
                                   pyfa_cuda_prefill_wgmma_smem_bytes(d, mode) + bq * d * 2)
                    XCTAssertLessThanOrEqual(pyfa_cuda_prefill_persistent_smem_bytes(d, mode), 225 * 1024, "D \(d)")
                    XCTAssertEqual(pyfa_cuda_prefill_wgmma_smem_bytes(d, mode) % 1024, 0, "the second Q tile, D \(d)")
                }
                // Clusters of two heads' blocks beside the producer from D 192 (tile_slot's cluster order takes 2).
                XCTAssertEqual(pyfa_cuda_prefill_wgmma_cluster_heads(d, mode), withProducer && d >= 192 ? 2 : 1,
                               "D \(d) mode \(mode)")
            }
            if split {
                XCTAssertEqual(d, Int32(PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM))
                // CUDAPlan.flashAttnPrefill gives the mma.sync path BQ 64, BK 32 at D = 512.
                XCTAssertFalse(pyfa_cuda_prefill_wgmma_block_q(d, rect) == 64 && bk == 32,
                               "the split tile differs from the mma.sync tile")
            }
        }
    }

    /// Persistent blocks at D 80 to 128, more than one wave, whatever the keys (cuda_layout.h says
    /// which of those were measured and why the rest follows).
    func testCudaPrefillPersistentRule() {
        for d: Int32 in [80, 96, 128] {
            XCTAssertEqual(pyfa_cuda_prefill_persistent_pays(d, 133, 132), 1, "D \(d)")
            XCTAssertEqual(pyfa_cuda_prefill_persistent_pays(d, 2048, 132), 1, "D \(d)")
            XCTAssertEqual(pyfa_cuda_prefill_persistent_pays(d, 132, 132), 0, "D \(d): one wave")
        }
        for d: Int32 in [64, 192, 256] {
            XCTAssertEqual(pyfa_cuda_prefill_persistent_pays(d, 2048, 132), 0, "D \(d)")
        }
    }

    /// pyfa_cuda_prefill_block_rank (tile_slot's launch order): without a cluster the block's
    /// linear index; in clusters of 2 along the heads a bijection onto the same ranks in which the
    /// two blocks of a cluster take neighbouring ranks, and so (as tile_slot reads a rank) one
    /// query tile and sequence and an even head and the next: one KV head where the query heads
    /// per KV head are even.
    func testCudaPrefillClusterRanksPairTwoHeadsOfOneKVHead() {
        for (gx, gy, gz) in [(1, 2, 1), (3, 4, 2), (5, 16, 3), (2, 32, 1), (7, 6, 2)] as [(UInt32, UInt32, UInt32)] {
            let total = Int(gx * gy * gz), planes = UInt64(gy * gz)
            var seen = [Bool](repeating: false, count: total)
            func slot(_ r: UInt64, _ section: UInt32) -> (qtile: UInt64, h: UInt64, b: UInt64) {
                let s = pyfa_cuda_prefill_rank_slot(UInt32(r), gx, UInt32(planes), section)
                let plane = s & 0xffff_ffff
                return (s >> 32, plane % UInt64(gy), plane / UInt64(gy))
            }
            for z in 0..<gz {
                for y in 0..<gy {
                    for x in 0..<gx {
                        XCTAssertEqual(pyfa_cuda_prefill_block_rank(x, y, z, gx, gy, 1),
                                       UInt64(x) + UInt64(gx) * (UInt64(z) * UInt64(gy) + UInt64(y)))
                        let r = pyfa_cuda_prefill_block_rank(x, y, z, gx, gy, 2)
                        XCTAssertLessThan(r, UInt64(total))
                        if r < UInt64(total) {
                            XCTAssertFalse(seen[Int(r)], "rank \(r) twice, grid (\(gx), \(gy), \(gz))")
                            seen[Int(r)] = true
                        }
                        guard y % 2 == 0 else { continue }
                        let partner = pyfa_cuda_prefill_block_rank(x, y + 1, z, gx, gy, 2)
                        XCTAssertEqual(r % 2, 0)
                        XCTAssertEqual(partner, r + 1)
                        // sections of whole KV heads at 2 query heads each (every plane: one section)
                        for section in [UInt32(planes), 2, 4] {  // every grid here has an even number of planes
                            let (a, b) = (slot(r, section), slot(partner, section))
                            XCTAssertEqual(a.qtile, b.qtile)
                            XCTAssertEqual(a.b, b.b)
                            XCTAssertEqual(a.h % 2, 0)
                            XCTAssertEqual(b.h, a.h + 1)
                            for group in [2, 4, 8] as [UInt64] where UInt64(gy) % group == 0 {
                                XCTAssertEqual(a.h / group, b.h / group, "one KV head at \(group) query heads per KV head")
                            }
                        }
                    }
                }
            }
            XCTAssertTrue(seen.allSatisfy { $0 }, "every rank taken, grid (\(gx), \(gy), \(gz))")
        }
    }

    /// pyfa_cuda_prefill_section_planes: whole KV heads whose K and V fit the section's bytes
    /// (32 MiB causal, 8 MiB not), at least one, at most every plane; a call whose K and V fit
    /// twice the section keeps one section (its order).
    func testCudaPrefillSectionsHoldL2sWorthOfKV() {
        let causal: UInt32 = 1, uniform: UInt32 = 0
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 16384, 128, causal), 16)  // 64 MiB in all: one section
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 16385, 128, causal), 6)   // past it: 3 KV heads of just over 8 MiB
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 16384, 256, causal), 4)   // 16 MiB: 2
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 4096, 128, causal), 16)   // 2 MiB: all 8 fit
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(64, 2, 8192, 128, causal), 16)   // B 4: 8 of 32 KV heads
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(32, 4, 32768, 128, causal), 8)   // 16 MiB: 2 KV heads of 4 query heads
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(8, 4, 1 << 20, 512, causal), 4)  // 2 GiB a KV head: one
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(1, 1, 1 << 20, 512, causal), 1)
        // Non-causal: 8 MiB sections past 16 MiB.
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 16384, 128, uniform), 2)  // 8 MiB a KV head: one
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 16385, 128, uniform), 2)  // just over 8 MiB: still one
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 4096, 128, uniform), 16)  // 16 MiB in all: one section
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 4097, 128, uniform), 6)   // past it: 3 KV heads of just over 2 MiB
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 4096, 256, uniform), 4)   // 4 MiB a KV head: 2
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(64, 2, 8192, 128, uniform), 4)   // B 4: 2 of 32 KV heads
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(16, 2, 1024, 64, uniform), 16)   // 2 MiB in all
        XCTAssertEqual(pyfa_cuda_prefill_section_planes(0, 2, 1 << 20, 128, uniform), 0) // no planes: none
    }

    /// pyfa_cuda_prefill_rank_slot: a bijection from the ranks onto (query tile, plane); within a
    /// section the query tile runs slowest, highest first (the order without sections when the
    /// section holds every plane); sections take their planes in order; where sections and
    /// planes are even, ranks 2c and 2c + 1 take one query tile, an even plane and the next.
    func testCudaPrefillRankOrderInSections() {
        for (tiles, planes, section) in [(1, 1, 1), (5, 16, 16), (5, 16, 8), (7, 16, 6), (3, 10, 4), (128, 16, 8),
                                         (4, 64, 16), (9, 6, 1), (2, 12, 12)] as [(UInt32, UInt32, UInt32)] {
            let total = Int(tiles * planes)
            var seen = [Bool](repeating: false, count: total)
            var last: (section: UInt64, qtile: UInt64)? = nil
            for r in 0..<UInt32(total) {
                let s = pyfa_cuda_prefill_rank_slot(r, tiles, planes, section)
                let (qtile, plane) = (s >> 32, s & 0xffff_ffff)
                XCTAssertLessThan(qtile, UInt64(tiles))
                XCTAssertLessThan(plane, UInt64(planes))
                guard qtile < UInt64(tiles) && plane < UInt64(planes) else { continue }
                let i = Int(qtile * UInt64(planes) + plane)
                XCTAssertFalse(seen[i], "(\(qtile), \(plane)) twice: \(tiles) tiles, \(planes) planes, sections of \(section)")
                seen[i] = true
                let sec = plane / UInt64(section)
                if let (ls, lq) = last {
                    XCTAssertTrue(sec > ls || (sec == ls && qtile <= lq), "rank \(r): sections in order, tiles descending in one")
                }
                last = (sec, qtile)
                if section == planes {
                    XCTAssertEqual(qtile, UInt64(tiles) - 1 - UInt64(r) / UInt64(planes))
                    XCTAssertEqual(plane, UInt64(r) % UInt64(planes))
                }
                if section % 2 == 0 && planes % 2 == 0 && r % 2 == 1 {
                    let before = pyfa_cuda_prefill_rank_slot(r - 1, tiles, planes, section)
                    XCTAssertEqual(before >> 32, qtile, "a cluster's two ranks: one query tile")
                    XCTAssertEqual((before & 0xffff_ffff) % 2, 0)
                    XCTAssertEqual(before & 0xffff_ffff, plane - 1)
                }
            }
            XCTAssertTrue(seen.allSatisfy { $0 }, "every slot taken: \(tiles) tiles, \(planes) planes, sections of \(section)")
        }
    }

    /// pyfa_cuda_prefill_split_parts: the last wave's blocks split where parts of them fill the
    /// idle SMs enough to pay each part's own cost (4 key tiles' worth) and the merge, by at least
    /// 5% of the modelled time, into 2 to 16 parts of at least 4 key tiles; whole waves and grids
    /// where it does not gain run whole. pyfa_cuda_prefill_splits: the kernels that take a split.
    func testCudaPrefillSplitFillsIdleSMs() {
        // 8 query rows over 4K keys, 32 heads (speculative decoding's verification): 32 blocks of
        // 32 key tiles on 132 SMs; 4 parts each fill 128 SMs once.
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(32, 132, 32), 4)
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(8, 132, 32), 8)
        // D 64, 2K, 4 heads: 44 blocks of 16 tiles in 3 parts (measured 28.9 -> 18.4 us on an H200).
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(44, 132, 16), 3)
        // D 64, 4K, 16 heads: 352 blocks, the last 88 in 3 parts measured 1% faster: left whole.
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(352, 132, 32), 0)
        // D 128, 4K and 16K: no split fills the last wave better.
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(512, 132, 32), 0)
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(2048, 132, 128), 0)
        // Whole waves, no SMs, and parts that would hold fewer than 4 tiles.
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(264, 132, 32), 0)
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(32, 0, 32), 0)
        XCTAssertEqual(pyfa_cuda_prefill_split_parts(32, 132, 7), 0)
        for blocks in [1, 8, 50, 133, 300, 352, 700, 5000] as [UInt64] {
            for tiles in [1, 8, 12, 32, 100, 1000] as [UInt32] {
                let parts = pyfa_cuda_prefill_split_parts(blocks, 132, tiles)
                XCTAssertTrue(parts == 0 || (parts >= 2 && parts <= 16 && tiles / UInt32(parts) >= 4),
                              "\(blocks) blocks of \(tiles) tiles: \(parts) parts")
            }
        }
        let rect = PYFA_PREFILL_KV_RECT
        for d: Int32 in [64, 80, 96, 128] { XCTAssertEqual(pyfa_cuda_prefill_splits(d, rect), 1, "D \(d)") }
        for d: Int32 in [192, 256, 512] { XCTAssertEqual(pyfa_cuda_prefill_splits(d, rect), 0, "D \(d)") }
        XCTAssertEqual(pyfa_cuda_prefill_splits(128, PYFA_PREFILL_KV_VARLEN), 0)
        XCTAssertEqual(pyfa_cuda_prefill_split_state_floats(64, rect), 4 * 9 * 384)
        XCTAssertEqual(pyfa_cuda_prefill_split_state_floats(128, rect), 4 * 17 * 256)
    }
}
