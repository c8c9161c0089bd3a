import CPyfa
import PyfaShaderCommon

/// Decode attention over a TurboQuant cache, in the rotated domain:
/// fwht_sign_premult(q) -> flash_attn_vec_tq -> reduce and fwht_sign_undo
/// (fused or not); where the backend's plan says so, the decode kernel
/// rotates q itself (q_in). Semantics, grid, nwg and the partials' tmp layout are
/// flash_attn_vec's. Contract: turboquant_params.h,
/// `pyfa_flash_attn_vec_tq_params`.
public enum FlashAttnVecTQ {
    static let kernel = "flash_attn_vec_tq"
    static let fusedReduceKernel = "flash_attn_vec_reduce_tq_hb_undo"

    static func validate(_ p: pyfa_flash_attn_vec_tq_params) throws {
        try FlashAttnVec.validate(p.attn)
        try TurboQuant.checkHeadDim(p.attn.head_dim)
        try TurboQuant.checkBits(p.k_bits, "k_bits")
        try TurboQuant.checkBits(p.v_bits, "v_bits")
        try require(p.fused <= 1, "fused: \(p.fused) must be 0 or 1")
        try require(p.q_in == UInt32(PYFA_TQ_Q_IN_ROTATED), "q_in: \(p.q_in) must be 0 (the op sets it)")
    }

    /// Where the regions of tmp start (turboquant_params.h), in bytes.
    public struct TmpLayout {
        public var qRot: Int
        public var oRot: Int
        public var total: Int
    }

    /// Fills nwg from the plan when 0; returns the geometry and tmp's layout.
    /// `splitBatch`: as FlashAttnVec.plan's (paged batches).
    public static func plan(_ device: Device, _ params: inout pyfa_flash_attn_vec_tq_params,
                            maxKvLen: UInt32, splitBatch: UInt32? = nil) throws -> (VecGeometry, TmpLayout) {
        try validate(params)
        try require(maxKvLen <= params.attn.kv_capacity,
                    "kv_len: \(maxKvLen) exceeds kv_capacity (\(params.attn.kv_capacity))")
        var geometry = Paged.splitGeometry(batch: params.attn.batch, splitBatch: splitBatch) { batch in
            var sized = params
            sized.attn.batch = batch
            return device.backend.plan.flashAttnVecTQ(sized, maxKvLen: max(1, maxKvLen))
        }
        if params.attn.nwg == 0 {
            params.attn.nwg = geometry.nwg
        } else {
            geometry.nwg = params.attn.nwg
        }
        // Regions start on 16 bytes (rows are read and written as float4 / float2).
        let partialBytes = try FlashAttnVec.tmpBytes(params.attn)
        let rowBytes = try checkedProduct([Int(params.attn.batch), Int(params.attn.num_heads),
                                           Int(params.attn.head_dim), 4], what: "tmp")
        let qRot = try checkedSum(partialBytes, 15, what: "tmp") & ~15
        let oRot = try checkedSum(qRot, rowBytes, what: "tmp")
        return (geometry, TmpLayout(qRot: qRot, oRot: oRot, total: try checkedSum(oRot, rowBytes, what: "tmp")))
    }

    /// What a plan fixes once for all its runs (TQDecodePlan), as FlashAttnVec.Prepared: the
    /// geometry and tmp layout, the codebooks' bytes, and the pipelines of its usual run (the
    /// decode's, merging when `merges`, and the fused tail's of a split that does not merge).
    public struct Prepared {
        let geometry: VecGeometry
        let layout: TmpLayout
        let merges: Bool
        let pipeline: Pipeline
        let reduceUndoPipeline: Pipeline?
        let kCodebook: KernelArg, vCodebook: KernelArg

        /// For `p` as FlashAttnVecTQ.plan filled it (nwg set) and what it returned; compiles the
        /// pipelines now, so no run compiles.
        init(_ device: Device, _ p: pyfa_flash_attn_vec_tq_params, geometry: VecGeometry, layout: TmpLayout,
             out: DType, lse: Bool) throws {
            self.geometry = geometry
            self.layout = layout
            let a = p.attn, direct = a.nwg == 1
            merges = mergesLast(device, p)
            pipeline = try device.registry.pipeline(kernel, constants: vecConstants(
                kBits: p.k_bits, vBits: p.v_bits, headDim: a.head_dim, softcap: a.softcap > 0, direct: direct,
                lse: lse, merge: merges, out: out))
            reduceUndoPipeline = !direct && p.fused == 1 && !merges ? try device.registry.pipeline(
                fusedReduceKernel, constants: FlashAttnVec.reduceConstants(headDim: a.head_dim, out: out, lse: lse)) : nil
            kCodebook = try TurboQuant.codebookArg(p.k_bits)
            vCodebook = try TurboQuant.codebookArg(p.v_bits)
        }
    }

    /// `tickets` (a plan's, u32 [batch * num_heads], zero): where mergesLast allows it, a fused
    /// split's last workgroup of each row merges and undoes it, and no tail is recorded.
    /// `prepared`: a plan's (Prepared), for dense caches.
    public static func encode(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_vec_tq_params,
                              q: Buffer?, kCodes: Buffer?, kScales: Buffer?, vCodes: Buffer?, vScales: Buffer?,
                              kvLen: SequenceValues?, ringStart: SequenceValues?, tmp: Buffer?, out: Buffer?,
                              lse: Buffer?, paged: PagedKV? = nil, tickets: Buffer? = nil,
                              prepared: Prepared? = nil) throws {
        // With `paged`: codes [num_pages * page_size * Hkv, row_bytes] and scales
        // [num_pages * page_size * Hkv] are pools in the pages' layout, as FlashAttnVec.encode's.
        var p = paramsIn
        if prepared != nil && paged != nil {
            throw PyfaError.internal("encode: a plan's prepared state is for dense caches, not paged pools")
        }
        if let paged { p.attn = try Paged.params(p.attn, paged.pages) }
        try validate(p)
        let a = p.attn
        let B = Int(a.batch), H = Int(a.num_heads), D = Int(a.head_dim)
        let q = try Check.buffer(q, "q", dtypes: TurboQuant.floatTypes, elements: B * H * D, rows: true)  // bounded by validate
        // A pool is checked as one sequence of one head holding every pool row.
        let poolRows = try paged.map { UInt32(try Paged.validate($0.pages, numKvHeads: a.num_kv_heads).rows) }
        let (seqs, heads, rows) = poolRows.map { (1, UInt32(1), $0) } ?? (B, a.num_kv_heads, a.kv_capacity)
        let (kc, ks) = try TurboQuant.checkCache(kCodes, kScales, "k_", sequences: seqs, heads: heads,
                                                 capacity: rows, headDim: a.head_dim, bits: p.k_bits)
        let (vc, vs) = try TurboQuant.checkCache(vCodes, vScales, "v_", sequences: seqs, heads: heads,
                                                 capacity: rows, headDim: a.head_dim, bits: p.v_bits)
        let kvLen = try SequenceValues.check(kvLen, "kv_len", count: B)
        let out = try Check.buffer(out, "out", dtypes: TurboQuant.floatTypes, elements: B * H * D, rows: true)
        if let lse { try Check.buffer(lse, "lse", dtypes: [.f32], elements: B * H) }
        let maxLen: UInt32, kvLenArg: KernelArg, ringStartArg: KernelArg?
        var splitBatch: UInt32? = nil, tableArg: KernelArg? = nil
        let ringValues: SequenceValues
        var table: SequenceValues? = nil
        if let paged {
            try require(ringStart == nil, "ring_start: paged sequences are not rings (pass none)")
            table = try SequenceValues.check(paged.blockTable, "block_table", count: Paged.tableCount(batch: a.batch, paged.pages))
            (maxLen, splitBatch, kvLenArg, tableArg) = try Paged.checkLengths(kvLen, paged, batch: a.batch,
                                                                              capacity: a.kv_capacity)
            ringValues = kvLen
            ringStartArg = nil  // o_rot stands in below (every declared slot is bound), never read with PAGED
        } else {
            ringValues = try SequenceValues.check(ringStart, "ring_start", count: B)
            (maxLen, kvLenArg, ringStartArg) = try FlashAttnVec.checkLengths(kvLen, ringValues, a)
        }
        let (geometry, layout) = try prepared.map { ($0.geometry, $0.layout) }
            ?? plan(encoder.device, &p, maxKvLen: maxLen, splitBatch: splitBatch)
        let t = try Check.buffer(tmp, "tmp", dtypes: [.f32], elements: layout.total / 4, rows: true)
        try Check.sameDevice([q, kc, ks, vc, vs, kvLen.buffer, ringValues.buffer, table?.buffer, t, out, lse],
                             encoder.device)
        let inputs: [(String, Buffer?)] = [("q", q), ("k_codes", kc), ("k_scales", ks), ("v_codes", vc),
                                           ("v_scales", vs), ("kv_len", kvLen.buffer), ("ring_start", ringValues.buffer),
                                           ("block_table", table?.buffer)]
        try Check.noOverlap(out, "out", inputs: inputs, ("tmp", t))
        try Check.noOverlap(t, "tmp", inputs: inputs)
        try Check.noOverlap(lse, "lse", inputs: inputs, ("tmp", t), ("out", out))
        let seedLo = p.seed_lo, seedHi = p.seed_hi
        let nrows = a.batch * a.num_heads  // fits 32 bits: validate

        // q into the rotated domain of K: by its own dispatch, or by the decode kernel.
        let qRot = KernelArg.buffer(t, offset: layout.qRot), oRot = KernelArg.buffer(t, offset: layout.oRot)
        let qArg: KernelArg
        if encoder.device.backend.plan.turboquantRotatesQ(p) {
            p.q_in = UInt32(PYFA_TQ_Q_IN_UNROTATED) + UInt32(q.dtype.rawValue)
            qArg = .buffer(q)
        } else {
            let premult = pyfa_tq_fwht_params(nrows: nrows, head_dim: a.head_dim,
                                              transform: UInt32(PYFA_TQ_FWHT_SIGN_PREMULT),
                                              stream: UInt32(PYFA_TQ_STREAM_K), seed_lo: seedLo, seed_hi: seedHi)
            try TurboQuant.encodeFwht(encoder, premult, src: .buffer(q), srcType: q.dtype, dst: qRot, dstType: .f32)
            encoder.memoryBarrier()
            qArg = qRot
        }

        let direct = p.attn.nwg == 1
        let merge = tickets != nil && paged == nil && (prepared?.merges ?? mergesLast(encoder.device, p))
        let ticketBuffer = merge ? try Check.buffer(tickets, "tickets", dtypes: [.u32], elements: B * H) : nil
        let usual = prepared.map { $0.merges == merge } ?? false
        let pipeline = try usual ? prepared!.pipeline : encoder.device.registry.pipeline(kernel, constants: vecConstants(
            kBits: p.k_bits, vBits: p.v_bits, headDim: a.head_dim, softcap: a.softcap > 0, direct: direct,
            lse: lse != nil, paged: paged != nil, merge: merge, out: out.dtype))
        let pagedArgs = Paged.args(paged, tableArg: tableArg, unread: oRot)
        let args: [SlotArg] = [
            // Structs the kernels read in place first (params, pages, codebooks):
            // CUDA carries inline bytes in list order while they fit the launch,
            // and per-sequence values of a large batch are uploaded instead.
            .at(PYFA_VEC_ARG_PARAMS, .value(p)),
            pagedArgs.pages,
            .at(PYFA_TQ_VEC_ARG_K_CODEBOOK, try prepared?.kCodebook ?? TurboQuant.codebookArg(p.k_bits)),
            .at(PYFA_TQ_VEC_ARG_V_CODEBOOK, try prepared?.vCodebook ?? TurboQuant.codebookArg(p.v_bits)),
            .at(PYFA_VEC_ARG_Q, qArg),
            .at(PYFA_VEC_ARG_K, .buffer(kc)),
            .at(PYFA_VEC_ARG_V, .buffer(vc)),
            .at(PYFA_VEC_ARG_KV_LEN, kvLenArg),
            .at(PYFA_VEC_ARG_RING_START, ringStartArg ?? oRot),
            .at(PYFA_VEC_ARG_OUT, oRot),
            .at(PYFA_VEC_ARG_LSE, lse.map { .buffer($0) } ?? oRot),
            .at(PYFA_TQ_VEC_ARG_K_SCALES, .buffer(ks)),
            .at(PYFA_TQ_VEC_ARG_V_SCALES, .buffer(vs)),
            // Bound in every dispatch (it holds q_rot), so every slot a kernel
            // declares is bound (Metal requires it); only nwg > 1 writes the
            // partials' region. An absent lse has o_rot stand in, unwritten
            // there (PYFA_TQ_VEC_FC_HAS_LSE = 0).
            .at(PYFA_VEC_ARG_TMP, .buffer(t)),
            pagedArgs.table,
        ] + (ticketBuffer.map { [.at(PYFA_TQ_VEC_ARG_MERGED_OUT, .buffer(out)), .at(PYFA_VEC_ARG_TICKETS, .buffer($0))] }
             ?? [])
        encoder.setOpKind(.attention)
        try encoder.dispatch(pipeline, args: args, grid: (p.attn.nwg, a.num_kv_heads, a.batch),
                             threads: (geometry.threads, 1, 1), threadgroupMemory: geometry.threadgroupMemory)
        if merge { return }
        encoder.memoryBarrier()

        // The output back from the rotated domain of V, stored once in out's dtype.
        if !direct && p.fused == 1 {
            try encodeReduceUndo(encoder, tmp: t, out: out, lse: lse, nrows: nrows, headDim: a.head_dim,
                                 nwg: p.attn.nwg, seedLo: seedLo, seedHi: seedHi,
                                 pipeline: usual ? prepared!.reduceUndoPipeline : nil)
            return
        }
        if !direct {
            try FlashAttnVec.encodeReduce(encoder, tmp: .buffer(t), out: oRot, outType: .f32, lse: lse, nrows: nrows,
                                          headDim: a.head_dim, nwg: p.attn.nwg)
            encoder.memoryBarrier()
        }
        let undo = pyfa_tq_fwht_params(nrows: nrows, head_dim: a.head_dim, transform: UInt32(PYFA_TQ_FWHT_SIGN_UNDO),
                                       stream: UInt32(PYFA_TQ_STREAM_V), seed_lo: seedLo, seed_hi: seedHi)
        try TurboQuant.encodeFwht(encoder, undo, src: oRot, srcType: .f32, dst: .buffer(out), dstType: out.dtype)
    }

    /// lse concerns the kernels that write it (as in FlashAttnVec.vecConstants): the direct
    /// path, whose output is the f32 rotated row the undo reads, and a split whose last
    /// workgroup merges and undoes (`merge`, DIRECT_OUT 2), the only one storing out's dtype.
    static func vecConstants(kBits: UInt32, vBits: UInt32, headDim: UInt32, softcap: Bool,
                             direct: Bool, lse: Bool, paged: Bool = false, merge: Bool = false,
                             out: DType = .f32) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_TQ_VEC_FC_COUNT, [
            PYFA_TQ_VEC_FC_K_BITS: Int32(kBits),
            PYFA_TQ_VEC_FC_V_BITS: Int32(vBits),
            PYFA_TQ_VEC_FC_HEAD_DIM: Int32(headDim),
            PYFA_TQ_VEC_FC_HAS_SOFTCAP: softcap ? 1 : 0,
            PYFA_TQ_VEC_FC_DIRECT_OUT: direct ? 1 : (merge ? 2 : 0),
            PYFA_TQ_VEC_FC_HAS_LSE: (direct || merge) && lse ? 1 : 0,
            PYFA_TQ_VEC_FC_PAGED: paged ? 1 : 0,
            PYFA_TQ_VEC_FC_OUT_DTYPE: merge ? out.rawValue : DType.f32.rawValue,
        ])
    }

    /// Whether a split of these params may merge and undo in its last workgroups: the
    /// backend's plan allows it (FlashAttnVec.mergesLast), the tail is the fused one, and
    /// the merge's scratch fits every kernel's drained ring (PYFA_CUDA_TQ_MERGE_MAX_NWG).
    static func mergesLast(_ device: Device, _ p: pyfa_flash_attn_vec_tq_params) -> Bool {
        p.attn.nwg > 1 && p.attn.nwg <= UInt32(PYFA_CUDA_TQ_MERGE_MAX_NWG) && p.fused == 1
            && device.backend.plan.lastWorkgroupMerges(nwg: p.attn.nwg)
    }

    static func encodeReduceUndo(_ encoder: CommandEncoder, tmp: Buffer, out: Buffer, lse: Buffer?, nrows: UInt32,
                                 headDim: UInt32, nwg: UInt32, seedLo: UInt32, seedHi: UInt32,
                                 pipeline prepared: Pipeline? = nil) throws {
        let r = pyfa_tq_reduce_undo_params(
            reduce: pyfa_attn_reduce_params(nrows: nrows, head_dim: headDim, nwg: nwg, reserved: 0),
            seed_lo: seedLo, seed_hi: seedHi, stream: UInt32(PYFA_TQ_STREAM_V), reserved: 0)
        let g = encoder.device.backend.plan.turboquantReduceUndo(headDim: headDim, nwg: nwg)
        let pipeline = try prepared ?? encoder.device.registry.pipeline(
            fusedReduceKernel, constants: FlashAttnVec.reduceConstants(headDim: headDim, out: out.dtype, lse: lse != nil))
        encoder.setOpKind(.reduce)
        try encoder.dispatch(pipeline, args: FlashAttnVec.reduceArgs(.value(r), tmp: .buffer(tmp), out: .buffer(out), lse: lse),
                             grid: (nrows, 1, 1), threads: (g.threads, 1, 1), threadgroupMemory: g.threadgroupMemory)
    }
}
