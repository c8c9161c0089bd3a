/*
 * CPU bodies of the TurboQuant kernels (contracts in turboquant_params.h):
 * hadamard_quantize_kv, tq_dequantize_kv, fwht / fwht_sign_premult /
 * fwht_sign_undo, flash_attn_vec_tq and flash_attn_vec_reduce_tq_hb_undo.
 * Included after attn_vec_body.h, whose decode body and reduce they reuse.
 */
#include "tq_codec.h"

/* The widths and head dims the TurboQuant bodies are built for; anything else
 * is reported through pyfa_cpu_fail (see attn_vec_body.h) before a row is
 * touched, since the row buffers and codebook tables are sized for these. */
#define TQ_IS(v) || x == (v)
PYFA_INLINE int tq_bits_ok(int x) { return 0 PYFA_FOR_EACH_TQ_BITS(TQ_IS); }
PYFA_INLINE int tq_head_dim_ok(uint32_t x) { return 0 PYFA_FOR_EACH_TQ_HEAD_DIM(TQ_IS); }
#undef TQ_IS

/* The three FWHT transforms of one f32 row, src -> dst (may alias). One
 * out-of-line copy serves fwht_sign_undo and the fused reduce + undo, so the
 * two run the same instructions. */
__attribute__((noinline)) static void tq_transform_row(float *dst, const float *src, uint32_t transform, uint32_t D,
                                                       uint64_t seed, uint32_t stream) {
    float u[PYFA_MAX_HEAD_DIM];
    memcpy(u, src, (size_t)D * sizeof(float));
    if (transform == PYFA_TQ_FWHT_SIGN_PREMULT) tq_apply_signs(u, seed, stream, D);
    tq_fwht(u, D);
    scale_f32(u, 1.0f / sqrtf((float)D), D);
    if (transform == PYFA_TQ_FWHT_SIGN_UNDO) tq_apply_signs(u, seed, stream, D);
    memcpy(dst, u, (size_t)D * sizeof(float));
}

PYFA_INLINE void tq_fwht_kernel(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t transform) {
    const pyfa_tq_fwht_params *p = (const pyfa_tq_fwht_params *)d->args[PYFA_TQ_FWHT_ARG_PARAMS];
    const int dt = d->constants[PYFA_TQ_FWHT_FC_SRC_DTYPE];
    const uint32_t D = p->head_dim;
    float row[PYFA_MAX_HEAD_DIM];
    if (!tq_head_dim_ok(D)) {
        pyfa_cpu_fail(d, "unsupported head_dim %u", D);
        return;
    }
    const char *src = (const char *)d->args[PYFA_TQ_FWHT_ARG_SRC] + (size_t)x * D * dtype_size(dt);
    switch (dt) {
    case PYFA_DTYPE_F16: row_to_f32(row, src, D, PYFA_DTYPE_F16); break;
    case PYFA_DTYPE_BF16: row_to_f32(row, src, D, PYFA_DTYPE_BF16); break;
    case PYFA_DTYPE_F32: row_to_f32(row, src, D, PYFA_DTYPE_F32); break;
    default: pyfa_cpu_fail(d, "unsupported src dtype %d", dt); return;
    }
    const int dst_dt = d->constants[PYFA_TQ_FWHT_FC_DST_DTYPE];
    if (!is_float_dtype(dst_dt)) {
        pyfa_cpu_fail(d, "unsupported dst dtype %d", dst_dt);
        return;
    }
    tq_transform_row(row, row, transform, D, tq_seed(p->seed_lo, p->seed_hi), p->stream);
    row_store_scaled((char *)d->args[PYFA_TQ_FWHT_ARG_DST] + (size_t)x * D * dtype_size(dst_dt), row, 1.0f, D, dst_dt);
}

void PYFA_ISA(pyfa_cpu_fwht)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z, void *scratch) {
    (void)y, (void)z, (void)scratch;
    tq_fwht_kernel(d, x, PYFA_TQ_FWHT_PLAIN);
}

void PYFA_ISA(pyfa_cpu_fwht_sign_premult)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                          void *scratch) {
    (void)y, (void)z, (void)scratch;
    tq_fwht_kernel(d, x, PYFA_TQ_FWHT_SIGN_PREMULT);
}

void PYFA_ISA(pyfa_cpu_fwht_sign_undo)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                       void *scratch) {
    (void)y, (void)z, (void)scratch;
    tq_fwht_kernel(d, x, PYFA_TQ_FWHT_SIGN_UNDO);
}

/* Reduce of row x, then the undo, through the same two out-of-line functions
 * as flash_attn_vec_reduce followed by fwht_sign_undo. */
void PYFA_ISA(pyfa_cpu_flash_attn_vec_reduce_tq_hb_undo)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y,
                                                         uint32_t z, void *scratch) {
    (void)y, (void)z, (void)scratch;
    const pyfa_tq_reduce_undo_params *p = (const pyfa_tq_reduce_undo_params *)d->args[PYFA_REDUCE_ARG_PARAMS];
    const uint32_t D = p->reduce.head_dim;
    float row[PYFA_MAX_HEAD_DIM];
    if (!vec_reduce_constants_ok(d)) return;
    if (!tq_head_dim_ok(D)) {
        pyfa_cpu_fail(d, "unsupported head_dim %u", D);
        return;
    }
    const float lse = vec_reduce_row(&p->reduce, (const float *)d->args[PYFA_REDUCE_ARG_TMP], x, row);
    tq_transform_row(row, row, PYFA_TQ_FWHT_SIGN_UNDO, D, tq_seed(p->seed_lo, p->seed_hi), p->stream);
    vec_reduce_store(d, x, row, D, lse);
}

/* Token x of KV head y. */
void PYFA_ISA(pyfa_cpu_hadamard_quantize_kv)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                             void *scratch) {
    (void)z, (void)scratch;
    const pyfa_tq_quantize_params *p = (const pyfa_tq_quantize_params *)d->args[PYFA_TQ_QUANT_ARG_PARAMS];
    const int dt = d->constants[PYFA_TQ_QUANT_FC_SRC_DTYPE];
    const uint32_t D = p->head_dim, bits = p->bits, levels = 1u << bits;
    float row[PYFA_MAX_HEAD_DIM], work[PYFA_MAX_HEAD_DIM], th[TQ_MAX_LEVELS];
    const int32_t position = *(const int32_t *)d->args[PYFA_TQ_QUANT_ARG_POSITION];
    if (position < 0 || (uint32_t)position >= p->kv_capacity) return; /* a dropped append (kv_advance) */
    if (!tq_head_dim_ok(D) || !tq_bits_ok((int)bits)) {
        pyfa_cpu_fail(d, "unsupported head_dim %u / bits %u", D, bits);
        return;
    }
    const float *cb = (const float *)d->args[PYFA_TQ_QUANT_ARG_CODEBOOK];
    tq_thresholds(th, cb, levels);
    const char *src = (const char *)d->args[PYFA_TQ_QUANT_ARG_SRC] +
                      ((size_t)x * p->num_kv_heads + y) * D * dtype_size(dt);
    switch (dt) {
    case PYFA_DTYPE_F16: row_to_f32(row, src, D, PYFA_DTYPE_F16); break;
    case PYFA_DTYPE_BF16: row_to_f32(row, src, D, PYFA_DTYPE_BF16); break;
    case PYFA_DTYPE_F32: row_to_f32(row, src, D, PYFA_DTYPE_F32); break;
    default: pyfa_cpu_fail(d, "unsupported src dtype %d", dt); return;
    }
    uint32_t slot = (uint32_t)position + x;
    if (slot >= p->kv_capacity) slot -= p->kv_capacity;
    const size_t r = ((size_t)p->sequence * p->num_kv_heads + y) * p->kv_capacity + slot;
    uint8_t *codes = (uint8_t *)d->args[PYFA_TQ_QUANT_ARG_CODES] + r * PYFA_TQ_ROW_BYTES((size_t)D, bits);
    ((float *)d->args[PYFA_TQ_QUANT_ARG_SCALES])[r] =
        tq_encode_row(row, work, codes, cb, th, bits, D, tq_seed(p->seed_lo, p->seed_hi), p->stream,
                      p->norm_correction);
}

/* Token x of KV head y into the K pools (z = 0: K stream, k_bits) or the V
 * pools (z = 1: V stream, v_bits), encoded as hadamard_quantize_kv does. */
void PYFA_ISA(pyfa_cpu_tq_quantize_paged)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                          void *scratch) {
    (void)scratch;
    const pyfa_tq_quantize_paged_params *p =
        (const pyfa_tq_quantize_paged_params *)d->args[PYFA_TQ_QUANT_PAGED_ARG_PARAMS];
    const int dt = d->constants[PYFA_TQ_QUANT_PAGED_FC_SRC_DTYPE];
    const uint32_t D = p->head_dim, bits = z ? p->v_bits : p->k_bits, levels = 1u << bits;
    float row[PYFA_MAX_HEAD_DIM], work[PYFA_MAX_HEAD_DIM], th[TQ_MAX_LEVELS];
    if (!tq_head_dim_ok(D) || !tq_bits_ok((int)bits)) {
        pyfa_cpu_fail(d, "unsupported head_dim %u / bits %u", D, bits);
        return;
    }
    const pyfa_kv_pages *pg = &p->pages;
    const int32_t slot = ((const int32_t *)d->args[PYFA_TQ_QUANT_PAGED_ARG_SLOT_MAPPING])[x];
    if (slot < 0 || (uint32_t)slot >= pg->num_pages * pg->page_size) return; /* padding: nothing written */
    const size_t r = PYFA_PAGE_ROW(pg->layout, pg->page_size, p->num_kv_heads, (uint32_t)slot / pg->page_size,
                                   (uint32_t)slot % pg->page_size, y);
    const float *cb = (const float *)d->args[z ? PYFA_TQ_QUANT_PAGED_ARG_V_CODEBOOK : PYFA_TQ_QUANT_PAGED_ARG_K_CODEBOOK];
    tq_thresholds(th, cb, levels);
    const char *src = (const char *)d->args[z ? PYFA_TQ_QUANT_PAGED_ARG_SRC_V : PYFA_TQ_QUANT_PAGED_ARG_SRC_K] +
                      ((size_t)x * p->num_kv_heads + y) * D * dtype_size(dt);
    switch (dt) {
    case PYFA_DTYPE_F16: row_to_f32(row, src, D, PYFA_DTYPE_F16); break;
    case PYFA_DTYPE_BF16: row_to_f32(row, src, D, PYFA_DTYPE_BF16); break;
    case PYFA_DTYPE_F32: row_to_f32(row, src, D, PYFA_DTYPE_F32); break;
    default: pyfa_cpu_fail(d, "unsupported src dtype %d", dt); return;
    }
    uint8_t *codes = (uint8_t *)d->args[z ? PYFA_TQ_QUANT_PAGED_ARG_V_CODES : PYFA_TQ_QUANT_PAGED_ARG_K_CODES] +
                     r * PYFA_TQ_ROW_BYTES((size_t)D, bits);
    float *scales = (float *)d->args[z ? PYFA_TQ_QUANT_PAGED_ARG_V_SCALES : PYFA_TQ_QUANT_PAGED_ARG_K_SCALES];
    scales[r] = tq_encode_row(row, work, codes, cb, th, bits, D, tq_seed(p->seed_lo, p->seed_hi),
                              z ? PYFA_TQ_STREAM_V : PYFA_TQ_STREAM_K, p->norm_correction);
}

/* Row x of KV head y. */
void PYFA_ISA(pyfa_cpu_tq_dequantize_kv)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                         void *scratch) {
    (void)z, (void)scratch;
    const pyfa_tq_dequantize_params *p = (const pyfa_tq_dequantize_params *)d->args[PYFA_TQ_DEQUANT_ARG_PARAMS];
    const uint32_t D = p->head_dim, bits = p->bits;
    if (!tq_head_dim_ok(D) || !tq_bits_ok((int)bits)) {
        pyfa_cpu_fail(d, "unsupported head_dim %u / bits %u", D, bits);
        return;
    }
    float cb[TQ_MAX_LEVELS] = {0};
    memcpy(cb, d->args[PYFA_TQ_DEQUANT_ARG_CODEBOOK], sizeof(float) << bits);
    uint32_t slot = p->first_slot + x;
    if (slot >= p->kv_capacity) slot -= p->kv_capacity;
    const size_t r = ((size_t)p->sequence * p->num_kv_heads + y) * p->kv_capacity + slot;
    const uint8_t *codes = (const uint8_t *)d->args[PYFA_TQ_DEQUANT_ARG_CODES] + r * PYFA_TQ_ROW_BYTES((size_t)D, bits);
    const float scale = ((const float *)d->args[PYFA_TQ_DEQUANT_ARG_SCALES])[r];
    float *out = (float *)d->args[PYFA_TQ_DEQUANT_ARG_OUT] + ((size_t)x * p->num_kv_heads + y) * D;
    tq_decode_row(out, codes, scale, cb, (int)bits, D, tq_seed(p->seed_lo, p->seed_hi), p->stream);
}

#define TQ_VEC_CASE_D(DV)                                                                          \
    case DV:                                                                                       \
        if (d->constants[PYFA_TQ_VEC_FC_PAGED]) vec_body(d, x, y, 1, z, (float *)scratch, PYFA_DTYPE_F32, DV, kb, vb, 1); \
        else vec_body(d, x, y, 1, z, (float *)scratch, PYFA_DTYPE_F32, DV, kb, vb, 0);             \
        return;

void PYFA_ISA(pyfa_cpu_flash_attn_vec_tq)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                          void *scratch) {
    const int kb = d->constants[PYFA_TQ_VEC_FC_K_BITS], vb = d->constants[PYFA_TQ_VEC_FC_V_BITS];
    if (!tq_bits_ok(kb) || !tq_bits_ok(vb)) { /* vec_load_row's width switch takes these as given */
        pyfa_cpu_fail(d, "unsupported k_bits %d / v_bits %d", kb, vb);
        return;
    }
    switch (d->constants[PYFA_TQ_VEC_FC_HEAD_DIM]) {
        PYFA_FOR_EACH_TQ_HEAD_DIM(TQ_VEC_CASE_D)
    default: pyfa_cpu_fail(d, "unsupported head_dim %d", d->constants[PYFA_TQ_VEC_FC_HEAD_DIM]); return;
    }
}
