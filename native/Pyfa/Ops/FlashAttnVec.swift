import CPyfa
import PyfaShaderCommon

/// Decode attention: one query row per head over a KV cache, split over `nwg`
/// workgroups per sequence, then a reduce pass merging their (S, M) states.
/// out's dtype (f32, f16 or bf16) is the output type; an optional f32 lse
/// [batch * num_heads] receives each row's log-sum-exp.
/// Contract: pyfa_params.h, `pyfa_flash_attn_vec_params`.
public enum FlashAttnVec {
    static let kernel = "flash_attn_vec"
    static let reduceKernel = "flash_attn_vec_reduce"
    static let floatTypes: [DType] = attentionFloatTypes
    static let indexTypes: [DType] = [.u32, .i32]
    static let maxWorkgroups: UInt32 = 1024

    /// Checks the shape fields and fills `nwg` from the backend's plan when 0.
    /// Returns the geometry and the tmp bytes the dispatch needs (0 if nwg == 1).
    /// `splitBatch` (paged batches, Paged.splitBatch): the batch the split is sized for, when not params.batch.
    /// `paged`: k / v are paged pools (the backend's plan may walk them its own way).
    public static func plan(_ device: Device, _ params: inout pyfa_flash_attn_vec_params, kvDType: DType,
                            maxKvLen: UInt32, splitBatch: UInt32? = nil,
                            paged: Bool = false) throws -> (VecGeometry, Int) {
        try validate(params)
        try require(floatTypes.contains(kvDType), "kv_dtype: \(kvDType) is not one of f32, f16, bf16")
        try require(maxKvLen <= params.kv_capacity,
                    "kv_len: \(maxKvLen) exceeds kv_capacity (\(params.kv_capacity))")
        let backendPlan = device.backend.plan
        var geometry = Paged.splitGeometry(batch: params.batch, splitBatch: splitBatch) { batch in
            var sized = params
            sized.batch = batch
            return paged ? backendPlan.flashAttnVecPaged(sized, kvDType: kvDType, maxKvLen: max(1, maxKvLen))
                : backendPlan.flashAttnVec(sized, kvDType: kvDType, maxKvLen: max(1, maxKvLen))
        }
        if params.nwg == 0 {
            params.nwg = geometry.nwg
        } else {
            geometry.nwg = params.nwg
        }
        return (geometry, try tmpBytes(params))
    }

    static func tmpBytes(_ p: pyfa_flash_attn_vec_params) throws -> Int {
        p.nwg <= 1 ? 0 : try checkedProduct([Int(p.batch), Int(p.num_heads), Int(p.nwg), Int(p.head_dim) + 2, 4],
                                            what: "tmp")
    }

    static func validate(_ p: pyfa_flash_attn_vec_params) throws {
        try require(p.batch > 0, "batch: must be > 0")
        try Check.heads(p.num_heads, p.num_kv_heads)
        try Check.headDim(p.head_dim)
        try require(p.kv_capacity > 0, "kv_capacity: must be > 0")
        try require(p.nwg <= maxWorkgroups, "nwg: \(p.nwg) exceeds \(maxWorkgroups)")
        try Check.scale(p.scale)
        try Check.softcap(p.softcap)
        // Query rows are one 32-bit grid dimension of the reduce.
        _ = try checkedCount32([p.batch, p.num_heads], what: "batch * num_heads")
        _ = try checkedProduct([Int(p.batch), Int(p.num_heads), Int(p.head_dim), 4], what: "q")
        _ = try checkedProduct([Int(p.batch), Int(p.num_kv_heads), Int(p.kv_capacity), Int(p.head_dim), 4],
                               what: "k_cache")
    }

    /// kv_len and ring_start rules, checked where their values are on the
    /// host (given as values, or in host-visible buffers): any run of kv_len
    /// positions from slot ring_start, wrapping at kv_capacity, is a valid
    /// sequence (pyfa_params.h); values the device
    /// holds are read when the dispatch runs and clamped by the kernels.
    /// Returns the largest checked kv_len (kv_capacity when one is unknown)
    /// and the kernel arguments of both.
    static func checkLengths(_ kvLen: SequenceValues, _ ringStart: SequenceValues,
                             _ p: pyfa_flash_attn_vec_params) throws -> (UInt32, KernelArg, KernelArg) {
        let B = Int(p.batch)
        let lens = try kvLen.hostValues(count: B, "kv_len")
        let rings = try ringStart.hostValues(count: B, "ring_start")
        var maxLen: UInt32 = lens == nil ? p.kv_capacity : 0
        for b in 0..<B {
            let n = lens?[b], r = rings?[b]
            if let n {
                try require(n > 0 && UInt32(n) <= p.kv_capacity,
                            "kv_len[\(b)]: \(n) must be in 1...kv_capacity (\(p.kv_capacity))")
                maxLen = max(maxLen, UInt32(n))
            }
            if let r {
                try require(r >= 0 && UInt32(r) < p.kv_capacity,
                            "ring_start[\(b)]: \(r) must be in 0..<kv_capacity (\(p.kv_capacity))")
            }
        }
        return (maxLen, kvLen.argument, ringStart.argument)
    }

    /// What a plan fixes once for all its runs (DecodePlan): the geometry, nwg included, the tmp
    /// bytes, and the pipelines of its usual run, the decode's (merging in its last workgroups when
    /// `merges`) and, for a split that does not merge, the reduce's. A run given it skips the
    /// geometry and pipeline lookups, whose inputs the plan fixed (shapes, dtypes, options; the
    /// geometry's threads, memory and variant do not depend on kv_len or kv_capacity); it still
    /// checks every buffer and length it binds. A run that merges otherwise than `merges` (one
    /// given its own workspace has no tickets) looks its pipelines up.
    public struct Prepared {
        let geometry: VecGeometry
        let tmpBytes: Int
        let merges: Bool
        let pipeline: Pipeline
        let reducePipeline: Pipeline?

        /// For `p` as FlashAttnVec.plan filled it (nwg set) and the geometry and tmp bytes it
        /// returned; compiles the pipelines now, so no run compiles.
        init(_ device: Device, _ p: pyfa_flash_attn_vec_params, geometry: VecGeometry, tmpBytes: Int, q: DType,
             kv: DType, out: DType, lse: Bool) throws {
            self.geometry = geometry
            self.tmpBytes = tmpBytes
            merges = mergesLast(device, p, geometry)
            pipeline = try device.registry.pipeline(kernel, constants: vecConstants(
                q: q, kv: kv, headDim: p.head_dim, softcap: p.softcap > 0, direct: p.nwg == 1,
                variant: geometry.variant, out: out, lse: lse, merge: merges))
            reducePipeline = p.nwg > 1 && !merges ? try device.registry.pipeline(
                reduceKernel, constants: reduceConstants(headDim: p.head_dim, out: out, lse: lse)) : nil
        }
    }

    /// With `paged` k and v are the pools [num_pages, page_size, Hkv, D] (NHD)
    /// or [num_pages, Hkv, page_size, D] (HND), params.kv_capacity is taken
    /// from the pages (pages_per_seq * page_size), and ringStart must be nil
    /// (paged sequences are not rings; paged_kv_params.h).
    /// `tickets` (a plan's, u32 [batch * num_heads], zero): where the backend's plan allows it
    /// (mergesLast), a split decode's last workgroup of each row merges it, and no reduce is recorded.
    public static func encode(_ encoder: CommandEncoder, _ paramsIn: pyfa_flash_attn_vec_params,
                              q: Buffer?, k: Buffer?, v: Buffer?, kvLen: SequenceValues?,
                              ringStart: SequenceValues?, tmp: Buffer?, out: Buffer?, lse: Buffer?,
                              paged: PagedKV? = nil, tickets: Buffer? = nil, prepared: Prepared? = nil) throws {
        var p = paged == nil ? paramsIn : try Paged.params(paramsIn, paged!.pages)
        if prepared != nil && paged != nil {
            throw PyfaError.internal("encode: a plan's prepared state is for dense caches, not paged pools")
        }
        try validate(p)
        let B = Int(p.batch), H = Int(p.num_heads), Hkv = Int(p.num_kv_heads), D = Int(p.head_dim)
        let q = try Check.buffer(q, "q", dtypes: floatTypes, elements: B * H * D, rows: true)  // bounded by validate
        let poolRows = try paged.map { try Paged.validate($0.pages, numKvHeads: p.num_kv_heads).rows }
        let cacheElements = try poolRows.map { try checkedProduct([$0, D, 4], what: "k_pages") / 4 }
            ?? B * Hkv * Int(p.kv_capacity) * D  // bounded by validate
        let (kName, vName) = paged == nil ? ("k_cache", "v_cache") : ("k_pages", "v_pages")
        let k = try Check.buffer(k, kName, dtypes: floatTypes, elements: cacheElements, rows: true)
        let v = try Check.buffer(v, vName, dtypes: [k.dtype], elements: cacheElements, rows: true)
        let kvLen = try SequenceValues.check(kvLen, "kv_len", count: B)
        let out = try Check.buffer(out, "out", dtypes: floatTypes, elements: B * H * D, rows: true)
        if let lse { try Check.buffer(lse, "lse", dtypes: [.f32], elements: B * H) }
        let maxLen: UInt32, kvLenArg: KernelArg, ringStartArg: KernelArg
        var splitBatch: UInt32? = nil, tableArg: KernelArg? = nil
        let ringValues: SequenceValues
        var table: SequenceValues? = nil
        if let paged {
            try require(ringStart == nil, "ring_start: paged sequences are not rings (pass none)")
            table = try SequenceValues.check(paged.blockTable, "block_table", count: Paged.tableCount(batch: p.batch, paged.pages))
            (maxLen, splitBatch, kvLenArg, tableArg) = try Paged.checkLengths(kvLen, paged, batch: p.batch,
                                                                              capacity: p.kv_capacity)
            ringValues = kvLen
            ringStartArg = .buffer(out)  // slot bound (Metal binds every declared slot), never read with PAGED
        } else {
            ringValues = try SequenceValues.check(ringStart, "ring_start", count: B)
            (maxLen, kvLenArg, ringStartArg) = try checkLengths(kvLen, ringValues, p)
        }
        let (geometry, needTmp) = try prepared.map { ($0.geometry, $0.tmpBytes) }
            ?? plan(encoder.device, &p, kvDType: k.dtype, maxKvLen: maxLen, splitBatch: splitBatch, paged: paged != nil)
        var tmpBuffer: Buffer? = nil
        if needTmp > 0 {
            tmpBuffer = try Check.buffer(tmp, "tmp", dtypes: [.f32], elements: needTmp / 4, rows: true)
        }
        try Check.sameDevice([q, k, v, kvLen.buffer, ringValues.buffer, table?.buffer, tmpBuffer, out, lse],
                             encoder.device)
        let inputs: [(String, Buffer?)] = [("q", q), (kName, k), (vName, v), ("kv_len", kvLen.buffer),
                                           ("ring_start", ringValues.buffer), ("block_table", table?.buffer)]
        try Check.noOverlap(out, "out", inputs: inputs, ("tmp", tmpBuffer))
        try Check.noOverlap(tmpBuffer, "tmp", inputs: inputs)
        try Check.noOverlap(lse, "lse", inputs: inputs, ("tmp", tmpBuffer), ("out", out))

        let merge = tickets != nil && (prepared?.merges ?? mergesLast(encoder.device, p, geometry))
        let ticketBuffer = merge ? try Check.buffer(tickets, "tickets", dtypes: [.u32], elements: B * H) : nil
        let usual = prepared.map { $0.merges == merge } ?? false
        let pipeline = try usual ? prepared!.pipeline : encoder.device.registry.pipeline(kernel, constants: vecConstants(
            q: q.dtype, kv: k.dtype, headDim: p.head_dim, softcap: p.softcap > 0, direct: p.nwg == 1,
            variant: geometry.variant, out: out.dtype, lse: lse != nil, paged: paged != nil, merge: merge))
        let pagedArgs = Paged.args(paged, tableArg: tableArg, unread: .buffer(out))
        let args: [SlotArg] = [
            .at(PYFA_VEC_ARG_PARAMS, .value(p)),
            pagedArgs.pages,
            .at(PYFA_VEC_ARG_Q, .buffer(q)),
            .at(PYFA_VEC_ARG_K, .buffer(k)),
            .at(PYFA_VEC_ARG_V, .buffer(v)),
            .at(PYFA_VEC_ARG_KV_LEN, kvLenArg),
            .at(PYFA_VEC_ARG_RING_START, ringStartArg),
            .at(PYFA_VEC_ARG_OUT, .buffer(out)),
            // Without a split there is no tmp, and without an lse no lse; out
            // stands in, so every slot a kernel declares is bound (Metal
            // requires it); the constants keep it unwritten there.
            .at(PYFA_VEC_ARG_TMP, .buffer(tmpBuffer ?? out)),
            .at(PYFA_VEC_ARG_LSE, .buffer(lse ?? out)),
            pagedArgs.table,
        ] + (ticketBuffer.map { [.at(PYFA_VEC_ARG_TICKETS, .buffer($0))] } ?? [])
        encoder.setOpKind(.attention)
        try encoder.dispatch(pipeline, args: args, grid: (p.nwg, p.num_kv_heads, p.batch),
                             threads: (geometry.threads, 1, 1), threadgroupMemory: geometry.threadgroupMemory)
        guard let t = tmpBuffer, !merge else { return }

        encoder.memoryBarrier()
        let nrows = p.batch * p.num_heads  // fits 32 bits: validate
        try encodeReduce(encoder, tmp: .buffer(t), out: .buffer(out), outType: out.dtype, lse: lse, nrows: nrows,
                         headDim: p.head_dim, nwg: p.nwg, pipeline: usual ? prepared!.reducePipeline : nil)
    }

    /// out and lse concern the kernels that write out: the direct path (nwg == 1) and a split
    /// whose last workgroup merges (`merge`, DIRECT_OUT 2). Otherwise the split path writes
    /// partials and its reduce writes out and lse, so its constants are f32 and no lse whatever
    /// the caller asked (one specialisation).
    public static func vecConstants(q: DType, kv: DType, headDim: UInt32, softcap: Bool, direct: Bool,
                                    variant: Int32, out: DType, lse: Bool, paged: Bool = false,
                                    merge: Bool = false) throws -> FunctionConstants {
        let writesOut = direct || merge
        return try FunctionConstants(count: PYFA_VEC_FC_COUNT, [
            PYFA_VEC_FC_Q_DTYPE: q.rawValue,
            PYFA_VEC_FC_KV_DTYPE: kv.rawValue,
            PYFA_VEC_FC_HEAD_DIM: Int32(headDim),
            PYFA_VEC_FC_HAS_SOFTCAP: softcap ? 1 : 0,
            PYFA_VEC_FC_DIRECT_OUT: direct ? 1 : (merge ? 2 : 0),
            PYFA_VEC_FC_VARIANT: variant,
            PYFA_VEC_FC_OUT_DTYPE: writesOut ? out.rawValue : DType.f32.rawValue,
            PYFA_VEC_FC_HAS_LSE: writesOut && lse ? 1 : 0,
            PYFA_VEC_FC_PAGED: paged ? 1 : 0,
        ])
    }

    /// Whether a split dispatch of this geometry may merge in its last workgroups: the
    /// backend's plan allows it and the merge's scratch (2 nwg floats per warp) fits the
    /// dispatch's threadgroup memory.
    static func mergesLast(_ device: Device, _ p: pyfa_flash_attn_vec_params, _ geometry: VecGeometry) -> Bool {
        let warps = Int(max(1, geometry.threads / 32))
        return p.nwg > 1 && device.backend.plan.lastWorkgroupMerges(nwg: p.nwg)
            && 8 * Int(p.nwg) * warps <= geometry.threadgroupMemory
    }

    /// Constants of both reduce kernels (dense and the fused TurboQuant undo).
    static func reduceConstants(headDim: UInt32, out: DType, lse: Bool) throws -> FunctionConstants {
        try FunctionConstants(count: PYFA_REDUCE_FC_COUNT, [
            PYFA_REDUCE_FC_HEAD_DIM: Int32(headDim),
            PYFA_REDUCE_FC_OUT_DTYPE: out.rawValue,
            PYFA_REDUCE_FC_HAS_LSE: lse ? 1 : 0,
        ])
    }

    /// The slots of both reduce kernels; without an lse out stands in for it
    /// (every declared slot is bound; PYFA_REDUCE_FC_HAS_LSE = 0 keeps it unwritten).
    static func reduceArgs(_ params: KernelArg, tmp: KernelArg, out: KernelArg,
                           lse: Buffer?) -> [SlotArg] {
        [.at(PYFA_REDUCE_ARG_PARAMS, params),
         .at(PYFA_REDUCE_ARG_TMP, tmp),
         .at(PYFA_REDUCE_ARG_OUT, out),
         .at(PYFA_REDUCE_ARG_LSE, lse.map { .buffer($0) } ?? out)]
    }

    /// The reduce pass of dense and (unfused) TurboQuant decode; out of dtype outType. `pipeline`:
    /// the reduce's for these constants where a plan prepared it (else looked up).
    static func encodeReduce(_ encoder: CommandEncoder, tmp: KernelArg, out: KernelArg, outType: DType, lse: Buffer?,
                             nrows: UInt32, headDim: UInt32, nwg: UInt32, pipeline prepared: Pipeline? = nil) throws {
        let r = pyfa_attn_reduce_params(nrows: nrows, head_dim: headDim, nwg: nwg, reserved: 0)
        let geometry = encoder.device.backend.plan.attnReduce(headDim: headDim, nwg: nwg)
        let pipeline = try prepared ?? encoder.device.registry.pipeline(
            reduceKernel, constants: reduceConstants(headDim: headDim, out: outType, lse: lse != nil))
        encoder.setOpKind(.reduce)
        try encoder.dispatch(pipeline, args: reduceArgs(.value(r), tmp: tmp, out: out, lse: lse), grid: (nrows, 1, 1),
                             threads: (geometry.threads, 1, 1), threadgroupMemory: geometry.threadgroupMemory)
    }
}
