/*
 * 8-lane float vectors and element loads for CPU kernel bodies.
 *
 * A kernel body is compiled twice: once for the baseline target and once with
 * AVX2+FMA+F16C enabled (see *_avx2.c); kernels.c picks one at run time, so no
 * build needs -march=native. PYFA_ISA(name) gives each copy its own symbol.
 */
#pragma once
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

/* e^x for 8 lanes, x <= 0 (softmax weights): Cody-Waite reduction and a
 * degree-6 polynomial, within 2 ulp of expf for x >= -87; below that (weights
 * under 1e-38 next to a weight of 1) it returns about 1e-38 instead of 0. */
PYFA_INLINE vf8 vf8_exp_nonpos(vf8 x) {
    x = __builtin_elementwise_max(x, vf8_splat(-87.0f));
    const vf8 n = __builtin_elementwise_round(x * vf8_splat(1.44269504088896341f));
    vf8 r = x - n * vf8_splat(0.693359375f);
    r = r - n * vf8_splat(-2.12194440e-4f);
    vf8 p = vf8_splat(1.9875691500e-4f);
    p = p * r + vf8_splat(1.3981999507e-3f);
    p = p * r + vf8_splat(8.3334519073e-3f);
    p = p * r + vf8_splat(4.1665795894e-2f);
    p = p * r + vf8_splat(1.6666665459e-1f);
    p = p * r + vf8_splat(5.0000001201e-1f);
    p = p * r * r + r + vf8_splat(1.0f);
    const vi8 e = (__builtin_convertvector(n, vi8) + 127) << 23;
    return p * (vf8)e;
}
