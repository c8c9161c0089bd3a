/*
 * Metal kernels by registry name: PYFA_METAL_KERNEL(name, source file). The
 * file defines `kernel void <name>` with the op family's function constants
 * (type int) at the indices of its shaders/common header; kernels sharing a
 * file share their constants' indices. Every file named here, and every
 * header a source includes, is embedded into libpyfa
 * (native/MetalSources/sources.c).
 *
 * PYFA_METAL_SAFE_MATH_FILE(file): a source whose library is built with fast
 * math off (MTLMathModeSafe: IEEE rounding, no reassociation), for kernels
 * whose results must be the CPU's bits. Other files build with Metal's
 * default fast math.
 */
PYFA_METAL_KERNEL(flash_attn_vec, "flash_attn_vec.metal")
PYFA_METAL_KERNEL(flash_attn_vec_reduce, "flash_attn_vec_reduce.metal")
PYFA_METAL_KERNEL(kv_append, "kv_append.metal")
PYFA_METAL_KERNEL(kv_advance, "kv_append.metal")
PYFA_METAL_KERNEL(flash_attn_prefill, "flash_attn_prefill.metal")
PYFA_METAL_KERNEL(flash_attn_prefill_blk, "flash_attn_prefill_blk.metal")
PYFA_METAL_KERNEL(merge_attention_states, "merge_attention_states.metal")
PYFA_METAL_KERNEL(flash_attn_vec_reduce_tq_hb_undo, "flash_attn_vec_reduce.metal")
PYFA_METAL_KERNEL(flash_attn_vec_tq, "flash_attn_vec_tq.metal")
PYFA_METAL_KERNEL(hadamard_quantize_kv, "turboquant_quantize.metal")
PYFA_METAL_KERNEL(tq_dequantize_kv, "turboquant_dequantize.metal")
PYFA_METAL_KERNEL(fwht, "turboquant_fwht.metal")
PYFA_METAL_KERNEL(fwht_sign_premult, "turboquant_fwht.metal")
PYFA_METAL_KERNEL(fwht_sign_undo, "turboquant_fwht.metal")
/* paged appends */
PYFA_METAL_KERNEL(kv_append_paged, "kv_append.metal")
PYFA_METAL_KERNEL(tq_quantize_paged, "turboquant_quantize.metal")

/* The TurboQuant codec: code bytes and scales byte-identical to the CPU's. */
PYFA_METAL_SAFE_MATH_FILE("turboquant_quantize.metal")
PYFA_METAL_SAFE_MATH_FILE("turboquant_dequantize.metal")
