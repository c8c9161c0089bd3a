/*
 * 8-lane float vectors and element loads for CPU kernel bodies.
 *
 * A kernel body is compiled twice: once for the baseline target and once with
 * AVX2+FMA+F16C enabled (see *_avx2.c); kernels.c picks one at run time, so no
 * build needs -march=native. PYFA_ISA(name) gives each copy its own symbol.
 */
#pragma once
/* Kernel bodies fuse multiply-adds wherever they like; the TurboQuant codec
 * turns that off inside its functions (`#pragma clang fp contract(off)`) so
 * the generic and AVX2 builds round alike. Pragmas rather than build flags,
 * so the package has no unsafe flags and apps can depend on it by version. */
#pragma clang fp contract(fast)
/* 32-byte vector arguments between functions of one build are intended. */
#pragma clang diagnostic ignored "-Wpsabi"
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "pyfa_params.h"

#if defined(PYFA_CPU_AVX2)
#include <immintrin.h>
#define PYFA_ISA(name) name##_avx2
#else
#define PYFA_ISA(name) name##_generic
#endif

#define PYFA_INLINE static inline __attribute__((always_inline))

typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
typedef uint8_t vb8 __attribute__((vector_size(8)));

PYFA_INLINE vf8 vf8_splat(float x) { return (vf8){x, x, x, x, x, x, x, x}; }
PYFA_INLINE vf8 vf8_load(const float *p) { vf8 v; memcpy(&v, p, sizeof v); return v; }
PYFA_INLINE void vf8_store(float *p, vf8 v) { memcpy(p, &v, sizeof v); }
PYFA_INLINE float vf8_sum(vf8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
PYFA_INLINE float vf8_max(vf8 v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* IEEE half -> float for 8 lanes: bit arithmetic that also gets subnormals,
 * infinities and NaN right. */
PYFA_INLINE vf8 vf8_from_f16(const uint16_t *p) {
#if defined(PYFA_CPU_AVX2)
    return (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vh8 h;
    memcpy(&h, p, sizeof h);
    vu8 w = __builtin_convertvector(h, vu8);
    vu8 sign = (w & 0x8000u) << 16;
    vu8 em = w & 0x7fffu;
    vf8 finite = (vf8)(em << 13) * vf8_splat(0x1p112f); /* rebias exponent, scale subnormals */
    vu8 is_special = (vu8)(em >= 0x7c00u);            /* inf / NaN */
    vu8 special = (em << 13) | 0x7f800000u;
    vu8 bits = (((vu8)finite & ~is_special) | (special & is_special)) | sign;
    return (vf8)bits;
#endif
}

PYFA_INLINE vf8 vf8_from_bf16(const uint16_t *p) {
    vh8 h;
    memcpy(&h, p, sizeof h);
    return (vf8)(__builtin_convertvector(h, vu8) << 16);
}

/* Loads 8 consecutive elements of a row stored as `dtype` (a compile-time
 * constant at every call site, so the switch folds away). */
PYFA_INLINE vf8 vf8_load_as(const void *row, uint32_t i, int dtype) {
    switch (dtype) {
    case PYFA_DTYPE_F16: return vf8_from_f16((const uint16_t *)row + i);
    case PYFA_DTYPE_BF16: return vf8_from_bf16((const uint16_t *)row + i);
    default: return vf8_load((const float *)row + i);
    }
}

PYFA_INLINE uint32_t dtype_size(int dtype) { return dtype == PYFA_DTYPE_F32 ? 4u : 2u; }

/* Row of n elements (n % 8 == 0) converted to f32 in dst. */
PYFA_INLINE void row_to_f32(float *dst, const void *row, uint32_t n, int dtype) {
    for (uint32_t i = 0; i < n; i += 8) vf8_store(dst + i, vf8_load_as(row, i, dtype));
}

PYFA_INLINE float dot_f32(const float *a, const float *b, uint32_t n) {
    vf8 s0 = vf8_splat(0), s1 = vf8_splat(0);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 += vf8_load(a + i) * vf8_load(b + i);
        s1 += vf8_load(a + i + 8) * vf8_load(b + i + 8);
    }
    for (; i < n; i += 8) s0 += vf8_load(a + i) * vf8_load(b + i);
    return vf8_sum(s0 + s1);
}

/* dot_f32(a, b + k * stride, n) for k = 0..3 into out[k], bit for bit: each row keeps
 * dot_f32's two accumulators and order, and the four rows share a's loads. dot_f32's two
 * chains of dependent adds bound it by the add's latency; eight chains in flight here keep the
 * FMA pipes busy (a score of a D = 256 row: 16 dependent steps a chain either way). */
PYFA_INLINE void dot4_f32(const float *a, const float *b, size_t stride, uint32_t n, float out[4]) {
    const float *b0 = b, *b1 = b + stride, *b2 = b + 2 * stride, *b3 = b + 3 * stride;
    vf8 s00 = vf8_splat(0), s01 = vf8_splat(0), s10 = vf8_splat(0), s11 = vf8_splat(0);
    vf8 s20 = vf8_splat(0), s21 = vf8_splat(0), s30 = vf8_splat(0), s31 = vf8_splat(0);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const vf8 x0 = vf8_load(a + i), x1 = vf8_load(a + i + 8);
        s00 += x0 * vf8_load(b0 + i);
        s01 += x1 * vf8_load(b0 + i + 8);
        s10 += x0 * vf8_load(b1 + i);
        s11 += x1 * vf8_load(b1 + i + 8);
        s20 += x0 * vf8_load(b2 + i);
        s21 += x1 * vf8_load(b2 + i + 8);
        s30 += x0 * vf8_load(b3 + i);
        s31 += x1 * vf8_load(b3 + i + 8);
    }
    for (; i < n; i += 8) {
        const vf8 x0 = vf8_load(a + i);
        s00 += x0 * vf8_load(b0 + i);
        s10 += x0 * vf8_load(b1 + i);
        s20 += x0 * vf8_load(b2 + i);
        s30 += x0 * vf8_load(b3 + i);
    }
    out[0] = vf8_sum(s00 + s01);
    out[1] = vf8_sum(s10 + s11);
    out[2] = vf8_sum(s20 + s21);
    out[3] = vf8_sum(s30 + s31);
}

/* y += a * x over n floats (n % 8 == 0). */
PYFA_INLINE void axpy_f32(float *y, float a, const float *x, uint32_t n) {
    vf8 va = vf8_splat(a);
    for (uint32_t i = 0; i < n; i += 8) vf8_store(y + i, vf8_load(y + i) + va * vf8_load(x + i));
}

PYFA_INLINE void scale_f32(float *y, float a, uint32_t n) {
    vf8 va = vf8_splat(a);
    for (uint32_t i = 0; i < n; i += 8) vf8_store(y + i, vf8_load(y + i) * va);
}

/* Softcap applied to a raw score already multiplied by `scale`. */
PYFA_INLINE float apply_softcap(float s, float softcap) { return softcap * tanhf(s / softcap); }

PYFA_INLINE vf8 vf8_max2(vf8 a, vf8 b) { return __builtin_elementwise_max(a, b); }

/* 2^x for x <= 0 (the softmax domain): exactly 1 at 0, exactly 0 for
 * x <= -127 and -inf, relative error ~2e-7 elsewhere (Cephes exp2f
 * polynomial on the reduced argument f in [-0.5, 0.5]). */
PYFA_INLINE vf8 vf8_exp2(vf8 x) {
    const vf8 round_magic = vf8_splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf8 xc = vf8_max2(x, vf8_splat(-127.0f));
    vf8 n = (xc + round_magic) - round_magic;
    vf8 f = xc - n;
    vf8 poly = vf8_splat(1.535336188319500e-4f);
    poly = poly * f + vf8_splat(1.339887440266574e-3f);
    poly = poly * f + vf8_splat(9.618437357674640e-3f);
    poly = poly * f + vf8_splat(5.550332471162809e-2f);
    poly = poly * f + vf8_splat(2.402264791363012e-1f);
    poly = poly * f + vf8_splat(6.931472028550421e-1f);
    vi8 e = (__builtin_convertvector(n, vi8) + 127) << 23; /* n = -127 gives 0.0 */
    return (vf8_splat(1.0f) + f * poly) * (vf8)e;
}

/* float -> IEEE half bits, round to nearest even, with overflow to inf,
 * subnormals and NaN (quiet) handled. */
PYFA_INLINE uint16_t f32_to_f16_bits(float x) {
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint32_t sign = f & 0x80000000u;
    f ^= sign;
    uint32_t o;
    if (f >= 0x47800000u) { /* |x| >= 65536, inf or NaN */
        o = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (f < 0x38800000u) { /* result subnormal or zero */
        float t;
        const uint32_t magic_bits = 0x3f000000u; /* 0.5 = 2^(127-15+23-10+1 - 127) */
        float magic;
        memcpy(&magic, &magic_bits, 4);
        memcpy(&t, &f, 4);
        t += magic;
        uint32_t tb;
        memcpy(&tb, &t, 4);
        o = tb - magic_bits;
    } else {
        const uint32_t mant_odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        f += mant_odd;
        o = f >> 13;
    }
    return (uint16_t)(o | (sign >> 16));
}

/* float -> bfloat16 bits, round to nearest even, NaN kept quiet. */
PYFA_INLINE vh8 vf8_to_bf16_bits(vf8 v) {
    vu8 u = (vu8)v;
    vu8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu8 is_nan = (vu8)((u & 0x7fffffffu) > 0x7f800000u);
    vu8 quiet = (u >> 16) | 0x40u;
    return __builtin_convertvector((rounded & ~is_nan) | (quiet & is_nan), vh8);
}

/* Stores 8 floats as consecutive elements i..i+7 of a row of `dtype`
 * (a compile-time constant at every call site). */
PYFA_INLINE void vf8_store_as(void *row, uint32_t i, vf8 v, int dtype) {
    switch (dtype) {
    case PYFA_DTYPE_F16: {
#if defined(PYFA_CPU_AVX2)
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
        for (int l = 0; l < 8; l++) ((uint16_t *)row)[i + l] = f32_to_f16_bits(v[l]);
#endif
        return;
    }
    case PYFA_DTYPE_BF16: {
        vh8 h = vf8_to_bf16_bits(v);
        memcpy((uint16_t *)row + i, &h, sizeof h);
        return;
    }
    default: vf8_store((float *)row + i, v); return;
    }
}

/* dst[0, n) = src[i] * scale as `dtype` (f32, f16 or bf16; n % 8 == 0),
 * rounded to nearest even: the one conversion of a kernel's final store. The
 * dtype may vary at run time; each case stores with a constant one. */
PYFA_INLINE void row_store_scaled(void *dst, const float *src, float scale, uint32_t n, int dtype) {
    const vf8 s = vf8_splat(scale);
    switch (dtype) {
    case PYFA_DTYPE_F16:
        for (uint32_t i = 0; i < n; i += 8) vf8_store_as(dst, i, vf8_load(src + i) * s, PYFA_DTYPE_F16);
        return;
    case PYFA_DTYPE_BF16:
        for (uint32_t i = 0; i < n; i += 8) vf8_store_as(dst, i, vf8_load(src + i) * s, PYFA_DTYPE_BF16);
        return;
    default:
        for (uint32_t i = 0; i < n; i += 8) vf8_store_as(dst, i, vf8_load(src + i) * s, PYFA_DTYPE_F32);
        return;
    }
}

/* n (any count) elements of a row of `dtype` as floats. */
PYFA_INLINE void row_to_f32_n(float *dst, const void *row, uint32_t n, int dtype) {
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) vf8_store(dst + i, vf8_load_as(row, i, dtype));
    if (i < n) {
        uint16_t tail[16] = {0};
        const uint32_t es = dtype_size(dtype);
        memcpy(tail, (const char *)row + (size_t)i * es, (size_t)(n - i) * es);
        vf8 t = vf8_load_as(tail, 0, dtype);
        for (uint32_t l = 0; l < n - i; l++) dst[i + l] = t[l];
    }
}

/* In-place transpose of the 8x8 block held by r[0..7] (r[i] = row i). */
PYFA_INLINE void vf8_transpose8(vf8 r[8]) {
    vf8 t[8], s[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * p + 1] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int p = 0; p < 2; p++) {
        for (int h = 0; h < 2; h++) {
            const vf8 a = t[4 * p + h], b = t[4 * p + 2 + h];
            s[4 * p + 2 * h] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
            s[4 * p + 2 * h + 1] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
        }
    }
    for (int c = 0; c < 4; c++) {
        r[c] = __builtin_shufflevector(s[c], s[4 + c], 0, 1, 2, 3, 8, 9, 10, 11);
        r[c + 4] = __builtin_shufflevector(s[c], s[4 + c], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* tanh for 8 lanes, relative error ~5e-7: the odd Taylor polynomial to x^13
 * below |x| = 0.5 (truncation < 1e-7), above it (1 - e) / (1 + e) with
 * e = exp(-2|x|) <= 0.37 from vf8_exp2, which damps exp2's error. */
PYFA_INLINE vf8 vf8_tanh(vf8 x) {
    const vu8 sign = (vu8)x & 0x80000000u;
    const vf8 a = (vf8)((vu8)x & 0x7fffffffu);
    const vf8 e = vf8_exp2(a * vf8_splat(-2.0f * 1.44269504088896341f));
    const vf8 big = (vf8_splat(1.0f) - e) / (vf8_splat(1.0f) + e);
    const vf8 a2 = a * a;
    vf8 poly = vf8_splat(21844.0f / 6081075.0f);
    poly = poly * a2 + vf8_splat(-1382.0f / 155925.0f);
    poly = poly * a2 + vf8_splat(62.0f / 2835.0f);
    poly = poly * a2 + vf8_splat(-17.0f / 315.0f);
    poly = poly * a2 + vf8_splat(2.0f / 15.0f);
    poly = poly * a2 + vf8_splat(-1.0f / 3.0f);
    const vf8 small = a + a * a2 * poly;
    const vu8 use_small = (vu8)(a < vf8_splat(0.5f));
    return (vf8)((((vu8)small & use_small) | ((vu8)big & ~use_small)) | sign);
}

/* e^x for 8 lanes, x <= 0 (softmax weights), through vf8_exp2: exactly 1 at
 * 0 and 0 far below; the extra rounding of x·log2(e) adds ~|x|·6e-8 relative
 * error, which only weights far below the row's maximum see. */
PYFA_INLINE vf8 vf8_exp_nonpos(vf8 x) { return vf8_exp2(x * vf8_splat(1.44269504088896341f)); }
