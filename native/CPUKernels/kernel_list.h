/* Every CPU kernel, as pyfa_cpu_<registry name>. Each has a _generic and an
 * _avx2 build (see cpu_simd.h). */
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec_reduce)
PYFA_CPU_KERNEL(pyfa_cpu_kv_append)
PYFA_CPU_KERNEL(pyfa_cpu_kv_advance)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_prefill)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_prefill_blk)
PYFA_CPU_KERNEL(pyfa_cpu_merge_attention_states)
PYFA_CPU_KERNEL(pyfa_cpu_hadamard_quantize_kv)
PYFA_CPU_KERNEL(pyfa_cpu_tq_dequantize_kv)
PYFA_CPU_KERNEL(pyfa_cpu_fwht)
PYFA_CPU_KERNEL(pyfa_cpu_fwht_sign_premult)
PYFA_CPU_KERNEL(pyfa_cpu_fwht_sign_undo)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec_tq)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec_reduce_tq_hb_undo)
/* paged appends */
PYFA_CPU_KERNEL(pyfa_cpu_kv_append_paged)
PYFA_CPU_KERNEL(pyfa_cpu_tq_quantize_paged)
