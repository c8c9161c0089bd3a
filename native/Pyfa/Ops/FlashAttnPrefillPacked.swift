import CPyfa
import PyfaShaderCommon

/// Prefill over packed sequences: flash_attn_prefill with its KV_MODE
/// function constant set to varlen (q, k, v packed by cu_seqlens, flash-attn's
/// flash_attn_varlen_func) or paged (q packed by cu_seqlens_q, K/V read from
/// page pools through block_table and kv_len: chunked prefill and speculative
/// decoding against a paged cache). Contract: flash_attn_prefill_params.h
/// ("Packed sequences") and paged_kv_params.h.
///
/// Host-visible metadata is checked here: cu_seqlens start at 0, never
/// decrease and end at the packed length; each sequence's q_len_b is at most
/// params.q_len and at most its kv_len_b (a query row cannot sit before
/// position 0); kv_len_b at most params.kv_len (and, paged, the sequence's
/// pages); the block_table entries a sequence uses name pool pages. Metadata
/// only the device can read is clamped by the kernels.
public enum FlashAttnPrefillPacked {
    static let metaTypes: [DType] = [.i32]

    /// The packed-mode slots of a rectangular dispatch: stand-ins the kernels
    /// do not read (every declared slot is bound).
    static func rectangularStandIns(_ q: Buffer) -> [SlotArg] {
        [.at(PYFA_PREFILL_ARG_CU_SEQLENS_Q, .buffer(q)), .at(PYFA_PREFILL_ARG_SEQ_K, .buffer(q)),
         .at(PYFA_PREFILL_ARG_BLOCK_TABLE, .buffer(q)), .at(PYFA_PREFILL_ARG_PAGES, .value(pyfa_kv_pages())),
         .at(PYFA_PREFILL_ARG_PACKED, .value(pyfa_prefill_packed()))]
    }

    /// The rules of the parameter structs alone (no memory): what a plan checks once.
    static func validate(_ p: pyfa_flash_attn_prefill_params, mode: Int32, packed: pyfa_prefill_packed,
                         pages: pyfa_kv_pages) throws {
        try require(mode == PYFA_PREFILL_KV_VARLEN || mode == PYFA_PREFILL_KV_PAGED,
                    "kv_mode: \(mode) must be PYFA_PREFILL_KV_VARLEN (1) or PYFA_PREFILL_KV_PAGED (2)")
        try FlashAttnPrefill.validate(p)
        try require(p.batch < UInt32(Int32.max), "batch: must be < \(Int32.max)")
        let m = p.mask_strides
        try require(m.0 == 0 && m.1 == 0 && m.2 == 0,
                    "mask_strides: masks are not supported with packed sequences (varlen / paged rows have no [q_len, kv_len] mask plane); must be 0")
        try require(p.q_offset == 0,
                    "q_offset: not read with packed sequences (each sequence's queries end at its last key); must be 0")
        try require(packed.reserved.0 == 0 && packed.reserved.1 == 0, "packed.reserved: must be 0")
        try require(packed.total_q > 0 && packed.total_q <= UInt32(Int32.max),
                    "total_q: \(packed.total_q) must be in 1...\(Int32.max)")
        if mode == PYFA_PREFILL_KV_VARLEN {
            try require(packed.total_k > 0 && packed.total_k <= UInt32(Int32.max),
                        "total_k: \(packed.total_k) must be in 1...\(Int32.max)")
            try require(pages.page_size == 0 && pages.num_pages == 0 && pages.pages_per_seq == 0 && pages.layout == 0,
                        "pages: must be zero in varlen mode")
        } else {
            try require(packed.total_k == 0, "total_k: must be 0 in paged mode (keys come from the pools)")
            try checkPages(pages, numKvHeads: p.num_kv_heads)
            try require(UInt64(p.kv_len) <= UInt64(pages.pages_per_seq) * UInt64(pages.page_size),
                        "kv_len: \(p.kv_len) (the longest sequence) exceeds pages_per_seq * page_size (\(UInt64(pages.pages_per_seq) * UInt64(pages.page_size)))")
        }
    }

    static func checkPages(_ g: pyfa_kv_pages, numKvHeads: UInt32) throws {
        try require(g.page_size >= 1 && g.page_size <= UInt32(PYFA_MAX_PAGE_SIZE) && g.page_size & (g.page_size - 1) == 0,
                    "page_size: \(g.page_size) must be a power of two in 1...\(PYFA_MAX_PAGE_SIZE)")
        try require(g.num_pages >= 1, "num_pages: must be >= 1")
        try require(g.pages_per_seq >= 1, "pages_per_seq: must be >= 1")
        try require(g.layout == UInt32(PYFA_PAGES_NHD) || g.layout == UInt32(PYFA_PAGES_HND),
                    "page_layout: \(g.layout) must be PYFA_PAGES_NHD (0) or PYFA_PAGES_HND (1)")
        try require(UInt64(g.num_pages) * UInt64(g.page_size) * UInt64(numKvHeads) <= UInt64(UInt32.max),
                    "num_pages: num_pages * page_size * num_kv_heads (\(UInt64(g.num_pages) * UInt64(g.page_size) * UInt64(numKvHeads))) must fit 32 bits")
    }

    /// Elements of q / out (rows total_q of num_heads heads) by the head and row strides.
    static func packedExtent(_ s: (Int64, Int64, Int64), heads: UInt32, rows: UInt32, headDim: UInt32,
                             _ name: String) throws -> Int {
        try FlashAttnPrefill.extent((0, s.1, s.2), (1, heads, rows), inner: Int(headDim), name)
    }

    /// int32 values of a host-visible buffer, else nil (the kernels clamp device values).
    static func hostValues(_ b: Buffer, count: Int) -> [Int32]? {
        guard let ptr = b.contents else { return nil }
        return (0..<count).map { ptr.load(fromByteOffset: $0 * 4, as: Int32.self) }
    }

    /// cu_seqlens rules: [0] == 0, non-decreasing, [batch] == total, each length <= maxLen.
    static func checkCuSeqlens(_ cu: [Int32], _ name: String, total: UInt32, maxLen: UInt32,
                               maxName: String) throws -> [Int] {
        try require(cu[0] == 0, "\(name)[0]: \(cu[0]) must be 0")
        var lens: [Int] = []
        for b in 0..<(cu.count - 1) {
            let n = Int(cu[b + 1]) - Int(cu[b])
            try require(n >= 0, "\(name)[\(b + 1)]: \(cu[b + 1]) is below \(name)[\(b)] = \(cu[b]) (must be non-decreasing)")
            try require(n <= Int(maxLen), "\(name): sequence \(b) has \(n) rows, more than \(maxName) (\(maxLen))")
            lens.append(n)
        }
        try require(Int(cu[cu.count - 1]) == Int(total),
                    "\(name)[\(cu.count - 1)]: \(cu[cu.count - 1]) must equal the packed length (\(total))")
        return lens
    }

    public static func encode(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_prefill_params, mode: Int32,
                              packed: pyfa_prefill_packed, pages: pyfa_kv_pages, q: Buffer?, k: Buffer?, v: Buffer?,
                              cuSeqlensQ: Buffer?, seqK: Buffer?, blockTable: Buffer?, out: Buffer?,
                              lse: Buffer?) throws {
        var p = paramsIn
        try validate(p, mode: mode, packed: packed, pages: pages)
        let paged = mode == PYFA_PREFILL_KV_PAGED
        let q = try Check.buffer(q, "q", dtypes: FlashAttnPrefill.floatTypes, elements: 0, rows: true)
        let (geometry, _) = try FlashAttnPrefill.plan(encoder.device, &p, dtype: q.dtype, kvMode: mode)
        try checkTiles(p)
        let B = Int(p.batch), D = Int(p.head_dim)
        try Check.buffer(q, "q", dtypes: [q.dtype],
                         elements: packedExtent(p.q_strides, heads: p.num_heads, rows: packed.total_q, headDim: p.head_dim, "q"), rows: true)
        let kName = paged ? "k_pages" : "k", vName = paged ? "v_pages" : "v"
        let kvElements = paged
            ? try checkedProduct([Int(pages.num_pages), Int(pages.page_size), Int(p.num_kv_heads), D], what: "k_pages")
            : try packedExtent(p.k_strides, heads: p.num_kv_heads, rows: packed.total_k, headDim: p.head_dim, "k")
        let vElements = paged ? kvElements
            : try packedExtent(p.v_strides, heads: p.num_kv_heads, rows: packed.total_k, headDim: p.head_dim, "v")
        let k = try Check.buffer(k, kName, dtypes: [q.dtype], elements: kvElements, rows: true)
        let v = try Check.buffer(v, vName, dtypes: [q.dtype], elements: vElements, rows: true)
        let out = try Check.buffer(out, "out", dtypes: FlashAttnPrefill.outTypes(q.dtype),
                                   elements: packedExtent(p.out_strides, heads: p.num_heads, rows: packed.total_q,
                                                          headDim: p.head_dim, "out"), rows: true)
        // Packed rows have no batch stride (not read: extent 1 here).
        try FlashAttnPrefill.checkStrides(p, io: q.dtype, out: out.dtype, qAxes: (1, p.num_heads, packed.total_q),
                                          kvAxes: paged ? nil : (1, p.num_kv_heads, packed.total_k))
        if let lse {
            try Check.buffer(lse, "lse", dtypes: [.f32],
                             elements: checkedProduct([Int(p.num_heads), Int(packed.total_q)], what: "lse"))
        }
        let cuQ = try Check.buffer(cuSeqlensQ, "cu_seqlens_q", dtypes: metaTypes, elements: B + 1)
        let seqKName = paged ? "kv_len" : "cu_seqlens_k"
        let seqK = try Check.buffer(seqK, seqKName, dtypes: metaTypes, elements: paged ? B : B + 1)
        var table: Buffer? = nil
        if paged {
            guard blockTable != nil else { throw PyfaError.invalid("block_table: buffer is NULL (paged mode reads one)") }
            table = try Check.buffer(blockTable, "block_table", dtypes: metaTypes,
                                     elements: checkedProduct([B, Int(pages.pages_per_seq)], what: "block_table"))
        } else {
            try require(blockTable == nil, "block_table: only paged mode reads one")
        }
        try checkHostMetadata(p, paged: paged, packed: packed, pages: pages, cuQ: cuQ, seqK: seqK, table: table)
        try Check.sameDevice([q, k, v, cuQ, seqK, table, out, lse], encoder.device)
        let inputs: [(String, Buffer?)] = [("q", q), (kName, k), (vName, v), ("cu_seqlens_q", cuQ),
                                           (seqKName, seqK), ("block_table", table)]
        try Check.noOverlap(out, "out", inputs: inputs)
        try Check.noOverlap(lse, "lse", inputs: inputs, ("out", out))

        let constants = try FlashAttnPrefill.prefillConstants(
            dtype: q.dtype, headDim: p.head_dim, blockQ: p.block_q, blockK: p.block_k, maskKind: nil,
            causal: p.causal != 0, window: p.window > 0, softcap: p.softcap > 0, blk: false, lse: lse != nil,
            out: out.dtype, kvMode: mode)
        let pipeline = try encoder.device.registry.pipeline(FlashAttnPrefill.kernel, constants: constants)
        // Absent mask / blk / lse / block_table have a stand-in bound that the
        // constants say not to read (every declared slot is bound).
        let args: [SlotArg] = [
            .at(PYFA_PREFILL_ARG_PARAMS, .value(p)),
            .at(PYFA_PREFILL_ARG_Q, .buffer(q)),
            .at(PYFA_PREFILL_ARG_K, .buffer(k)),
            .at(PYFA_PREFILL_ARG_V, .buffer(v)),
            .at(PYFA_PREFILL_ARG_MASK, .buffer(q)),
            .at(PYFA_PREFILL_ARG_BLK, .buffer(q)),
            .at(PYFA_PREFILL_ARG_OUT, .buffer(out)),
            .at(PYFA_PREFILL_ARG_LSE, .buffer(lse ?? out)),
            .at(PYFA_PREFILL_ARG_CU_SEQLENS_Q, .buffer(cuQ)),
            .at(PYFA_PREFILL_ARG_SEQ_K, .buffer(seqK)),
            .at(PYFA_PREFILL_ARG_BLOCK_TABLE, .buffer(table ?? cuQ)),
            .at(PYFA_PREFILL_ARG_PAGES, .value(pages)),
            .at(PYFA_PREFILL_ARG_PACKED, .value(packed)),
        ]
        encoder.setOpKind(.attention)
        try encoder.dispatch(pipeline, args: args, grid: (p.num_q_blocks, p.num_heads, p.batch),
                             threads: (geometry.threads, 1, 1), threadgroupMemory: geometry.threadgroupMemory)
    }

    /// The launch's tiles (params with the plan's tile): a (query tile, head, sequence) grid over
    /// the declared longest sequence, whose ranks the kernels count in 32 bits (cuda_layout.h,
    /// pyfa_cuda_prefill_rank_slot). Checked where a plan is made and where a call is encoded.
    static func checkTiles(_ p: pyfa_flash_attn_prefill_params) throws {
        let tiles = UInt64(p.num_q_blocks) * UInt64(p.num_heads) * UInt64(p.batch)
        try require(tiles <= UInt64(UInt32.max),
                    "max_seqlen_q: \(p.q_len) rows make \(p.num_q_blocks) query tiles of \(p.block_q) a head and sequence; "
                    + "query tiles x heads (\(p.num_heads)) x sequences (\(p.batch)) = \(tiles) must be at most \(UInt32.max) "
                    + "(the kernels count tiles in 32 bits): lower max_seqlen_q or split the batch")
    }

    /// The metadata rules on the values the host can read (see the type's comment).
    static func checkHostMetadata(_ p: pyfa_flash_attn_prefill_params, paged: Bool, packed: pyfa_prefill_packed,
                                  pages: pyfa_kv_pages, cuQ: Buffer, seqK: Buffer, table: Buffer?) throws {
        let B = Int(p.batch)
        let qLens = try hostValues(cuQ, count: B + 1).map {
            try checkCuSeqlens($0, "cu_seqlens_q", total: packed.total_q, maxLen: p.q_len, maxName: "max_seqlen_q")
        }
        var kLens: [Int]? = nil
        if !paged {
            kLens = try hostValues(seqK, count: B + 1).map {
                try checkCuSeqlens($0, "cu_seqlens_k", total: packed.total_k, maxLen: p.kv_len, maxName: "max_seqlen_k")
            }
        } else if let lens = hostValues(seqK, count: B) {
            let cap = Int(pages.pages_per_seq) * Int(pages.page_size)
            for b in 0..<B {
                try require(lens[b] >= 0 && Int(lens[b]) <= cap,
                            "kv_len[\(b)]: \(lens[b]) must be in 0...pages_per_seq * page_size (\(cap))")
                try require(UInt32(lens[b]) <= p.kv_len, "kv_len[\(b)]: \(lens[b]) exceeds the declared longest kv_len (\(p.kv_len))")
            }
            kLens = lens.map { Int($0) }
        }
        if let qLens, let kLens {
            for b in 0..<B {
                try require(qLens[b] <= kLens[b],
                            "\(paged ? "kv_len" : "cu_seqlens_k"): sequence \(b) has \(qLens[b]) query rows but \(kLens[b]) keys (a query row would sit before position 0; q_len_b must be <= kv_len_b)")
            }
        }
        if paged, let table, let rows = hostValues(table, count: B * Int(pages.pages_per_seq)) {
            let pps = Int(pages.pages_per_seq), ps = Int(pages.page_size)
            for b in 0..<B {
                // Only the pages a sequence uses (all of its row when kv_len is on the device).
                let used = kLens.map { ($0[b] + ps - 1) / ps } ?? pps
                for i in 0..<used {
                    let e = rows[b * pps + i]
                    try require(e >= 0 && UInt32(e) < pages.num_pages,
                                "block_table[\(b)][\(i)]: \(e) must be in 0..<num_pages (\(pages.num_pages))")
                }
            }
        }
    }
}
