import PyfaShaderCommon

/// Metal geometry. Decode and prefill sizes come from metal_layout.h, the
/// functions the kernels read too. Ops without Metal kernels yet get
/// placeholder geometry: their pipelines report "no Metal implementation yet"
/// before any dispatch.
struct MetalPlan: BackendPlan {
    let maxThreadgroupMemory: Int

    /// Threadgroups a decode aims for across the whole grid: enough to fill
    /// the SIMD-group slots of a large Apple GPU.
    static let decodeThreadgroups: UInt32 = 256
    /// Fewest visible positions worth a workgroup of their own.
    static let positionsPerWorkgroup: UInt32 = 128

    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        let groups = max(1, UInt64(p.batch) * UInt64(p.num_kv_heads))
        let target = UInt64(MetalPlan.decodeThreadgroups)
        let visible = p.window > 0 ? min(maxKvLen, p.window) : maxKvLen
        var nwg = UInt32(groups >= target ? 1 : (target + groups - 1) / groups)
        nwg = max(1, min(nwg, visible / MetalPlan.positionsPerWorkgroup, 64))
        let group = p.num_heads / max(1, p.num_kv_heads)
        return VecGeometry(nwg: nwg, threads: UInt32(PYFA_METAL_VEC_THREADS),
                           threadgroupMemory: Int(pyfa_metal_vec_threadgroup_bytes(p.head_dim, group)))
    }

    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (UInt32(PYFA_METAL_REDUCE_THREADS), 0)
    }

    /// The tile of metal_layout.h for head_dim and the I/O element size.
    func flashAttnPrefill(headDim: UInt32, dtype: DType) -> PrefillGeometry {
        let bytes = UInt32(dtype.size)
        return PrefillGeometry(blockQ: pyfa_metal_prefill_block_q(headDim, bytes),
                               blockK: pyfa_metal_prefill_block_k(headDim, bytes),
                               threads: UInt32(PYFA_METAL_PREFILL_THREADS),
                               threadgroupMemory: Int(pyfa_metal_prefill_threadgroup_bytes(headDim, bytes)))
    }

    /// The blk pre-pass and merge_attention_states: one SIMD-group, no threadgroup memory.
    func prefillAux(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (UInt32(PYFA_METAL_PREFILL_AUX_THREADS), 0)
    }
    func turboquantRows(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (32, 0) }
    func turboquantReduceUndo(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) { (32, 0) }
}
