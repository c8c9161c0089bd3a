/*
 * CUDA kernels by registry name: PYFA_CUDA_KERNEL(name, source file, max
 * threads per block). The source defines
 *   template <int...> __device__ void <name>_body(const pyfa_cuda_args &)
 * taking the kernel's function constants as template arguments, in order;
 * the registry generates the extern "C" __global__ entry per specialisation.
 * Every file named here is embedded into libpyfa (native/CUDADriver/sources.c).
 */
PYFA_CUDA_KERNEL(flash_attn_vec, "attn_vec.cu", 128)
PYFA_CUDA_KERNEL(flash_attn_vec_reduce, "attn_vec.cu", 512)
PYFA_CUDA_KERNEL(kv_append, "kv_append.cu", 128)
PYFA_CUDA_KERNEL(kv_advance, "kv_append.cu", 32)
/* the most of any specialisation; attn_prefill.cu's PYFA_MAX_THREADS_flash_attn_prefill gives each its own */
PYFA_CUDA_KERNEL(flash_attn_prefill, "attn_prefill.cu",
                 PYFA_CUDA_PREFILL_WGMMA_MAX_THREADS)
PYFA_CUDA_KERNEL(flash_attn_prefill_persistent, "attn_prefill.cu", PYFA_CUDA_PREFILL_WGMMA_MAX_THREADS)
PYFA_CUDA_KERNEL(flash_attn_prefill_blk, "attn_prefill.cu", 128)
PYFA_CUDA_KERNEL(merge_attention_states, "attn_prefill.cu", 128)
PYFA_CUDA_KERNEL(hadamard_quantize_kv, "turboquant.cu", 32)
PYFA_CUDA_KERNEL(tq_dequantize_kv, "turboquant.cu", 32)
PYFA_CUDA_KERNEL(fwht, "turboquant.cu", 32)
PYFA_CUDA_KERNEL(fwht_sign_premult, "turboquant.cu", 32)
PYFA_CUDA_KERNEL(fwht_sign_undo, "turboquant.cu", 32)
PYFA_CUDA_KERNEL(flash_attn_vec_reduce_tq_hb_undo, "turboquant.cu", 128)
PYFA_CUDA_KERNEL(flash_attn_vec_tq, "turboquant.cu", 128)
/* paged appends */
PYFA_CUDA_KERNEL(kv_append_paged, "kv_append.cu", 128)
PYFA_CUDA_KERNEL(tq_quantize_paged, "turboquant.cu", 32)
