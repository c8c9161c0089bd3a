import CPyfa
import PyfaShaderCommon

/// Every (kernel, function constants) pair the dispatchers can request, so a
/// backend that compiles ahead of use (CI's CUDA compile check) covers them
/// all. Each family builds its constants with the same builder its
/// dispatcher uses; families whose tiles come from a backend plan take that plan.
public enum KernelSpecialisations {
    public static func all(plan: BackendPlan) throws -> [(name: String, constants: [FunctionConstants])] {
        try flashAttnVec() + kvAppend() + prefill(plan: plan) + turboQuant()
            + pagedAppend()
    }

    // MARK: paged appends

    /// kv_append_paged: every (src dtype, pool dtype) pair; tq_quantize_paged:
    /// every src dtype, K bits, V bits and head dim.
    static func pagedAppend() throws -> [(name: String, constants: [FunctionConstants])] {
        let floats = attentionFloatTypes
        let dense = try floats.flatMap { s in try floats.map { try PagedAppend.denseConstants(src: s, cache: $0) } }
        var tq: [FunctionConstants] = []
        for src in floats {
            for d in TurboQuant.headDims {
                for kb in TurboQuant.bitWidths {
                    for vb in TurboQuant.bitWidths {
                        tq.append(try PagedAppend.turboQuantConstants(src: src, kBits: kb, vBits: vb, headDim: d))
                    }
                }
            }
        }
        return [(PagedAppend.denseKernel, dense), (PagedAppend.turboQuantKernel, tq)]
    }

    /// kv_append: every (src dtype, cache dtype) pair; kv_advance, which has no constants.
    static func kvAppend() throws -> [(name: String, constants: [FunctionConstants])] {
        let pairs = KVAppend.floatTypes.flatMap { s in KVAppend.floatTypes.map { (s, $0) } }
        return [(KVAppend.kernel, try pairs.map { try KVAppend.constants(src: $0.0, cache: $0.1) }),
                (KVAdvance.kernel, [try KVAdvance.constants()])]
    }

    static let headDims: [UInt32] = supportedHeadDims.sorted()
    static let flags = [false, true]

    /// `lists` in order, each constants list once (builders fold the options
    /// a specialisation ignores, e.g. the split path's out dtype and lse).
    static func unique(_ lists: [FunctionConstants]) -> [FunctionConstants] {
        var seen = Set<FunctionConstants>()
        return lists.filter { seen.insert($0).inserted }
    }

    /// Both reduce kernels' constants over `dims`.
    static func reduce(dims: [UInt32]) throws -> [FunctionConstants] {
        var all: [FunctionConstants] = []
        for d in dims {
            for out in FlashAttnVec.floatTypes {
                for lse in flags { all.append(try FlashAttnVec.reduceConstants(headDim: d, out: out, lse: lse)) }
            }
        }
        return all
    }

    static func flashAttnVec() throws -> [(name: String, constants: [FunctionConstants])] {
        var vec: [FunctionConstants] = []
        for q in FlashAttnVec.floatTypes {
            for kv in FlashAttnVec.floatTypes {
                for d in headDims {
                    let variants = kv == .f32 ? [PYFA_VEC_VARIANT_PORTABLE]
                        : [PYFA_VEC_VARIANT_PORTABLE, PYFA_VEC_VARIANT_MMA]
                    for softcap in flags {
                        for direct in flags {
                            for variant in variants {
                                for out in FlashAttnVec.floatTypes {
                                    for lse in flags {
                                        for paged in flags {  // paged decode (PagedKV.swift)
                                            vec.append(try FlashAttnVec.vecConstants(
                                                q: q, kv: kv, headDim: d, softcap: softcap, direct: direct,
                                                variant: variant, out: out, lse: lse, paged: paged))
                                        }
                                        for paged in flags where !direct {  // a plan's split whose last workgroup merges
                                            vec.append(try FlashAttnVec.vecConstants(
                                                q: q, kv: kv, headDim: d, softcap: softcap, direct: false,
                                                variant: variant, out: out, lse: lse, paged: paged, merge: true))
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        return [(FlashAttnVec.kernel, unique(vec)), (FlashAttnVec.reduceKernel, try reduce(dims: headDims))]
    }

    /// flash_attn_prefill, its blk pre-pass and merge_attention_states: every
    /// constants list their dispatchers build, with each backend's tile.
    static func prefill(plan: BackendPlan) throws -> [(name: String, constants: [FunctionConstants])] {
        var attn: [FunctionConstants] = [], blk: [FunctionConstants] = [], merge: [FunctionConstants] = []
        var persistent: [FunctionConstants] = []
        let masks: [(kind: Int32?, blk: [Bool])] = [
            (nil, [false]), (PYFA_MASK_ADDITIVE, [false, true]), (PYFA_MASK_BOOL, [false, true]),
        ]
        for dtype in FlashAttnPrefill.floatTypes {
            let outs = FlashAttnPrefill.outTypes(dtype)
            for d in headDims {
                let g = plan.flashAttnPrefill(headDim: d, dtype: dtype, kvMode: PYFA_PREFILL_KV_RECT)
                for mask in masks {
                    for causal in flags {
                        for window in flags {
                            for softcap in flags {
                                for hasBlk in mask.blk {
                                    for lse in flags {
                                        for out in outs {
                                            let c = try FlashAttnPrefill.prefillConstants(
                                                dtype: dtype, headDim: d, blockQ: g.blockQ, blockK: g.blockK,
                                                maskKind: mask.kind, causal: causal, window: window,
                                                softcap: softcap, blk: hasBlk, lse: lse, out: out)
                                            attn.append(c)
                                            // Persistent blocks: unmasked calls (BackendPlan.prefillPersistent).
                                            if mask.kind == nil && plan.prefillPersistentServes(headDim: d, dtype: dtype) {
                                                persistent.append(c)
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                // Both packed modes take one tile (cuda_layout.h: only the rectangular mode differs).
                let packed = plan.flashAttnPrefill(headDim: d, dtype: dtype, kvMode: PYFA_PREFILL_KV_VARLEN)
                attn += try packedPrefill(dtype: dtype, headDim: d, blockQ: packed.blockQ, blockK: packed.blockK)
                for kind in [PYFA_MASK_ADDITIVE, PYFA_MASK_BOOL] {
                    let c = try FlashAttnPrefill.blkConstants(dtype: dtype, blockQ: g.blockQ, blockK: g.blockK, maskKind: kind)
                    if !blk.contains(c) { blk.append(c) }
                }
            }
            for lse in flags {
                for out in outs { merge.append(try MergeAttentionStates.constants(dtype: dtype, hasLse: lse, out: out)) }
            }
        }
        return [(FlashAttnPrefill.kernel, attn), (FlashAttnPrefill.persistentKernel, persistent),
                (FlashAttnPrefill.blkKernel, blk), (MergeAttentionStates.kernel, merge)]
    }

    /// flash_attn_prefill in the packed modes (varlen, paged): no mask or blk.
    static func packedPrefill(dtype: DType, headDim: UInt32, blockQ: UInt32, blockK: UInt32) throws -> [FunctionConstants] {
        var all: [FunctionConstants] = []
        for mode in [PYFA_PREFILL_KV_VARLEN, PYFA_PREFILL_KV_PAGED] {
            for causal in flags {
                for window in flags {
                    for softcap in flags {
                        for lse in flags {
                            for out in FlashAttnPrefill.outTypes(dtype) {
                                all.append(try FlashAttnPrefill.prefillConstants(
                                    dtype: dtype, headDim: headDim, blockQ: blockQ, blockK: blockK, maskKind: nil,
                                    causal: causal, window: window, softcap: softcap, blk: false, lse: lse, out: out,
                                    kvMode: mode))
                            }
                        }
                    }
                }
            }
        }
        return all
    }

    static func turboQuant() throws -> [(name: String, constants: [FunctionConstants])] {
        let bits = TurboQuant.bitWidths, dims = TurboQuant.headDims
        var quantize: [FunctionConstants] = [], dequantize: [FunctionConstants] = []
        var fwht: [FunctionConstants] = [], vec: [FunctionConstants] = []
        for d in dims {
            for src in TurboQuant.floatTypes {
                for dst in TurboQuant.floatTypes { fwht.append(try TurboQuant.fwhtConstants(src: src, headDim: d, dst: dst)) }
                for b in bits { quantize.append(try TurboQuant.quantizeConstants(src: src, bits: b, headDim: d)) }
            }
            for b in bits { dequantize.append(try TurboQuant.dequantizeConstants(bits: b, headDim: d)) }
            for kb in bits {
                for vb in bits {
                    for softcap in flags {
                        for direct in flags {
                            for lse in flags {
                                for paged in flags {  // paged decode (PagedKV.swift)
                                    vec.append(try FlashAttnVecTQ.vecConstants(kBits: kb, vBits: vb, headDim: d,
                                                                               softcap: softcap, direct: direct,
                                                                               lse: lse, paged: paged))
                                }
                                for out in TurboQuant.floatTypes where !direct {  // a ring plan's split merged last
                                    vec.append(try FlashAttnVecTQ.vecConstants(kBits: kb, vBits: vb, headDim: d,
                                                                               softcap: softcap, direct: false,
                                                                               lse: lse, merge: true, out: out))
                                }
                            }
                        }
                    }
                }
            }
        }
        return [("hadamard_quantize_kv", quantize), ("tq_dequantize_kv", dequantize)]
            + TurboQuant.fwhtKernels.map { ($0, fwht) }
            + [(FlashAttnVecTQ.kernel, unique(vec)), (FlashAttnVecTQ.fusedReduceKernel, try reduce(dims: dims))]
    }
}
