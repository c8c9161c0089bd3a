/*
 * Metal kernels by registry name: PYFA_METAL_KERNEL(name, source file). The
 * file defines `kernel void <name>` with the op family's function constants
 * (type int) at the indices of its shaders/common header. Every file named
 * here, and every header a source includes, is embedded into libpyfa
 * (native/MetalSources/sources.c).
 */
PYFA_METAL_KERNEL(flash_attn_vec, "flash_attn_vec.metal")
PYFA_METAL_KERNEL(flash_attn_vec_reduce, "flash_attn_vec_reduce.metal")
PYFA_METAL_KERNEL(flash_attn_prefill, "flash_attn_prefill.metal")
PYFA_METAL_KERNEL(flash_attn_prefill_blk, "flash_attn_prefill_blk.metal")
PYFA_METAL_KERNEL(merge_attention_states, "merge_attention_states.metal")
