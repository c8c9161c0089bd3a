/*
 * TurboQuant kernels on CUDA; contracts in turboquant_params.h.
 *
 * Row kernels (hadamard_quantize_kv, tq_dequantize_kv, fwht,
 * fwht_sign_premult, fwht_sign_undo): one warp per row, lane l holding the
 * E = D/32 consecutive coordinates [l*E, l*E + E). The FWHT runs its stages
 * in the codec's order (in-lane stages first, then one shuffle per stage),
 * each output an add or subtract of the same two operands as on the CPU, so
 * every backend gets the same bits. The codec's arithmetic is spelled with
 * _rn intrinsics, which the compiler never contracts into FMAs; its sums run
 * in the codec's order (8 partial sums, one lane each, then the fixed tree).
 * flash_attn_vec_reduce_tq_hb_undo merges a row with 4 warps, then warp 0
 * rotates it with the same transform as fwht_sign_undo.
 *
 * Decode (flash_attn_vec_tq) follows the dense decode (attn_vec.cu) over
 * packed codes. Block = 4 warps = one workgroup (iwg, KV head, sequence). A
 * lane owns 16 coordinates of a row (2*bits bytes of its K codes and of its V
 * codes); D/16 lanes hold a row, so a warp covers PW = 512/D consecutive rows
 * per load, U loads per step. Each warp streams its rows' codes and scales
 * with 16-byte cp.async copies into its own share of a STAGES-deep ring in
 * shared memory, issued STAGES-1 steps ahead (the bytes in flight cost no
 * registers); lanes read their codes back, unpack them in registers and look
 * the values up in the codebooks in shared memory (16 entries at 4 bits:
 * conflict-free). GT query heads of the GQA group share every code read. Each
 * row group keeps its own online-softmax state (log2 domain, rescaled only
 * when its maximum grows); the block merges them at the end as attn_vec.cu
 * does, in a merge area that overlays the ring.
 */
#include "pyfa_cuda.cuh"
#include "attn_vec_reduce.cuh"

constexpr int hadamard_quantize_kv_max_threads = 32;
constexpr int tq_dequantize_kv_max_threads = 32;
constexpr int fwht_max_threads = 32;
constexpr int fwht_sign_premult_max_threads = 32;
constexpr int fwht_sign_undo_max_threads = 32;
constexpr int flash_attn_vec_reduce_tq_hb_undo_max_threads = 128;
constexpr int flash_attn_vec_tq_max_threads = 128;
constexpr int tq_quantize_paged_max_threads = 32;
/* Blocks per SM the decode kernel's registers allow: for the vector kernel 4
 * caps them at 128 (no spills when K and V bits are equal; a few dozen bytes
 * otherwise); the tensor-core kernel (4-bit K and V) takes the registers of
 * the blocks its shared memory holds (below). */
#ifndef PYFA_TQ_VEC_MIN_BLOCKS
#define PYFA_TQ_VEC_MIN_BLOCKS 4
#endif
#ifndef PYFA_TQ_VEC_MMA
#define PYFA_TQ_VEC_MMA 15 /* head dims taking the tensor-core kernel: pyfa_cuda_tq_uses_mma */
#endif
/* Blocks per SM the tensor-core kernel's registers allow at D <= 128, where
 * shared memory holds 3 (at D >= 256 it holds 2). */
#ifndef PYFA_TQ_MMA_MIN_BLOCKS
#define PYFA_TQ_MMA_MIN_BLOCKS 3
#endif
#ifdef PYFA_COMPILE_CHECK /* the body sits behind a call there, compiled without the entry's cap */
#define PYFA_MIN_BLOCKS_flash_attn_vec_tq(...) 1
#else
#define PYFA_MIN_BLOCKS_flash_attn_vec_tq(KB, VB, D, ...)                                                            \
    (pyfa_cuda_tq_uses_mma(KB, VB, D, PYFA_TQ_VEC_MMA) ? ((D) <= 128 ? PYFA_TQ_MMA_MIN_BLOCKS : 2) : PYFA_TQ_VEC_MIN_BLOCKS)
#endif

/* Tuning knobs of the decode kernel (NVRTC -D options from the CUDA plan, which
 * sizes shared memory with the same values): query heads per pass, row loads
 * per lane and step, and the depth of the cp.async ring. */
#ifndef PYFA_TQ_VEC_HEADS
#define PYFA_TQ_VEC_HEADS 2
#endif
#ifndef PYFA_TQ_VEC_ROWS_PER_STEP
#define PYFA_TQ_VEC_ROWS_PER_STEP 2
#endif
#ifndef PYFA_TQ_VEC_STAGES
#define PYFA_TQ_VEC_STAGES 4
#endif

namespace tq {

/* Sign of coordinate i of stream `stream`: bit 63 of splitmix64 output number (stream << 32 | i) + 1. */
__device__ __forceinline__ bool sign_negative(uint64_t seed, uint32_t stream, uint32_t i) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * ((((uint64_t)stream << 32) | i) + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (z >> 63) != 0;
}

__device__ __forceinline__ uint64_t seed64(uint32_t lo, uint32_t hi) { return (uint64_t)lo | (uint64_t)hi << 32; }

/* u[k] *= s[lane*E + k] (exact: a sign flip). */
template <int E>
__device__ __forceinline__ void apply_signs(float (&u)[E], uint64_t seed, uint32_t stream, int lane) {
#pragma unroll
    for (int k = 0; k < E; k++)
        if (sign_negative(seed, stream, (uint32_t)(lane * E + k))) u[k] = -u[k];
}

/* Unnormalised FWHT of a warp's row, natural order, stages h = 1, 2, .. D/2. */
template <int E>
__device__ __forceinline__ void fwht_warp(float (&u)[E], int lane) {
#pragma unroll
    for (int h = 1; h < E; h *= 2)
#pragma unroll
        for (int k = 0; k < E; k++)
            if ((k & h) == 0) {
                const float a = u[k], b = u[k + h];
                u[k] = __fadd_rn(a, b);
                u[k + h] = __fsub_rn(a, b);
            }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) { /* h = m * E: the partner holds the same k */
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int k = 0; k < E; k++) {
            const float other = __shfl_xor_sync(0xffffffffu, u[k], m);
            u[k] = upper ? __fsub_rn(other, u[k]) : __fadd_rn(u[k], other);
        }
    }
}

/* sum_i a[i]*b[i] of two shared rows in the codec's order: lane l < 8 sums
 * a[8k+l]*b[8k+l] over k ascending, then ((p0+p4)+(p1+p5))+((p2+p6)+(p3+p7)).
 * Every lane of the warp gets the result. */
template <int D>
__device__ __forceinline__ float dot_codec(const float *a, const float *b, int lane) {
    float p = 0.0f;
    if (lane < 8)
        for (int k = 0; k < D / 8; k++) p = __fadd_rn(p, __fmul_rn(a[8 * k + lane], b[8 * k + lane]));
    p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, 4)); /* lanes 0..3: p_l + p_{l+4} */
    p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, 1)); /* lanes 0, 2: pairs */
    p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, 2)); /* lane 0: the tree */
    return __shfl_sync(0xffffffffu, p, 0);
}

/* The three transforms of turboquant_params.h on a warp's row; one copy
 * serves fwht_sign_undo and the fused reduce + undo. */
template <int D>
__device__ __forceinline__ void transform_warp(float (&u)[D / 32], uint32_t transform, uint64_t seed,
                                               uint32_t stream, int lane) {
    if (transform == PYFA_TQ_FWHT_SIGN_PREMULT) apply_signs(u, seed, stream, lane);
    fwht_warp(u, lane);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn((float)D));
#pragma unroll
    for (int k = 0; k < D / 32; k++) u[k] = __fmul_rn(u[k], r);
    if (transform == PYFA_TQ_FWHT_SIGN_UNDO) apply_signs(u, seed, stream, lane);
}

/* This lane's E = D / 32 coordinates (lane E .. lane E + E - 1) of row `row` of
 * the SDT rows at `base`: the loads of the fwht kernels and of the decode
 * kernels' q rotation, so both rotate the same values. */
template <int SDT, int D>
__device__ __forceinline__ void load_row_warp(const char *base, size_t row, int lane, float (&u)[D / 32]) {
    constexpr int E = D / 32, ESZ = SDT == PYFA_DTYPE_F32 ? 4 : 2;
    const char *src = base + row * D * ESZ;
#pragma unroll
    for (int k = 0; k < E; k++) u[k] = pyfa_load_f32<SDT>(src, lane * E + k);
}

/* Rows [row0, row0 + gn) of the op's q (dtype q_in - PYFA_TQ_Q_IN_UNROTATED)
 * into the rotated domain as f32 [gn][D] at dst, with fwht_sign_premult's
 * arithmetic (tq::transform_warp on the same loads), so the values are the
 * q_rot that kernel writes; warp w of `warps` takes rows w, w + warps, ..
 * Both decode kernels call it when the op binds its q (q_in UNROTATED). */
template <int D>
__device__ __forceinline__ void rotate_q_rows(const pyfa_cuda_args &a, const pyfa_flash_attn_vec_tq_params &tp,
                                              size_t row0, uint32_t gn, float *dst, uint32_t warps) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int dtype = (int)tp.q_in - PYFA_TQ_Q_IN_UNROTATED;
    const char *q = pyfa_ptr<const char>(a, PYFA_VEC_ARG_Q);
    for (uint32_t h = warp; h < gn; h += warps) {
        float u[E];
        if (dtype == PYFA_DTYPE_F32) load_row_warp<PYFA_DTYPE_F32, D>(q, row0 + h, lane, u);
        else if (dtype == PYFA_DTYPE_F16) load_row_warp<PYFA_DTYPE_F16, D>(q, row0 + h, lane, u);
        else load_row_warp<PYFA_DTYPE_BF16, D>(q, row0 + h, lane, u);
        transform_warp<D>(u, PYFA_TQ_FWHT_SIGN_PREMULT, seed64(tp.seed_lo, tp.seed_hi), PYFA_TQ_STREAM_K, lane);
        float2 *o = reinterpret_cast<float2 *>(dst + h * D + lane * E);
#pragma unroll
        for (int k = 0; k < E; k += 2) o[k / 2] = make_float2(u[k], u[k + 1]);
    }
}

/* Index of coordinate i of a packed row: bits [BITS*i, BITS*i + BITS) of the
 * row read as a little-endian bit stream (the packing of turboquant_params.h). */
template <int BITS>
__device__ __forceinline__ uint32_t code_from_bytes(const uint8_t *row, uint32_t i) {
    const uint32_t bit = BITS * i, byte = bit >> 3, sh = bit & 7;
    uint32_t w = row[byte];
    if (sh + BITS > 8) w |= (uint32_t)row[byte + 1] << 8;
    return (w >> sh) & ((1u << BITS) - 1);
}

} // namespace tq

/* ------------------------------------------------------------------ FWHT kernels */

template <int SDT, int D, int DDT>
__device__ __forceinline__ void tq_fwht_row(const pyfa_cuda_args &a, uint32_t transform) {
    static_assert(pyfa_is_float_dtype(SDT) && pyfa_is_tq_head_dim(D) && pyfa_is_float_dtype(DDT),
                  "fwht: src dtype / head_dim / dst dtype");
    constexpr int E = D / 32;
    const pyfa_tq_fwht_params &p = pyfa_param<pyfa_tq_fwht_params>(a, PYFA_TQ_FWHT_ARG_PARAMS);
    const int lane = threadIdx.x & 31;
    const size_t row = blockIdx.x;
    float u[E];
    tq::load_row_warp<SDT, D>(pyfa_ptr<const char>(a, PYFA_TQ_FWHT_ARG_SRC), row, lane, u);
    tq::transform_warp<D>(u, transform, tq::seed64(p.seed_lo, p.seed_hi), p.stream, lane);
    char *dst = pyfa_ptr<char>(a, PYFA_TQ_FWHT_ARG_DST) + row * D * (DDT == PYFA_DTYPE_F32 ? 4 : 2);
#pragma unroll
    for (int k = 0; k < E; k++) pyfa_store_f32<DDT>(dst, lane * E + k, u[k]);
}

template <int SDT, int D, int DDT>
__device__ void fwht_body(const pyfa_cuda_args &a) { tq_fwht_row<SDT, D, DDT>(a, PYFA_TQ_FWHT_PLAIN); }
template <int SDT, int D, int DDT>
__device__ void fwht_sign_premult_body(const pyfa_cuda_args &a) {
    tq_fwht_row<SDT, D, DDT>(a, PYFA_TQ_FWHT_SIGN_PREMULT);
}
template <int SDT, int D, int DDT>
__device__ void fwht_sign_undo_body(const pyfa_cuda_args &a) { tq_fwht_row<SDT, D, DDT>(a, PYFA_TQ_FWHT_SIGN_UNDO); }

/* flash_attn_vec_reduce of row blockIdx.x, then fwht_sign_undo of it: the
 * reduce's per-element function (attn_vec_reduce.cuh) and the undo's
 * transform (tq::transform_warp), so the bits equal the two kernels' (the
 * unfused reduce stores the f32 row the undo loads; both store out in dtype
 * ODT once, at the end). Every thread merges elements as the reduce kernel
 * does (the loads over nwg partials are the latency); warp 0 then rotates
 * the row. */
template <int D, int ODT, int HAS_LSE>
__device__ void flash_attn_vec_reduce_tq_hb_undo_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_tq_head_dim(D) && pyfa_is_float_dtype(ODT),
                  "flash_attn_vec_reduce_tq_hb_undo: head_dim / out dtype");
    constexpr int E = D / 32;
    const pyfa_tq_reduce_undo_params &p = pyfa_param<pyfa_tq_reduce_undo_params>(a, PYFA_REDUCE_ARG_PARAMS);
    __shared__ float s_row[D];
    __shared__ float scratch[2 * PYFA_REDUCE_MAX_NWG];
    const uint32_t row = blockIdx.x, nwg = p.reduce.nwg < PYFA_REDUCE_MAX_NWG ? p.reduce.nwg : PYFA_REDUCE_MAX_NWG;
    const float *tmp = pyfa_ptr<const float>(a, PYFA_REDUCE_ARG_TMP);
    const float *sm = tmp + (size_t)p.reduce.nrows * p.reduce.nwg * D + (size_t)row * p.reduce.nwg * 2;
    const float *part = tmp + (size_t)row * p.reduce.nwg * D;
    const float lse = attn_vec_reduce_row(sm, part, nwg, D, scratch, [&](uint32_t e, float x) { s_row[e] = x; });
    if (HAS_LSE && threadIdx.x == 0) pyfa_ptr<float>(a, PYFA_REDUCE_ARG_LSE)[row] = lse;
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    float u[E];
#pragma unroll
    for (int k = 0; k < E; k++) u[k] = s_row[lane * E + k];
    tq::transform_warp<D>(u, PYFA_TQ_FWHT_SIGN_UNDO, tq::seed64(p.seed_lo, p.seed_hi), p.stream, lane);
    char *o = pyfa_ptr<char>(a, PYFA_REDUCE_ARG_OUT) + (size_t)row * D * (ODT == PYFA_DTYPE_F32 ? 4 : 2);
#pragma unroll
    for (int k = 0; k < E; k++) pyfa_store_f32<ODT>(o, lane * E + k, u[k]);
}

/* DIRECT_OUT 2 (flash_attn_vec_tq): after attn_vec_merge_last wrote the
 * merged rotated rows [row0, row0 + gn) to o_rot (the OUT slot, f32) in this
 * workgroup, the last of their rows, each warp takes a row through
 * fwht_sign_undo's transform into the op's out (PYFA_TQ_VEC_ARG_MERGED_OUT,
 * dtype out_dtype): the bits of the reduce + undo tails, which read the same
 * f32 rows. Every thread of the block calls it. */
template <int D>
__device__ __noinline__ void tq_undo_merged_rows(const pyfa_cuda_args &a, const pyfa_flash_attn_vec_tq_params &tp,
                                                 uint32_t gn, size_t row0, int out_dtype) {
    constexpr int E = D / 32;
    __syncthreads(); /* every warp's merged rows are written (global memory, this block's) */
    const int lane = threadIdx.x & 31;
    const float *o_rot = pyfa_ptr<const float>(a, PYFA_VEC_ARG_OUT);
    void *out = pyfa_ptr<void>(a, PYFA_TQ_VEC_ARG_MERGED_OUT);
    for (uint32_t g = threadIdx.x >> 5; g < gn; g += blockDim.x >> 5) {
        const size_t row = row0 + g;
        float u[E];
#pragma unroll
        for (int k = 0; k < E; k++) u[k] = __ldcg(o_rot + row * D + lane * E + k);
        tq::transform_warp<D>(u, PYFA_TQ_FWHT_SIGN_UNDO, tq::seed64(tp.seed_lo, tp.seed_hi), PYFA_TQ_STREAM_V, lane);
#pragma unroll
        for (int k = 0; k < E; k++) pyfa_store_as(out, row * D + lane * E + k, u[k], out_dtype);
    }
}

/* ------------------------------------------------------------------ codec */

#ifdef PYFA_COMPILE_CHECK /* one encoder per (bits, head dim) behind a call, whatever the input dtype */
#define PYFA_TQ_ENCODE_INLINE __noinline__
#else
#define PYFA_TQ_ENCODE_INLINE __forceinline__
#endif

/* Encodes the row s_x (f32, shared; prescaled in place) with codebook cb,
 * sign stream `stream` and the seed into the packed row `codes` and *scale
 * (lane 0). Both encoders (hadamard_quantize_kv, tq_quantize_paged) run it,
 * so their codes and scales are the same bytes. */
template <int BITS, int D>
__device__ PYFA_TQ_ENCODE_INLINE void tq_encode_row(const float *cb, uint64_t seed, uint32_t stream,
                                                    uint32_t norm_correction, float *s_x, uint8_t *codes,
                                                    float *scale_out) {
    constexpr int E = D / 32, L = 1 << BITS;
    __shared__ float s_th[L], s_t[D], s_c[D];
    __shared__ uint8_t s_idx[D];
    const int lane = threadIdx.x & 31;
    for (int k = lane; k < L; k += 32) s_th[k] = k == 0 ? -INFINITY : __fmul_rn(__fadd_rn(cb[k - 1], cb[k]), 0.5f);
    __syncthreads();

    /* The codec's prescale: 2^(128 - E), E the biased exponent of max |x| in 1..254. */
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < E; k++) m = max(m, __float_as_uint(s_x[lane * E + k]) & 0x7fffffffu);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const uint32_t ex = min(max(m >> 23, 1u), 254u);
    const float pre = __uint_as_float((255u - ex) << 23);
    float u[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        u[k] = __fmul_rn(s_x[lane * E + k], pre);
        s_x[lane * E + k] = u[k];
    }
    __syncthreads(); /* the prescaled row, for sumsq */
    tq::apply_signs(u, seed, stream, lane);
    tq::fwht_warp(u, lane);
    const float norm = __fsqrt_rn(tq::dot_codec<D>(s_x, s_x, lane));
    const float inv = norm > 0.0f ? __fdiv_rn(1.0f, norm) : 0.0f;
#pragma unroll
    for (int k = 0; k < E; k++) {
        const float t = __fmul_rn(u[k], inv);
        uint32_t idx = 0;
        if constexpr (L <= 16) { /* #{k : th[k] < t} */
#pragma unroll
            for (int j = 1; j < L; j++) idx += s_th[j] < t ? 1u : 0u;
        } else { /* the same count by binary search over the sorted thresholds */
#pragma unroll
            for (uint32_t step = L / 2; step > 0; step /= 2) idx += s_th[idx + step] < t ? step : 0u;
        }
        s_t[lane * E + k] = t;
        s_c[lane * E + k] = cb[idx];
        s_idx[lane * E + k] = (uint8_t)idx;
    }
    __syncthreads();

    for (int g = lane; g < D / 8; g += 32) {
        uint64_t w = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) w |= (uint64_t)s_idx[8 * g + j] << (BITS * j);
#pragma unroll
        for (int k = 0; k < BITS; k++) codes[g * BITS + k] = (uint8_t)(w >> (8 * k));
    }
    float scale = norm;
    if (norm_correction == PYFA_TQ_NORM_PRESERVING) {
        const float q2 = tq::dot_codec<D>(s_c, s_c, lane);
        if (q2 > 0.0f) scale = __fmul_rn(norm, __fsqrt_rn(__fdiv_rn((float)D, q2)));
    } else if (norm_correction == PYFA_TQ_NORM_UNBIASED) {
        const float ct = tq::dot_codec<D>(s_c, s_t, lane);
        if (ct > 0.0f) scale = __fmul_rn(norm, __fdiv_rn((float)D, ct));
    }
    if (lane == 0) *scale_out = __fdiv_rn(scale, pre);
}

/* Token blockIdx.x of KV head blockIdx.y (one warp): the row widened to f32
 * (exact), then encoded. One dispatch for K and V: z = 1 encodes V's row with
 * the V sign stream; with tickets the dispatch advances the state itself
 * (pyfa_read_advanced), a dropped append's workgroups taking theirs too. */
template <int SDT, int BITS, int D>
__device__ void hadamard_quantize_kv_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(SDT) && pyfa_is_tq_bits(BITS) && pyfa_is_tq_head_dim(D),
                  "hadamard_quantize_kv: src dtype / bits / head_dim");
    const pyfa_tq_quantize_params &p = pyfa_param<pyfa_tq_quantize_params>(a, PYFA_TQ_QUANT_ARG_PARAMS);
    __shared__ float s_x[D];
    constexpr int ESZ = SDT == PYFA_DTYPE_F32 ? 4 : 2;
    const bool is_v = blockIdx.z != 0;
    const bool advances = a.arg[PYFA_TQ_QUANT_ARG_TICKETS] != 0;
    pyfa_kv_state next;
    const int32_t position =
        pyfa_append_position(a, PYFA_TQ_QUANT_ARG_POSITION, PYFA_TQ_QUANT_ARG_ADVANCE, advances, next);
    if (position >= 0 && (uint32_t)position < p.kv_capacity) { /* else a dropped append (kv_advance) */
        const char *src = pyfa_ptr<const char>(a, is_v ? PYFA_TQ_QUANT_ARG_SRC_V : PYFA_TQ_QUANT_ARG_SRC) +
                          ((size_t)blockIdx.x * p.num_kv_heads + blockIdx.y) * D * ESZ;
        for (int i = threadIdx.x; i < D; i += blockDim.x) s_x[i] = pyfa_load_f32<SDT>(src, i);
        uint32_t slot = (uint32_t)position + blockIdx.x;
        if (slot >= p.kv_capacity) slot -= p.kv_capacity;
        const size_t r = ((size_t)p.sequence * p.num_kv_heads + blockIdx.y) * p.kv_capacity + slot;
        uint8_t *codes = pyfa_ptr<uint8_t>(a, is_v ? PYFA_TQ_QUANT_ARG_CODES_V : PYFA_TQ_QUANT_ARG_CODES) +
                         r * (size_t)PYFA_TQ_ROW_BYTES(D, BITS);
        float *scale = pyfa_ptr<float>(a, is_v ? PYFA_TQ_QUANT_ARG_SCALES_V : PYFA_TQ_QUANT_ARG_SCALES) + r;
        /* its first barrier publishes s_x */
        tq_encode_row<BITS, D>(&pyfa_param<float>(a, PYFA_TQ_QUANT_ARG_CODEBOOK), tq::seed64(p.seed_lo, p.seed_hi),
                               is_v ? PYFA_TQ_STREAM_V : p.stream, p.norm_correction, s_x, codes, scale);
    }
    if (advances) pyfa_store_advanced_last(a, PYFA_TQ_QUANT_ARG_POSITION, PYFA_TQ_QUANT_ARG_TICKETS, next);
}

/* tq_quantize_paged (contract: paged_kv_params.h): one warp encodes token
 * blockIdx.x of KV head blockIdx.y into the K pools (blockIdx.z == 0: K
 * stream, KB bits) or the V pools (1: V stream, VB bits) with the encoder
 * above. A slot outside the pool writes nothing (the whole block returns
 * before any barrier). The template order is the constants' index order:
 * src dtype, K bits, head dim, V bits. */
template <int SDT, int BITS, int D>
__device__ __forceinline__ void tq_quantize_paged_row(const pyfa_cuda_args &a, const pyfa_tq_quantize_paged_params &p,
                                                      size_t r, bool is_v) {
    __shared__ float s_x[D];
    constexpr int ESZ = SDT == PYFA_DTYPE_F32 ? 4 : 2;
    const char *src = pyfa_ptr<const char>(a, is_v ? PYFA_TQ_QUANT_PAGED_ARG_SRC_V : PYFA_TQ_QUANT_PAGED_ARG_SRC_K) +
                      ((size_t)blockIdx.x * p.num_kv_heads + blockIdx.y) * D * ESZ;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s_x[i] = pyfa_load_f32<SDT>(src, i);
    uint8_t *codes = pyfa_ptr<uint8_t>(a, is_v ? PYFA_TQ_QUANT_PAGED_ARG_V_CODES : PYFA_TQ_QUANT_PAGED_ARG_K_CODES) +
                     r * (size_t)PYFA_TQ_ROW_BYTES(D, BITS);
    float *scale = pyfa_ptr<float>(a, is_v ? PYFA_TQ_QUANT_PAGED_ARG_V_SCALES : PYFA_TQ_QUANT_PAGED_ARG_K_SCALES) + r;
    const float *cb = &pyfa_param<float>(a, is_v ? PYFA_TQ_QUANT_PAGED_ARG_V_CODEBOOK : PYFA_TQ_QUANT_PAGED_ARG_K_CODEBOOK);
    tq_encode_row<BITS, D>(cb, tq::seed64(p.seed_lo, p.seed_hi), is_v ? PYFA_TQ_STREAM_V : PYFA_TQ_STREAM_K,
                           p.norm_correction, s_x, codes, scale);
}

template <int SDT, int KB, int D, int VB>
__device__ void tq_quantize_paged_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(SDT) && pyfa_is_tq_bits(KB) && pyfa_is_tq_head_dim(D) && pyfa_is_tq_bits(VB),
                  "tq_quantize_paged: src dtype / k_bits / head_dim / v_bits");
    const pyfa_tq_quantize_paged_params &p = pyfa_param<pyfa_tq_quantize_paged_params>(a, PYFA_TQ_QUANT_PAGED_ARG_PARAMS);
    const int32_t slot = pyfa_values<int32_t>(a, PYFA_TQ_QUANT_PAGED_ARG_SLOT_MAPPING)[blockIdx.x];
    if (slot < 0 || (uint32_t)slot >= p.pages.num_pages * p.pages.page_size) return;
    const uint32_t page = (uint32_t)slot / p.pages.page_size, t = (uint32_t)slot % p.pages.page_size;
    const size_t r = PYFA_PAGE_ROW(p.pages.layout, p.pages.page_size, p.num_kv_heads, page, t, blockIdx.y);
    if (blockIdx.z == 0) tq_quantize_paged_row<SDT, KB, D>(a, p, r, false);
    else tq_quantize_paged_row<SDT, VB, D>(a, p, r, true);
}

/* Decodes slot (first_slot + blockIdx.x) mod kv_capacity of KV head blockIdx.y
 * into the original domain: x~ = s . FWHT(c[idx]) * (scale / D). */
template <int BITS, int D>
__device__ void tq_dequantize_kv_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_tq_bits(BITS) && pyfa_is_tq_head_dim(D), "tq_dequantize_kv: bits / head_dim");
    constexpr int E = D / 32;
    const pyfa_tq_dequantize_params &p = pyfa_param<pyfa_tq_dequantize_params>(a, PYFA_TQ_DEQUANT_ARG_PARAMS);
    const float *cb = &pyfa_param<float>(a, PYFA_TQ_DEQUANT_ARG_CODEBOOK);
    const int lane = threadIdx.x & 31;
    const uint32_t x = blockIdx.x, y = blockIdx.y;
    uint32_t slot = p.first_slot + x;
    if (slot >= p.kv_capacity) slot -= p.kv_capacity;
    const size_t r = ((size_t)p.sequence * p.num_kv_heads + y) * p.kv_capacity + slot;
    const uint8_t *codes = pyfa_ptr<const uint8_t>(a, PYFA_TQ_DEQUANT_ARG_CODES) + r * (size_t)PYFA_TQ_ROW_BYTES(D, BITS);
    const float scale = pyfa_ptr<const float>(a, PYFA_TQ_DEQUANT_ARG_SCALES)[r];
    float u[E];
#pragma unroll
    for (int k = 0; k < E; k++) u[k] = cb[tq::code_from_bytes<BITS>(codes, lane * E + k)];
    tq::fwht_warp(u, lane);
    const float f = __fdiv_rn(scale, (float)D);
#pragma unroll
    for (int k = 0; k < E; k++) u[k] = __fmul_rn(u[k], f);
    tq::apply_signs(u, tq::seed64(p.seed_lo, p.seed_hi), p.stream, lane);
    float *out = pyfa_ptr<float>(a, PYFA_TQ_DEQUANT_ARG_OUT) + ((size_t)x * p.num_kv_heads + y) * D;
#pragma unroll
    for (int k = 0; k < E; k++) out[lane * E + k] = u[k];
}

/* ------------------------------------------------------------------ decode */

namespace tq_vec {
constexpr int NW = 4;                         /* warps per block */
constexpr int E = 16;                         /* coordinates per lane and row */
constexpr int GT = PYFA_TQ_VEC_HEADS;         /* query heads per pass */
constexpr int U = PYFA_TQ_VEC_ROWS_PER_STEP;  /* row loads per lane and step */
constexpr int STAGES = PYFA_TQ_VEC_STAGES;    /* ring depth of the cp.async pipeline */
constexpr int CB_FLOATS = 2 * 256;            /* both codebooks, each padded to 256 entries */
static_assert(U % 2 == 0, "U even keeps every ring region 16-byte aligned");

/* Geometry of one (K bits, V bits, D). A warp's share of a ring stage holds,
 * for each u, the K codes of its PW rows, then their V codes, then the rows'
 * K and V scales. */
template <int KB, int VB, int D>
struct shape {
    static constexpr int LPR = D / E;                   /* lanes per row */
    static constexpr int PW = 32 / LPR;                 /* rows per warp and load */
    static constexpr int STEP = U * NW * PW;            /* positions per block step */
    static constexpr int KROW = D * KB / 8, VROW = D * VB / 8;
    static constexpr int KCH = KROW % 16 == 0 ? 16 : 8; /* copy size: never straddles two rows */
    static constexpr int VCH = VROW % 16 == 0 ? 16 : 8;
    static constexpr int K_OFF = 0, V_OFF = U * PW * KROW, S_OFF = V_OFF + U * PW * VROW;
    static constexpr int WARP_BYTES = S_OFF + U * 2 * PW * 4;
    static constexpr int RING_BYTES = STAGES * NW * WARP_BYTES;
    static constexpr int MERGE_BYTES = NW * PW * GT * D * 4;
    /* Dynamic shared memory: codebooks, (m, s) pairs, then the ring, which the merge area overlays. */
    static constexpr int MS_FLOATS = NW * PW * GT * 2;
    static constexpr int SMEM_BYTES = (CB_FLOATS + MS_FLOATS) * 4 + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES);
    static_assert((RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) >= 8 * PYFA_CUDA_TQ_MERGE_MAX_NWG * NW,
                  "the last workgroup's merge scratch fits the drained ring");
    static_assert(SMEM_BYTES == pyfa_cuda_tq_vec_smem_bytes(D, KB, VB, U, STAGES, GT) && E == 16 &&
                      NW == PYFA_CUDA_DECODE_WARPS,
                  "the plan sizes this kernel with pyfa_cuda_tq_vec_smem_bytes");
};

/* A lane's share of a packed row: 2*BITS bytes in WORDS 32-bit words. */
template <int BITS>
struct lane_codes {
    static constexpr int WORDS = (2 * BITS + 3) / 4;
};

/* A lane's 2*BITS code bytes from shared memory (aligned to their size; 3 bits: to 2). */
template <int BITS>
__device__ __forceinline__ void lds_codes(const char *ptr, uint32_t *w) {
    if constexpr (BITS == 8) {
        const uint4 v = *reinterpret_cast<const uint4 *>(ptr);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (BITS == 4) {
        const uint2 v = *reinterpret_cast<const uint2 *>(ptr);
        w[0] = v.x, w[1] = v.y;
    } else if constexpr (BITS == 2) {
        w[0] = *reinterpret_cast<const uint32_t *>(ptr);
    } else {
        const uint16_t *h = reinterpret_cast<const uint16_t *>(ptr);
        w[0] = (uint32_t)h[0] | (uint32_t)h[1] << 16;
        w[1] = h[2];
    }
}

/* Index j (0..15) of a lane's codes: bits [BITS*j, BITS*j + BITS) of its words. */
template <int BITS>
__device__ __forceinline__ uint32_t code_at(const uint32_t *w, int j) {
    const int bit = BITS * j, word = bit >> 5, sh = bit & 31;
    if (sh + BITS <= 32) return (w[word] >> sh) & ((1u << BITS) - 1);
    return __funnelshift_r(w[word], w[word + 1], sh) & ((1u << BITS) - 1);
}

/* Asynchronous global -> shared copy of N = 4, 8 or 16 bytes; bytes == 0 writes zeros. */
template <int N>
__device__ __forceinline__ void cp_async(void *smem_dst, const void *src, uint32_t bytes) {
    if constexpr (N == 16) {
        pyfa_cp_async16(smem_dst, src, bytes);
    } else {
        const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N), "r"(bytes) : "memory");
    }
}

/* Copies the PW rows starting at position `first` (row bytes ROW, chunks of CH)
 * into dst; rows at or past `end` become zeros and are not read. With
 * `paged` head is the pool's start and a position's row is pg.row(pos). */
template <int ROW, int CH, int PW>
__device__ __forceinline__ void copy_rows(char *dst, const uint8_t *head, uint32_t first, uint32_t end, uint32_t ring,
                                          uint32_t cap, int lane, bool paged, const attn_vec_pages &pg) {
    constexpr int CPR = ROW / CH, N = PW * CPR;
#pragma unroll
    for (int c0 = 0; c0 < N; c0 += 32) {
        const int c = c0 + lane;
        if (N % 32 == 0 || c < N) {
            const uint32_t pos = first + c / CPR;
            uint32_t slot = pos + ring;
            slot = slot >= cap ? slot - cap : slot;
            const bool live = pos < end;
            if (paged) slot = live ? pg.row(pos) : 0u;
            const uint8_t *src = head + (live ? (size_t)slot * ROW + (c % CPR) * CH : 0);
            cp_async<CH>(dst + c * CH, src, live ? (uint32_t)CH : 0u);
        }
    }
}
} // namespace tq_vec

#ifdef PYFA_COMPILE_CHECK
#define PYFA_TQ_VEC_IMPL_INLINE __noinline__
#else
#define PYFA_TQ_VEC_IMPL_INLINE __forceinline__
#endif

namespace tq_vec {
/* Per-lane partial dots of the U rows' K codes with the GT heads' q slices
 * (heads at or past gn give 0). Behind a call in the compile check, so its
 * unrolled body compiles once per bit width. */
template <int KB>
__device__ PYFA_TQ_VEC_IMPL_INLINE void partial_scores(const float (&q)[GT][E], const uint32_t (&kc)[U][lane_codes<KB>::WORDS],
                                                       const float *s_cbk, uint32_t gn, float (&sc)[U][GT]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        float kf[E];
#pragma unroll
        for (int j = 0; j < E; j++) kf[j] = s_cbk[code_at<KB>(kc[u], j)];
#pragma unroll
        for (int g = 0; g < GT; g++) {
            float d0 = 0.0f, d1 = 0.0f;
            if ((uint32_t)g < gn) {
#pragma unroll
                for (int j = 0; j < E; j += 2) {
                    d0 = fmaf(q[g][j], kf[j], d0);
                    d1 = fmaf(q[g][j + 1], kf[j + 1], d1);
                }
            }
            sc[u][g] = d0 + d1;
        }
    }
}

/* acc[g] += wt[u][g] * c_V[codes of row u], rows in order, for heads below gn. */
template <int VB>
__device__ PYFA_TQ_VEC_IMPL_INLINE void accumulate_values(float (&acc)[GT][E], const uint32_t (&vc)[U][lane_codes<VB>::WORDS],
                                                          const float *s_cbv, uint32_t gn, const float (&wt)[U][GT]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        float vf[E];
#pragma unroll
        for (int j = 0; j < E; j++) vf[j] = s_cbv[code_at<VB>(vc[u], j)];
#pragma unroll
        for (int g = 0; g < GT; g++) {
            if ((uint32_t)g < gn) {
#pragma unroll
                for (int j = 0; j < E; j++) acc[g][j] = fmaf(wt[u][g], vf[j], acc[g][j]);
            }
        }
    }
}
} // namespace tq_vec

template <int KB, int VB, int D>
__device__ PYFA_TQ_VEC_IMPL_INLINE void flash_attn_vec_tq_impl(const pyfa_cuda_args &a, const bool SOFTCAP,
                                                               const bool DIRECT, const bool MERGE, const bool LSE,
                                                               const bool PAGED, const int OUT_DTYPE) {
    using namespace tq_vec;
    using S = shape<KB, VB, D>;
    constexpr int LPR = S::LPR, PW = S::PW, STEP = S::STEP, KROW = S::KROW, VROW = S::VROW;
    constexpr int KW = lane_codes<KB>::WORDS, VW = lane_codes<VB>::WORDS;
    const pyfa_flash_attn_vec_tq_params &tp = pyfa_param<pyfa_flash_attn_vec_tq_params>(a, PYFA_VEC_ARG_PARAMS);
    const pyfa_flash_attn_vec_params &p = tp.attn;

    extern __shared__ __align__(16) float smem[];
    { /* the plan sizes it with pyfa_cuda_tq_vec_smem_bytes (== S::SMEM_BYTES); a short launch faults, loudly */
        uint32_t dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < (uint32_t)S::SMEM_BYTES) __trap();
    }
    float *s_cbk = smem, *s_cbv = smem + 256, *s_ms = smem + CB_FLOATS;
    char *s_ring = reinterpret_cast<char *>(smem + CB_FLOATS + S::MS_FLOATS);
    float *s_acc = reinterpret_cast<float *>(s_ring); /* [state][GT][D], state = warp * PW + row group */
    {
        const float *cbk = &pyfa_param<float>(a, PYFA_TQ_VEC_ARG_K_CODEBOOK);
        const float *cbv = &pyfa_param<float>(a, PYFA_TQ_VEC_ARG_V_CODEBOOK);
        for (int i = threadIdx.x; i < (1 << KB); i += blockDim.x) s_cbk[i] = cbk[i];
        for (int i = threadIdx.x; i < (1 << VB); i += blockDim.x) s_cbv[i] = cbv[i];
    }
    __syncthreads();

    const uint32_t iwg = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = lane / LPR, sub = lane % LPR;
    const uint32_t G = p.num_heads / p.num_kv_heads, cap = p.kv_capacity, nwg = p.nwg;

    const attn_vec_span span = attn_vec_workgroup_span(a, b, cap, p.window, nwg, iwg, PAGED);
    const uint32_t ring = span.ring, begin = span.begin, end = span.end;
    attn_vec_pages pg = {}; /* PAGED: codes and scales are pool rows from the pools' starts */
    if (PAGED) pg = attn_vec_pages_of(a, b, kvh, p.num_kv_heads);

    const size_t head_rows = PAGED ? 0 : ((size_t)b * p.num_kv_heads + kvh) * cap;
    const uint8_t *khead = pyfa_ptr<const uint8_t>(a, PYFA_VEC_ARG_K) + head_rows * KROW;
    const uint8_t *vhead = pyfa_ptr<const uint8_t>(a, PYFA_VEC_ARG_V) + head_rows * VROW;
    const float *kscales = pyfa_ptr<const float>(a, PYFA_TQ_VEC_ARG_K_SCALES) + head_rows;
    const float *vscales = pyfa_ptr<const float>(a, PYFA_TQ_VEC_ARG_V_SCALES) + head_rows;
    const float *qrot = pyfa_ptr<const float>(a, PYFA_VEC_ARG_Q);
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    const float qscale = SOFTCAP ? 1.0f : p.scale * PYFA_LOG2E;

    /* This warp's share of ring stage `stage`. */
    auto warp_stage = [&](int stage) { return s_ring + (stage * NW + warp) * S::WARP_BYTES; };
    /* Copies this warp's rows of the step at `base` (positions base + u*NW*PW + warp*PW + r). */
    auto issue = [&](uint32_t base, int stage) {
        char *w = warp_stage(stage);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t first = base + u * NW * PW + warp * PW;
            copy_rows<KROW, S::KCH, PW>(w + S::K_OFF + u * PW * KROW, khead, first, end, ring, cap, lane, PAGED, pg);
            copy_rows<VROW, S::VCH, PW>(w + S::V_OFF + u * PW * VROW, vhead, first, end, ring, cap, lane, PAGED, pg);
            if (lane < 2 * PW) { /* lanes 0..PW-1: K scales, PW..2PW-1: V scales */
                const int r = lane % PW;
                const uint32_t pos = first + r;
                uint32_t slot = pos + ring;
                slot = slot >= cap ? slot - cap : slot;
                const bool live = pos < end;
                if (PAGED) slot = live ? pg.row(pos) : 0u;
                const float *src = (lane < PW ? kscales : vscales) + (live ? slot : 0);
                cp_async<4>(w + S::S_OFF + (u * 2 * PW + lane) * 4, src, live ? 4u : 0u);
            }
        }
        pyfa_cp_async_commit();
    };

    /* q_in UNROTATED: the op bound its q, rotated here at the start of each pass into the
     * merge area (MERGE_BYTES holds GT rows of D floats per state), free until the pass's
     * first copies. */
    const bool rotate_q = tp.q_in != PYFA_TQ_Q_IN_ROTATED;
    for (uint32_t g0 = 0; g0 < G; g0 += GT) {
        const uint32_t gn = G - g0 < (uint32_t)GT ? G - g0 : (uint32_t)GT;
        const size_t row0 = (size_t)b * p.num_heads + (size_t)kvh * G + g0;
        if (rotate_q) {
            tq::rotate_q_rows<D>(a, tp, row0, gn, s_acc, NW);
            __syncthreads();
        }
        float q[GT][E], acc[GT][E], m[GT], s[GT];
#pragma unroll
        for (int g = 0; g < GT; g++) {
            const bool live = (uint32_t)g < gn;
            const float *qrow = rotate_q ? s_acc + g * D : qrot + (row0 + g) * D;
#pragma unroll
            for (int t = 0; t < E; t += 2) { /* q_rot and the merge area start on 16 bytes */
                const float2 v = live ? *reinterpret_cast<const float2 *>(qrow + sub * E + t) : make_float2(0.0f, 0.0f);
                q[g][t] = v.x * qscale, q[g][t + 1] = v.y * qscale;
            }
#pragma unroll
            for (int t = 0; t < E; t++) acc[g][t] = 0.0f;
            m[g] = -INFINITY;
            s[g] = 0.0f;
        }
        if (rotate_q) __syncthreads(); /* every warp has its q before the copies overwrite the area */

#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) issue(begin + st * STEP, st);
        int stage = 0;
        for (uint32_t base = begin; base < end; base += STEP) {
            __syncwarp(); /* every lane is done reading the stage the next issue overwrites */
            issue(base + (STAGES - 1) * STEP, stage == 0 ? STAGES - 1 : stage - 1);
            pyfa_cp_async_wait<STAGES - 1>();
            __syncwarp(); /* the stage's bytes, copied by all lanes, are visible to all */
            const char *w = warp_stage(stage);
            stage = stage + 1 == STAGES ? 0 : stage + 1;
            uint32_t kc[U][KW], vc[U][VW];
            float ks[U], vs[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                lds_codes<KB>(w + S::K_OFF + u * PW * KROW + rg * KROW + sub * (2 * KB), kc[u]);
                lds_codes<VB>(w + S::V_OFF + u * PW * VROW + rg * VROW + sub * (2 * VB), vc[u]);
                const float *sp = reinterpret_cast<const float *>(w + S::S_OFF) + u * 2 * PW; /* K, then V scales */
                ks[u] = sp[rg] * inv_sqrt_d;
                vs[u] = sp[PW + rg] * inv_sqrt_d;
            }
            /* Scores: per-lane partial dots of the (row, head) pairs, summed over the row's lanes. */
            float sc[U][GT];
            partial_scores<KB>(q, kc, s_cbk, gn, sc);
#pragma unroll
            for (int o = 1; o < LPR; o <<= 1)
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int g = 0; g < GT; g++) sc[u][g] += __shfl_xor_sync(0xffffffffu, sc[u][g], o);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const bool live = base + u * NW * PW + warp * PW + rg < end;
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    float x = sc[u][g] * ks[u];
                    if (SOFTCAP) x = p.softcap * tanhf(x * p.scale / p.softcap) * PYFA_LOG2E;
                    sc[u][g] = live ? x : -INFINITY;
                }
            }
            /* Online softmax per row group; the accumulators rescale only when the maximum grows. */
            float wt[U][GT];
#pragma unroll
            for (int g = 0; g < GT; g++) {
                if ((uint32_t)g >= gn) {
#pragma unroll
                    for (int u = 0; u < U; u++) wt[u][g] = 0.0f;
                    continue;
                }
                float mx = sc[0][g];
#pragma unroll
                for (int u = 1; u < U; u++) mx = fmaxf(mx, sc[u][g]);
                if (mx > m[g]) {
                    const float alpha = exp2f(m[g] - mx);
                    s[g] *= alpha;
#pragma unroll
                    for (int t = 0; t < E; t++) acc[g][t] *= alpha;
                    m[g] = mx;
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const float e = m[g] == -INFINITY ? 0.0f : exp2f(sc[u][g] - m[g]);
                    s[g] += e;
                    wt[u][g] = e * vs[u];
                }
            }
            accumulate_values<VB>(acc, vc, s_cbv, gn, wt);
        }

        /* Merge the row groups' states: each publishes, then all threads combine.
         * The merge area overlays the ring: drain the (zero-fill) copies first. */
        pyfa_cp_async_wait<0>();
        __syncthreads();
        const int state = warp * PW + rg;
#pragma unroll
        for (int g = 0; g < GT; g++) {
            float4 *dst = reinterpret_cast<float4 *>(s_acc + (state * GT + g) * D + sub * E);
#pragma unroll
            for (int t = 0; t < E; t += 4) dst[t / 4] = make_float4(acc[g][t], acc[g][t + 1], acc[g][t + 2], acc[g][t + 3]);
            if (sub == 0) {
                s_ms[(state * GT + g) * 2] = m[g];
                s_ms[(state * GT + g) * 2 + 1] = s[g];
            }
        }
        __syncthreads();
        /* The direct output is the rotated f32 row the undo reads (o_rot); so is a merged one,
         * which the merging workgroup then takes through the undo (the merge's scratch in the
         * drained ring: the codebooks at the start of shared memory serve the next pass). */
        if (attn_vec_write_states<NW * PW, GT, D>(a, s_ms, s_acc, gn, row0, p.batch * p.num_heads, nwg, iwg, DIRECT,
                                                  PYFA_DTYPE_F32, LSE, s_acc) && MERGE)
            tq_undo_merged_rows<D>(a, tp, gn, row0, OUT_DTYPE);
        __syncthreads();
    }
}

/* 4-bit K and V take the tensor-core decode (it copies scales with tq_vec::cp_async). */
#include "turboquant_mma.cuh"

/* DIRECT: 1 = nwg == 1 (o_rot, then the undo dispatch), 2 = split whose last
 * workgroup of each row merges and undoes it (tickets bound, never paged),
 * 0 = split (partials, then the reduce and undo dispatches). */
template <int KB, int VB, int D, int SOFTCAP, int DIRECT, int HAS_LSE, int PAGED, int OUT_DTYPE>
__device__ __forceinline__ void flash_attn_vec_tq_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_tq_bits(KB) && pyfa_is_tq_bits(VB) && pyfa_is_tq_head_dim(D) && DIRECT >= 0 &&
                      DIRECT <= 2 && !(DIRECT == 2 && PAGED) && pyfa_is_float_dtype(OUT_DTYPE),
                  "flash_attn_vec_tq: k/v bits / head_dim / direct out / out dtype");
    if constexpr (pyfa_cuda_tq_uses_mma(KB, VB, D, PYFA_TQ_VEC_MMA)) {
        flash_attn_vec_tq_mma_impl<D>(a, SOFTCAP != 0, DIRECT == 1, DIRECT == 2, HAS_LSE != 0, PAGED != 0, OUT_DTYPE);
    } else {
        flash_attn_vec_tq_impl<KB, VB, D>(a, SOFTCAP != 0, DIRECT == 1, DIRECT == 2, HAS_LSE != 0, PAGED != 0,
                                          OUT_DTYPE);
    }
}
