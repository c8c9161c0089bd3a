/*
 * Decode attention (flash_attn_vec) and its reduce pass on CUDA; contracts in
 * pyfa_params.h. Block = 4 warps = one workgroup (iwg, KV head, sequence).
 *
 * Bandwidth plan: a K/V row is split into 16-byte chunks, one per lane, over
 * WPR warps (1 for rows up to 512 bytes, 2 for 1 KB rows such as D = 512 in
 * 16 bits), so every load is 16 bytes and rows are read coalesced. The block's
 * warps form NW / WPR row groups; a group takes U consecutive positions per
 * step. Loads are cp.async copies into a per-warp ring of STAGES steps in
 * shared memory (each lane reads back only its own 16-byte chunks, so no
 * barrier is needed), issued STAGES-1 steps ahead: the bytes in flight do not
 * cost registers, and compute overlaps the next steps' loads. The query heads
 * of the GQA group are served from the same loads, GT heads per pass (GT
 * bounds the registers holding q and the accumulators; larger groups re-read
 * the rows); heads past the group's size cost a uniform branch, not work.
 * Partial dot products of a row split over warps meet in shared memory
 * (double-buffered, one named barrier per step).
 * Softmax runs in the log2 domain (q pre-scaled by scale*log2(e)); the tmp
 * (S, M) pairs are written in the natural-log domain the reduce contract uses.
 */
#include "pyfa_cuda.cuh"
#include "attn_vec_reduce.cuh"

constexpr int flash_attn_vec_max_threads = 128;
constexpr int flash_attn_vec_reduce_max_threads = 512;

/* Tuning knobs (NVRTC -D options set them from the CUDA plan; part of the
 * cache key): floats of q and of the accumulators a lane holds per pass for
 * rows held by one warp / by several warps, and positions per step. */
#ifndef PYFA_VEC_GT_BUDGET
#define PYFA_VEC_GT_BUDGET 32
#endif
#ifndef PYFA_VEC_GT_BUDGET_WIDE
#define PYFA_VEC_GT_BUDGET_WIDE 64
#endif
#ifndef PYFA_VEC_ROWS_PER_STEP
#define PYFA_VEC_ROWS_PER_STEP 4
#endif
#ifndef PYFA_VEC_STAGES
#define PYFA_VEC_STAGES 3
#endif

namespace attn_vec {
constexpr int NW = 4;                     /* warps per block */
constexpr int U = PYFA_VEC_ROWS_PER_STEP; /* positions per row-group step */
constexpr int STAGES = PYFA_VEC_STAGES;   /* ring depth of the cp.async pipeline */
/* Ring bytes of one block: [STAGES][U][K, V][NW warps][32 lanes] x 16 bytes. */
constexpr int RING_BYTES = STAGES * U * 2 * NW * 32 * 16;

template <int KVDT, int D>
struct shape {
    static constexpr int VEC = pyfa_vec16<KVDT>::elems; /* elements per lane per row */
    static constexpr int C = D / VEC;                   /* 16-byte chunks per row */
    static constexpr int WPR = (C + 31) / 32;           /* warps per row */
    static constexpr int RG = NW / WPR;                 /* row groups per block */
    static constexpr int GT = pyfa_cuda_vec_heads_per_pass(16 / VEC, D, PYFA_VEC_GT_BUDGET, PYFA_VEC_GT_BUDGET_WIDE);
    static_assert(WPR <= NW && WPR == pyfa_cuda_vec_warps_per_row(16 / VEC, D), "a row must fit in one block");
    static_assert(NW == PYFA_CUDA_DECODE_WARPS, "the plan sizes blocks of PYFA_CUDA_DECODE_WARPS warps");
    /* The carve-up below (scores, then ring or merge area) within the plan's bytes. */
    static_assert(2 * NW * U * GT * 4 + (RING_BYTES > RG * GT * (D + 2) * 4 ? RING_BYTES : RG * GT * (D + 2) * 4) <=
                      pyfa_cuda_vec_smem_bytes(16 / VEC, D, PYFA_VEC_GT_BUDGET, PYFA_VEC_GT_BUDGET_WIDE, U, STAGES),
                  "attn_vec carve-up exceeds pyfa_cuda_vec_smem_bytes");
};

__device__ __forceinline__ float load_q(const char *row, uint32_t i, int dtype) {
    if (dtype == PYFA_DTYPE_F32) return pyfa_load_f32<PYFA_DTYPE_F32>(row, i);
    if (dtype == PYFA_DTYPE_BF16) return pyfa_load_f32<PYFA_DTYPE_BF16>(row, i);
    return pyfa_load_f32<PYFA_DTYPE_F16>(row, i);
}

/* Step STEP of a warp reduce-scatter of N values: lanes whose bit (16 >> STEP)
 * is set keep the upper half, the others the lower half, each adding the
 * partner's copy. After L = log2(min(N, 32)) steps lane l holds the warp sums
 * of values [l * N/32, ...) (N >= 32) or of value l >> (5 - L) (N < 32). */
template <int N, int STEP, int L>
struct reduce_scatter {
    static __device__ __forceinline__ void run(float *v, int lane) {
        constexpr int o = 16 >> STEP, half = N >> (STEP + 1);
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < half; i++) {
            const float send = upper ? v[i] : v[i + half];
            const float keep = upper ? v[i + half] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
        reduce_scatter<N, STEP + 1, L>::run(v, lane);
    }
};
template <int N, int L>
struct reduce_scatter<N, L, L> {
    static __device__ __forceinline__ void run(float *, int) {}
};

/* Barrier over the WPR warps of row group `group` (ids 1.. leave 0 to __syncthreads). */
__device__ __forceinline__ void group_barrier(int group, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(threads) : "memory");
}
} // namespace attn_vec
using attn_vec::load_q;

/* The kernel proper. The q dtype, softcap, direct-output, out dtype and lse
 * constants are plain arguments: inlined into an entry point they are
 * compile-time constants again, and a compile check (PYFA_COMPILE_CHECK) can
 * keep one copy per (KV dtype, head dim) behind a call instead of dozens. */
#ifdef PYFA_COMPILE_CHECK
#define PYFA_VEC_IMPL_INLINE __noinline__
#else
#define PYFA_VEC_IMPL_INLINE __forceinline__
#endif

template <int KVDT, int D>
__device__ PYFA_VEC_IMPL_INLINE void flash_attn_vec_impl(const pyfa_cuda_args &a, const int QDT, const bool SOFTCAP,
                                                         const bool DIRECT, const int ODT, const bool LSE,
                                                         const bool PAGED) {
    using S = attn_vec::shape<KVDT, D>;
    constexpr int NW = attn_vec::NW, U = attn_vec::U, VEC = S::VEC, C = S::C, WPR = S::WPR, RG = S::RG, GT = S::GT;
    constexpr int ESZ = KVDT == PYFA_DTYPE_F32 ? 4 : 2;
    const pyfa_flash_attn_vec_params &p = pyfa_param<pyfa_flash_attn_vec_params>(a, PYFA_VEC_ARG_PARAMS);
    const uint32_t iwg = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = warp / WPR, part = warp % WPR;
    const int c = part * 32 + lane; /* this lane's chunk of a row */
    const bool active = c < C;
    const uint32_t G = p.num_heads / p.num_kv_heads, cap = p.kv_capacity, nwg = p.nwg;

    const attn_vec_span span = attn_vec_workgroup_span(a, b, cap, p.window, nwg, iwg, PAGED);
    const uint32_t ring = span.ring, begin = span.begin, end = span.end;
    /* PAGED: rows are pool rows from the pool's start (attn_vec_pages). */
    attn_vec_pages pg = {};
    if (PAGED) pg = attn_vec_pages_of(a, b, kvh, p.num_kv_heads);

    const size_t row_bytes = (size_t)D * ESZ;
    const size_t head_off = PAGED ? 0 : ((size_t)b * p.num_kv_heads + kvh) * cap * row_bytes;
    const char *kbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_K) + head_off + (size_t)c * 16;
    const char *vbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_V) + head_off + (size_t)c * 16;
    const char *qbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_Q);
    const float qscale = SOFTCAP ? 1.0f : p.scale * PYFA_LOG2E;

    /* Shared memory: the partial dots of split rows, then the load ring, which
     * the merge area reuses once a pass's loads are done. */
    extern __shared__ float smem[];
    float *s_part = smem;                          /* [2][NW][U*GT] scores */
    char *kv_ring = reinterpret_cast<char *>(smem + 2 * NW * U * GT);
    float *s_acc = reinterpret_cast<float *>(kv_ring); /* [RG][GT][D] */
    float *s_ms = s_acc + RG * GT * D;              /* [RG][GT][2] */
    constexpr int STAGES = attn_vec::STAGES;
    /* This lane's 16-byte slot of (stage, u, k or v) in the ring. */
    auto ring_at = [&](int stage, int u, int kv) {
        return kv_ring + ((((stage * U + u) * 2 + kv) * NW + warp) * 32 + lane) * 16;
    };
    /* Copies the K/V chunks of positions [base, base + U) into ring stage `stage`. */
    auto issue = [&](uint32_t base, int stage) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t pos = base + u;
            uint32_t slot = pos + ring;
            slot = slot >= cap ? slot - cap : slot;
            const bool live = pos < end && active;
            if (PAGED) slot = live ? pg.row(pos) : 0u;
            const size_t off = live ? slot * row_bytes : 0;
            pyfa_cp_async16(ring_at(stage, u, 0), kbase + off, live ? 16u : 0u);
            pyfa_cp_async16(ring_at(stage, u, 1), vbase + off, live ? 16u : 0u);
        }
        pyfa_cp_async_commit();
    };

    for (uint32_t g0 = 0; g0 < G; g0 += GT) {
        const uint32_t gn = G - g0 < (uint32_t)GT ? G - g0 : (uint32_t)GT;
        float q[GT][VEC], acc[GT][VEC], m[GT], s[GT];
#pragma unroll
        for (int g = 0; g < GT; g++) {
            const size_t row = (size_t)b * p.num_heads + (size_t)kvh * G + g0 + g;
            const char *qrow = qbase + row * D * (QDT == PYFA_DTYPE_F32 ? 4 : 2);
            const bool live = (uint32_t)g < gn && active;
#pragma unroll
            for (int t = 0; t < VEC; t++) {
                q[g][t] = live ? load_q(qrow, c * VEC + t, QDT) * qscale : 0.0f;
                acc[g][t] = 0.0f;
            }
            m[g] = -INFINITY;
            s[g] = 0.0f;
        }

        int parity = 0;
        const uint32_t first = begin + rg * U, stride = RG * U;
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) issue(first + st * stride, st);
        int stage = 0;
        for (uint32_t base = first; base - rg * U < end; base += stride) {
            /* Every warp of a group runs the same steps (barriers below); rows past `end` are masked. */
            issue(base + (STAGES - 1) * stride, (stage + STAGES - 1) % STAGES);
            pyfa_cp_async_wait<STAGES - 1>();
            uint4 kr[U], vr[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                kr[u] = pyfa_lds16(ring_at(stage, u, 0));
                vr[u] = pyfa_lds16(ring_at(stage, u, 1));
            }
            stage = stage + 1 == STAGES ? 0 : stage + 1;
            /* Scores: per-lane partial dots of the N = U*GT (position, head) pairs,
             * summed over the warp by a reduce-scatter (N-1 + 5-log2(N) shuffles
             * instead of 5 per pair), published to shared memory, summed over the
             * warps of a split row, and read back by every lane. */
            constexpr int N = U * GT;
            constexpr int L = N >= 32 ? 5 : N >= 16 ? 4 : N >= 8 ? 3 : N >= 4 ? 2 : N >= 2 ? 1 : 0;
            constexpr int R = N >= 32 ? N / 32 : 1; /* values a lane keeps */
            float v[N];
#pragma unroll
            for (int u = 0; u < U; u++) {
                float kf[VEC];
                pyfa_chunk_to_f32<KVDT>(kr[u], kf);
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    float d = 0.0f;
                    if ((uint32_t)g < gn) {
#pragma unroll
                        for (int e = 0; e < VEC; e++) d = fmaf(q[g][e], kf[e], d);
                    }
                    v[u * GT + g] = d;
                }
            }
            attn_vec::reduce_scatter<N, 0, L>::run(v, lane);
#pragma unroll
            for (int o = 16 >> L; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
            float *mine = s_part + (parity * NW + warp) * N;
            if constexpr (N >= 32) {
#pragma unroll
                for (int j = 0; j < R; j++) mine[lane * R + j] = v[j];
            } else {
                if ((lane & ((32 >> L) - 1)) == 0) mine[lane >> (5 - L)] = v[0];
            }
            if constexpr (WPR > 1) {
                attn_vec::group_barrier(rg, WPR * 32);
            } else {
                __syncwarp();
            }
            float sc[U][GT];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    float total = 0.0f;
#pragma unroll
                    for (int w = 0; w < WPR; w++) total += s_part[(parity * NW + rg * WPR + w) * N + u * GT + g];
                    sc[u][g] = total;
                }
            parity ^= 1;
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    float x = sc[u][g];
                    if (SOFTCAP) x = p.softcap * tanhf(x * p.scale / p.softcap) * PYFA_LOG2E;
                    sc[u][g] = base + u < end ? x : -INFINITY;
                }
            }
#pragma unroll
            for (int g = 0; g < GT; g++) {
                if ((uint32_t)g >= gn) continue;
                float mx = sc[0][g];
#pragma unroll
                for (int u = 1; u < U; u++) mx = fmaxf(mx, sc[u][g]);
                const float m_new = fmaxf(m[g], mx);
                if (m_new == -INFINITY) {
#pragma unroll
                    for (int u = 0; u < U; u++) sc[u][g] = 0.0f;
                    continue;
                }
                const float alpha = exp2f(m[g] - m_new);
                s[g] *= alpha;
#pragma unroll
                for (int e = 0; e < VEC; e++) acc[g][e] *= alpha;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    sc[u][g] = exp2f(sc[u][g] - m_new);
                    s[g] += sc[u][g];
                }
                m[g] = m_new;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                float vf[VEC];
                pyfa_chunk_to_f32<KVDT>(vr[u], vf);
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    if ((uint32_t)g < gn) {
#pragma unroll
                        for (int e = 0; e < VEC; e++) acc[g][e] = fmaf(sc[u][g], vf[e], acc[g][e]);
                    }
                }
            }
        }

        /* Merge the row groups' states: each publishes, then all threads combine.
         * The merge area overlays the ring: drain the (zero-fill) copies first. */
        pyfa_cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GT; g++) {
            if (active) {
#pragma unroll
                for (int t = 0; t < VEC; t++) s_acc[(rg * GT + g) * D + c * VEC + t] = acc[g][t];
            }
            if (lane == 0 && part == 0) {
                s_ms[(rg * GT + g) * 2] = m[g];
                s_ms[(rg * GT + g) * 2 + 1] = s[g];
            }
        }
        __syncthreads();
        attn_vec_write_states<RG, GT, D>(a, s_ms, s_acc, gn, (size_t)b * p.num_heads + (size_t)kvh * G + g0,
                                           p.batch * p.num_heads, nwg, iwg, DIRECT, ODT, LSE);
        __syncthreads();
    }
}

/* The tensor-core variant for 16-bit caches (it reads q through load_q). */
#include "attn_vec_mma.cuh"

template <int QDT, int KVDT, int D, int SOFTCAP, int DIRECT, int VARIANT, int ODT, int HAS_LSE, int PAGED>
__device__ __forceinline__ void flash_attn_vec_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(QDT) && pyfa_is_float_dtype(KVDT), "flash_attn_vec: q/kv dtype");
    static_assert(pyfa_is_head_dim(D), "flash_attn_vec: head_dim");
    static_assert(VARIANT == PYFA_VEC_VARIANT_PORTABLE || VARIANT == PYFA_VEC_VARIANT_MMA, "flash_attn_vec: variant");
    static_assert(pyfa_is_float_dtype(ODT), "flash_attn_vec: out dtype");
    /* DIRECT 2: split, the last workgroup of a row merges (attn_vec_write_states, tickets bound). */
    static_assert(DIRECT >= 0 && DIRECT <= 2, "flash_attn_vec: DIRECT_OUT is 0, 1 or 2");
    if constexpr (VARIANT == PYFA_VEC_VARIANT_MMA && KVDT != PYFA_DTYPE_F32) {
        flash_attn_vec_mma_impl<QDT, KVDT, D>(a, SOFTCAP != 0, DIRECT == 1, ODT, HAS_LSE != 0, PAGED != 0);
    } else {
        flash_attn_vec_impl<KVDT, D>(a, QDT, SOFTCAP != 0, DIRECT == 1, ODT, HAS_LSE != 0, PAGED != 0);
    }
}

/* Merges the nwg partial states of row blockIdx.x (contract in pyfa_params.h)
 * with the block-size-independent merge of attn_vec_reduce.cuh, into out of
 * dtype ODT and, with HAS_LSE, the row's lse. */
template <int D, int ODT, int HAS_LSE>
__device__ void flash_attn_vec_reduce_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_head_dim(D) && pyfa_is_float_dtype(ODT), "flash_attn_vec_reduce: head_dim / out dtype");
    __shared__ float scratch[2 * PYFA_REDUCE_MAX_NWG];
    const pyfa_attn_reduce_params &p = pyfa_param<pyfa_attn_reduce_params>(a, PYFA_REDUCE_ARG_PARAMS);
    const uint32_t row = blockIdx.x, nwg = p.nwg < PYFA_REDUCE_MAX_NWG ? p.nwg : PYFA_REDUCE_MAX_NWG;
    const float *tmp = pyfa_ptr<const float>(a, PYFA_REDUCE_ARG_TMP);
    const float *sm = tmp + (size_t)p.nrows * p.nwg * D + (size_t)row * p.nwg * 2;
    const float *part = tmp + (size_t)row * p.nwg * D;
    char *o = pyfa_ptr<char>(a, PYFA_REDUCE_ARG_OUT) + (size_t)row * D * (ODT == PYFA_DTYPE_F32 ? 4 : 2);
    const float lse = attn_vec_reduce_row(sm, part, nwg, D, scratch,
                                          [&](uint32_t e, float x) { pyfa_store_f32<ODT>(o, e, x); });
    if (HAS_LSE && threadIdx.x == 0) pyfa_ptr<float>(a, PYFA_REDUCE_ARG_LSE)[row] = lse;
}
