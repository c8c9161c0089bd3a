// kv_append on Metal (contract: pyfa_params.h): one SIMD-group writes one
// cache row, lanes striding over its elements. Conversions widen to float
// (exact) and round to the cache dtype to nearest even (half(x), bfloat(x));
// equal dtypes copy the bits.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_src_dtype [[function_constant(PYFA_KV_APPEND_FC_SRC_DTYPE)]];
constant int fc_cache_dtype [[function_constant(PYFA_KV_APPEND_FC_CACHE_DTYPE)]];

// Stores x as element i of a row of `dtype`.
inline void pyfa_store1(device uchar *row, uint i, int dtype, float x) {
    if (dtype == PYFA_DTYPE_F16) ((device half *)row)[i] = half(x);
    else if (dtype == PYFA_DTYPE_BF16) ((device bfloat *)row)[i] = bfloat(x);
    else ((device float *)row)[i] = x;
}

kernel void kv_append(
    constant pyfa_kv_append_params &p [[buffer(PYFA_KV_APPEND_ARG_PARAMS)]],
    device const uchar *src [[buffer(PYFA_KV_APPEND_ARG_SRC)]],
    device uchar *cache [[buffer(PYFA_KV_APPEND_ARG_CACHE)]],
    device const int *position [[buffer(PYFA_KV_APPEND_ARG_POSITION)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    // Unreachable through the dispatcher (it checks both dtypes): write nothing.
    if (!pyfa_is_attn_dtype(fc_src_dtype) || !pyfa_is_attn_dtype(fc_cache_dtype)) return;
    const uint token = tg.x, head = tg.y, D = p.head_dim, cap = p.kv_capacity;
    const int pos = position[0];
    if (pos < 0 || uint(pos) >= cap) return; // a dropped append (kv_advance)
    // (pos + token) mod cap without forming a sum that may pass 2^32.
    const uint slot = pyfa_ring_slot(token, uint(pos), cap);
    device const uchar *s = src + (ulong(token) * p.num_kv_heads + head) * D * pyfa_dtype_size(fc_src_dtype);
    device uchar *c = cache + ((ulong(p.sequence) * p.num_kv_heads + head) * cap + slot) * D *
                                  pyfa_dtype_size(fc_cache_dtype);
    for (uint i = lane; i < D; i += PYFA_METAL_KV_APPEND_THREADS) {
        if (fc_src_dtype == fc_cache_dtype && fc_src_dtype == PYFA_DTYPE_F32)
            ((device uint *)c)[i] = ((device const uint *)s)[i];
        else if (fc_src_dtype == fc_cache_dtype)
            ((device ushort *)c)[i] = ((device const ushort *)s)[i];
        else
            pyfa_store1(c, i, fc_cache_dtype, pyfa_load1(s, i, fc_src_dtype));
    }
}

// kv_advance (contract: pyfa_params.h): lane 0 of the one threadgroup moves
// the cache state past an append.
kernel void kv_advance(
    constant pyfa_kv_advance_params &p [[buffer(PYFA_KV_ADVANCE_ARG_PARAMS)]],
    device pyfa_kv_state *st [[buffer(PYFA_KV_ADVANCE_ARG_STATE)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    if (lane != 0 || tg.x != 0) return;
    *st = pyfa_kv_advanced(*st, p);
}

// kv_append_paged (contract: paged_kv_params.h): one SIMD-group writes one
// pool row; z picks K (0) or V (1). A slot outside the pool (padding) writes
// nothing. The constants are kv_append's (same indices).
kernel void kv_append_paged(
    constant pyfa_kv_append_paged_params &p [[buffer(PYFA_KV_APPEND_PAGED_ARG_PARAMS)]],
    device const uchar *src_k [[buffer(PYFA_KV_APPEND_PAGED_ARG_SRC_K)]],
    device const uchar *src_v [[buffer(PYFA_KV_APPEND_PAGED_ARG_SRC_V)]],
    device uchar *k_pages [[buffer(PYFA_KV_APPEND_PAGED_ARG_K_PAGES)]],
    device uchar *v_pages [[buffer(PYFA_KV_APPEND_PAGED_ARG_V_PAGES)]],
    device const int *slot_mapping [[buffer(PYFA_KV_APPEND_PAGED_ARG_SLOT_MAPPING)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    if (!pyfa_is_attn_dtype(fc_src_dtype) || !pyfa_is_attn_dtype(fc_cache_dtype)) return;
    const uint token = tg.x, head = tg.y, D = p.head_dim;
    const int slot = slot_mapping[token];
    if (slot < 0 || uint(slot) >= p.pages.num_pages * p.pages.page_size) return;
    const uint page = uint(slot) / p.pages.page_size, t = uint(slot) % p.pages.page_size;
    const ulong row = PYFA_PAGE_ROW(p.pages.layout, p.pages.page_size, p.num_kv_heads, page, t, head);
    device const uchar *s = (tg.z ? src_v : src_k) + (ulong(token) * p.num_kv_heads + head) * D *
                                                         pyfa_dtype_size(fc_src_dtype);
    device uchar *c = (tg.z ? v_pages : k_pages) + row * D * pyfa_dtype_size(fc_cache_dtype);
    for (uint i = lane; i < D; i += PYFA_METAL_KV_APPEND_THREADS) {
        if (fc_src_dtype == fc_cache_dtype && fc_src_dtype == PYFA_DTYPE_F32)
            ((device uint *)c)[i] = ((device const uint *)s)[i];
        else if (fc_src_dtype == fc_cache_dtype)
            ((device ushort *)c)[i] = ((device const ushort *)s)[i];
        else
            pyfa_store1(c, i, fc_cache_dtype, pyfa_load1(s, i, fc_src_dtype));
    }
}
