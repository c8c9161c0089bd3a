/*
 * CPU body of kv_append (contract in pyfa_params.h). Included by
 * kv_append_generic.c and kv_append_avx2.c.
 */
#include "cpu_simd.h"
#include "pyfa_cpu.h"

/* One row of D elements, SDT -> CDT, both compile-time constants at each call
 * site (the switch below), so the loads and stores fold to one path. */
PYFA_INLINE void kv_append_row(char *dst, const char *src, uint32_t D, int sdt, int cdt) {
    uint32_t i = 0;
    for (; i + 8 <= D; i += 8) vf8_store_as(dst, i, vf8_load_as(src, i, sdt), cdt);
    if (i < D) { /* the last D % 8 elements, through an 8-lane staging row */
        char in[32] = {0}, out[32];
        memcpy(in, src + (size_t)i * dtype_size(sdt), (size_t)(D - i) * dtype_size(sdt));
        vf8_store_as(out, 0, vf8_load_as(in, 0, sdt), cdt);
        memcpy(dst + (size_t)i * dtype_size(cdt), out, (size_t)(D - i) * dtype_size(cdt));
    }
}

#define KV_APPEND_CASE(S, C)                                                                       \
    case (S) * 16 + (C): kv_append_row(dst, src, D, S, C); return;

/* One row into the cache or pool (`what` names it in the failure message):
 * equal dtypes copy the bits, others convert through f32. */
PYFA_INLINE void kv_append_convert(const pyfa_cpu_dispatch *d, char *dst, const char *src, uint32_t D, int sdt,
                                   int cdt, const char *what) {
    if (sdt == cdt && (sdt == PYFA_DTYPE_F32 || sdt == PYFA_DTYPE_F16 || sdt == PYFA_DTYPE_BF16)) {
        memcpy(dst, src, (size_t)D * dtype_size(sdt));
        return;
    }
    switch (sdt * 16 + cdt) {
        KV_APPEND_CASE(PYFA_DTYPE_F32, PYFA_DTYPE_F16)
        KV_APPEND_CASE(PYFA_DTYPE_F32, PYFA_DTYPE_BF16)
        KV_APPEND_CASE(PYFA_DTYPE_F16, PYFA_DTYPE_F32)
        KV_APPEND_CASE(PYFA_DTYPE_F16, PYFA_DTYPE_BF16)
        KV_APPEND_CASE(PYFA_DTYPE_BF16, PYFA_DTYPE_F32)
        KV_APPEND_CASE(PYFA_DTYPE_BF16, PYFA_DTYPE_F16)
    default: pyfa_cpu_fail(d, "unsupported src / %s dtype %d / %d", what, sdt, cdt); return;
    }
}

/* Token x of KV head y. */
void PYFA_ISA(pyfa_cpu_kv_append)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z, void *scratch) {
    (void)z, (void)scratch;
    const pyfa_kv_append_params *p = (const pyfa_kv_append_params *)d->args[PYFA_KV_APPEND_ARG_PARAMS];
    const int sdt = d->constants[PYFA_KV_APPEND_FC_SRC_DTYPE], cdt = d->constants[PYFA_KV_APPEND_FC_CACHE_DTYPE];
    const uint32_t D = p->head_dim, cap = p->kv_capacity;
    const int32_t position = *(const int32_t *)d->args[PYFA_KV_APPEND_ARG_POSITION];
    if (position < 0 || (uint32_t)position >= cap) return; /* a dropped append (kv_advance) */
    /* (position + x) mod cap without forming a sum that may pass 2^32. */
    const uint32_t pos = (uint32_t)position;
    const uint32_t slot = x >= cap - pos ? x - (cap - pos) : x + pos;
    const char *src = (const char *)d->args[PYFA_KV_APPEND_ARG_SRC] +
                      ((size_t)x * p->num_kv_heads + y) * D * dtype_size(sdt);
    char *dst = (char *)d->args[PYFA_KV_APPEND_ARG_CACHE] +
                (((size_t)p->sequence * p->num_kv_heads + y) * cap + slot) * D * dtype_size(cdt);
    kv_append_convert(d, dst, src, D, sdt, cdt, "cache");
}

/* kv_advance (contract in pyfa_params.h): the one workgroup moves the cache
 * state past an append. */
void PYFA_ISA(pyfa_cpu_kv_advance)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z, void *scratch) {
    (void)x, (void)y, (void)z, (void)scratch;
    pyfa_kv_state *st = (pyfa_kv_state *)d->args[PYFA_KV_ADVANCE_ARG_STATE];
    *st = pyfa_kv_advanced(*st, *(const pyfa_kv_advance_params *)d->args[PYFA_KV_ADVANCE_ARG_PARAMS]);
}

/* The pool row of slot `slot` for KV head `head`, or -1 for a slot outside
 * the pool (padding: the token writes nothing). 32-bit arithmetic is exact:
 * num_pages * page_size * num_kv_heads fits 32 bits (paged_kv_params.h). */
PYFA_INLINE int64_t paged_slot_row(const pyfa_kv_pages *pg, uint32_t num_kv_heads, int32_t slot, uint32_t head) {
    if (slot < 0 || (uint32_t)slot >= pg->num_pages * pg->page_size) return -1;
    const uint32_t page = (uint32_t)slot / pg->page_size, t = (uint32_t)slot % pg->page_size;
    return (int64_t)PYFA_PAGE_ROW(pg->layout, pg->page_size, num_kv_heads, page, t, head);
}

/* Token x of KV head y into the K pool (z = 0) or the V pool (z = 1). */
void PYFA_ISA(pyfa_cpu_kv_append_paged)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                        void *scratch) {
    (void)scratch;
    const pyfa_kv_append_paged_params *p =
        (const pyfa_kv_append_paged_params *)d->args[PYFA_KV_APPEND_PAGED_ARG_PARAMS];
    const int sdt = d->constants[PYFA_KV_APPEND_PAGED_FC_SRC_DTYPE];
    const int cdt = d->constants[PYFA_KV_APPEND_PAGED_FC_CACHE_DTYPE];
    const uint32_t D = p->head_dim;
    const int32_t slot = ((const int32_t *)d->args[PYFA_KV_APPEND_PAGED_ARG_SLOT_MAPPING])[x];
    const int64_t row = paged_slot_row(&p->pages, p->num_kv_heads, slot, y);
    if (row < 0) return;
    const char *src = (const char *)d->args[z ? PYFA_KV_APPEND_PAGED_ARG_SRC_V : PYFA_KV_APPEND_PAGED_ARG_SRC_K] +
                      ((size_t)x * p->num_kv_heads + y) * D * dtype_size(sdt);
    char *dst = (char *)d->args[z ? PYFA_KV_APPEND_PAGED_ARG_V_PAGES : PYFA_KV_APPEND_PAGED_ARG_K_PAGES] +
                (size_t)row * D * dtype_size(cdt);
    kv_append_convert(d, dst, src, D, sdt, cdt, "pool");
}

#undef KV_APPEND_CASE
