// Helpers every pyfa Metal kernel shares: reading rows of the attention
// dtypes (pyfa_params.h codes) as f32. The dtype is a function constant, so
// each specialisation keeps one branch.
#pragma once
#include <metal_stdlib>
#include "pyfa_params.h"
using namespace metal;

// bf16 bits -> f32 (bf16 is the high half of an f32): exact.
inline float pyfa_bf16_to_f32(ushort bits) { return as_type<float>(uint(bits) << 16); }

// Element i of a row of `dtype`.
inline float pyfa_load1(device const uchar *row, uint i, int dtype) {
    if (dtype == PYFA_DTYPE_F16) return float(((device const half *)row)[i]);
    if (dtype == PYFA_DTYPE_BF16) return pyfa_bf16_to_f32(((device const ushort *)row)[i]);
    return ((device const float *)row)[i];
}

// float4 column c (elements 4c .. 4c + 3) of a row of `dtype`.
inline float4 pyfa_load4(device const uchar *row, uint c, int dtype) {
    if (dtype == PYFA_DTYPE_F16) return float4(((device const half4 *)row)[c]);
    if (dtype == PYFA_DTYPE_BF16) {
        const ushort4 u = ((device const ushort4 *)row)[c];
        return float4(pyfa_bf16_to_f32(u.x), pyfa_bf16_to_f32(u.y), pyfa_bf16_to_f32(u.z), pyfa_bf16_to_f32(u.w));
    }
    return ((device const float4 *)row)[c];
}

// Stores v as element i of a row of `dtype`, rounded to nearest even: the one
// conversion of a kernel's final store (accumulation stays f32).
inline void pyfa_store1(device uchar *row, uint i, float v, int dtype) {
    if (dtype == PYFA_DTYPE_F16) ((device half *)row)[i] = half(v);
    else if (dtype == PYFA_DTYPE_BF16) ((device bfloat *)row)[i] = bfloat(v);
    else ((device float *)row)[i] = v;
}

// Stores v as float4 column c (elements 4c .. 4c + 3) of a row of `dtype`.
inline void pyfa_store4(device uchar *row, uint c, float4 v, int dtype) {
    if (dtype == PYFA_DTYPE_F16) ((device half4 *)row)[c] = half4(v);
    else if (dtype == PYFA_DTYPE_BF16) ((device bfloat4 *)row)[c] = bfloat4(v);
    else ((device float4 *)row)[c] = v;
}

// Whether a function constant holds a value the kernels are built for (the
// X-macro lists of pyfa_params.h). A specialisation outside them is never
// dispatched (the dispatchers validate first); if one is, its kernel fills
// its outputs with NaN instead of returning with them unwritten.
#define PYFA_METAL_IS(v) || x == (v)
inline bool pyfa_is_head_dim(int x) { return false PYFA_FOR_EACH_HEAD_DIM(PYFA_METAL_IS); }
inline bool pyfa_is_attn_dtype(int x) { return false PYFA_FOR_EACH_ATTN_DTYPE(PYFA_METAL_IS); }
#undef PYFA_METAL_IS

// Bytes of one element of an attention dtype.
inline uint pyfa_dtype_size(int dtype) { return dtype == PYFA_DTYPE_F32 ? 4 : 2; }

// The score of a masked position, and the running max before any key: a
// finite stand-in for -inf, since Metal compiles with fast math, which may
// assume no infinities (a comparison with -INFINITY can fold away). Every
// real score is above it, and exp(PYFA_MASKED_SCORE - m) is 0.
#define PYFA_MASKED_SCORE (-3.0e38f)

// The cache slot of logical position pos (< cap) with the ring starting at
// slot ring (< cap), without forming pos + ring (which may pass 2^32).
inline uint pyfa_ring_slot(uint pos, uint ring, uint cap) { return pos >= cap - ring ? pos - (cap - ring) : pos + ring; }

// The logical positions [begin, end) workgroup iwg of a sequence covers, and
// the sequence's ring_start. kv_len and ring_start may be device-resident and
// unchecked (or rewritten after the call was recorded), so they are clamped
// into range, as every GPU backend does: a length above the capacity reads
// the whole cache, a ring_start outside it counts as 0.
struct pyfa_vec_span {
    uint ring, begin, end;
};

inline pyfa_vec_span pyfa_vec_workgroup_span(uint kv_len, uint ring, uint cap, uint window, uint nwg, uint iwg) {
    kv_len = int(kv_len) < 0 ? 0 : min(kv_len, cap);
    ring = ring < cap ? ring : 0;
    const uint lo = (window > 0 && kv_len > window) ? kv_len - window : 0;
    const ulong n = kv_len - lo, chunk = (n + nwg - 1) / nwg;
    const ulong c0 = ulong(iwg) * chunk, c1 = c0 + chunk;
    pyfa_vec_span span;
    span.ring = ring;
    span.begin = lo + uint(c0 < n ? c0 : n);
    span.end = lo + uint(c1 < n ? c1 : n);
    return span;
}

// Paged pools (paged_kv_params.h) for one (sequence, KV head) of a decode
// workgroup with the PAGED constant: pyfa_page_row(pg, s) is the pool row
// of position s (s < pages_per_seq * page_size: kv_len is clamped there),
// a block_table entry outside 0..num_pages-1 read as page num_pages - 1.
// page_size is a power of two (shift and mask); 32-bit rows are exact (the
// dispatchers check num_pages * page_size * num_kv_heads fits).
struct pyfa_pages {
    device const int *table; // this sequence's block_table row
    uint shift, mask, num_pages, num_kv_heads, kvh, layout;
};

inline pyfa_pages pyfa_pages_of(constant pyfa_kv_pages &kp, device const int *block_table, uint b, uint kvh,
                                uint num_kv_heads) {
    pyfa_pages pg;
    pg.table = block_table + ulong(b) * kp.pages_per_seq;
    pg.shift = 0; // log2(page_size), a power of two; a loop: the MSL executor has no ctz
    while ((1u << pg.shift) < kp.page_size && pg.shift < 31) pg.shift++;
    pg.mask = kp.page_size - 1;
    pg.num_pages = kp.num_pages;
    pg.num_kv_heads = num_kv_heads;
    pg.kvh = kvh;
    pg.layout = kp.layout;
    return pg;
}

inline uint pyfa_page_row(thread const pyfa_pages &pg, uint s) {
    uint page = uint(pg.table[s >> pg.shift]);
    page = page < pg.num_pages ? page : pg.num_pages - 1;
    return PYFA_PAGE_ROW(pg.layout, pg.mask + 1, pg.num_kv_heads, page, s & pg.mask, pg.kvh);
}

// -inf as a stored value (an LSE of a row with no visible key), and a test
// for it by bit pattern: fast math may fold -INFINITY comparisons away.
inline float pyfa_neg_inf() { return as_type<float>(0xff800000u); }
inline bool pyfa_is_neg_inf(float x) { return as_type<uint>(x) == 0xff800000u; }

// Apple's layout of an 8x8 SIMD-group matrix: lane l's thread_elements() are
// row pyfa_mat_row(l), columns pyfa_mat_col(l) and pyfa_mat_col(l) + 1.
inline uint pyfa_mat_row(uint l) { return ((l >> 2) & 4) + ((l >> 1) & 3); }
inline uint pyfa_mat_col(uint l) { return ((l >> 2) & 2) * 2 + (l & 1) * 2; }
