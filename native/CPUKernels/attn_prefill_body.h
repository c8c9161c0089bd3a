/*
 * CPU bodies of flash_attn_prefill, flash_attn_prefill_blk and
 * merge_attention_states (contracts in flash_attn_prefill_params.h).
 * Included by attn_prefill_generic.c and attn_prefill_avx2.c.
 *
 * flash_attn_prefill: one threadgroup = one tile of PF_BQ query rows of one
 * head. Q is converted to f32 once, pre-scaled (by scale*log2(e) without
 * softcap) and stored transposed in 16-row panels; each K/V tile of PF_BK
 * keys is converted to f32 once into scratch. Scores are computed by a 16x6
 * register-blocked micro-kernel into S^T [PF_BK][PF_BQ] (keys major), so the
 * online-softmax statistics are vector operations over query rows; P V uses
 * a 6x16 register-blocked micro-kernel that also applies the rescale factor.
 * Softmax runs in base 2 (exp2); statistics are f32. No [q_len, kv_len]
 * score matrix ever exists.
 */
#include "cpu_simd.h"
#include "pyfa_cpu.h"

/* Tile shape of the CPU plan (pyfa_cpu_prefill_tile reports it). The
 * micro-kernels need PF_BQ % 48 == 0 and PF_BK % 6 == 0. */
#define PF_BQ 48
#define PF_BK 48
#define PF_QK_ROWS 16 /* query rows per Q panel / score micro-kernel */
#define PF_QK_KEYS 6  /* keys per score micro-kernel */
#define PF_PV_ROWS 6  /* query rows per P V micro-kernel */

#define PF_LOG2E 1.44269504088896340736f
#define PF_LN2 0.69314718055994530942f

/* Scratch floats of one flash_attn_prefill threadgroup. */
#define PF_SCRATCH_FLOATS(D) (2 * (size_t)PF_BQ * (D) + 2 * (size_t)PF_BK * (D) + 2 * (size_t)PF_BK * PF_BQ + 3 * (size_t)PF_BQ)

/* st[j][i] = sum_d qt[i][d] * kt[j][d] for j < jn (a multiple of 6) and
 * i < rows (a multiple of 16). qt is stored as panels [PF_BQ/16][D][16]. */
PYFA_INLINE void pf_scores(float *st, const float *qt, const float *kt, uint32_t jn, uint32_t rows, const uint32_t D) {
    for (uint32_t jb = 0; jb < jn; jb += PF_QK_KEYS) {
        const float *k0 = kt + (size_t)jb * D;
        for (uint32_t ib = 0; ib < rows; ib += PF_QK_ROWS) {
            const float *panel = qt + (size_t)(ib / PF_QK_ROWS) * D * PF_QK_ROWS;
            vf8 a[PF_QK_KEYS][2];
            for (int r = 0; r < PF_QK_KEYS; r++) a[r][0] = a[r][1] = vf8_splat(0.0f);
            for (uint32_t dd = 0; dd < D; dd++) {
                const vf8 q0 = vf8_load(panel + (size_t)dd * PF_QK_ROWS);
                const vf8 q1 = vf8_load(panel + (size_t)dd * PF_QK_ROWS + 8);
                for (int r = 0; r < PF_QK_KEYS; r++) {
                    const vf8 kk = vf8_splat(k0[(size_t)r * D + dd]);
                    a[r][0] += q0 * kk;
                    a[r][1] += q1 * kk;
                }
            }
            for (int r = 0; r < PF_QK_KEYS; r++) {
                vf8_store(st + (size_t)(jb + r) * PF_BQ + ib, a[r][0]);
                vf8_store(st + (size_t)(jb + r) * PF_BQ + ib + 8, a[r][1]);
            }
        }
    }
}

/* o[i][:] = o[i][:] * alpha[i] + sum_{j < nk} st[j][i] * vt[j][:] for the
 * first rows_used rows (rounded up to a multiple of 6). */
PYFA_INLINE void pf_accumulate(float *o, const float *st, const float *vt, const float *alpha, uint32_t nk,
                               uint32_t rows_used, const uint32_t D) {
    for (uint32_t rb = 0; rb < rows_used; rb += PF_PV_ROWS) {
        for (uint32_t db = 0; db < D; db += 16) {
            vf8 a[PF_PV_ROWS][2];
            for (int r = 0; r < PF_PV_ROWS; r++) {
                const vf8 s = vf8_splat(alpha[rb + r]);
                const float *orow = o + (size_t)(rb + r) * D + db;
                a[r][0] = vf8_load(orow) * s;
                a[r][1] = vf8_load(orow + 8) * s;
            }
            for (uint32_t j = 0; j < nk; j++) {
                const float *vr = vt + (size_t)j * D + db;
                const vf8 v0 = vf8_load(vr), v1 = vf8_load(vr + 8);
                const float *pr = st + (size_t)j * PF_BQ + rb;
                for (int r = 0; r < PF_PV_ROWS; r++) {
                    const vf8 pp = vf8_splat(pr[r]);
                    a[r][0] += pp * v0;
                    a[r][1] += pp * v1;
                }
            }
            for (int r = 0; r < PF_PV_ROWS; r++) {
                float *orow = o + (size_t)(rb + r) * D + db;
                vf8_store(orow, a[r][0]);
                vf8_store(orow + 8, a[r][1]);
            }
        }
    }
}

/* Adds the mask tile (query rows [0, nq), keys [j0, j0 + nk)) to S^T in the
 * base-2 domain: rows are converted to additive form in mt [PF_BQ][PF_BK]
 * (bool: 0 or -inf; entries outside the tile 0), then added through 8x8
 * transposes. */
PYFA_INLINE void pf_add_mask(float *st, float *mt, const char *mbase, int64_t row_stride, int64_t j0, uint32_t nq,
                             uint32_t nk, uint32_t rows, int bool_mask, const int dt) {
    const uint32_t es = bool_mask ? 1 : dtype_size(dt);
    const uint32_t cols = (nk + 7) / 8 * 8;
    for (uint32_t i = 0; i < rows; i++) {
        float *dst = mt + (size_t)i * PF_BK;
        if (i >= nq) {
            memset(dst, 0, (size_t)cols * sizeof(float));
            continue;
        }
        const char *src = mbase + ((int64_t)i * row_stride + j0) * es;
        if (bool_mask) {
            uint32_t j = 0;
            for (; j + 8 <= nk; j += 8) {
                vb8 bytes;
                memcpy(&bytes, src + j, sizeof bytes);
                const vu8 blocked = (vu8)(__builtin_convertvector(bytes, vu8) == 0u);
                vf8_store(dst + j, (vf8)(blocked & 0xff800000u));
            }
            for (; j < nk; j++) dst[j] = src[j] ? 0.0f : -INFINITY;
        } else {
            row_to_f32_n(dst, src, nk, dt);
        }
        for (uint32_t j = nk; j < cols; j++) dst[j] = 0.0f;
    }
    const vf8 log2e = vf8_splat(PF_LOG2E);
    for (uint32_t ib = 0; ib < rows; ib += 8)
        for (uint32_t jb = 0; jb < cols; jb += 8) {
            vf8 r[8];
            for (int l = 0; l < 8; l++) r[l] = vf8_load(mt + (size_t)(ib + l) * PF_BK + jb);
            vf8_transpose8(r);
            for (int l = 0; l < 8; l++) {
                float *s = st + (size_t)(jb + l) * PF_BQ + ib;
                vf8_store(s, vf8_load(s) + r[l] * log2e);
            }
        }
}

/* Converts rows [0, n) of a K or V tile to f32 and zeroes rows [n, PF_BK). */
PYFA_INLINE void pf_load_tile(float *dst, const char *base, int64_t row_stride_bytes, uint32_t n, const int dt,
                              const uint32_t D) {
    for (uint32_t j = 0; j < n; j++) row_to_f32(dst + (size_t)j * D, base + (int64_t)j * row_stride_bytes, D, dt);
    if (n < PF_BK) memset(dst + (size_t)n * D, 0, (size_t)(PF_BK - n) * D * sizeof(float));
}

/* Converts keys [j0, j0 + n) of KV head kvh of a paged sequence (its
 * block_table row bt) to f32 rows and zeroes rows [n, PF_BK). Pool rows are
 * head_dim elements, contiguous; a page entry outside the pool reads the last
 * page (paged_kv_params.h). */
PYFA_INLINE void pf_load_tile_paged(float *dst, const char *pool, const pyfa_kv_pages *pg, const int32_t *bt,
                                    uint32_t num_kv_heads, uint32_t kvh, int64_t j0, uint32_t n, const int dt,
                                    const uint32_t D) {
    const uint32_t es = dtype_size(dt);
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t s = (uint32_t)(j0 + j);
        int32_t page = bt[s / pg->page_size];
        if (page < 0 || (uint32_t)page >= pg->num_pages) page = (int32_t)pg->num_pages - 1;
        const uint32_t row = PYFA_PAGE_ROW(pg->layout, pg->page_size, num_kv_heads, (uint32_t)page,
                                           s % pg->page_size, kvh);
        row_to_f32(dst + (size_t)j * D, pool + (int64_t)row * D * es, D, dt);
    }
    if (n < PF_BK) memset(dst + (size_t)n * D, 0, (size_t)(PF_BK - n) * D * sizeof(float));
}

/* One sequence of a dispatch: its rows, keys and positions. Rectangular mode:
 * params' q_len, kv_len, q_offset. Packed modes: the clamped cu_seqlens /
 * kv_len values of flash_attn_prefill_params.h. */
typedef struct pf_sequence {
    uint32_t q_len;   /* query rows of the sequence this dispatch writes (<= params.q_len) */
    uint32_t kv_len;  /* keys */
    int64_t q_offset; /* position of query row 0 */
    int64_t q_row0;   /* packed modes: q / out row of query row 0 */
    int64_t k_row0;   /* varlen: k / v row of key 0 */
    const int32_t *block_table; /* paged: the sequence's row of block_table */
} pf_sequence;

PYFA_INLINE int64_t pf_clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

PYFA_INLINE pf_sequence pf_sequence_of(const pyfa_cpu_dispatch *d, const pyfa_flash_attn_prefill_params *p,
                                       uint32_t b, int kv_mode) {
    pf_sequence s = {p->q_len, p->kv_len, p->q_offset, 0, 0, NULL};
    if (kv_mode == PYFA_PREFILL_KV_RECT) return s;
    const pyfa_prefill_packed *pk = (const pyfa_prefill_packed *)d->args[PYFA_PREFILL_ARG_PACKED];
    const int32_t *cu_q = (const int32_t *)d->args[PYFA_PREFILL_ARG_CU_SEQLENS_Q];
    const int32_t *seq_k = (const int32_t *)d->args[PYFA_PREFILL_ARG_SEQ_K];
    const int64_t q_begin = pf_clamp(cu_q[b], 0, pk->total_q), q_end = pf_clamp(cu_q[b + 1], q_begin, pk->total_q);
    int64_t kv_len;
    if (kv_mode == PYFA_PREFILL_KV_VARLEN) {
        const int64_t k_begin = pf_clamp(seq_k[b], 0, pk->total_k);
        kv_len = pf_clamp(seq_k[b + 1], k_begin, pk->total_k) - k_begin;
        s.k_row0 = k_begin;
    } else {
        const pyfa_kv_pages *pg = (const pyfa_kv_pages *)d->args[PYFA_PREFILL_ARG_PAGES];
        kv_len = pf_clamp(seq_k[b], 0, (int64_t)pg->pages_per_seq * pg->page_size);
        s.block_table = (const int32_t *)d->args[PYFA_PREFILL_ARG_BLOCK_TABLE] + (size_t)b * pg->pages_per_seq;
    }
    s.q_row0 = q_begin;
    s.q_len = (uint32_t)(q_end - q_begin < (int64_t)p->q_len ? q_end - q_begin : p->q_len);
    s.kv_len = (uint32_t)kv_len;
    s.q_offset = kv_len - (q_end - q_begin);
    return s;
}

PYFA_INLINE void prefill_body(const pyfa_cpu_dispatch *d, uint32_t qtile, uint32_t h, uint32_t b, float *scratch,
                              const int dt, const uint32_t D) {
    const pyfa_flash_attn_prefill_params *p = (const pyfa_flash_attn_prefill_params *)d->args[PYFA_PREFILL_ARG_PARAMS];
    const int has_mask = d->constants[PYFA_PREFILL_FC_HAS_MASK];
    const int bool_mask = d->constants[PYFA_PREFILL_FC_MASK_KIND] == PYFA_MASK_BOOL;
    const int causal = d->constants[PYFA_PREFILL_FC_DO_CAUSAL];
    const int has_window = d->constants[PYFA_PREFILL_FC_HAS_WINDOW];
    const int has_softcap = d->constants[PYFA_PREFILL_FC_HAS_SOFTCAP];
    const int has_blk = d->constants[PYFA_PREFILL_FC_HAS_BLK];
    const int has_lse = d->constants[PYFA_PREFILL_FC_HAS_LSE];
    const int kv_mode = d->constants[PYFA_PREFILL_FC_KV_MODE];
    const uint32_t es = dtype_size(dt);
    const pf_sequence seq = pf_sequence_of(d, p, b, kv_mode);

    const uint32_t i0 = qtile * PF_BQ;
    if (i0 >= seq.q_len) return; /* a tile past a packed sequence's rows */
    const uint32_t nq = seq.q_len - i0 < PF_BQ ? seq.q_len - i0 : PF_BQ;
    /* Rows each stage covers, nested so every stage reads rows the previous
     * one wrote: P V in blocks of 6, softmax in 8s, scores in 16s (<= PF_BQ). */
    const uint32_t rows_used = (nq + PF_PV_ROWS - 1) / PF_PV_ROWS * PF_PV_ROWS;
    const uint32_t rows_softmax = (rows_used + 7) / 8 * 8;
    const uint32_t rows_scores = (rows_softmax + PF_QK_ROWS - 1) / PF_QK_ROWS * PF_QK_ROWS;
    const uint32_t kvh = h / (p->num_heads / p->num_kv_heads);
    const int64_t window = p->window;
    const float scale = p->scale, softcap = p->softcap;

    float *qt = scratch;                        /* [PF_BQ/16][D][16] */
    float *o = qt + (size_t)PF_BQ * D;          /* [PF_BQ][D] */
    float *kt = o + (size_t)PF_BQ * D;          /* [PF_BK][D] */
    float *vt = kt + (size_t)PF_BK * D;         /* [PF_BK][D] */
    float *st = vt + (size_t)PF_BK * D;         /* [PF_BK][PF_BQ] */
    float *m = st + (size_t)PF_BK * PF_BQ;      /* [PF_BQ] running max (base 2) */
    float *l = m + PF_BQ;                       /* [PF_BQ] running sum */
    float *alpha = l + PF_BQ;                   /* [PF_BQ] rescale of this tile */
    float *mt = alpha + PF_BQ;                  /* [PF_BQ][PF_BK] mask tile, additive form */

    /* Q tile -> f32 (rows staged in o), scaled, transposed into panels. */
    const float qscale = has_softcap ? 1.0f : scale * PF_LOG2E;
    /* Packed modes: row r of the sequence is packed row q_row0 + r (no batch stride). */
    const int64_t q_batch = kv_mode == PYFA_PREFILL_KV_RECT ? b * p->q_strides[0] : 0;
    const int64_t out_batch = kv_mode == PYFA_PREFILL_KV_RECT ? b * p->out_strides[0] : 0;
    const int64_t row0 = seq.q_row0 + i0;
    const char *qbase = (const char *)d->args[PYFA_PREFILL_ARG_Q] +
                        (q_batch + h * p->q_strides[1] + row0 * p->q_strides[2]) * es;
    for (uint32_t i = 0; i < PF_BQ; i++) {
        float *row = o + (size_t)i * D;
        if (i < nq) row_to_f32(row, qbase + (int64_t)i * p->q_strides[2] * es, D, dt);
        else memset(row, 0, (size_t)D * sizeof(float));
        float *panel = qt + (size_t)(i / PF_QK_ROWS) * D * PF_QK_ROWS + i % PF_QK_ROWS;
        for (uint32_t dd = 0; dd < D; dd++) panel[(size_t)dd * PF_QK_ROWS] = row[dd] * qscale;
    }
    memset(o, 0, (size_t)PF_BQ * D * sizeof(float));
    for (uint32_t i = 0; i < PF_BQ; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }

    /* Keys any row of this tile can see. */
    const int64_t p_lo = seq.q_offset + i0, p_hi = p_lo + nq - 1;
    int64_t k_begin = 0, k_end = seq.kv_len;
    if (causal && p_hi + 1 < k_end) k_end = p_hi + 1;
    if (has_window && p_lo - window + 1 > k_begin) k_begin = p_lo - window + 1;

    /* Varlen: key j is packed row k_row0 + j; paged: rows through the block table. */
    const int64_t k_first = kv_mode == PYFA_PREFILL_KV_RECT ? b * p->k_strides[0] : seq.k_row0 * p->k_strides[2];
    const int64_t v_first = kv_mode == PYFA_PREFILL_KV_RECT ? b * p->v_strides[0] : seq.k_row0 * p->v_strides[2];
    const char *kbase = (const char *)d->args[PYFA_PREFILL_ARG_K] + (k_first + kvh * p->k_strides[1]) * es;
    const char *vbase = (const char *)d->args[PYFA_PREFILL_ARG_V] + (v_first + kvh * p->v_strides[1]) * es;
    const pyfa_kv_pages *pages = (const pyfa_kv_pages *)d->args[PYFA_PREFILL_ARG_PAGES];
    const int paged = kv_mode == PYFA_PREFILL_KV_PAGED;
    const char *mbase = NULL;
    const uint8_t *blk_row = NULL;
    if (has_mask) {
        const uint32_t mask_es = bool_mask ? 1 : es;
        mbase = (const char *)d->args[PYFA_PREFILL_ARG_MASK] +
                (b * p->mask_strides[0] + h * p->mask_strides[1] + (int64_t)i0 * p->mask_strides[2]) * mask_es;
        if (has_blk) {
            const uint32_t mask_heads = p->mask_strides[1] ? p->num_heads : 1;
            const uint64_t plane = (uint64_t)(p->mask_strides[0] ? b : 0) * mask_heads + (p->mask_strides[1] ? h : 0);
            blk_row = (const uint8_t *)d->args[PYFA_PREFILL_ARG_BLK] +
                      (plane * p->num_q_blocks + qtile) * (uint64_t)p->num_k_blocks;
        }
    }

    for (int64_t j0 = k_end > k_begin ? k_begin / PF_BK * PF_BK : k_end; j0 < k_end; j0 += PF_BK) {
        const uint32_t nk = seq.kv_len - j0 < PF_BK ? (uint32_t)(seq.kv_len - j0) : PF_BK;
        const uint8_t cls = blk_row ? blk_row[j0 / PF_BK] : PYFA_BLK_MIXED;
        if (cls == PYFA_BLK_SKIP) continue;

        if (paged)
            pf_load_tile_paged(kt, (const char *)d->args[PYFA_PREFILL_ARG_K], pages, seq.block_table, p->num_kv_heads,
                               kvh, j0, nk, dt, D);
        else
            pf_load_tile(kt, kbase + j0 * p->k_strides[2] * es, p->k_strides[2] * es, nk, dt, D);
        const uint32_t jn = (nk + PF_QK_KEYS - 1) / PF_QK_KEYS * PF_QK_KEYS;
        pf_scores(st, qt, kt, jn, rows_scores, D);
        for (uint32_t j = nk; j < PF_BK; j++)
            for (uint32_t i = 0; i < rows_scores; i += 8) vf8_store(st + (size_t)j * PF_BQ + i, vf8_splat(-INFINITY));

        if (has_softcap) {
            const vf8 inv_cap = vf8_splat(scale / softcap), out_scale = vf8_splat(softcap * PF_LOG2E);
            for (uint32_t j = 0; j < nk; j++)
                for (uint32_t i = 0; i < rows_softmax; i += 8) {
                    float *s = st + (size_t)j * PF_BQ + i;
                    vf8_store(s, vf8_tanh(vf8_load(s) * inv_cap) * out_scale);
                }
        }
        if (has_mask && cls != PYFA_BLK_ZERO) pf_add_mask(st, mt, mbase, p->mask_strides[2], j0, nq, nk, rows_softmax,
                                                          bool_mask, dt);
        /* Causal / window edges: only tiles the edge crosses need a per-entry test. */
        const int causal_edge = causal && j0 + nk - 1 > p_lo;
        const int window_edge = has_window && j0 <= p_hi - window;
        if (causal_edge || window_edge) {
            /* Key j0+j is hidden from rows i < key - p_lo (causal) and from
             * rows i >= key + window - p_lo (window): two runs of S^T row j. */
            for (uint32_t j = 0; j < nk; j++) {
                const int64_t key = j0 + j;
                float *srow = st + (size_t)j * PF_BQ;
                if (causal_edge) {
                    const int64_t a = key - p_lo;
                    for (uint32_t i = 0; i < (a < (int64_t)nq ? (uint32_t)(a > 0 ? a : 0) : nq); i++) srow[i] = -INFINITY;
                }
                if (window_edge) {
                    const int64_t c = key + window - p_lo;
                    for (uint32_t i = c > 0 ? (c < (int64_t)nq ? (uint32_t)c : nq) : 0; i < nq; i++) srow[i] = -INFINITY;
                }
            }
        }

        /* Online softmax over the tile, 8 query rows at a time. */
        for (uint32_t i = 0; i < rows_softmax; i += 8) {
            vf8 mx = vf8_splat(-INFINITY);
            for (uint32_t j = 0; j < nk; j++) mx = vf8_max2(mx, vf8_load(st + (size_t)j * PF_BQ + i));
            const vf8 m_old = vf8_load(m + i);
            const vf8 m_new = vf8_max2(m_old, mx);
            /* A row with nothing visible yet keeps m = -inf; subtracting 0
             * instead keeps exp2 away from -inf - -inf. */
            const vu8 none = (vu8)(m_new == vf8_splat(-INFINITY));
            const vf8 m_use = (vf8)((vu8)m_new & ~none);
            const vf8 a = vf8_exp2(m_old - m_use);
            vf8 sum = vf8_splat(0.0f);
            for (uint32_t j = 0; j < nk; j++) {
                float *s = st + (size_t)j * PF_BQ + i;
                const vf8 e = vf8_exp2(vf8_load(s) - m_use);
                vf8_store(s, e);
                sum += e;
            }
            vf8_store(l + i, vf8_load(l + i) * a + sum);
            vf8_store(m + i, m_new);
            vf8_store(alpha + i, a);
        }

        if (paged)
            pf_load_tile_paged(vt, (const char *)d->args[PYFA_PREFILL_ARG_V], pages, seq.block_table, p->num_kv_heads,
                               kvh, j0, nk, dt, D);
        else
            pf_load_tile(vt, vbase + j0 * p->v_strides[2] * es, p->v_strides[2] * es, nk, dt, D);
        pf_accumulate(o, st, vt, alpha, nk, rows_used, D);
    }

    /* out is the I/O dtype or f32 (the entry point checks). */
    const int out_dt = d->constants[PYFA_PREFILL_FC_OUT_DTYPE];
    const uint32_t oes = dtype_size(out_dt);
    char *obase = (char *)d->args[PYFA_PREFILL_ARG_OUT] +
                  (out_batch + h * p->out_strides[1] + row0 * p->out_strides[2]) * oes;
    /* lse: [batch, num_heads, q_len], or [num_heads, total_q] in the packed modes. */
    float *lse = NULL;
    if (has_lse) {
        const pyfa_prefill_packed *pk = (const pyfa_prefill_packed *)d->args[PYFA_PREFILL_ARG_PACKED];
        lse = (float *)d->args[PYFA_PREFILL_ARG_LSE] +
              (kv_mode == PYFA_PREFILL_KV_RECT ? ((size_t)b * p->num_heads + h) * p->q_len + i0
                                               : (size_t)h * pk->total_q + (size_t)row0);
    }
    for (uint32_t i = 0; i < nq; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        char *orow = obase + (int64_t)i * p->out_strides[2] * oes;
        row_store_scaled(orow, o + (size_t)i * D, inv, D, out_dt);
        if (lse) lse[i] = l[i] > 0.0f ? (m[i] + log2f(l[i])) * PF_LN2 : -INFINITY;
    }
}

/* One case per supported head dim (PYFA_FOR_EACH_HEAD_DIM), per I/O dtype. */
#define PF_CASE_D(DT, DV) case DV: prefill_body(d, x, y, z, (float *)scratch, DT, DV); return;
#define PF_CASE_F32(DV) PF_CASE_D(PYFA_DTYPE_F32, DV)
#define PF_CASE_F16(DV) PF_CASE_D(PYFA_DTYPE_F16, DV)
#define PF_CASE_BF16(DV) PF_CASE_D(PYFA_DTYPE_BF16, DV)
#define PF_SWITCH_D(CASE)                                                                          \
    switch (d->constants[PYFA_PREFILL_FC_HEAD_DIM]) {                                              \
        PYFA_FOR_EACH_HEAD_DIM(CASE)                                                               \
    default:                                                                                       \
        pyfa_cpu_fail(d, "unsupported head_dim %d", d->constants[PYFA_PREFILL_FC_HEAD_DIM]);       \
        return;                                                                                    \
    }

/* Defaults report through pyfa_cpu_fail and write nothing (see attn_vec_body.h). */
void PYFA_ISA(pyfa_cpu_flash_attn_prefill)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                           void *scratch) {
    if (d->constants[PYFA_PREFILL_FC_BLOCK_Q] != PF_BQ || d->constants[PYFA_PREFILL_FC_BLOCK_K] != PF_BK) {
        pyfa_cpu_fail(d, "unsupported tile %dx%d (built for %dx%d)", d->constants[PYFA_PREFILL_FC_BLOCK_Q],
                      d->constants[PYFA_PREFILL_FC_BLOCK_K], PF_BQ, PF_BK);
        return;
    }
    const int out_dt = d->constants[PYFA_PREFILL_FC_OUT_DTYPE];
    if (out_dt != d->constants[PYFA_PREFILL_FC_DTYPE] && out_dt != PYFA_DTYPE_F32) {
        pyfa_cpu_fail(d, "unsupported out dtype %d for dtype %d", out_dt, d->constants[PYFA_PREFILL_FC_DTYPE]);
        return;
    }
    /* Groups are handed out in the order of their linear index; that index is
     * read with the query tile slowest and highest first, so under causal
     * masking the tiles with the most keys start first across every head and
     * sequence and the pool's tail is made of short tiles. */
    {
        const uint64_t planes = (uint64_t)d->grid[1] * d->grid[2];
        const uint64_t rank = x + (uint64_t)d->grid[0] * ((uint64_t)z * d->grid[1] + y);
        const uint32_t plane = (uint32_t)(rank % planes);
        x = d->grid[0] - 1 - (uint32_t)(rank / planes);
        y = plane % (uint32_t)d->grid[1];
        z = plane / (uint32_t)d->grid[1];
    }
    switch (d->constants[PYFA_PREFILL_FC_DTYPE]) {
    case PYFA_DTYPE_F16: PF_SWITCH_D(PF_CASE_F16)
    case PYFA_DTYPE_BF16: PF_SWITCH_D(PF_CASE_BF16)
    case PYFA_DTYPE_F32: PF_SWITCH_D(PF_CASE_F32)
    default: pyfa_cpu_fail(d, "unsupported dtype %d", d->constants[PYFA_PREFILL_FC_DTYPE]); return;
    }
}

/* Folds entries [0, n) of one mask row into the tile's flags: *any_open is set
 * if an entry does not block, *any_active if an entry is not a no-op.
 * Additive entries are compared as bit patterns (exact -inf, +-0). */
PYFA_INLINE void pf_blk_row(const char *row, uint32_t n, const int dt, const int bool_mask, int *any_open,
                            int *any_active) {
    uint32_t j = 0;
    if (bool_mask) {
        vb8 open = {0}, active = {0};
        for (; j + 8 <= n; j += 8) {
            vb8 b;
            memcpy(&b, row + j, sizeof b);
            open |= (vb8)(b != 0);
            active |= (vb8)(b == 0);
        }
        uint64_t o, a;
        memcpy(&o, &open, 8);
        memcpy(&a, &active, 8);
        *any_open |= o != 0;
        *any_active |= a != 0;
        for (; j < n; j++) {
            *any_open |= row[j] != 0;
            *any_active |= row[j] == 0;
        }
    } else if (dt == PYFA_DTYPE_F32) {
        const uint32_t *w = (const uint32_t *)row;
        vu8 open = {0}, active = {0};
        for (; j + 8 <= n; j += 8) {
            vu8 u;
            memcpy(&u, w + j, sizeof u);
            open |= (vu8)(u != 0xff800000u);
            active |= u & 0x7fffffffu;
        }
        for (int l = 0; l < 8; l++) {
            *any_open |= open[l] != 0;
            *any_active |= active[l] != 0;
        }
        for (; j < n; j++) {
            *any_open |= w[j] != 0xff800000u;
            *any_active |= (w[j] & 0x7fffffffu) != 0;
        }
    } else {
        const uint16_t ninf = dt == PYFA_DTYPE_F16 ? 0xfc00u : 0xff80u;
        const uint16_t *w = (const uint16_t *)row;
        vh8 open = {0}, active = {0};
        for (; j + 8 <= n; j += 8) {
            vh8 u;
            memcpy(&u, w + j, sizeof u);
            open |= (vh8)(u != ninf);
            active |= u & 0x7fffu;
        }
        for (int l = 0; l < 8; l++) {
            *any_open |= open[l] != 0;
            *any_active |= active[l] != 0;
        }
        for (; j < n; j++) {
            *any_open |= w[j] != ninf;
            *any_active |= (w[j] & 0x7fffu) != 0;
        }
    }
}

PYFA_INLINE void pf_blk_body(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z, const int dt,
                             const int bool_mask) {
    const pyfa_flash_attn_prefill_params *p = (const pyfa_flash_attn_prefill_params *)d->args[PYFA_PREFILL_ARG_PARAMS];
    const uint32_t BQ = (uint32_t)d->constants[PYFA_BLK_FC_BLOCK_Q], BK = (uint32_t)d->constants[PYFA_BLK_FC_BLOCK_K];
    const uint32_t es = bool_mask ? 1 : dtype_size(dt);
    const uint32_t qt = x / p->num_k_blocks, kt = x % p->num_k_blocks;
    const uint32_t i0 = qt * BQ, nq = p->q_len - i0 < BQ ? p->q_len - i0 : BQ;
    const uint32_t j0 = kt * BK, nk = p->kv_len - j0 < BK ? p->kv_len - j0 : BK;
    const uint32_t mask_heads = p->mask_strides[1] ? p->num_heads : 1;
    const char *base = (const char *)d->args[PYFA_PREFILL_ARG_MASK] +
                       ((int64_t)z * p->mask_strides[0] + (int64_t)y * p->mask_strides[1] + (int64_t)i0 * p->mask_strides[2]) * es;
    int any_open = 0, any_active = 0;
    for (uint32_t i = 0; i < nq && !(any_open && any_active); i++)
        pf_blk_row(base + ((int64_t)i * p->mask_strides[2] + j0) * es, nk, dt, bool_mask, &any_open, &any_active);
    uint8_t *out = (uint8_t *)d->args[PYFA_PREFILL_ARG_BLK] +
                   ((uint64_t)z * mask_heads + y) * p->num_q_blocks * (uint64_t)p->num_k_blocks + x;
    *out = !any_open ? PYFA_BLK_SKIP : !any_active ? PYFA_BLK_ZERO : PYFA_BLK_MIXED;
}

/* Classifies tile x (query tile x / num_k_blocks, key tile x % num_k_blocks)
 * of mask plane (z, y). */
void PYFA_ISA(pyfa_cpu_flash_attn_prefill_blk)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                               void *scratch) {
    (void)scratch;
    if (d->constants[PYFA_BLK_FC_MASK_KIND] == PYFA_MASK_BOOL) {
        pf_blk_body(d, x, y, z, PYFA_DTYPE_F32, 1);
        return;
    }
    switch (d->constants[PYFA_BLK_FC_DTYPE]) {
    case PYFA_DTYPE_F16: pf_blk_body(d, x, y, z, PYFA_DTYPE_F16, 0); return;
    case PYFA_DTYPE_BF16: pf_blk_body(d, x, y, z, PYFA_DTYPE_BF16, 0); return;
    case PYFA_DTYPE_F32: pf_blk_body(d, x, y, z, PYFA_DTYPE_F32, 0); return;
    default: pyfa_cpu_fail(d, "unsupported dtype %d", d->constants[PYFA_BLK_FC_DTYPE]); return;
    }
}

/* Merges row (z, y, x) of two partial attentions of dtype dt into out of
 * dtype out_dt (dt or f32). */
PYFA_INLINE void merge_body(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z, const int dt,
                            const int out_dt) {
    const pyfa_merge_attn_params *p = (const pyfa_merge_attn_params *)d->args[PYFA_MERGE_ARG_PARAMS];
    const uint32_t D = p->head_dim, es = dtype_size(dt);
    const size_t idx = ((size_t)z * p->num_heads + y) * p->seq_len + x;
    const int64_t off = (int64_t)z * p->o_strides[0] + (int64_t)y * p->o_strides[1] + (int64_t)x * p->o_strides[2];
    const char *oa = (const char *)d->args[PYFA_MERGE_ARG_O_A] + off * es;
    const char *ob = (const char *)d->args[PYFA_MERGE_ARG_O_B] + off * es;
    char *out = (char *)d->args[PYFA_MERGE_ARG_OUT] + off * dtype_size(out_dt);
    float *lse_out = d->constants[PYFA_MERGE_FC_HAS_LSE] ? (float *)d->args[PYFA_MERGE_ARG_LSE_OUT] + idx : NULL;
    const float la = ((const float *)d->args[PYFA_MERGE_ARG_LSE_A])[idx];
    const float lb = ((const float *)d->args[PYFA_MERGE_ARG_LSE_B])[idx];
    const float mx = la > lb ? la : lb;
    if (!(mx > -INFINITY)) { /* neither side saw a key */
        for (uint32_t i = 0; i < D; i += 8) vf8_store_as(out, i, vf8_splat(0.0f), out_dt);
        if (lse_out) *lse_out = -INFINITY;
        return;
    }
    /* +inf dominates (flash_attn_prefill_params.h): weight 1 for each +inf side, 0 for the other. */
    const int top = mx == INFINITY;
    const float wa = top ? (float)(la == INFINITY) : expf(la - mx), wb = top ? (float)(lb == INFINITY) : expf(lb - mx);
    const float total = wa + wb;
    const vf8 fa = vf8_splat(wa / total), fb = vf8_splat(wb / total);
    for (uint32_t i = 0; i < D; i += 8)
        vf8_store_as(out, i, fa * vf8_load_as(oa, i, dt) + fb * vf8_load_as(ob, i, dt), out_dt);
    if (lse_out) *lse_out = mx + logf(total);
}

/* Defaults report through pyfa_cpu_fail and write nothing (see attn_vec_body.h). */
void PYFA_ISA(pyfa_cpu_merge_attention_states)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                               void *scratch) {
    (void)scratch;
    const int dt = d->constants[PYFA_MERGE_FC_DTYPE], out_dt = d->constants[PYFA_MERGE_FC_OUT_DTYPE];
    if (out_dt != dt && out_dt != PYFA_DTYPE_F32) {
        pyfa_cpu_fail(d, "unsupported out dtype %d for dtype %d", out_dt, dt);
        return;
    }
    const int f32_out = out_dt == PYFA_DTYPE_F32;
    switch (dt) {
    case PYFA_DTYPE_F16:
        if (f32_out) merge_body(d, x, y, z, PYFA_DTYPE_F16, PYFA_DTYPE_F32);
        else merge_body(d, x, y, z, PYFA_DTYPE_F16, PYFA_DTYPE_F16);
        return;
    case PYFA_DTYPE_BF16:
        if (f32_out) merge_body(d, x, y, z, PYFA_DTYPE_BF16, PYFA_DTYPE_F32);
        else merge_body(d, x, y, z, PYFA_DTYPE_BF16, PYFA_DTYPE_BF16);
        return;
    case PYFA_DTYPE_F32: merge_body(d, x, y, z, PYFA_DTYPE_F32, PYFA_DTYPE_F32); return;
    default: pyfa_cpu_fail(d, "unsupported dtype %d", dt); return;
    }
}
