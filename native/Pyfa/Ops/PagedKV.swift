import CPyfa
import PyfaShaderCommon

/// The paged-pool description a paged decode takes (paged_kv_params.h): the
/// pool geometry and the block table [batch, pages_per_seq] int32, host
/// values or memory the kernels read.
public struct PagedKV {
    public var pages: pyfa_kv_pages
    public var blockTable: SequenceValues
    public init(pages: pyfa_kv_pages, blockTable: SequenceValues) {
        self.pages = pages
        self.blockTable = blockTable
    }
}

/// The rules every paged decode shares (dense and TurboQuant).
enum Paged {
    /// Pool geometry: a power-of-two page size up to PYFA_MAX_PAGE_SIZE, at
    /// least one page and one column, a known layout, pool rows
    /// (num_pages * page_size * num_kv_heads) within 32 bits, so kernels
    /// compute PYFA_PAGE_ROW exactly in 32-bit arithmetic, and a sequence's
    /// capacity (pages_per_seq * page_size) within int32 (the kernels read
    /// kv_len as int32). Returns (pool rows, per-sequence capacity).
    static func validate(_ pg: pyfa_kv_pages, numKvHeads: UInt32) throws -> (rows: Int, capacity: UInt32) {
        let ps = pg.page_size
        try require(ps >= 1 && ps <= UInt32(PYFA_MAX_PAGE_SIZE) && ps & (ps - 1) == 0,
                    "page_size: \(ps) must be a power of two in 1...\(PYFA_MAX_PAGE_SIZE)")
        try require(pg.num_pages >= 1, "num_pages: must be >= 1")
        try require(pg.pages_per_seq >= 1, "pages_per_seq: must be >= 1")
        try require(pg.layout == UInt32(PYFA_PAGES_NHD) || pg.layout == UInt32(PYFA_PAGES_HND),
                    "page_layout: \(pg.layout) must be PYFA_PAGES_NHD (0) or PYFA_PAGES_HND (1)")
        let rows = UInt64(pg.num_pages) * UInt64(ps) * UInt64(numKvHeads)
        try require(rows <= UInt64(UInt32.max),
                    "num_pages: num_pages * page_size * num_kv_heads (\(rows)) must fit 32 bits")
        let capacity = UInt64(pg.pages_per_seq) * UInt64(ps)
        try require(capacity <= UInt64(Int32.max),
                    "pages_per_seq: pages_per_seq * page_size (\(capacity)) must be at most \(Int32.max)")
        return (Int(rows), UInt32(capacity))
    }

    /// The decode params of a paged dispatch: kv_capacity is the per-sequence
    /// capacity (the kernels clamp kv_len there, paged_kv_params.h).
    static func params(_ p: pyfa_flash_attn_vec_params, _ pg: pyfa_kv_pages) throws -> pyfa_flash_attn_vec_params {
        var q = p
        q.kv_capacity = try validate(pg, numKvHeads: p.num_kv_heads).capacity
        return q
    }

    /// kv_len and block_table checked where the host can read them: kv_len
    /// in 0...pages_per_seq * page_size (0: an empty sequence, out zeros and
    /// lse -inf), every block_table entry in 0..<num_pages (also columns past
    /// kv_len, which this run does not read: a table is reused as sequences
    /// grow, so a bad entry is refused before a later run reads it). Returns the longest
    /// checked kv_len (the capacity when unknown), the split batch (below)
    /// and both kernel arguments.
    static func checkLengths(_ kvLen: SequenceValues, _ paged: PagedKV, batch: UInt32,
                             capacity: UInt32) throws -> (maxLen: UInt32, splitBatch: UInt32, KernelArg, KernelArg) {
        let B = Int(batch), pg = paged.pages, pps = Int(pg.pages_per_seq)
        let lens = try kvLen.hostValues(count: B, "kv_len")
        let table = try paged.blockTable.hostValues(count: B * pps, "block_table")
        var maxLen: UInt32 = lens == nil ? capacity : 0
        var total: UInt64 = 0
        for b in 0..<B {
            if let n = lens?[b] {
                try require(n >= 0 && UInt32(n) <= capacity,
                            "kv_len[\(b)]: \(n) must be in 0...pages_per_seq * page_size (\(capacity))")
                maxLen = max(maxLen, UInt32(n))
                total += UInt64(n)
            }
            if let table {
                for i in 0..<pps {
                    let e = table[b * pps + i]
                    try require(e >= 0 && UInt32(e) < pg.num_pages,
                                "block_table[\(b)][\(i)]: \(e) must be in 0..<num_pages (\(pg.num_pages))")
                }
            }
        }
        return (maxLen, splitBatch(total: lens == nil ? nil : total, maxLen: maxLen, batch: batch),
                kvLen.argument, paged.blockTable.argument)
    }

    /// The batch the backend's split plan is asked for. A paged batch mixes
    /// lengths: every sequence gets the same nwg workgroups per KV head, and
    /// a workgroup of a short sequence finishes at once, so sizing nwg from
    /// batch * num_kv_heads (as for equal lengths) starves the GPU when a
    /// few long sequences carry most of the work. The plan is asked instead
    /// for ceil(sum kv_len / max kv_len) sequences of the longest length:
    /// the work of the batch in units of the longest sequence, so the long
    /// sequences split about as much as that many equal ones would, and the
    /// short ones' idle workgroups cost only their launch. Equal lengths give
    /// the batch itself; unknown (device) lengths plan as if every sequence
    /// were full.
    static func splitBatch(total: UInt64?, maxLen: UInt32, batch: UInt32) -> UInt32 {
        guard let total, maxLen > 0 else { return batch }
        return UInt32(max(1, min(UInt64(batch), (total + UInt64(maxLen) - 1) / UInt64(maxLen))))
    }

    /// The split of a mixed-length batch. Asked for `splitBatch` sequences
    /// of the longest length, the backend answers `planned`, sized to fill
    /// its block slots in whole waves, which assumes equal workgroups. In a
    /// mixed batch they are not, and the longest sequence's workgroups end
    /// last when they start late; so each may carry at most 1/mixedTail of a
    /// slot's share of the work. `single` is the split the backend gives ONE
    /// longest sequence (its block slots per KV head): a slot's share of the
    /// batch is splitBatch / single of a longest sequence, and one of its
    /// workgroups (1/nwg of it) stays within 1/mixedTail of that share when
    /// nwg >= mixedTail * single / splitBatch. Equal lengths (splitBatch ==
    /// batch) keep the planned split.
    static let mixedTail: UInt64 = 8

    /// The decode geometry for `batch` sequences split as `splitBatch` (nil:
    /// the batch itself) longest ones: ask(n) is the backend's geometry for a
    /// batch of n; a mixed batch's split gets mixedSplit's floor.
    static func splitGeometry(batch: UInt32, splitBatch: UInt32?, ask: (UInt32) -> VecGeometry) -> VecGeometry {
        let sized = max(1, min(splitBatch ?? batch, batch))
        var geometry = ask(sized)
        if sized < batch {
            geometry.nwg = mixedSplit(planned: geometry.nwg, single: ask(1).nwg, splitBatch: sized, batch: batch)
        }
        return geometry
    }
    static func mixedSplit(planned: UInt32, single: UInt32, splitBatch: UInt32, batch: UInt32) -> UInt32 {
        guard splitBatch < batch else { return planned }
        let floor = (mixedTail * UInt64(single) + UInt64(splitBatch) - 1) / UInt64(max(1, splitBatch))
        return max(planned, UInt32(clamping: min(floor, UInt64(single))))
    }

    /// The block table's element count: batch * pages_per_seq (fits Int: both 32-bit).
    static func tableCount(batch: UInt32, _ pg: pyfa_kv_pages) -> Int { Int(batch) * Int(pg.pages_per_seq) }

    /// The PAGES and BLOCK_TABLE slots: without paging a zero pyfa_kv_pages
    /// and `unread` (every declared slot is bound; PAGED = 0 keeps them
    /// unread). The dispatchers list `pages` first and `table` last: CUDA
    /// carries inline bytes in list order while they fit the launch, and the
    /// structs kernels read in place (params, pages, codebooks) must fit
    /// before host values of any size (a block table), which may be uploaded.
    static func args(_ paged: PagedKV?, tableArg: KernelArg?,
                     unread: KernelArg) -> (pages: SlotArg, table: SlotArg) {
        (.at(PYFA_VEC_ARG_PAGES, .value(paged?.pages ?? pyfa_kv_pages())),
         .at(PYFA_VEC_ARG_BLOCK_TABLE, tableArg ?? unread))
    }
}
