/*
 * The TurboQuant codec on one row, exactly as turboquant_params.h specifies
 * it. FMA contraction is off in every function that produces codes or
 * scales, so the generic and AVX2 builds encode byte for byte alike.
 */
#pragma once
#include "cpu_simd.h"

#define TQ_MAX_LEVELS 256

PYFA_INLINE uint64_t tq_seed(uint32_t lo, uint32_t hi) { return (uint64_t)lo | (uint64_t)hi << 32; }

/* Sign of coordinate i in stream `stream`: bit 63 of a splitmix64 output. */
PYFA_INLINE int tq_sign_negative(uint64_t seed, uint32_t stream, uint32_t i) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * ((((uint64_t)stream << 32) | i) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (int)(z >> 63);
}

/* The +-1.0f vector of (seed, stream), remembered per thread for the last
 * (seed, stream, D) asked: a dispatch encodes many rows with one vector. */
typedef struct tq_sign_cache {
    uint64_t seed;
    uint32_t stream, D;
    float s[PYFA_MAX_HEAD_DIM];
} tq_sign_cache;

static _Thread_local tq_sign_cache tq_signs_memo;

PYFA_INLINE const float *tq_sign_vector(uint64_t seed, uint32_t stream, uint32_t D) {
    tq_sign_cache *m = &tq_signs_memo;
    if (m->D != D || m->seed != seed || m->stream != stream) {
        for (uint32_t i = 0; i < D; i++) m->s[i] = tq_sign_negative(seed, stream, i) ? -1.0f : 1.0f;
        m->seed = seed;
        m->stream = stream;
        m->D = D;
    }
    return m->s;
}

/* x[i] *= s[i] (exact: a sign flip). */
PYFA_INLINE void tq_apply_signs(float *x, uint64_t seed, uint32_t stream, uint32_t D) {
    const float *s = tq_sign_vector(seed, stream, D);
    for (uint32_t i = 0; i < D; i += 8) vf8_store(x + i, vf8_load(x + i) * vf8_load(s + i));
}

/* Unnormalised in-place FWHT, natural order. Every output is the same tree
 * of adds whatever the loop order, so the vector stages match the scalar. */
PYFA_INLINE void tq_fwht(float *u, uint32_t D) {
#pragma clang fp contract(off)
    for (uint32_t h = 1; h < 8 && h < D; h *= 2)
        for (uint32_t i = 0; i < D; i += 2 * h)
            for (uint32_t j = i; j < i + h; j++) {
                float a = u[j], b = u[j + h];
                u[j] = a + b;
                u[j + h] = a - b;
            }
    for (uint32_t h = 8; h < D; h *= 2)
        for (uint32_t i = 0; i < D; i += 2 * h)
            for (uint32_t j = i; j < i + h; j += 8) {
                vf8 a = vf8_load(u + j), b = vf8_load(u + j + h);
                vf8_store(u + j, a + b);
                vf8_store(u + j + h, a - b);
            }
}

/* dot in the codec's order: 8 lane partials, then vf8_sum's tree. */
PYFA_INLINE float tq_dot(const float *a, const float *b, uint32_t D) {
#pragma clang fp contract(off)
    vf8 acc = vf8_splat(0.0f);
    for (uint32_t i = 0; i < D; i += 8) acc = acc + vf8_load(a + i) * vf8_load(b + i);
    return vf8_sum(acc);
}

/* Index of the cell of t: #{k in 1..L-1 : th[k] < t}, th[k] = (c[k-1]+c[k])/2,
 * by a branch-free binary search over the sorted thresholds. */
PYFA_INLINE uint32_t tq_cell(const float *th, uint32_t levels, float t) {
    uint32_t lo = 0;
    for (uint32_t step = levels / 2; step > 0; step /= 2) lo += step & (0u - (uint32_t)(th[lo + step] < t));
    return lo;
}

/* tq_cell of 8 values at once (the same count, by comparing against every threshold). */
PYFA_INLINE vi8 tq_cells8(const float *th, uint32_t levels, vf8 t) {
    vi8 count = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t k = 1; k < levels; k++) count -= (vi8)(t > vf8_splat(th[k]));
    return count;
}

PYFA_INLINE void tq_thresholds(float *th, const float *cb, uint32_t levels) {
#pragma clang fp contract(off)
    th[0] = -INFINITY;
    for (uint32_t k = 1; k < levels; k++) th[k] = (cb[k - 1] + cb[k]) * 0.5f;
}

/* Packs D indices: group g of 8 takes `bits` bytes, little-endian, index j at bit bits*j. */
PYFA_INLINE void tq_pack(uint8_t *codes, const uint8_t *idx, uint32_t bits, uint32_t D) {
    for (uint32_t g = 0; g < D / 8; g++) {
        uint64_t w = 0;
        for (uint32_t j = 0; j < 8; j++) w |= (uint64_t)idx[8 * g + j] << (bits * j);
        for (uint32_t k = 0; k < bits; k++) codes[g * bits + k] = (uint8_t)(w >> (8 * k));
    }
}

/* The codec's row prescale (turboquant_params.h): 2^(128 - E), E the biased
 * exponent of max |x[i]| clamped to 1..254, found on the bit patterns. */
PYFA_INLINE float tq_prescale(const float *x, uint32_t D) {
    uint32_t m = 0;
    for (uint32_t i = 0; i < D; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    uint32_t e = m >> 23;
    e = e < 1 ? 1 : (e > 254 ? 254 : e);
    const uint32_t pb = (255u - e) << 23;
    float p;
    memcpy(&p, &pb, sizeof p);
    return p;
}

/*
 * Encodes x[D] (f32, original domain). work: D floats. Writes the packed
 * row and returns the scale. cb: the f32 codebook, th: its thresholds.
 */
PYFA_INLINE float tq_encode_row(const float *x, float *work, uint8_t *codes, const float *cb, const float *th,
                                uint32_t bits, uint32_t D, uint64_t seed, uint32_t stream, uint32_t norm_correction) {
#pragma clang fp contract(off)
    uint8_t idx[PYFA_MAX_HEAD_DIM];
    float cval[PYFA_MAX_HEAD_DIM], xs[PYFA_MAX_HEAD_DIM];
    const uint32_t levels = 1u << bits;
    const float pre = tq_prescale(x, D);
    for (uint32_t i = 0; i < D; i++) xs[i] = x[i] * pre;
    memcpy(work, xs, (size_t)D * sizeof(float));
    tq_apply_signs(work, seed, stream, D);
    tq_fwht(work, D);
    const float norm = sqrtf(tq_dot(xs, xs, D));
    const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    for (uint32_t i = 0; i < D; i++) work[i] = work[i] * inv;
    if (levels <= 16) {
        for (uint32_t i = 0; i < D; i += 8) {
            const vi8 c = tq_cells8(th, levels, vf8_load(work + i));
            for (uint32_t j = 0; j < 8; j++) idx[i + j] = (uint8_t)c[j];
        }
    } else {
        for (uint32_t i = 0; i < D; i++) idx[i] = (uint8_t)tq_cell(th, levels, work[i]);
    }
    for (uint32_t i = 0; i < D; i++) cval[i] = cb[idx[i]];
    tq_pack(codes, idx, bits, D);
    float scale = norm;
    if (norm_correction == PYFA_TQ_NORM_PRESERVING) {
        const float q2 = tq_dot(cval, cval, D);
        if (q2 > 0.0f) scale = norm * sqrtf((float)D / q2);
    } else if (norm_correction == PYFA_TQ_NORM_UNBIASED) {
        const float ct = tq_dot(cval, work, D);
        if (ct > 0.0f) scale = norm * ((float)D / ct);
    }
    return scale / pre;
}

/* The centroids c[idx] of a packed row (rotated domain, unscaled). */
PYFA_INLINE void tq_centroids_row(float *dst, const uint8_t *codes, const float *cb, const int bits, uint32_t D) {
    const uint32_t mask = (1u << bits) - 1;
#if defined(PYFA_CPU_AVX2)
    const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    const __m256i vmask = _mm256_set1_epi32((int)mask);
    const __m256 lo8 = _mm256_loadu_ps(cb);
    const __m256 hi8 = bits >= 4 ? _mm256_loadu_ps(cb + 8) : lo8;
    for (uint32_t g = 0; g < D / 8; g++) {
        const uint8_t *p = codes + (size_t)g * bits;
        __m256i idx;
        if (bits == 8) {
            idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        } else {
            uint32_t w = 0;
            memcpy(&w, p, (size_t)bits); /* bits <= 4 bytes */
            idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), vmask);
        }
        __m256 v;
        if (bits == 8) {
            v = _mm256_i32gather_ps(cb, idx, 4);
        } else if (bits == 4) {
            __m256 a = _mm256_permutevar8x32_ps(lo8, idx), b = _mm256_permutevar8x32_ps(hi8, idx);
            v = _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        } else {
            v = _mm256_permutevar8x32_ps(lo8, idx);
        }
        _mm256_storeu_ps(dst + 8 * g, v);
    }
#else
    for (uint32_t g = 0; g < D / 8; g++) {
        uint64_t w = 0;
        memcpy(&w, codes + (size_t)g * bits, (size_t)bits);
        for (uint32_t j = 0; j < 8; j++) dst[8 * g + j] = cb[(w >> (bits * j)) & mask];
    }
#endif
}

/*
 * 4-bit centroids in the order PERM4 (AVX2 only): within each aligned group of
 * 8 coordinates, position r holds coordinate TQ_PERM4(r) = 2*(r%4) + r/4.
 * Dot products do not care about the order when the other operand is permuted
 * alike, and the values are the same floats as tq_centroids_row's. Each float
 * is assembled from four byte-plane lookups (one vpshufb per byte); `planes`
 * comes from tq_byte_planes. D % 32 == 0.
 */
#define TQ_PERM4(r) (2 * ((r) % 4) + (r) / 4)

#if defined(PYFA_CPU_AVX2)
typedef struct tq_planes {
    __m256i b[4];
} tq_planes;

PYFA_INLINE void tq_byte_planes(tq_planes *planes, const float *cb16) {
    uint8_t t[4][16];
    for (int i = 0; i < 16; i++) {
        uint32_t u;
        memcpy(&u, cb16 + i, 4);
        for (int k = 0; k < 4; k++) t[k][i] = (uint8_t)(u >> (8 * k));
    }
    for (int k = 0; k < 4; k++) planes->b[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t[k]));
}

PYFA_INLINE void tq_centroids_row_perm4(float *dst, const uint8_t *codes, const tq_planes *planes, uint32_t D) {
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (uint32_t t = 0; t < D / 32; t++) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(codes + 16 * t));
        const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
        const __m256i idx = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        const __m256i p0 = _mm256_shuffle_epi8(planes->b[0], idx), p1 = _mm256_shuffle_epi8(planes->b[1], idx);
        const __m256i p2 = _mm256_shuffle_epi8(planes->b[2], idx), p3 = _mm256_shuffle_epi8(planes->b[3], idx);
        const __m256i a = _mm256_unpacklo_epi8(p0, p1), b = _mm256_unpackhi_epi8(p0, p1);
        const __m256i c = _mm256_unpacklo_epi8(p2, p3), e = _mm256_unpackhi_epi8(p2, p3);
        float *o = dst + 32 * t;
        _mm256_storeu_si256((__m256i *)o, _mm256_unpacklo_epi16(a, c));
        _mm256_storeu_si256((__m256i *)(o + 8), _mm256_unpackhi_epi16(a, c));
        _mm256_storeu_si256((__m256i *)(o + 16), _mm256_unpacklo_epi16(b, e));
        _mm256_storeu_si256((__m256i *)(o + 24), _mm256_unpackhi_epi16(b, e));
    }
}
#endif

/* x in natural order -> PERM4 order (forward = 1), or back (forward = 0). */
PYFA_INLINE void tq_permute4(float *x, uint32_t D, int forward) {
    float g[8];
    for (uint32_t i = 0; i < D; i += 8) {
        memcpy(g, x + i, sizeof g);
        for (uint32_t r = 0; r < 8; r++) {
            if (forward) x[i + r] = g[TQ_PERM4(r)];
            else x[i + TQ_PERM4(r)] = g[r];
        }
    }
}

/* Original-domain row: x~ = s . FWHT(c[idx]) * (scale / D). */
PYFA_INLINE void tq_decode_row(float *dst, const uint8_t *codes, float scale, const float *cb, int bits, uint32_t D,
                               uint64_t seed, uint32_t stream) {
#pragma clang fp contract(off)
    tq_centroids_row(dst, codes, cb, bits, D);
    tq_fwht(dst, D);
    const float r = scale / (float)D;
    for (uint32_t i = 0; i < D; i++) dst[i] = dst[i] * r;
    tq_apply_signs(dst, seed, stream, D);
}
