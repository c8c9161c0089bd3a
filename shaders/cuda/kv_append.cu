/*
 * kv_append on CUDA (contract: pyfa_params.h): one block writes one cache
 * row, threads striding over its elements (consecutive threads, consecutive
 * elements: coalesced). Conversions widen to f32 (exact) and round to the
 * cache dtype to nearest even (cvt.rn); equal dtypes copy the bits.
 */
#include "pyfa_cuda.cuh"

/* kv_advance (contract: pyfa_params.h): thread 0 of the one block moves the
 * cache state past an append. */
constexpr int kv_advance_max_threads = 32;

template <int UNUSED = 0>
__device__ void kv_advance_body(const pyfa_cuda_args &a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    pyfa_kv_state *st = pyfa_ptr<pyfa_kv_state>(a, PYFA_KV_ADVANCE_ARG_STATE);
    *st = pyfa_kv_advanced(*st, pyfa_param<pyfa_kv_advance_params>(a, PYFA_KV_ADVANCE_ARG_PARAMS));
}

/* One row of D elements from src (dtype SDT) to dst (CDT), the block's threads
 * striding over it: bits copied for equal dtypes, else widened to f32 and
 * rounded to nearest even. */
template <int SDT, int CDT>
__device__ __forceinline__ void kv_copy_row(char *dst, const char *src, uint32_t D) {
    for (uint32_t i = threadIdx.x; i < D; i += blockDim.x) {
        if constexpr (SDT == CDT && SDT == PYFA_DTYPE_F32) {
            reinterpret_cast<uint32_t *>(dst)[i] = reinterpret_cast<const uint32_t *>(src)[i];
        } else if constexpr (SDT == CDT) {
            reinterpret_cast<uint16_t *>(dst)[i] = reinterpret_cast<const uint16_t *>(src)[i];
        } else {
            pyfa_store_f32<CDT>(dst, i, pyfa_load_f32<SDT>(src, i));
        }
    }
}

constexpr int kv_append_max_threads = 128;

template <int SDT, int CDT>
__device__ void kv_append_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(SDT) && pyfa_is_float_dtype(CDT), "kv_append: src / cache dtype");
    const pyfa_kv_append_params &p = pyfa_param<pyfa_kv_append_params>(a, PYFA_KV_APPEND_ARG_PARAMS);
    constexpr int SSZ = SDT == PYFA_DTYPE_F32 ? 4 : 2, CSZ = CDT == PYFA_DTYPE_F32 ? 4 : 2;
    const uint32_t token = blockIdx.x, head = blockIdx.y, D = p.head_dim, cap = p.kv_capacity;
    const bool is_v = blockIdx.z != 0; /* one dispatch for K and V: z = 1 writes V */
    /* With tickets the dispatch advances the state itself (pyfa_read_advanced). */
    const bool advances = a.arg[PYFA_KV_APPEND_ARG_TICKETS] != 0;
    pyfa_kv_state next;
    const int32_t position =
        pyfa_append_position(a, PYFA_KV_APPEND_ARG_POSITION, PYFA_KV_APPEND_ARG_ADVANCE, advances, next);
    if (position >= 0 && (uint32_t)position < cap) { /* else a dropped append (kv_advance) */
        /* (position + token) mod cap without forming a sum that may pass 2^32. */
        const uint32_t pos = (uint32_t)position;
        const uint32_t slot = token >= cap - pos ? token - (cap - pos) : token + pos;
        const char *src = pyfa_ptr<const char>(a, is_v ? PYFA_KV_APPEND_ARG_SRC_V : PYFA_KV_APPEND_ARG_SRC) +
                          ((size_t)token * p.num_kv_heads + head) * D * SSZ;
        char *dst = pyfa_ptr<char>(a, is_v ? PYFA_KV_APPEND_ARG_CACHE_V : PYFA_KV_APPEND_ARG_CACHE) +
                    (((size_t)p.sequence * p.num_kv_heads + head) * cap + slot) * D * CSZ;
        kv_copy_row<SDT, CDT>(dst, src, D);
    }
    if (advances) pyfa_store_advanced_last(a, PYFA_KV_APPEND_ARG_POSITION, PYFA_KV_APPEND_ARG_TICKETS, next);
}

/* kv_append_paged (contract: paged_kv_params.h): one block writes one pool
 * row, blockIdx.z choosing K (0) or V (1); a slot outside the pool (padding)
 * writes nothing. */
constexpr int kv_append_paged_max_threads = 128;

template <int SDT, int CDT>
__device__ void kv_append_paged_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(SDT) && pyfa_is_float_dtype(CDT), "kv_append_paged: src / pool dtype");
    const pyfa_kv_append_paged_params &p = pyfa_param<pyfa_kv_append_paged_params>(a, PYFA_KV_APPEND_PAGED_ARG_PARAMS);
    constexpr int SSZ = SDT == PYFA_DTYPE_F32 ? 4 : 2, CSZ = CDT == PYFA_DTYPE_F32 ? 4 : 2;
    const uint32_t token = blockIdx.x, head = blockIdx.y, D = p.head_dim;
    const int32_t slot = pyfa_values<int32_t>(a, PYFA_KV_APPEND_PAGED_ARG_SLOT_MAPPING)[token];
    if (slot < 0 || (uint32_t)slot >= p.pages.num_pages * p.pages.page_size) return;
    const uint32_t page = (uint32_t)slot / p.pages.page_size, t = (uint32_t)slot % p.pages.page_size;
    const size_t row = PYFA_PAGE_ROW(p.pages.layout, p.pages.page_size, p.num_kv_heads, page, t, head);
    const bool is_v = blockIdx.z != 0;
    const char *src = pyfa_ptr<const char>(a, is_v ? PYFA_KV_APPEND_PAGED_ARG_SRC_V : PYFA_KV_APPEND_PAGED_ARG_SRC_K) +
                      ((size_t)token * p.num_kv_heads + head) * D * SSZ;
    char *dst = pyfa_ptr<char>(a, is_v ? PYFA_KV_APPEND_PAGED_ARG_V_PAGES : PYFA_KV_APPEND_PAGED_ARG_K_PAGES) +
                row * D * CSZ;
    kv_copy_row<SDT, CDT>(dst, src, D);
}
