/*
 * CPU bodies of flash_attn_vec, flash_attn_vec_tq and flash_attn_vec_reduce
 * (contracts in pyfa_params.h, turboquant_params.h). Included by
 * attn_vec_generic.c and attn_vec_avx2.c.
 *
 * One threadgroup = (workgroup iwg, KV head, sequence). It converts each K/V
 * row to f32 once and uses it for all query heads of the GQA group, walking
 * its share of the visible logical positions in blocks with one online-softmax
 * update per block. Slots at or past kv_len are never read. With the PAGED
 * constant the rows come from paged pools (paged_kv_params.h): a slot is
 * then a row of the pool, not of this sequence's head.
 *
 * Paged pools with the CPU plan's PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS: the
 * threadgroup with KV head 0 walks every KV head of its (sequence, split)
 * and those of heads 1.. return at once. A page holds the rows of all heads
 * (32 KB at page_size 16, 8 heads, D = 128, f16). One head's share of it is
 * pieces of D elements num_kv_heads rows apart in NHD (256 bytes 2 KB
 * apart), which one core reads at a third of its sequential bandwidth
 * whatever is prefetched, and one 4 KB run in HND, after which the hardware
 * prefetchers restart; a threadgroup that takes every head of a block uses
 * the block's whole page at once. On 2 cores (B 8, H 16/8, D 128, f16,
 * L 1K and 8K; docs/cuda/PAGED.md) paged / contiguous decode went from
 * 1.8-2.2x to 1.0-1.1x over NHD pools, 1.3-1.4x to 0.9-1.0x over HND pools
 * (medians of six runs).
 * Each head keeps its own softmax state and sees the same blocks, rows and
 * operations in the same order as on its own, so the results are bit for
 * bit those of per-head threadgroups with the same nwg. The grid stays the
 * dispatcher's (nwg, num_kv_heads, batch): the pool hands threadgroups out
 * one by one, so an empty one costs an atomic increment and a call, and no
 * backend-neutral code learns about it.
 *
 * flash_attn_vec_tq runs the same body with kbits/vbits > 0: a row is then
 * the codebook centroids of its codes (rotated domain), and its scale
 * (scale / sqrt(D)) multiplies the score (K) or the softmax weight (V).
 */
#include "cpu_simd.h"
#include "pyfa_cpu.h"
#include "tq_codec.h"

#define VEC_BLOCK 16

/* Eight chains of adds in flight (dot4_f32, accumulate_rows' wide chunks) where the registers
 * hold them: AVX2's sixteen 256-bit registers. In the baseline build a vf8 takes two 128-bit
 * registers, and the wide forms took 11-14% more instructions under callgrind. */
#if defined(PYFA_CPU_AVX2)
#define VEC_WIDE_CHAINS 1
#else
#define VEC_WIDE_CHAINS 0
#endif

/* Scratch floats of a flash_attn_vec threadgroup holding the softmax state
 * of R query heads (R = the GQA group G, or num_heads when it walks every KV
 * head; the CPU plan uses it): q and acc rows, each head's block of scores,
 * M and S, one block of f32 rows, the TurboQuant codebooks. */
#define VEC_SCRATCH_FLOATS(R, D) \
    ((size_t)(R) * (D) * 2 + (size_t)VEC_BLOCK * (D) + (size_t)(R) * (VEC_BLOCK + 2) + 2 * (size_t)TQ_MAX_LEVELS)

/* Where a K or V row comes from: a dense cache row of kv_dt, or (bits > 0)
 * TurboQuant codes with a per-slot scale. */
typedef struct vec_rows {
    const char *base;     /* this (sequence, KV head)'s slot 0 */
    size_t row_bytes;
    const float *scales;  /* TurboQuant: this head's per-slot scales */
    const float *cb;      /* TurboQuant: codebook, padded to TQ_MAX_LEVELS */
#if defined(PYFA_CPU_AVX2)
    tq_planes planes;     /* 4-bit rows: decoded in PERM4 order (tq_codec.h) */
#endif
} vec_rows;

/* Whether rows of this width arrive in PERM4 order. */
PYFA_INLINE int vec_perm4(int bits) {
#if defined(PYFA_CPU_AVX2)
    return bits == 4;
#else
    (void)bits;
    return 0;
#endif
}

/* A paged pool's geometry for one (sequence, KV head) (paged_kv_params.h):
 * position s lives in pool row PYFA_PAGE_ROW(layout, page_size, Hkv,
 * page, s % page_size, h) with page = block_table[b][s / page_size],
 * an entry outside 0..num_pages-1 read as num_pages - 1. */
typedef struct vec_pages {
    const int32_t *table; /* this sequence's block_table row */
    uint32_t shift, mask; /* log2(page_size), page_size - 1 */
    uint32_t num_pages, num_kv_heads, kvh, layout;
} vec_pages;

PYFA_INLINE void vec_pages_init(vec_pages *pg, const pyfa_cpu_dispatch *d, uint32_t b, uint32_t kvh) {
    const pyfa_kv_pages *kp = (const pyfa_kv_pages *)d->args[PYFA_VEC_ARG_PAGES];
    const pyfa_flash_attn_vec_params *p = (const pyfa_flash_attn_vec_params *)d->args[PYFA_VEC_ARG_PARAMS];
    pg->table = (const int32_t *)d->args[PYFA_VEC_ARG_BLOCK_TABLE] + (size_t)b * kp->pages_per_seq;
    pg->shift = (uint32_t)__builtin_ctz(kp->page_size); /* a power of two (the dispatchers check) */
    pg->mask = kp->page_size - 1;
    pg->num_pages = kp->num_pages;
    pg->num_kv_heads = p->num_kv_heads;
    pg->kvh = kvh;
    pg->layout = kp->layout;
}

/* Pool row of position s (s < pages_per_seq * page_size: kv_len is clamped there). */
PYFA_INLINE uint32_t vec_page_row(const vec_pages *pg, uint32_t s) {
    uint32_t page = (uint32_t)pg->table[s >> pg->shift];
    page = page < pg->num_pages ? page : pg->num_pages - 1;
    return PYFA_PAGE_ROW(pg->layout, pg->mask + 1, pg->num_kv_heads, page, s & pg->mask, pg->kvh);
}

/* Pool rows of positions [pos, pos + nb) (nb <= VEC_BLOCK) into slots. A
 * block inside one page is a run of rows a fixed step apart (1 row in HND,
 * num_kv_heads rows in NHD): one block_table read serves the block, and the
 * row loop addresses like the dense one. */
PYFA_INLINE void vec_block_slots(const vec_pages *pg, uint32_t pos, uint32_t nb, uint32_t *slots) {
    if ((pos & pg->mask) + nb <= pg->mask + 1) {
        const uint32_t row0 = vec_page_row(pg, pos), step = pg->layout == PYFA_PAGES_NHD ? pg->num_kv_heads : 1;
        for (uint32_t j = 0; j < nb; j++) slots[j] = row0 + j * step;
    } else {
        for (uint32_t j = 0; j < nb; j++) slots[j] = vec_page_row(pg, pos + j);
    }
}

/* How far ahead (positions) paged rows are prefetched. Paged rows lie in
 * runs of page_size rows spread over the pool (a page of 16 f16 rows at
 * D = 128 is one 4 KB OS page per head), and the hardware prefetchers
 * restart at every run. Loading K row s prefetches K row s +
 * VEC_PREFETCH_AHEAD, loading V row s the V row: one row per row loaded, so
 * the misses stay spread over the block instead of arriving as one burst
 * (a block's 32 K and V rows at once) that fills the core's miss buffers and
 * stalls the loads behind it. Into L2 (locality 1; into L1 was slower): the
 * rows are read once, two blocks later. On Zen 4, with the block slots
 * above, paged decode takes 0.62x (HND) and 0.8x (NHD) the time it took with
 * one burst per block one block ahead (docs/cuda/PAGED.md); 4 or 8 blocks
 * ahead were no better than 2. */
#define VEC_PREFETCH_AHEAD (2 * VEC_BLOCK)

/* Prefetches the row of position s, `head_rows` pool rows past pg->kvh's. */
PYFA_INLINE void vec_prefetch_row(const vec_pages *pg, const vec_rows *r, uint32_t s, uint32_t head_rows) {
    const char *p = r->base + (size_t)(vec_page_row(pg, s) + head_rows) * r->row_bytes;
    for (size_t o = 0; o < r->row_bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

/* Row `slot` as f32 in dst; returns the factor its dot products take. */
PYFA_INLINE float vec_load_row(float *dst, const vec_rows *r, uint32_t slot, int kv_dt, int bits, uint32_t D,
                               float inv_sqrt_d) {
    if (bits) {
        const uint8_t *codes = (const uint8_t *)r->base + slot * r->row_bytes;
        switch (bits) { /* a constant width per copy, so the unpacking specialises */
        case 2: tq_centroids_row(dst, codes, r->cb, 2, D); break;
        case 3: tq_centroids_row(dst, codes, r->cb, 3, D); break;
#if defined(PYFA_CPU_AVX2)
        case 4: tq_centroids_row_perm4(dst, codes, &r->planes, D); break;
#else
        case 4: tq_centroids_row(dst, codes, r->cb, 4, D); break;
#endif
        default: tq_centroids_row(dst, codes, r->cb, 8, D); break;
        }
        return r->scales[slot] * inv_sqrt_d;
    }
    row_to_f32(dst, r->base + slot * r->row_bytes, D, kv_dt);
    return 1.0f;
}

/* acc[i] += sum over j < nb, in order, of w[j] * rows[j][i]; D % 16 == 0. Each register chunk
 * of acc is a chain of nb dependent adds: from D = 128 chunks of 64 floats keep eight chains in
 * flight (the order per element, and so the bits, are those of any chunk width; at D = 64 the
 * wide chunk measured no faster). */
PYFA_INLINE void accumulate_rows(float *acc, const float *w, const float *rows, uint32_t nb, uint32_t D) {
    uint32_t i = 0;
    for (; VEC_WIDE_CHAINS && D >= 128 && i + 64 <= D; i += 64) {
        vf8 a[8];
        for (int c = 0; c < 8; c++) a[c] = vf8_load(acc + i + 8 * c);
        for (uint32_t j = 0; j < nb; j++) {
            const float *r = rows + (size_t)j * D + i;
            const vf8 wj = vf8_splat(w[j]);
            for (int c = 0; c < 8; c++) a[c] += wj * vf8_load(r + 8 * c);
        }
        for (int c = 0; c < 8; c++) vf8_store(acc + i + 8 * c, a[c]);
    }
    for (; i + 32 <= D; i += 32) {
        vf8 a0 = vf8_load(acc + i), a1 = vf8_load(acc + i + 8), a2 = vf8_load(acc + i + 16), a3 = vf8_load(acc + i + 24);
        for (uint32_t j = 0; j < nb; j++) {
            const float *r = rows + (size_t)j * D + i;
            const vf8 wj = vf8_splat(w[j]);
            a0 += wj * vf8_load(r);
            a1 += wj * vf8_load(r + 8);
            a2 += wj * vf8_load(r + 16);
            a3 += wj * vf8_load(r + 24);
        }
        vf8_store(acc + i, a0);
        vf8_store(acc + i + 8, a1);
        vf8_store(acc + i + 16, a2);
        vf8_store(acc + i + 24, a3);
    }
    for (; i < D; i += 16) {
        vf8 a0 = vf8_load(acc + i), a1 = vf8_load(acc + i + 8);
        for (uint32_t j = 0; j < nb; j++) {
            const vf8 wj = vf8_splat(w[j]);
            a0 += wj * vf8_load(rows + (size_t)j * D + i);
            a1 += wj * vf8_load(rows + (size_t)j * D + i + 8);
        }
        vf8_store(acc + i, a0);
        vf8_store(acc + i + 8, a1);
    }
}

/* `paged` (the PAGED constant) is a constant at every call site, like the
 * dtype and head dim: the dense copies compile without the paged branches.
 * The threadgroup walks KV heads kvh0 .. kvh0 + nkv - 1 of sequence b: nkv
 * is the constant 1 in the dense copies, num_kv_heads (with kvh0 = 0) where
 * a paged dispatch walks every head (top of this file). Head h's state (q,
 * acc, scores, M, S) is that of query heads (kvh0 + h) * G .. + G - 1. */
PYFA_INLINE void vec_body(const pyfa_cpu_dispatch *d, uint32_t iwg, uint32_t kvh0, uint32_t nkv, uint32_t b,
                          float *scratch, const int kv_dt, const uint32_t D, const int kbits, const int vbits,
                          const int paged) {
    const pyfa_flash_attn_vec_params *p = (const pyfa_flash_attn_vec_params *)d->args[PYFA_VEC_ARG_PARAMS];
    const uint32_t G = p->num_heads / p->num_kv_heads, R = nkv * G;
    const uint32_t cap = p->kv_capacity, nwg = p->nwg;
    /* kv_len and ring_start clamped as pyfa_params.h says (as the GPU kernels
     * do); a paged sequence has no ring_start (and kv_capacity is
     * pages_per_seq * page_size there, paged_kv_params.h). */
    uint32_t kv_len = ((const uint32_t *)d->args[PYFA_VEC_ARG_KV_LEN])[b];
    uint32_t ring = paged ? 0 : ((const uint32_t *)d->args[PYFA_VEC_ARG_RING_START])[b];
    kv_len = (int32_t)kv_len < 0 ? 0 : (kv_len > cap ? cap : kv_len);
    ring = ring < cap ? ring : 0;
    /* Paged: rows are addressed from the pool's start by vec_page_row, for
     * KV head kvh0; head kvh0 + h's row of a token is h * head_step rows on
     * (PYFA_PAGE_ROW: the next row in NHD, the next page_size rows in HND). */
    vec_pages pg = {0};
    if (paged) vec_pages_init(&pg, d, b, kvh0);
    const uint32_t head_step = paged && pg.layout == PYFA_PAGES_HND ? pg.mask + 1 : 1;
    const int q_dt = kbits ? PYFA_DTYPE_F32 : d->constants[PYFA_VEC_FC_Q_DTYPE];
    const int has_softcap = d->constants[PYFA_VEC_FC_HAS_SOFTCAP];
    const int direct = d->constants[PYFA_VEC_FC_DIRECT_OUT];
    /* TurboQuant's direct output is the rotated f32 row its undo reads. */
    const int out_dt = kbits ? PYFA_DTYPE_F32 : d->constants[PYFA_VEC_FC_OUT_DTYPE];
    const int has_lse = d->constants[kbits ? PYFA_TQ_VEC_FC_HAS_LSE : PYFA_VEC_FC_HAS_LSE];
    const float scale = p->scale, softcap = p->softcap;

    /* This workgroup's logical positions [begin, end). */
    const uint32_t lo = (p->window && kv_len > p->window) ? kv_len - p->window : 0;
    const uint64_t n = kv_len - lo, chunk = (n + nwg - 1) / nwg;
    const uint64_t b0 = (uint64_t)iwg * chunk, b1 = b0 + chunk;
    const uint32_t begin = lo + (uint32_t)(b0 < n ? b0 : n), end = lo + (uint32_t)(b1 < n ? b1 : n);

    float *qf = scratch, *acc = qf + (size_t)R * D, *kb = acc + (size_t)R * D;
    float *sc = kb + (size_t)VEC_BLOCK * D, *Ms = sc + (size_t)R * VEC_BLOCK, *Ss = Ms + R;
    float *kcb = Ss + R, *vcb = kcb + TQ_MAX_LEVELS;

    const size_t head_rows = paged ? 0 : ((size_t)b * p->num_kv_heads + kvh0) * cap;
    vec_rows kr, vr;
    kr.row_bytes = kbits ? PYFA_TQ_ROW_BYTES((size_t)D, kbits) : (size_t)D * dtype_size(kv_dt);
    vr.row_bytes = vbits ? PYFA_TQ_ROW_BYTES((size_t)D, vbits) : (size_t)D * dtype_size(kv_dt);
    kr.base = (const char *)d->args[PYFA_VEC_ARG_K] + head_rows * kr.row_bytes;
    vr.base = (const char *)d->args[PYFA_VEC_ARG_V] + head_rows * vr.row_bytes;
    kr.scales = vr.scales = NULL;
    kr.cb = kcb;
    vr.cb = vcb;
    if (kbits) { /* codebooks copied into zero-padded tables the vector lookups may over-read */
        memset(kcb, 0, 2 * TQ_MAX_LEVELS * sizeof(float));
        memcpy(kcb, d->args[PYFA_TQ_VEC_ARG_K_CODEBOOK], sizeof(float) << kbits);
        memcpy(vcb, d->args[PYFA_TQ_VEC_ARG_V_CODEBOOK], sizeof(float) << vbits);
        kr.scales = (const float *)d->args[PYFA_TQ_VEC_ARG_K_SCALES] + head_rows;
        vr.scales = (const float *)d->args[PYFA_TQ_VEC_ARG_V_SCALES] + head_rows;
#if defined(PYFA_CPU_AVX2)
        if (kbits == 4) tq_byte_planes(&kr.planes, kcb);
        if (vbits == 4) tq_byte_planes(&vr.planes, vcb);
#endif
    }
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    float kf[VEC_BLOCK];

    for (uint32_t g = 0; g < R; g++) {
        const size_t row = (size_t)b * p->num_heads + (size_t)kvh0 * G + g;
        const char *qrow = (const char *)d->args[PYFA_VEC_ARG_Q] + row * D * dtype_size(q_dt);
        float *qg = qf + (size_t)g * D;
        switch (q_dt) {
        case PYFA_DTYPE_F16: row_to_f32(qg, qrow, D, PYFA_DTYPE_F16); break;
        case PYFA_DTYPE_BF16: row_to_f32(qg, qrow, D, PYFA_DTYPE_BF16); break;
        default: row_to_f32(qg, qrow, D, PYFA_DTYPE_F32); break;
        }
        if (!has_softcap) scale_f32(qg, scale, D);
        if (vec_perm4(kbits)) tq_permute4(qg, D, 1); /* K rows arrive permuted */
        memset(acc + (size_t)g * D, 0, (size_t)D * sizeof(float));
        Ms[g] = -INFINITY;
        Ss[g] = 0.0f;
    }

    for (uint32_t pos = begin; pos < end; pos += VEC_BLOCK) {
        const uint32_t nb = end - pos < VEC_BLOCK ? end - pos : VEC_BLOCK;
        uint32_t slots[VEC_BLOCK];
        if (paged) vec_block_slots(&pg, pos, nb, slots);
        /* Every head walked takes the whole block before the next head does:
         * the heads' rows of a block share its page. */
        for (uint32_t h = 0; h < nkv; h++) {
            const uint32_t hrow = h * head_step; /* pool rows past kvh0's */
            for (uint32_t j = 0; j < nb; j++) {
                const uint32_t s = pos + j + ring;
                if (!paged) slots[j] = s >= cap ? s - cap : s;
                if (paged && pos + j + VEC_PREFETCH_AHEAD < end)
                    vec_prefetch_row(&pg, &kr, pos + j + VEC_PREFETCH_AHEAD, hrow);
                kf[j] = vec_load_row(kb + (size_t)j * D, &kr, slots[j] + hrow, kv_dt, kbits, D, inv_sqrt_d);
            }
            for (uint32_t g = h * G; g < (h + 1) * G; g++) {
                const float *qg = qf + (size_t)g * D;
                float *sg = sc + (size_t)g * VEC_BLOCK;
                float mb = -INFINITY;
                /* From D = 128 the scores come four rows at a time (dot4_f32: the same bits);
                 * below, one at a time, as they measured faster at D = 64. */
                float dots[VEC_BLOCK];
                uint32_t j4 = 0;
                if (VEC_WIDE_CHAINS && D >= 128)
                    for (; j4 + 4 <= nb; j4 += 4) dot4_f32(qg, kb + (size_t)j4 * D, D, D, dots + j4);
                for (uint32_t j = 0; j < nb; j++) {
                    float s = j < j4 ? dots[j] : dot_f32(qg, kb + (size_t)j * D, D);
                    if (kbits) s *= kf[j];
                    if (has_softcap) s = apply_softcap(s * scale, softcap);
                    sg[j] = s;
                    mb = s > mb ? s : mb;
                }
                const float m_new = mb > Ms[g] ? mb : Ms[g];
                if (m_new == -INFINITY) { /* every score -inf: nothing to add */
                    for (uint32_t j = 0; j < nb; j++) sg[j] = 0.0f;
                    continue;
                }
                const float alpha = expf(Ms[g] - m_new);
                if (alpha != 1.0f) {
                    scale_f32(acc + (size_t)g * D, alpha, D);
                    Ss[g] *= alpha;
                }
                /* sg has VEC_BLOCK (a multiple of 8) slots; lanes past nb are not summed. */
                float sum = 0.0f;
                for (uint32_t j = 0; j < nb; j += 8) {
                    vf8 e = vf8_exp_nonpos(vf8_load(sg + j) - vf8_splat(m_new));
                    vf8_store(sg + j, e);
                }
                for (uint32_t j = 0; j < nb; j++) sum += sg[j];
                Ss[g] += sum;
                Ms[g] = m_new;
            }
            /* V rows into kb (the block's K rows are done with), then each head's
             * accumulator takes the whole block per register chunk, rows in order. */
            float vf[VEC_BLOCK];
            for (uint32_t j = 0; j < nb; j++) {
                if (paged && pos + j + VEC_PREFETCH_AHEAD < end)
                    vec_prefetch_row(&pg, &vr, pos + j + VEC_PREFETCH_AHEAD, hrow);
                vf[j] = vec_load_row(kb + (size_t)j * D, &vr, slots[j] + hrow, kv_dt, vbits, D, inv_sqrt_d);
            }
            for (uint32_t g = h * G; g < (h + 1) * G; g++) {
                float w[VEC_BLOCK];
                for (uint32_t j = 0; j < nb; j++) w[j] = sc[(size_t)g * VEC_BLOCK + j] * vf[j];
                accumulate_rows(acc + (size_t)g * D, w, kb, nb, D);
            }
        }
    }

    const uint32_t nrows = p->batch * p->num_heads;
    if (vec_perm4(vbits)) /* V rows arrived permuted */
        for (uint32_t g = 0; g < R; g++) tq_permute4(acc + (size_t)g * D, D, 0);
    for (uint32_t g = 0; g < R; g++) {
        const size_t row = (size_t)b * p->num_heads + (size_t)kvh0 * G + g;
        const float *ag = acc + (size_t)g * D;
        if (direct) {
            const float inv = Ss[g] > 0.0f ? 1.0f / Ss[g] : 0.0f;
            row_store_scaled((char *)d->args[PYFA_VEC_ARG_OUT] + row * D * dtype_size(out_dt), ag, inv, D, out_dt);
            if (has_lse) ((float *)d->args[PYFA_VEC_ARG_LSE])[row] = Ss[g] > 0.0f ? Ms[g] + logf(Ss[g]) : -INFINITY;
        } else {
            float *tmp = (float *)d->args[PYFA_VEC_ARG_TMP];
            memcpy(tmp + (row * nwg + iwg) * D, ag, (size_t)D * sizeof(float));
            float *sm = tmp + (size_t)nrows * nwg * D + (row * nwg + iwg) * 2;
            sm[0] = Ss[g];
            sm[1] = Ms[g];
        }
    }
}

/* The KV heads threadgroup (x, kvh, b) of a paged dispatch walks: under
 * PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS all of them from kvh 0 (none for kvh >
 * 0), else its own. Returns the count, *kvh0 the first. The plan picks the
 * variant only with scratch for num_heads states; a dispatch without it is
 * refused rather than overrun (pyfa_cpu_fail). */
PYFA_INLINE uint32_t vec_paged_heads(const pyfa_cpu_dispatch *d, uint32_t kvh, uint32_t D, uint32_t *kvh0) {
    const pyfa_flash_attn_vec_params *p = (const pyfa_flash_attn_vec_params *)d->args[PYFA_VEC_ARG_PARAMS];
    *kvh0 = kvh;
    if (d->constants[PYFA_VEC_FC_VARIANT] != PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS)
        return 1;
    if (d->threadgroup_memory < VEC_SCRATCH_FLOATS(p->num_heads, D) * sizeof(float)) {
        pyfa_cpu_fail(d, "all-KV-heads decode: %llu bytes of scratch, %zu needed",
                      (unsigned long long)d->threadgroup_memory, VEC_SCRATCH_FLOATS(p->num_heads, D) * sizeof(float));
        return 0;
    }
    *kvh0 = 0;
    return kvh == 0 ? p->num_kv_heads : 0;
}

/* Whether dtype is one a float operand may have (f32, f16, bf16). */
#define VEC_IS(v) || x == (v)
PYFA_INLINE int is_float_dtype(int x) { return 0 PYFA_FOR_EACH_ATTN_DTYPE(VEC_IS); }
#undef VEC_IS

/* Every switch over a function constant ends in a default that reports
 * through pyfa_cpu_fail (the queue turns it into an error) and writes
 * nothing: the dispatchers' validation keeps these unreachable, and if one is
 * reached anyway the op fails loudly instead of leaving its output unwritten. */
/* One case per supported head dim (PYFA_FOR_EACH_HEAD_DIM), per KV dtype. */
#define VEC_CASE_D(DT, DV)                                                                         \
    case DV:                                                                                       \
        if (d->constants[PYFA_VEC_FC_PAGED]) {                                                     \
            uint32_t kvh0, nkv = vec_paged_heads(d, y, DV, &kvh0);                                 \
            if (nkv) vec_body(d, x, kvh0, nkv, z, (float *)scratch, DT, DV, 0, 0, 1);              \
        } else {                                                                                   \
            vec_body(d, x, y, 1, z, (float *)scratch, DT, DV, 0, 0, 0);                            \
        }                                                                                          \
        return;
#define VEC_CASE_F32(DV) VEC_CASE_D(PYFA_DTYPE_F32, DV)
#define VEC_CASE_F16(DV) VEC_CASE_D(PYFA_DTYPE_F16, DV)
#define VEC_CASE_BF16(DV) VEC_CASE_D(PYFA_DTYPE_BF16, DV)
#define VEC_SWITCH_D(CASE)                                                                         \
    switch (d->constants[PYFA_VEC_FC_HEAD_DIM]) {                                                  \
        PYFA_FOR_EACH_HEAD_DIM(CASE)                                                               \
    default:                                                                                       \
        pyfa_cpu_fail(d, "unsupported head_dim %d", d->constants[PYFA_VEC_FC_HEAD_DIM]);           \
        return;                                                                                    \
    }

void PYFA_ISA(pyfa_cpu_flash_attn_vec)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                       void *scratch) {
    if (!is_float_dtype(d->constants[PYFA_VEC_FC_Q_DTYPE]) || !is_float_dtype(d->constants[PYFA_VEC_FC_OUT_DTYPE])) {
        pyfa_cpu_fail(d, "unsupported q / out dtype %d / %d", d->constants[PYFA_VEC_FC_Q_DTYPE],
                      d->constants[PYFA_VEC_FC_OUT_DTYPE]);
        return;
    }
    switch (d->constants[PYFA_VEC_FC_KV_DTYPE]) {
    case PYFA_DTYPE_F16: VEC_SWITCH_D(VEC_CASE_F16)
    case PYFA_DTYPE_BF16: VEC_SWITCH_D(VEC_CASE_BF16)
    case PYFA_DTYPE_F32: VEC_SWITCH_D(VEC_CASE_F32)
    default: pyfa_cpu_fail(d, "unsupported kv dtype %d", d->constants[PYFA_VEC_FC_KV_DTYPE]); return;
    }
}

/* Merges the nwg partial states of row x into o (f32) and returns the row's
 * lse (-inf when no workgroup saw a key, o then zeros). One out-of-line copy
 * serves both flash_attn_vec_reduce and the fused TurboQuant reduce + undo,
 * so the two run the same instructions. */
__attribute__((noinline)) static float vec_reduce_row(const pyfa_attn_reduce_params *p, const float *tmp, uint32_t x,
                                                      float *o) {
    const uint32_t D = p->head_dim, nwg = p->nwg;
    const float *sm = tmp + (size_t)p->nrows * nwg * D + (size_t)x * nwg * 2;
    const float *part = tmp + (size_t)x * nwg * D;
    float m = -INFINITY;
    for (uint32_t w = 0; w < nwg; w++)
        if (sm[2 * w] > 0.0f && sm[2 * w + 1] > m) m = sm[2 * w + 1];
    memset(o, 0, (size_t)D * sizeof(float));
    if (m == -INFINITY) return -INFINITY; /* no workgroup saw a key */
    float total = 0.0f;
    for (uint32_t w = 0; w < nwg; w++) {
        if (!(sm[2 * w] > 0.0f)) continue;
        const float f = expf(sm[2 * w + 1] - m);
        total += sm[2 * w] * f;
        axpy_f32(o, f, part + (size_t)w * D, D);
    }
    scale_f32(o, 1.0f / total, D);
    return m + logf(total);
}

/* Whether the reduce constants are ones the reduce bodies are built for. */
PYFA_INLINE int vec_reduce_constants_ok(const pyfa_cpu_dispatch *d) {
    if (is_float_dtype(d->constants[PYFA_REDUCE_FC_OUT_DTYPE])) return 1;
    pyfa_cpu_fail(d, "unsupported out dtype %d", d->constants[PYFA_REDUCE_FC_OUT_DTYPE]);
    return 0;
}

/* Stores a reduced (and for TurboQuant undone) f32 row x as out's dtype, and its lse. */
PYFA_INLINE void vec_reduce_store(const pyfa_cpu_dispatch *d, uint32_t x, const float *row, uint32_t D, float lse) {
    const int out_dt = d->constants[PYFA_REDUCE_FC_OUT_DTYPE];
    row_store_scaled((char *)d->args[PYFA_REDUCE_ARG_OUT] + (size_t)x * D * dtype_size(out_dt), row, 1.0f, D, out_dt);
    if (d->constants[PYFA_REDUCE_FC_HAS_LSE]) ((float *)d->args[PYFA_REDUCE_ARG_LSE])[x] = lse;
}

void PYFA_ISA(pyfa_cpu_flash_attn_vec_reduce)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                              void *scratch) {
    (void)y, (void)z, (void)scratch;
    const pyfa_attn_reduce_params *p = (const pyfa_attn_reduce_params *)d->args[PYFA_REDUCE_ARG_PARAMS];
    float row[PYFA_MAX_HEAD_DIM];
    if (!vec_reduce_constants_ok(d)) return;
    if (p->head_dim > PYFA_MAX_HEAD_DIM) {
        pyfa_cpu_fail(d, "unsupported head_dim %u", p->head_dim);
        return;
    }
    const float lse = vec_reduce_row(p, (const float *)d->args[PYFA_REDUCE_ARG_TMP], x, row);
    vec_reduce_store(d, x, row, p->head_dim, lse);
}
