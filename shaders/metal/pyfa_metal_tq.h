// Helpers of the TurboQuant Metal kernels (the codec, packing and rotation:
// turboquant_params.h). Row kernels run one SIMD-group per row
// (PYFA_METAL_TQ_ROW_THREADS lanes) over a row held in threadgroup memory.
#pragma once
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

// Whether a function constant holds a TurboQuant head dim / bit width.
#define PYFA_METAL_IS(v) || x == (v)
inline bool pyfa_is_tq_head_dim(int x) { return false PYFA_FOR_EACH_TQ_HEAD_DIM(PYFA_METAL_IS); }
inline bool pyfa_is_tq_bits(int x) { return false PYFA_FOR_EACH_TQ_BITS(PYFA_METAL_IS); }
#undef PYFA_METAL_IS

// s[i] of sign stream `stream` under the 64-bit seed (seed_hi:seed_lo):
// bit 63 of splitmix64 output number ((stream << 32 | i) + 1).
inline float pyfa_tq_sign(uint seed_lo, uint seed_hi, uint stream, uint i) {
    ulong z = (ulong(seed_hi) << 32 | ulong(seed_lo)) + 0x9E3779B97F4A7C15ul * ((ulong(stream) << 32 | ulong(i)) + 1ul);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ul;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBul;
    z = z ^ (z >> 31);
    return (z >> 63) != 0 ? -1.0f : 1.0f;
}

// In-place unnormalised FWHT of u[0, D), natural order, by `threads` lanes:
// stage h's D/2 butterflies (j, j + h), j & h == 0, spread over the lanes,
// a barrier after each stage. Every output is the same two operands added
// or subtracted as in the CPU's loops, so the result is bit for bit the
// CPU's. The caller has written u and passed a threadgroup barrier.
inline void pyfa_tq_fwht(threadgroup float *u, uint D, uint lane, uint threads) {
    for (uint h = 1; h < D; h *= 2) {
        for (uint k = lane; k < D / 2; k += threads) {
            const uint j = ((k & ~(h - 1)) << 1) | (k & (h - 1));
            const float a = u[j], b = u[j + h];
            u[j] = a + b;
            u[j + h] = a - b;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}

// The rest of a transform of turboquant_params.h (PYFA_TQ_FWHT_*) once the
// row u (D floats of threadgroup memory, [s .] src for SIGN_PREMULT) is
// written and a barrier passed: dst = [s .] (H.u) * (1 / sqrt(D)), stored as
// dst_dtype (rounded once, to nearest even). fwht_sign_undo and the fused
// reduce + undo both end with this function.
inline void pyfa_tq_transform_u(threadgroup float *u, device uchar *dst, int dst_dtype, uint D, uint transform,
                                uint seed_lo, uint seed_hi, uint stream, uint lane, uint threads) {
    pyfa_tq_fwht(u, D, lane, threads);
    const float inv_sqrt_d = 1.0f / sqrt(float(D));
    for (uint i = lane; i < D; i += threads) {
        const float y = u[i] * inv_sqrt_d;
        pyfa_store1(dst, i, transform == PYFA_TQ_FWHT_SIGN_UNDO ? y * pyfa_tq_sign(seed_lo, seed_hi, stream, i) : y,
                    dst_dtype);
    }
}

// One row through a transform: src (src_dtype) into u, then
// pyfa_tq_transform_u. src may be dst itself: every lane has read src before
// the first write to dst.
inline void pyfa_tq_transform_row(device const uchar *src, int src_dtype, device uchar *dst, int dst_dtype,
                                  threadgroup float *u, uint D, uint transform, uint seed_lo, uint seed_hi,
                                  uint stream, uint lane, uint threads) {
    for (uint i = lane; i < D; i += threads) {
        const float x = pyfa_load1(src, i, src_dtype);
        u[i] = transform == PYFA_TQ_FWHT_SIGN_PREMULT ? x * pyfa_tq_sign(seed_lo, seed_hi, stream, i) : x;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    pyfa_tq_transform_u(u, dst, dst_dtype, D, transform, seed_lo, seed_hi, stream, lane, threads);
}

// The `bits`-bit codes of coordinates 4c .. 4c + 3 of a packed row, code k in
// bits [k * bits, (k + 1) * bits) of the result. A packed row is one
// little-endian stream of codes (coordinate i at bit i * bits) and starts on
// an 8-byte boundary (D * bits / 8 is a multiple of 8 for D >= 64); a 3-bit
// quad may straddle two words, the others never do.
inline uint pyfa_tq_codes4(device const uint *row, uint c, uint bits) {
    const uint bit = 4 * bits * c, w = bit / 32, shift = bit % 32;
    uint codes = row[w] >> shift;
    if (shift + 4 * bits > 32) codes |= row[w + 1] << (32 - shift);
    return codes;
}

// The centroids of four codes from pyfa_tq_codes4, from a codebook copy.
inline float4 pyfa_tq_centroids4(uint codes, uint bits, threadgroup const float *cb) {
    const uint mask = (1u << bits) - 1;
    return float4(cb[codes & mask], cb[(codes >> bits) & mask], cb[(codes >> (2 * bits)) & mask],
                  cb[(codes >> (3 * bits)) & mask]);
}
