// hadamard_quantize_kv on Metal: the TurboQuant encoder (contract and codec:
// turboquant_params.h). One SIMD-group encodes one row: the signed row in
// threadgroup memory, the FWHT's stages across the lanes, cells and packing
// by groups of 8 coordinates, the 8-partial sums in lanes 0..7.
//
// Codes and scales must be the CPU's bytes. Every step below is the codec's
// f32 operation in the codec's order, so under IEEE arithmetic they are:
// the MSL executor (Linux) computes exactly that, and the test suite
// compares every head dim, bit width, input dtype and scale mode byte for
// byte against the CPU. On a Mac this file's library is built with fast math
// off (kernel_list.h, PYFA_METAL_SAFE_MATH_FILE: correctly rounded / and
// sqrt, no reassociation) and contraction is off below; fast math could move
// a rotated coordinate or a norm by an ulp and so flip a code at a cell
// boundary. The executor's tests cannot see Apple's compiler: they pin the
// algorithm and its order, and the compile options pin the arithmetic.
#include <metal_stdlib>
#include "turboquant_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

#pragma clang fp contract(off)

constant int fc_src_dtype [[function_constant(PYFA_TQ_QUANT_FC_SRC_DTYPE)]];
constant int fc_bits [[function_constant(PYFA_TQ_QUANT_FC_BITS)]];
constant int fc_head_dim [[function_constant(PYFA_TQ_QUANT_FC_HEAD_DIM)]];
// tq_quantize_paged's V bits (index 3; hadamard_quantize_kv leaves it unset and never reads it).
constant int fc_v_bits [[function_constant(PYFA_TQ_QUANT_PAGED_FC_V_BITS)]];

// ((p0 + p4) + (p1 + p5)) + ((p2 + p6) + (p3 + p7)) of lanes 0..7's partial
// sums, in every lane (the codec's sumsq / dot combination).
inline float pyfa_tq_combine8(float part) {
    float p[8];
    for (ushort l = 0; l < 8; l++) p[l] = simd_shuffle(part, l);
    return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
}

// idx = #{k in 1..L-1 : th[k] < t}, th[k] = (c[k-1] + c[k]) * 0.5f: the
// largest k whose threshold is below t, by binary search over the sorted
// thresholds (the same count as comparing with each of them).
inline uint pyfa_tq_cell(constant float *c, uint levels, float t) {
    uint lo = 0;
    for (uint step = levels / 2; step > 0; step /= 2) {
        const uint k = lo + step;
        const float th = (c[k - 1] + c[k]) * 0.5f;
        if (th < t) lo = k;
    }
    return lo;
}

// Encodes the row x (src dtype fc_src_dtype, head dim fc_head_dim) with
// `bits`, sign stream `stream` and the codebook into the packed row `row`
// and *scale_out (lane 0). One SIMD-group; shared holds 2 * D floats. Both
// encoders (hadamard_quantize_kv, tq_quantize_paged) run this function, so
// their codes and scales are the same bytes.
inline void pyfa_tq_encode(device const uchar *x, device uchar *row, device float *scale_out, constant float *codebook,
                           uint bits, uint seed_lo, uint seed_hi, uint stream, uint norm_correction,
                           threadgroup float *shared, ushort lane)
{
    const uint T = PYFA_METAL_TQ_ROW_THREADS;
    const uint D = uint(fc_head_dim), levels = 1u << bits;
    threadgroup float *u = shared;      // [D] s . x, then its FWHT
    threadgroup float *cval = u + D;    // [D] c[idx]

    for (uint i = lane; i < D; i += T) u[i] = pyfa_load1(x, i, fc_src_dtype) * pyfa_tq_sign(seed_lo, seed_hi, stream, i);

    // The codec's prescale: 2^(128 - E), E the biased exponent of max |x| in
    // 1..254 (|u[i]| = |x[i]|); each lane scales the coordinates it wrote.
    uint m = 0;
    for (uint i = lane; i < D; i += T) m = max(m, as_type<uint>(u[i]) & 0x7fffffffu);
    m = simd_max(m);
    const float pre = as_type<float>((255u - clamp(m >> 23, 1u, 254u)) << 23);
    for (uint i = lane; i < D; i += T) u[i] = u[i] * pre;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // sumsq(xs) (= sumsq(s . xs) exactly): partial l sums u[8k + l]^2, k ascending.
    float part = 0.0f;
    if (lane < 8) {
        for (uint i = lane; i < D; i += 8) {
            const float sq = u[i] * u[i];
            part = part + sq;
        }
    }
    const float norm = sqrt(pyfa_tq_combine8(part));
    const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    pyfa_tq_fwht(u, D, lane, T);

    // Cells of t = u * inv, packed by groups of 8 coordinates (bits bytes each).
    for (uint g = lane; g < D / 8; g += T) {
        ulong word = 0;
        for (uint j = 0; j < 8; j++) {
            const uint i = 8 * g + j;
            const uint idx = pyfa_tq_cell(codebook, levels, u[i] * inv);
            cval[i] = codebook[idx];
            word |= ulong(idx) << (bits * j);
        }
        for (uint k = 0; k < bits; k++) row[g * bits + k] = uchar(word >> (8 * k));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float scale = norm;
    if (norm_correction == PYFA_TQ_NORM_PRESERVING || norm_correction == PYFA_TQ_NORM_UNBIASED) {
        // sumsq(c[idx]) or dot(c[idx], t), in the codec's order.
        const bool preserving = norm_correction == PYFA_TQ_NORM_PRESERVING;
        float sum = 0.0f;
        if (lane < 8) {
            for (uint i = lane; i < D; i += 8) {
                const float other = preserving ? cval[i] : u[i] * inv;
                const float prod = cval[i] * other;
                sum = sum + prod;
            }
        }
        const float d = pyfa_tq_combine8(sum);
        if (d > 0.0f) scale = preserving ? norm * sqrt(float(D) / d) : norm * (float(D) / d);
    }
    if (lane == 0) *scale_out = scale / pre;
}

kernel void hadamard_quantize_kv(
    constant pyfa_tq_quantize_params &p [[buffer(PYFA_TQ_QUANT_ARG_PARAMS)]],
    device const uchar *src [[buffer(PYFA_TQ_QUANT_ARG_SRC)]],
    device uchar *codes [[buffer(PYFA_TQ_QUANT_ARG_CODES)]],
    device float *scales [[buffer(PYFA_TQ_QUANT_ARG_SCALES)]],
    constant float *codebook [[buffer(PYFA_TQ_QUANT_ARG_CODEBOOK)]],
    device const int *position [[buffer(PYFA_TQ_QUANT_ARG_POSITION)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint token = tg.x, head = tg.y;
    const int pos = position[0];
    if (pos < 0 || uint(pos) >= p.kv_capacity) return; // a dropped append (kv_advance)
    uint slot = uint(pos) + token;
    if (slot >= p.kv_capacity) slot -= p.kv_capacity;
    const ulong r = (ulong(p.sequence) * p.num_kv_heads + head) * p.kv_capacity + slot;
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_tq_bits(fc_bits) || !pyfa_is_attn_dtype(fc_src_dtype)) {
        if (lane == 0) scales[r] = NAN; // unreachable through the dispatchers: poison the row
        return;
    }
    const uint D = uint(fc_head_dim), bits = uint(fc_bits);
    device const uchar *x = src + (ulong(token) * p.num_kv_heads + head) * D * pyfa_dtype_size(fc_src_dtype);
    pyfa_tq_encode(x, codes + r * (D * bits / 8), scales + r, codebook, bits, p.seed_lo, p.seed_hi, p.stream,
                   p.norm_correction, shared, lane);
}

// tq_quantize_paged (contract: paged_kv_params.h): one SIMD-group encodes one
// row into the K pools (z = 0: K stream, K bits = fc_bits) or the V pools
// (z = 1: V stream, fc_v_bits). A slot outside the pool writes nothing.
kernel void tq_quantize_paged(
    constant pyfa_tq_quantize_paged_params &p [[buffer(PYFA_TQ_QUANT_PAGED_ARG_PARAMS)]],
    device const uchar *src_k [[buffer(PYFA_TQ_QUANT_PAGED_ARG_SRC_K)]],
    device const uchar *src_v [[buffer(PYFA_TQ_QUANT_PAGED_ARG_SRC_V)]],
    device uchar *k_codes [[buffer(PYFA_TQ_QUANT_PAGED_ARG_K_CODES)]],
    device float *k_scales [[buffer(PYFA_TQ_QUANT_PAGED_ARG_K_SCALES)]],
    device uchar *v_codes [[buffer(PYFA_TQ_QUANT_PAGED_ARG_V_CODES)]],
    device float *v_scales [[buffer(PYFA_TQ_QUANT_PAGED_ARG_V_SCALES)]],
    device const int *slot_mapping [[buffer(PYFA_TQ_QUANT_PAGED_ARG_SLOT_MAPPING)]],
    constant float *k_codebook [[buffer(PYFA_TQ_QUANT_PAGED_ARG_K_CODEBOOK)]],
    constant float *v_codebook [[buffer(PYFA_TQ_QUANT_PAGED_ARG_V_CODEBOOK)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint token = tg.x, head = tg.y;
    const bool is_v = tg.z != 0;
    const int bits_fc = is_v ? fc_v_bits : fc_bits;
    // Unreachable through the dispatcher (it checks every constant): write nothing.
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_tq_bits(bits_fc) || !pyfa_is_attn_dtype(fc_src_dtype)) return;
    const int slot = slot_mapping[token];
    if (slot < 0 || uint(slot) >= p.pages.num_pages * p.pages.page_size) return;
    const uint page = uint(slot) / p.pages.page_size, t = uint(slot) % p.pages.page_size;
    const ulong r = PYFA_PAGE_ROW(p.pages.layout, p.pages.page_size, p.num_kv_heads, page, t, head);
    const uint D = uint(fc_head_dim), bits = uint(bits_fc);
    device const uchar *x = (is_v ? src_v : src_k) + (ulong(token) * p.num_kv_heads + head) * D *
                                                         pyfa_dtype_size(fc_src_dtype);
    device uchar *row = (is_v ? v_codes : k_codes) + r * (D * bits / 8);
    device float *scale_out = (is_v ? v_scales : k_scales) + r;
    pyfa_tq_encode(x, row, scale_out, is_v ? v_codebook : k_codebook, bits, p.seed_lo, p.seed_hi,
                   is_v ? PYFA_TQ_STREAM_V : PYFA_TQ_STREAM_K, p.norm_correction, shared, lane);
}
