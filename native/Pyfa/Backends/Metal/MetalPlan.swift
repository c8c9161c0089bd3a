import PyfaShaderCommon

/// Metal geometry. Decode, prefill and TurboQuant sizes come from
/// metal_layout.h, the functions the kernels read too; every size there fits
/// the 32 KiB of threadgroup memory all Apple GPUs have (Swift tests pin it).
struct MetalPlan: BackendPlan {

    /// Threadgroups a decode aims for across the whole grid: enough to fill
    /// the SIMD-group slots of a large Apple GPU.
    static let decodeThreadgroups: UInt32 = 256
    /// Fewest visible positions worth a workgroup of their own.
    static let positionsPerWorkgroup: UInt32 = 128

    /// Workgroups per sequence for a decode over maxKvLen positions.
    static func decodeWorkgroups(_ p: pyfa_flash_attn_vec_params, maxKvLen: UInt32) -> UInt32 {
        let groups = max(1, UInt64(p.batch) * UInt64(p.num_kv_heads))
        let target = UInt64(MetalPlan.decodeThreadgroups)
        let visible = p.window > 0 ? min(maxKvLen, p.window) : maxKvLen
        let nwg = UInt32(groups >= target ? 1 : (target + groups - 1) / groups)
        return max(1, min(nwg, visible / MetalPlan.positionsPerWorkgroup, 64))
    }

    func flashAttnVec(_ p: pyfa_flash_attn_vec_params, kvDType: DType, maxKvLen: UInt32) -> VecGeometry {
        let group = p.num_heads / max(1, p.num_kv_heads)
        return VecGeometry(nwg: MetalPlan.decodeWorkgroups(p, maxKvLen: maxKvLen),
                           threads: UInt32(PYFA_METAL_VEC_THREADS),
                           threadgroupMemory: Int(pyfa_metal_vec_threadgroup_bytes(p.head_dim, group)))
    }

    func flashAttnVecTQ(_ p: pyfa_flash_attn_vec_tq_params, maxKvLen: UInt32) -> VecGeometry {
        let group = p.attn.num_heads / max(1, p.attn.num_kv_heads)
        return VecGeometry(nwg: MetalPlan.decodeWorkgroups(p.attn, maxKvLen: maxKvLen),
                           threads: UInt32(PYFA_METAL_VEC_THREADS),
                           threadgroupMemory: Int(pyfa_metal_vec_tq_threadgroup_bytes(p.attn.head_dim, group,
                                                                                      p.k_bits, p.v_bits)))
    }

    func attnReduce(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (UInt32(PYFA_METAL_REDUCE_THREADS), 0)
    }

    /// One SIMD-group per row (the kernel strides by PYFA_METAL_KV_APPEND_THREADS).
    func kvAppend(headDim: UInt32) -> UInt32 { UInt32(PYFA_METAL_KV_APPEND_THREADS) }

    /// The tile of metal_layout.h for head_dim and the I/O element size.
    func flashAttnPrefill(headDim: UInt32, dtype: DType, kvMode: Int32) -> PrefillGeometry {
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

    func turboquantRows(headDim: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (UInt32(PYFA_METAL_TQ_ROW_THREADS), Int(pyfa_metal_tq_rows_threadgroup_bytes(headDim)))
    }

    func turboquantReduceUndo(headDim: UInt32, nwg: UInt32) -> (threads: UInt32, threadgroupMemory: Int) {
        (UInt32(PYFA_METAL_REDUCE_THREADS), Int(pyfa_metal_tq_reduce_undo_threadgroup_bytes(headDim)))
    }
}
