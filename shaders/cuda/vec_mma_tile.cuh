/*
 * The steps the two tensor-core decodes (attn_vec_mma.cuh over 16-bit
 * caches, turboquant_mma.cuh over 4-bit codes) share around their own
 * fragment loads: the Qᵀ fragments of a pass, the online softmax of a tile,
 * and the publish of a pass's states. Lane (g, c) of a warp = lane 4g + c,
 * the fragment row group and column pair of mma m16n8k16; in a pass it
 * keeps the softmax state of query head g, and its Oᵀ columns are heads 2c
 * and 2c + 1.
 */
#pragma once
#include "pyfa_mma.cuh"
#include "attn_vec_reduce.cuh"

namespace vec_mma {
constexpr int NW = 4;    /* warps per block */
constexpr int HEADS = 8; /* query heads per pass: the n = 8 of m16n8k16 */

/* Qᵀ fragments of KSTEPS k-steps into s_q[kstep][lane]: lane (g, c) of
 * k-step kk holds q(g, 16kk + 2c + {0, 1}) and q(g, 16kk + 2c + 8 + {0, 1}),
 * hi and lo halves in dtype DT; heads at or past gn are zeros. */
template <int KSTEPS, int DT, class Q>
__device__ __forceinline__ void store_q_fragments(uint4 *s_q, uint32_t gn, Q q) {
    for (int i = threadIdx.x; i < KSTEPS * 32; i += NW * 32) {
        const int kk = i >> 5, h = (i & 31) >> 2, d0 = 16 * kk + 2 * (i & 3);
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if ((uint32_t)h < gn) {
            x[0] = q(h, d0), x[1] = q(h, d0 + 1);
            x[2] = q(h, d0 + 8), x[3] = q(h, d0 + 9);
        }
        uint4 f;
        pyfa_split2<DT>(x[0], x[1], f.x, f.z);
        pyfa_split2<DT>(x[2], x[3], f.y, f.w);
        s_q[i] = f;
    }
}

/* The log2-domain scores lane (g, c) needs for its Pᵀ fragments — head g at
 * tile positions 16j + 2c + {0, 1, 8, 9} — from s_score[KS][16 J][HEADS]
 * (the KS partial sums added in order), softcapped, -inf from `end` on. */
template <int J, int KS>
__device__ __forceinline__ void tile_scores(const float *s_score, uint32_t base, uint32_t end, bool softcap,
                                            const pyfa_flash_attn_vec_params &p, float (&x)[J][4]) {
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < J; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int pos = 16 * j + 2 * c + (e & 1) + (e >> 1) * 8;
            float v = s_score[pos * HEADS + g];
#pragma unroll
            for (int k = 1; k < KS; k++) v += s_score[(k * 16 * J + pos) * HEADS + g];
            if (softcap) v = p.softcap * tanhf(v * p.scale / p.softcap) * PYFA_LOG2E;
            x[j][e] = base + pos < end ? v : -INFINITY;
        }
    }
}

/* One online-softmax step of head g over a tile: x becomes exp2(x - M) (0
 * while nothing is visible), m and s move to the new maximum M, alike in the
 * head's four lanes and in every warp (same values, same order). Returns the
 * factors that rescale this lane's Oᵀ columns, heads 2c and 2c + 1. */
template <int J>
__device__ __forceinline__ float2 softmax_step(float (&x)[J][4], float &m, float &s) {
    const int c = threadIdx.x & 3;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) mx = fmaxf(mx, x[j][e]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            x[j][e] = m_new == -INFINITY ? 0.0f : exp2f(x[j][e] - m_new);
            sum += x[j][e];
        }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    s = s * alpha + sum;
    m = m_new;
    /* head h's alpha lives in lanes 4h.. 4h + 3: heads 2c and 2c + 1 in lanes 8c and 8c + 4 */
    return make_float2(__shfl_sync(0xffffffffu, alpha, 8 * c), __shfl_sync(0xffffffffu, alpha, 8 * c + 4));
}

/* The end of a pass: drains the ring (the merge area s_acc [HEADS][D]
 * overlays it), publishes each warp's Oᵀ blocks — block i's fragment rows g
 * and g + 8 are dims dim0(i) and dim0(i) + ROW8, dim0(i) < 0 for a block the
 * warp does not hold — and the (m, s) pairs, which every warp holds alike,
 * then writes heads [0, gn) through attn_vec_write_states (direct, out_dtype,
 * has_lse, merge_scratch and the result as there). */
template <int D, int ROW8, int MB, class Dim0>
__device__ __forceinline__ bool finish_pass(const pyfa_cuda_args &a, const pyfa_flash_attn_vec_params &p, float *s_acc,
                                            float *s_ms, const float (&acc)[MB][4], Dim0 dim0, float m, float s,
                                            uint32_t gn, size_t row0, uint32_t iwg, bool direct, int out_dtype,
                                            bool has_lse, float *merge_scratch = nullptr) {
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    pyfa_cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MB; i++) {
        const int d = dim0(i);
        if (d >= 0) {
            s_acc[(2 * c) * D + d] = acc[i][0];
            s_acc[(2 * c + 1) * D + d] = acc[i][1];
            s_acc[(2 * c) * D + d + ROW8] = acc[i][2];
            s_acc[(2 * c + 1) * D + d + ROW8] = acc[i][3];
        }
    }
    if (threadIdx.x < 32 && c == 0) {
        s_ms[g * 2] = m;
        s_ms[g * 2 + 1] = s;
    }
    __syncthreads();
    const bool merged = attn_vec_write_states<1, HEADS, D>(a, s_ms, s_acc, gn, row0, p.batch * p.num_heads, p.nwg, iwg,
                                                           direct, out_dtype, has_lse, merge_scratch);
    __syncthreads();
    return merged;
}
/* The end of a pass when every warp keeps its own softmax state (the
 * tensor-core decodes up to D = 256): drains the ring (the merge area
 * overlays it), puts warp w's Oᵀ blocks in merge slot w of s_acc
 * [NW][HEADS][D] — block i's fragment rows g and g + 8 are dims dim0(i) and
 * dim0(i) + ROW8 — and its (m, s) pairs in s_ms [NW][HEADS][2], then merges
 * the NW states of heads [0, gn) in warp order through attn_vec_write_states
 * (direct, out_dtype, has_lse, merge_scratch and the result as there). */
template <int D, int ROW8, int MB, class Dim0>
__device__ __forceinline__ bool finish_pass_per_warp(const pyfa_cuda_args &a, const pyfa_flash_attn_vec_params &p,
                                                     float *s_acc, float *s_ms, const float (&acc)[MB][4], Dim0 dim0,
                                                     float m, float s, uint32_t gn, size_t row0, uint32_t iwg,
                                                     bool direct, int out_dtype, bool has_lse,
                                                     float *merge_scratch = nullptr) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    pyfa_cp_async_wait<0>();
    __syncthreads();
    float *mine = s_acc + warp * HEADS * D;
#pragma unroll
    for (int i = 0; i < MB; i++) {
        const int d = dim0(i);
        mine[(2 * c) * D + d] = acc[i][0];
        mine[(2 * c + 1) * D + d] = acc[i][1];
        mine[(2 * c) * D + d + ROW8] = acc[i][2];
        mine[(2 * c + 1) * D + d + ROW8] = acc[i][3];
    }
    if (c == 0) {
        s_ms[(warp * HEADS + g) * 2] = m;
        s_ms[(warp * HEADS + g) * 2 + 1] = s;
    }
    __syncthreads();
    const bool merged = attn_vec_write_states<NW, HEADS, D>(a, s_ms, s_acc, gn, row0, p.batch * p.num_heads, p.nwg,
                                                            iwg, direct, out_dtype, has_lse, merge_scratch);
    __syncthreads();
    return merged;
}
} // namespace vec_mma
