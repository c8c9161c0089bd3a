import CPyfa
import PyfaShaderCommon

/// Prefill attention: tiled flash attention over many query rows, with
/// causal / window / softcap / additive or boolean masks, GQA, strided
/// layouts, optional LSE, and the blk tile-skip pre-pass. out is in the I/O
/// dtype or, on request, f32 (its buffer's dtype says which). One dispatcher
/// for every dtype, head_dim, layout and mask kind; the variants are function
/// constants. Contract: flash_attn_prefill_params.h.
public enum FlashAttnPrefill {
    static let kernel = "flash_attn_prefill"
    static let blkKernel = "flash_attn_prefill_blk"
    /// flash_attn_prefill's persistent blocks (flash_attn_prefill_params.h, pyfa_prefill_persist),
    /// with the same function constants, where a backend's plan runs them (BackendPlan.prefillPersistent).
    static let persistentKernel = "flash_attn_prefill_persistent"
    static let floatTypes: [DType] = attentionFloatTypes

    /// Checks the shape fields and fills the tile fields (block_q, block_k,
    /// num_q_blocks, num_k_blocks) from the backend's plan for `dtype`.
    /// Returns the geometry and the bytes a blk buffer for this mask layout needs.
    public static func plan(_ device: Device, _ p: inout pyfa_flash_attn_prefill_params, dtype: DType,
                            kvMode: Int32 = PYFA_PREFILL_KV_RECT) throws -> (PrefillGeometry, blkBytes: Int) {
        try validate(p)
        try require(floatTypes.contains(dtype), "dtype: \(dtype.name) not accepted (expected f32, f16 or bf16)")
        let g = device.backend.plan.flashAttnPrefill(headDim: p.head_dim, dtype: dtype, kvMode: kvMode)
        if p.block_q == 0 && p.block_k == 0 {
            p.block_q = g.blockQ
            p.block_k = g.blockK
        } else {
            try require(p.block_q == g.blockQ && p.block_k == g.blockK,
                        "block_q/block_k: \(p.block_q)x\(p.block_k) is not this backend's tile (\(g.blockQ)x\(g.blockK) at head_dim \(p.head_dim)); pass 0 to ask the plan")
        }
        p.num_q_blocks = (p.q_len + p.block_q - 1) / p.block_q
        p.num_k_blocks = (p.kv_len + p.block_k - 1) / p.block_k
        let blkBytes = try checkedProduct([p.mask_strides.0 != 0 ? Int(p.batch) : 1, p.mask_strides.1 != 0 ? Int(p.num_heads) : 1,
                                           Int(p.num_q_blocks), Int(p.num_k_blocks)], what: "blk")
        return (g, blkBytes)
    }

    static func validate(_ p: pyfa_flash_attn_prefill_params) throws {
        try require(p.batch > 0, "batch: must be > 0")
        try Check.heads(p.num_heads, p.num_kv_heads)
        try Check.headDim(p.head_dim)
        try require(p.q_len > 0, "q_len: must be > 0 (empty query sequences are not supported)")
        try require(p.kv_len > 0, "kv_len: must be > 0 (empty key sequences are not supported)")
        try require(p.q_len <= UInt32(Int32.max) && p.kv_len <= UInt32(Int32.max),
                    "q_len/kv_len: must be <= \(Int32.max)")
        try require(p.window <= UInt32(Int32.max), "window: must be <= \(Int32.max) (0 disables it)")
        try require(p.causal <= 1, "causal: must be 0 or 1, got \(p.causal)")
        try Check.scale(p.scale)
        try Check.softcap(p.softcap)
        for (name, s) in [("q_strides", p.q_strides), ("k_strides", p.k_strides), ("v_strides", p.v_strides),
                          ("out_strides", p.out_strides), ("mask_strides", p.mask_strides)] {
            try require(s.0 >= 0 && s.1 >= 0 && s.2 >= 0, "\(name): strides must be >= 0, got \(s)")
        }
    }

    /// Kernels copy rows of q, k, v and out in 16-byte pieces (the head_dim axis is contiguous), so
    /// the stride of every axis they step along (extent above 1; a stride of an axis of extent 1 is
    /// never applied) is a whole number of 16 bytes; and out's elements must not share memory
    /// (two threads would write one). `qAxes`, `kvAxes`: the (batch, head, row) extents of q / out
    /// and of k / v (nil: k and v are not read by strides, as paged pools).
    static func checkStrides(_ p: pyfa_flash_attn_prefill_params, io: DType, out: DType,
                             qAxes: (UInt32, UInt32, UInt32), kvAxes: (UInt32, UInt32, UInt32)?) throws {
        func pieces(_ name: String, _ s: (Int64, Int64, Int64), _ n: (UInt32, UInt32, UInt32), _ dtype: DType) throws {
            for (extent, stride) in [(n.0, s.0), (n.1, s.1), (n.2, s.2)] where extent > 1 {
                try require(stride % Int64(16 / dtype.size) == 0,
                            "\(name): \(s) elements of \(dtype.size) bytes; the stride of an axis longer than 1 must be a multiple of 16 bytes (\(16 / dtype.size) elements: kernels copy rows in 16-byte pieces)")
            }
        }
        try pieces("q_strides", p.q_strides, qAxes, io)
        if let kvAxes {
            try pieces("k_strides", p.k_strides, kvAxes, io)
            try pieces("v_strides", p.v_strides, kvAxes, io)
        }
        try pieces("out_strides", p.out_strides, qAxes, out)
        // Disjoint when, axes taken from the smallest stride up (head_dim first: stride 1), each
        // stride reaches past everything the smaller ones span. (The three axes sorted in place:
        // this runs at every dispatch.)
        let o = p.out_strides
        var a = (qAxes.0, o.0), b = (qAxes.1, o.1), c = (qAxes.2, o.2)
        if a.1 > b.1 { swap(&a, &b) }
        if b.1 > c.1 { swap(&b, &c) }
        if a.1 > b.1 { swap(&a, &b) }
        var span = Int64(p.head_dim)
        for (extent, stride) in [a, b, c] where extent > 1 {
            try require(stride >= span,
                        "out_strides: \(o) elements make rows of out share memory (with head_dim \(p.head_dim) and extents \(qAxes)); each output element needs its own")
            let (reach, overflow) = stride.multipliedReportingOverflow(by: Int64(extent))
            try require(!overflow, "out_strides: size overflows 64 bits")
            span = reach
        }
    }

    /// Elements a strided [n0, n1, n2, inner] view reaches (the last element + 1).
    static func extent(_ s: (Int64, Int64, Int64), _ n: (UInt32, UInt32, UInt32), inner: Int, _ name: String) throws -> Int {
        var total = inner
        for (count, stride) in [(n.0, s.0), (n.1, s.1), (n.2, s.2)] {
            let step = try checkedProduct([Int(count) - 1, Int(stride)], what: name)
            let (sum, overflow) = total.addingReportingOverflow(step)
            try require(!overflow, "\(name): size overflows 64 bits")
            total = sum
        }
        return total
    }

    /// Output dtypes of I/O dtype `io`: itself, or f32 on request.
    static func outTypes(_ io: DType) -> [DType] { io == .f32 ? [.f32] : [io, .f32] }

    /// The mask's kind from its dtype: u8 is boolean, q's dtype is additive.
    /// maskKind nil: no mask bound.
    static func prefillConstants(dtype: DType, headDim: UInt32, blockQ: UInt32, blockK: UInt32, maskKind: Int32?,
                                 causal: Bool, window: Bool, softcap: Bool, blk: Bool, lse: Bool,
                                 out: DType, kvMode: Int32 = PYFA_PREFILL_KV_RECT) throws -> FunctionConstants {
        let flag: (Bool) -> Int32 = { $0 ? 1 : 0 }
        return try FunctionConstants(count: PYFA_PREFILL_FC_COUNT, [
            PYFA_PREFILL_FC_DTYPE: dtype.rawValue,
            PYFA_PREFILL_FC_HEAD_DIM: Int32(headDim),
            PYFA_PREFILL_FC_BLOCK_Q: Int32(blockQ),
            PYFA_PREFILL_FC_BLOCK_K: Int32(blockK),
            PYFA_PREFILL_FC_HAS_MASK: flag(maskKind != nil),
            PYFA_PREFILL_FC_MASK_KIND: maskKind ?? PYFA_MASK_ADDITIVE,
            PYFA_PREFILL_FC_DO_CAUSAL: flag(causal),
            PYFA_PREFILL_FC_HAS_WINDOW: flag(window),
            PYFA_PREFILL_FC_HAS_SOFTCAP: flag(softcap),
            PYFA_PREFILL_FC_HAS_BLK: flag(blk),
            PYFA_PREFILL_FC_HAS_LSE: flag(lse),
            PYFA_PREFILL_FC_OUT_DTYPE: out.rawValue,
            PYFA_PREFILL_FC_KV_MODE: kvMode,
        ])
    }

    static func blkConstants(dtype: DType, blockQ: UInt32, blockK: UInt32, maskKind: Int32) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_BLK_FC_COUNT, [
            PYFA_BLK_FC_DTYPE: dtype.rawValue,
            PYFA_BLK_FC_BLOCK_Q: Int32(blockQ),
            PYFA_BLK_FC_BLOCK_K: Int32(blockK),
            PYFA_BLK_FC_MASK_KIND: maskKind,
        ])
    }

    static func maskKind(_ mask: Buffer, ioType: DType) throws -> Int32 {
        if mask.dtype == .u8 { return PYFA_MASK_BOOL }
        try require(mask.dtype == ioType,
                    "mask: dtype \(mask.dtype.name) not accepted (expected u8 for a boolean mask or \(ioType.name), q's dtype, for an additive mask)")
        return PYFA_MASK_ADDITIVE
    }

    /// A key split as a dispatch binds it (flash_attn_prefill_params.h): the backend's split
    /// (BackendPlan.prefillSplit), its tickets and its parts' states (a plan's).
    struct SplitRun {
        let split: pyfa_prefill_split
        let tickets: Buffer
        let states: Buffer

        /// The tickets' and states' sizes of `split`.
        static func sizes(_ split: pyfa_prefill_split) throws -> (tickets: Int, stateFloats: Int) {
            let splitBlocks = Int(split.blocks - split.first_rank) / Int(split.parts)
            return (splitBlocks, try checkedProduct([splitBlocks, Int(split.parts), Int(split.state_floats)], what: "split states"))
        }
    }

    public static func encode(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_prefill_params,
                              q: Buffer?, k: Buffer?, v: Buffer?, mask: Buffer?, blk: Buffer?,
                              out: Buffer?, lse: Buffer?) throws {
        try encode(encoder, paramsIn, q: q, k: k, v: v, mask: mask, blk: blk, out: out, lse: lse, split: nil)
    }

    static func encode(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_prefill_params,
                       q: Buffer?, k: Buffer?, v: Buffer?, mask: Buffer?, blk: Buffer?,
                       out: Buffer?, lse: Buffer?, split: SplitRun?) throws {
        var p = paramsIn
        try validate(p)
        let q = try Check.buffer(q, "q", dtypes: floatTypes, elements: 0, rows: true)
        let (geometry, blkBytes) = try plan(encoder.device, &p, dtype: q.dtype)
        let D = Int(p.head_dim)
        let qRows = (p.batch, p.num_heads, p.q_len), kvRows = (p.batch, p.num_kv_heads, p.kv_len)
        try Check.buffer(q, "q", dtypes: floatTypes, elements: extent(p.q_strides, qRows, inner: D, "q"), rows: true)
        let k = try Check.buffer(k, "k", dtypes: [q.dtype], elements: extent(p.k_strides, kvRows, inner: D, "k"), rows: true)
        let v = try Check.buffer(v, "v", dtypes: [q.dtype], elements: extent(p.v_strides, kvRows, inner: D, "v"), rows: true)
        let out = try Check.buffer(out, "out", dtypes: outTypes(q.dtype),
                                   elements: extent(p.out_strides, qRows, inner: D, "out"), rows: true)
        var kind = PYFA_MASK_ADDITIVE
        if let mask {
            kind = try maskKind(mask, ioType: q.dtype)
            try Check.buffer(mask, "mask", dtypes: [mask.dtype],
                             elements: extent(p.mask_strides, qRows, inner: Int(p.kv_len), "mask"))
        }
        if let blk {
            try require(mask != nil, "blk: needs a mask (blk classifies the mask's tiles)")
            try Check.buffer(blk, "blk", dtypes: [.u8], elements: blkBytes)
        }
        if let lse {
            try Check.buffer(lse, "lse", dtypes: [.f32],
                             elements: checkedProduct([Int(p.batch), Int(p.num_heads), Int(p.q_len)], what: "lse"))
        }
        try checkStrides(p, io: q.dtype, out: out.dtype, qAxes: qRows, kvAxes: kvRows)
        try Check.sameDevice([q, k, v, mask, blk, out, lse], encoder.device)
        let inputs: [(String, Buffer?)] = [("q", q), ("k", k), ("v", v), ("mask", mask), ("blk", blk)]
        try Check.noOverlap(out, "out", inputs: inputs)
        try Check.noOverlap(lse, "lse", inputs: inputs, ("out", out))

        let constants = try prefillConstants(dtype: q.dtype, headDim: p.head_dim, blockQ: p.block_q, blockK: p.block_k,
                                             maskKind: mask == nil ? nil : kind, causal: p.causal != 0,
                                             window: p.window > 0, softcap: p.softcap > 0, blk: blk != nil,
                                             lse: lse != nil, out: out.dtype)
        let pipeline = try encoder.device.registry.pipeline(kernel, constants: constants)
        let args: [SlotArg] = [
            .at(PYFA_PREFILL_ARG_PARAMS, .value(p)),
            .at(PYFA_PREFILL_ARG_Q, .buffer(q)),
            .at(PYFA_PREFILL_ARG_K, .buffer(k)),
            .at(PYFA_PREFILL_ARG_V, .buffer(v)),
            .at(PYFA_PREFILL_ARG_OUT, .buffer(out)),
            // Every slot is bound (Metal requires it of every declared
            // argument): an absent mask or blk has q stand in, an absent lse
            // out; the function constants say they are absent, so no kernel
            // reads or writes a stand-in.
            .at(PYFA_PREFILL_ARG_MASK, .buffer(mask ?? q)),
            .at(PYFA_PREFILL_ARG_BLK, .buffer(blk ?? q)),
            .at(PYFA_PREFILL_ARG_LSE, .buffer(lse ?? out)),
        ] + FlashAttnPrefillPacked.rectangularStandIns(q)
        // The blocks of two heads of one KV head in a cluster, where the backend takes one: they read
        // the same K and V tiles at about the same time.
        let pair = geometry.clusterHeads > 1 && (p.num_heads / p.num_kv_heads) % geometry.clusterHeads == 0
        encoder.setOpKind(.attention)
        if let split {
            // One-dimensional, without clusters (flash_attn_prefill_params.h, pyfa_prefill_split).
            let (tickets, stateFloats) = try SplitRun.sizes(split.split)
            try Check.buffer(split.tickets, "split tickets", dtypes: [.u32], elements: tickets)
            try Check.buffer(split.states, "split states", dtypes: [.f32], elements: stateFloats)
            pyfa_count(PYFA_COUNT_SPLIT_LAUNCH)
            try encoder.dispatch(pipeline, args: args + [
                .at(PYFA_PREFILL_ARG_SPLIT, .value(split.split)),
                .at(PYFA_PREFILL_ARG_SPLIT_TICKETS, .buffer(split.tickets)),
                .at(PYFA_PREFILL_ARG_SPLIT_STATES, .buffer(split.states)),
            ], grid: (split.split.blocks, 1, 1), threads: (geometry.threads, 1, 1),
               threadgroupMemory: geometry.threadgroupMemory)
            return
        }
        if let persistent = encoder.device.backend.plan.prefillPersistent(p, dtype: q.dtype, geometry: geometry,
                                                                          masked: mask != nil) {
            // One-dimensional, without clusters (flash_attn_prefill_params.h, pyfa_prefill_persist).
            let ranks = UInt32(p.num_q_blocks) * p.num_heads * p.batch  // the plan checked it fits
            let persistentPipeline = try encoder.device.registry.pipeline(persistentKernel, constants: constants)
            pyfa_count(PYFA_COUNT_PERSISTENT_LAUNCH)
            try encoder.dispatch(persistentPipeline, args: args + [.at(PYFA_PREFILL_ARG_PERSIST, .value(pyfa_prefill_persist(ranks: ranks)))],
                                 grid: (persistent.blocks, 1, 1), threads: (geometry.threads, 1, 1),
                                 threadgroupMemory: persistent.threadgroupMemory)
            return
        }
        try encoder.dispatch(pipeline, args: args, grid: (p.num_q_blocks, p.num_heads, p.batch),
                             threads: (geometry.threads, 1, 1), threadgroupMemory: geometry.threadgroupMemory,
                             cluster: (1, pair ? geometry.clusterHeads : 1, 1))
    }

    /// The blk pre-pass runs a threadgroup a (query tile, key tile) of a mask
    /// plane: their count (the grid's x) must fit an Int32. Returns it.
    /// Params with the tile fields filled (plan).
    static func checkBlkTiles(_ p: pyfa_flash_attn_prefill_params) throws -> UInt32 {
        let tiles = UInt64(p.num_q_blocks) * UInt64(p.num_k_blocks)
        try require(tiles <= UInt64(Int32.max),
                    "q_len/kv_len: \(p.q_len) x \(p.kv_len) make \(tiles) tiles of \(p.block_q) x \(p.block_k) for blk to classify; must be at most \(Int32.max)")
        return UInt32(tiles)
    }

    /// Encodes the blk pre-pass for `mask` (layout from params.mask_strides)
    /// with the tile of the prefill dispatch it serves (I/O dtype `dtype`),
    /// then a barrier so that dispatch reads it.
    public static func encodeBlk(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_prefill_params,
                                 dtype: DType, mask: Buffer?, blk: Buffer?) throws {
        var p = paramsIn
        try validate(p)
        guard let mask else { throw PyfaError.invalid("mask: buffer is NULL (blk classifies a mask)") }
        let (_, blkBytes) = try plan(encoder.device, &p, dtype: dtype)
        let kind = try maskKind(mask, ioType: dtype)
        try Check.buffer(mask, "mask", dtypes: [mask.dtype],
                         elements: extent(p.mask_strides, (p.batch, p.num_heads, p.q_len), inner: Int(p.kv_len), "mask"))
        let tiles = try checkBlkTiles(p)
        let blk = try Check.buffer(blk, "blk", dtypes: [.u8], elements: blkBytes)
        try Check.sameDevice([mask, blk], encoder.device)
        let pipeline = try encoder.device.registry.pipeline(
            blkKernel, constants: blkConstants(dtype: dtype, blockQ: p.block_q, blockK: p.block_k, maskKind: kind))
        let aux = encoder.device.backend.plan.prefillAux(headDim: p.head_dim)
        encoder.setOpKind(.other)
        try encoder.dispatch(pipeline, args: [
            .at(PYFA_PREFILL_ARG_PARAMS, .value(p)),
            .at(PYFA_PREFILL_ARG_MASK, .buffer(mask)),
            .at(PYFA_PREFILL_ARG_BLK, .buffer(blk)),
        ], grid: (tiles, p.mask_strides.1 != 0 ? p.num_heads : 1, p.mask_strides.0 != 0 ? p.batch : 1),
           threads: (aux.threads, 1, 1), threadgroupMemory: aux.threadgroupMemory)
        encoder.memoryBarrier()
    }
}
