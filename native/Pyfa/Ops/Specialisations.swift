import CPyfa
import PyfaShaderCommon

/// Every (kernel, function constants) pair the dispatchers can request, so a
/// backend that compiles ahead of use (CI's CUDA compile check) covers them
/// all. Each op family appends its own list; families whose tiles come from
/// a backend plan take that plan.
enum KernelSpecialisations {
    static func all(plan: BackendPlan) -> [(name: String, constants: [[Int32]])] {
        flashAttnVec + prefill(plan: plan) + turboQuant
    }

    static let floatCodes: [Int32] = FlashAttnVec.floatTypes.map(\.rawValue)
    static let headDims: [Int32] = supportedHeadDims.sorted().map { Int32($0) }

    static var flashAttnVec: [(name: String, constants: [[Int32]])] {
        var vec: [[Int32]] = []
        for q in floatCodes {
            for kv in floatCodes {
                for d in headDims {
                    let variants = kv == DType.f32.rawValue ? [PYFA_VEC_VARIANT_PORTABLE]
                        : [PYFA_VEC_VARIANT_PORTABLE, PYFA_VEC_VARIANT_MMA]
                    for softcap: Int32 in [0, 1] {
                        for direct: Int32 in [0, 1] {
                            for variant in variants { vec.append([q, kv, d, softcap, direct, variant]) }
                        }
                    }
                }
            }
        }
        return [(FlashAttnVec.kernel, vec), (FlashAttnVec.reduceKernel, headDims.map { [$0] })]
    }

    /// flash_attn_prefill, its blk pre-pass and merge_attention_states: every
    /// constants list their dispatchers build, with each backend's tile.
    static func prefill(plan: BackendPlan) -> [(name: String, constants: [[Int32]])] {
        var attn: [[Int32]] = [], blk: [[Int32]] = [], merge: [[Int32]] = []
        let masks: [(has: Int32, kind: Int32, blk: [Int32])] = [
            (0, PYFA_MASK_ADDITIVE, [0]), (1, PYFA_MASK_ADDITIVE, [0, 1]), (1, PYFA_MASK_BOOL, [0, 1]),
        ]
        for dtype in FlashAttnPrefill.floatTypes {
            let t = dtype.rawValue
            for d in headDims {
                let g = plan.flashAttnPrefill(headDim: UInt32(d), dtype: dtype)
                let (bq, bk) = (Int32(g.blockQ), Int32(g.blockK))
                for alignQ: Int32 in [0, 1] {
                    for alignK: Int32 in [0, 1] {
                        for mask in masks {
                            for causal: Int32 in [0, 1] {
                                for window: Int32 in [0, 1] {
                                    for softcap: Int32 in [0, 1] {
                                        for hasBlk in mask.blk {
                                            for lse: Int32 in [0, 1] {
                                                attn.append([t, d, bq, bk, alignQ, alignK, mask.has, mask.kind,
                                                             causal, window, softcap, hasBlk, lse])
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                for kind in [PYFA_MASK_ADDITIVE, PYFA_MASK_BOOL] {
                    blk.append([t, d, bq, bk, 0, 0, 1, kind, 0, 0, 0, 0, 0])
                }
            }
            // merge_attention_states takes any multiple of 8 up to PYFA_MAX_HEAD_DIM.
            for d in stride(from: 8, through: Int32(PYFA_MAX_HEAD_DIM), by: 8) {
                for lse: Int32 in [0, 1] { merge.append([t, d, lse]) }
            }
        }
        return [(FlashAttnPrefill.kernel, attn), (FlashAttnPrefill.blkKernel, blk), (MergeAttentionStates.kernel, merge)]
    }

    static var turboQuant: [(name: String, constants: [[Int32]])] {
        let bits = TurboQuant.bitWidths.map { Int32($0) }, dims = TurboQuant.headDims.map { Int32($0) }
        let srcCodes = TurboQuant.floatTypes.map(\.rawValue)
        var quantize: [[Int32]] = [], dequantize: [[Int32]] = [], fwht: [[Int32]] = [], vec: [[Int32]] = []
        for d in dims {
            for src in srcCodes {
                fwht.append([src, d])
                for b in bits { quantize.append([src, b, d]) }
            }
            for b in bits { dequantize.append([b, d]) }
            for kb in bits {
                for vb in bits {
                    for softcap: Int32 in [0, 1] {
                        for direct: Int32 in [0, 1] { vec.append([kb, vb, d, softcap, direct]) }
                    }
                }
            }
        }
        return [("hadamard_quantize_kv", quantize), ("tq_dequantize_kv", dequantize)]
            + TurboQuant.fwhtKernels.map { ($0, fwht) }
            + [(FlashAttnVecTQ.kernel, vec), (FlashAttnVecTQ.fusedReduceKernel, dims.map { [$0] })]
    }
}
