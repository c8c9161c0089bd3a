/* Every CPU kernel, as pyfa_cpu_<registry name>. Each has a _generic and an
 * _avx2 build (see cpu_simd.h). */
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_vec_reduce)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_prefill)
PYFA_CPU_KERNEL(pyfa_cpu_flash_attn_prefill_blk)
PYFA_CPU_KERNEL(pyfa_cpu_merge_attention_states)
