/*
 * Tensor-core decode (flash_attn_vec variant PYFA_VEC_VARIANT_MMA) for 16-bit
 * K/V caches; contracts in pyfa_params.h. Block = 4 warps = one workgroup
 * (iwg, KV head, sequence), serving up to HEADS = 8 query heads of the GQA
 * group per pass: the n = 8 of mma m16n8k16, so a whole group costs one read
 * of K and V however wide it is.
 *
 * The block streams tiles of TP positions through a cp.async ring in shared
 * memory, STAGES deep. Up to D = 256 a warp reads only the K and V rows of
 * its own 16 positions of a tile, so it copies and awaits its own rows of
 * each stage and the warps run apart, with no block barrier per tile; at
 * D = 512 the block fills each stage together and meets at a barrier per
 * tile. Ring rows are whole 128-byte lines with their 16-byte chunks
 * swizzled (chunk c of row r at c ^ (r & 7)): the eight rows of an ldmatrix
 * fall in distinct banks, and each quarter-warp's copy writes one aligned
 * line (where a row is whole lines: D = 64, 128, 256, 512; at 80, 96 and
 * 192 rows are rounded up to lines and some copies still straddle two), so a
 * line of the cache crosses to the SM once (rows padded by 16
 * bytes put the copies across two lines, and L2 served every line 1.5
 * times: 50.3M sectors for a 1.07 GB read, H200). Per tile:
 *   A. scores Sᵀ[pos][head] = K · Qᵀ: each warp takes 16 positions (and, for
 *      D = 512, half the dims, partial sums meeting in shared memory); K by
 *      ldmatrix, Qᵀ fragments prepared once per pass in shared memory;
 *   B. every warp reads all TP x 8 scores and runs the same online softmax
 *      (same values, same order: identical m and s in every warp), then adds
 *      Pᵀ into its own slice of the output Oᵀ[dim][head] += Vᵀ · Pᵀ, V by
 *      ldmatrix.trans.
 * P is split into hi + lo 16-bit halves, two products, so weights keep about
 * f32 accuracy (2^-22 relative for f16, 2^-16 for bf16) while V is used
 * exactly. q in the cache's own dtype is exact in one 16-bit term: it enters
 * the mma unscaled and the f32 scores take scale * log2 e after it (one
 * product per k-step). Any other q (f32, or the other 16-bit type) is scaled
 * first and split into hi + lo like P.
 * Softmax statistics stay in f32, in the log2 domain; the partial (S, M)
 * pairs go out in the natural-log domain of the reduce contract.
 */
#pragma once
#include "vec_mma_tile.cuh"

/* Ring depth in tiles (NVRTC -D options from the CUDA plan, which sizes shared
 * memory with the same values), by row size: D <= 128 with 4 (more bytes in
 * flight; H100, bf16, D = 128, 32K positions: 3 to 4 stages took B = 1 from
 * 61.9 to 58.6 us and B = 8 from 391 to 377 us; 5 measured alike, 6 slower);
 * 128 < D <= 256 with 3 (4 would need 266 KB of shared memory at D = 256);
 * 1 KB rows (D = 512) measured faster with 2. */
#ifndef PYFA_VEC_MMA_STAGES
#define PYFA_VEC_MMA_STAGES 4
#endif
#ifndef PYFA_VEC_MMA_STAGES_MID
#define PYFA_VEC_MMA_STAGES_MID 3
#endif
#ifndef PYFA_VEC_MMA_STAGES_WIDE
#define PYFA_VEC_MMA_STAGES_WIDE 2
#endif
/* Warps sharing one 16-position block's dims at D = 512 (2: tiles of 32
 * positions; 4: tiles of 16, half the shared memory). */
#ifndef PYFA_VEC_MMA_WIDE_SPLIT
#define PYFA_VEC_MMA_WIDE_SPLIT 2
#endif

namespace vec_mma {
template <int D>
struct shape {
    static constexpr int KSTEPS = D / 16;          /* 16-dim blocks: k-steps of K Qᵀ, m-blocks of Vᵀ Pᵀ */
    static constexpr int STAGES = D > 256 ? PYFA_VEC_MMA_STAGES_WIDE
                                : D > 128 ? PYFA_VEC_MMA_STAGES_MID : PYFA_VEC_MMA_STAGES;
    static constexpr int KS = D > 256 ? PYFA_VEC_MMA_WIDE_SPLIT : 1; /* warps sharing a position block's dims in phase A */
    static constexpr int PB = NW / KS;             /* 16-position blocks per tile */
    static constexpr int TP = 16 * PB;             /* positions per tile */
    static constexpr int KSPAN = KSTEPS / KS;      /* k-steps per warp in phase A */
    /* D <= 256: each warp keeps its own softmax state and Oᵀ over every dim
     * for the 16 positions it scores in a tile, and the NW states merge at
     * the end of a pass (no block barrier between the phases, no softmax
     * repeated in every warp); D = 512 (KS = 2) would need 128 accumulator
     * registers, so there the warps split the dims and share one state. */
    static constexpr bool PER_WARP = D <= 256;
    static constexpr int STATES = PER_WARP ? NW : 1;
    static constexpr int MB = PER_WARP ? KSTEPS : (KSTEPS + NW - 1) / NW; /* output m-blocks per warp (at most) */
    static constexpr int LD = (D * 2 + 127) / 128 * 128; /* bytes per ring row: whole lines, chunks swizzled */
    static constexpr int STAGE_BYTES = 2 * TP * LD; /* K rows, then V rows */
    static constexpr int RING_BYTES = STAGES * STAGE_BYTES;
    static constexpr int Q_BYTES = KSTEPS * 32 * 16;      /* Qᵀ fragments: [kstep][lane] x uint4 */
    static constexpr int SCORE_BYTES = KS * TP * HEADS * 4; /* [ks][pos][head] f32 */
    static constexpr int MS_BYTES = (STATES * HEADS * 2 * 4 + 127) / 128 * 128; /* whole lines, so the ring starts on one */
    static constexpr int MERGE_BYTES = STATES * HEADS * D * 4;
    static constexpr int SMEM_BYTES =
        Q_BYTES + SCORE_BYTES + MS_BYTES + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES);
    static_assert((Q_BYTES + SCORE_BYTES + MS_BYTES) % 128 == 0, "the ring starts on a line");
    static_assert(KSTEPS % KS == 0, "phase A splits the k-steps evenly");
    static_assert(!PER_WARP || KS == 1, "a warp with its own state scores its positions over every dim");
    static_assert(SMEM_BYTES == pyfa_cuda_vec_mma_smem_bytes(D, STAGES, KS) && HEADS == PYFA_CUDA_MMA_HEADS,
                  "the plan sizes this kernel with pyfa_cuda_vec_mma_smem_bytes");
    static_assert(D % 16 == 0, "head dims are multiples of 16");
};
} // namespace vec_mma

template <int QDT, int KVDT, int D>
__device__ __forceinline__ void flash_attn_vec_mma_impl(const pyfa_cuda_args &a, const bool SOFTCAP, const bool DIRECT,
                                                        const int ODT, const bool LSE, const bool PAGED) {
    static_assert(KVDT != PYFA_DTYPE_F32, "the tensor-core decode reads 16-bit caches");
    using S = vec_mma::shape<D>;
    constexpr int NW = vec_mma::NW, HEADS = vec_mma::HEADS, STAGES = S::STAGES;
    constexpr int TP = S::TP, LD = S::LD, CPR = D / 8; /* 16-byte chunks per row */
    const pyfa_flash_attn_vec_params &p = pyfa_param<pyfa_flash_attn_vec_params>(a, PYFA_VEC_ARG_PARAMS);
    const uint32_t iwg = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3; /* fragment row / column group of this lane */
    const uint32_t G = p.num_heads / p.num_kv_heads, cap = p.kv_capacity, nwg = p.nwg;

    extern __shared__ __align__(128) char smem_mma[];
    { /* the plan's size (CUDAPlan.vecMmaSharedBytes) mirrors S::SMEM_BYTES: a mismatch faults, loudly */
        uint32_t dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < (uint32_t)S::SMEM_BYTES) __trap();
    }
    uint4 *s_q = reinterpret_cast<uint4 *>(smem_mma);
    float *s_score = reinterpret_cast<float *>(smem_mma + S::Q_BYTES);
    float *s_ms = reinterpret_cast<float *>(smem_mma + S::Q_BYTES + S::SCORE_BYTES);
    char *s_ring = smem_mma + S::Q_BYTES + S::SCORE_BYTES + S::MS_BYTES;
    float *s_acc = reinterpret_cast<float *>(s_ring); /* [head][D], overlays the drained ring */

    const attn_vec_span span = attn_vec_workgroup_span(a, b, cap, p.window, nwg, iwg, PAGED);
    const uint32_t ring = span.ring, begin = span.begin, end = span.end;
    attn_vec_pages pg = {}; /* PAGED: pool rows from the pool's start */
    if (PAGED) pg = attn_vec_pages_of(a, b, kvh, p.num_kv_heads);
    const size_t row_bytes = (size_t)D * 2;
    const size_t head_off = PAGED ? 0 : ((size_t)b * p.num_kv_heads + kvh) * cap * row_bytes;
    const char *kbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_K) + head_off;
    const char *vbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_V) + head_off;
    const char *qbase = pyfa_ptr<const char>(a, PYFA_VEC_ARG_Q);
    const float qscale = SOFTCAP ? 1.0f : p.scale * PYFA_LOG2E;
    /* q is exact in one term of the cache's dtype: no lo product, scale after the mma */
    constexpr bool Q_EXACT = QDT == KVDT;

    /* This thread's copies in a tile: chunk k is row (tid + k NT) / CPR. */
    constexpr int NT = NW * 32, PER = TP * CPR / NT;
    static_assert(TP * CPR % NT == 0, "every thread copies the same number of chunks per tile");
    /* PAGED: the block_table entries of this thread's chunks in the next tile
     * issue() copies, loaded one tile ahead (tiles are issued in order) and
     * only turned into rows when used, so the loads fly under a whole tile of
     * work instead of stalling the copies. A position past `end` loads entry 0
     * (always in the table) and is never copied. */
    uint32_t next_entry[PER];
    auto look_up = [&](uint32_t base) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const uint32_t pos = base + (tid + k * NT) / CPR;
            next_entry[k] = pg.entry(pos < end ? pos : 0u);
        }
    };

    /* Copies the K and V rows of positions [base, base + TP) into ring stage
     * `stage` (rows past `end` as zeros) and commits them as one group, empty
     * for a tile wholly past `end`, which is never read. */
    auto issue = [&](uint32_t base, int stage) {
        char *kdst = s_ring + stage * S::STAGE_BYTES, *vdst = kdst + TP * LD;
        if (base < end) {
#pragma unroll
            for (int k = 0; k < PER; k++) {
                const int i = tid + k * NT, r = i / CPR, ch = i % CPR;
                const uint32_t pos = base + r;
                uint32_t slot = pos + ring;
                slot = slot >= cap ? slot - cap : slot;
                const bool live = pos < end;
                if (PAGED) slot = live ? pg.row_at(next_entry[k], pos) : 0u;
                const size_t off = (live ? slot * row_bytes : 0) + ch * 16;
                const int at = r * LD + ((ch ^ (r & 7)) << 4);
                pyfa_cp_async16(kdst + at, kbase + off, live ? 16u : 0u);
                pyfa_cp_async16(vdst + at, vbase + off, live ? 16u : 0u);
            }
        }
        if (PAGED) look_up(base + TP);
        pyfa_cp_async_commit();
    };

    /* PER_WARP: the pool row (slot) of this lane's row of the tile at `base`,
     * position base + 16 warp + (lane & 15); positions from `end` on repeat
     * row end - 1 (base < end), finite values whose weights are exactly 0.
     * PAGED: my_entry holds that row's block_table entry, loaded a tile ahead. */
    uint32_t my_entry = 0;
    auto my_pos = [&](uint32_t base) {
        const uint32_t pos = base + 16 * warp + (lane & 15);
        return pos < end ? pos : end - 1;
    };
    auto look_up_mine = [&](uint32_t base) {
        if (base < end) my_entry = pg.entry(my_pos(base));
    };
    auto my_slot = [&](uint32_t base) -> uint32_t {
        const uint32_t pos = my_pos(base);
        if (PAGED) return pg.row_at(my_entry, pos);
        const uint32_t slot = pos + ring;
        return slot >= cap ? slot - cap : slot;
    };
    /* PER_WARP: copies this warp's 16 K and 16 V rows of the tile at `base`
     * into its rows of stage `stage`, chunk i = lane + 32k of the warp's
     * 2 x 16 x CPR (matrix, row, chunk) with each row's slot shuffled from
     * its lane; one group committed per call, empty for a tile wholly past
     * `end` (never read). */
    auto issue_mine = [&](uint32_t base, int stage) {
        char *kdst = s_ring + stage * S::STAGE_BYTES + 16 * warp * LD, *vdst = kdst + TP * LD;
        if (base < end) {
            const uint32_t slot = my_slot(base);
#pragma unroll
            for (int k = 0; k < CPR; k++) {
                const int i = lane + 32 * k, mat = i / (16 * CPR), r = (i / CPR) % 16, ch = i % CPR;
                const uint32_t row_slot = __shfl_sync(0xffffffffu, slot, r);
                pyfa_cp_async16((mat ? vdst : kdst) + r * LD + ((ch ^ (r & 7)) << 4),
                                (mat ? vbase : kbase) + row_slot * row_bytes + ch * 16, 16u);
            }
        }
        if (PAGED) look_up_mine(base + TP);
        pyfa_cp_async_commit();
    };

    const int pb = warp % S::PB, ks = warp / S::PB; /* phase A: position block, dims share */
    for (uint32_t g0 = 0; g0 < G; g0 += HEADS) {
        const uint32_t gn = G - g0 < (uint32_t)HEADS ? G - g0 : (uint32_t)HEADS;
        const size_t row0 = (size_t)b * p.num_heads + (size_t)kvh * G + g0;
        if constexpr (S::PER_WARP) {
            if (PAGED) look_up_mine(begin);
#pragma unroll
            for (int st = 0; st < STAGES - 1; st++) issue_mine(begin + st * TP, st);
        } else {
            if (PAGED) look_up(begin);
#pragma unroll
            for (int st = 0; st < STAGES - 1; st++) issue(begin + st * TP, st);
        }
        vec_mma::store_q_fragments<S::KSTEPS, KVDT>(s_q, gn, [&](int h, int d) {
            const float x = load_q(qbase + (row0 + h) * D * (QDT == PYFA_DTYPE_F32 ? 4 : 2), d, QDT);
            return Q_EXACT ? x : x * qscale;
        });
        if constexpr (S::PER_WARP) __syncthreads(); /* the Qᵀ fragments */

        float acc[S::MB][4];
#pragma unroll
        for (int i = 0; i < S::MB; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m = -INFINITY, s = 0.0f; /* head g's running max (log2 domain) and sum */

        int stage = 0;
        for (uint32_t base = begin; base < end; base += TP) {
            if constexpr (S::PER_WARP) {
                pyfa_cp_async_wait<STAGES - 2>();
                __syncwarp(); /* the warp's rows have landed, and every lane is done with the stage refilled next */
                issue_mine(base + (STAGES - 1) * TP, stage == 0 ? STAGES - 1 : stage - 1);
            } else {
                pyfa_cp_async_wait<STAGES - 2>();
                __syncthreads(); /* this tile has landed; every warp is done with the previous one */
                issue(base + (STAGES - 1) * TP, stage == 0 ? STAGES - 1 : stage - 1);
            }
            const char *ktile = s_ring + stage * S::STAGE_BYTES, *vtile = ktile + TP * LD;
            stage = stage + 1 == STAGES ? 0 : stage + 1;

            /* A. Sᵀ for positions 16 pb + [0, 16) over this warp's k-steps; four
             * accumulators (k-step parity x q half, or k-step mod 4 for an exact
             * q) keep dependent mma chains short. */
            {
                float sp[4][4] = {};
                /* lane l addresses row pb 16 + (l & 15), chunk 2 kk + (l >> 4), which
                 * the swizzle puts at (2 kk) ^ ((l >> 4) ^ (l & 7)) */
                const uint32_t arow = smem_addr(ktile + (pb * 16 + (lane & 15)) * LD);
                const uint32_t aswz = (uint32_t)((lane >> 4) ^ (lane & 7));
                auto kstep = [&](int kk, float (&s0)[4], float (&s1)[4]) {
                    uint32_t fa[4];
                    ldsm_x4(arow + ((2u * kk ^ aswz) << 4), fa[0], fa[1], fa[2], fa[3]);
                    const uint4 fq = s_q[kk * 32 + lane];
                    mma16816<KVDT>(s0, fa, fq.x, fq.y);
                    if constexpr (!Q_EXACT) mma16816<KVDT>(s1, fa, fq.z, fq.w);
                };
                const int k0 = ks * S::KSPAN;
                if constexpr (Q_EXACT && S::KSPAN % 4 == 0) {
#pragma unroll 2
                    for (int t = 0; t < S::KSPAN / 4; t++) {
                        kstep(k0 + 4 * t, sp[0], sp[0]);
                        kstep(k0 + 4 * t + 1, sp[1], sp[1]);
                        kstep(k0 + 4 * t + 2, sp[2], sp[2]);
                        kstep(k0 + 4 * t + 3, sp[3], sp[3]);
                    }
                } else {
#pragma unroll 2
                    for (int t = 0; t < S::KSPAN / 2; t++) {
                        kstep(k0 + 2 * t, sp[0], sp[1]);
                        kstep(k0 + 2 * t + 1, sp[2], sp[3]);
                    }
                    if constexpr (S::KSPAN % 2 != 0) kstep(k0 + S::KSPAN - 1, sp[0], sp[1]);
                }
                float sc[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sc[e] = (sp[0][e] + sp[1][e]) + (sp[2][e] + sp[3][e]);
                    if constexpr (Q_EXACT) sc[e] *= qscale;
                }
                float *dst = s_score + (ks * TP + pb * 16 + g) * HEADS + 2 * c;
                *reinterpret_cast<float2 *>(dst) = make_float2(sc[0], sc[1]);
                *reinterpret_cast<float2 *>(dst + 8 * HEADS) = make_float2(sc[2], sc[3]);
            }
            if constexpr (S::PER_WARP) {
                __syncwarp(); /* this warp's scores are in s_score */
                /* B. Softmax over this warp's 16 positions, then its Oᵀ over every
                 * dim: Vᵀ of positions 16 warp + [0, 16) times Pᵀ. */
                float x[1][4];
                vec_mma::tile_scores<1, 1>(s_score + warp * 16 * HEADS, base + 16 * warp, end, SOFTCAP, p, x);
                const float2 alpha = vec_mma::softmax_step<1>(x, m, s);
                uint32_t phi[2], plo[2];
                pyfa_split2<KVDT>(x[0][0], x[0][1], phi[0], plo[0]);
                pyfa_split2<KVDT>(x[0][2], x[0][3], phi[1], plo[1]);
                /* lane l addresses row 16 warp + (l & 7) + 8 (l >> 4), chunk 2 i + ((l >> 3) & 1),
                 * swizzled to (2 i) ^ (((l >> 3) & 1) ^ (l & 7)) */
                const uint32_t vrow = smem_addr(vtile + (16 * warp + (lane & 7) + ((lane >> 4) << 3)) * LD);
                const uint32_t vswz = (uint32_t)(((lane >> 3) & 1) ^ (lane & 7));
#pragma unroll
                for (int i = 0; i < S::MB; i++) {
                    acc[i][0] *= alpha.x, acc[i][1] *= alpha.y, acc[i][2] *= alpha.x, acc[i][3] *= alpha.y;
                    uint32_t fv[4];
                    ldsm_x4_trans(vrow + ((2u * i ^ vswz) << 4), fv[0], fv[1], fv[2], fv[3]);
                    mma16816<KVDT>(acc[i], fv, phi[0], phi[1]);
                    mma16816<KVDT>(acc[i], fv, plo[0], plo[1]);
                }
            } else {
                __syncthreads();

                /* B. The tile's softmax for head g, then this warp's Oᵀ blocks. */
                constexpr int J = TP / 16;
                float x[J][4];
                vec_mma::tile_scores<J, S::KS>(s_score, base, end, SOFTCAP, p, x);
                const float2 alpha = vec_mma::softmax_step<J>(x, m, s);
                const float a0 = alpha.x, a1 = alpha.y;
                /* lane l addresses row 16 j + (l & 7) + 8 (l >> 4), chunk 2 mb + ((l >> 3) & 1) */
                const uint32_t vrow = smem_addr(vtile + ((lane & 7) + ((lane >> 4) << 3)) * LD);
                const uint32_t vswz = (uint32_t)(((lane >> 3) & 1) ^ (lane & 7));
                uint32_t phi[J][2], plo[J][2];
#pragma unroll
                for (int j = 0; j < J; j++) {
                    pyfa_split2<KVDT>(x[j][0], x[j][1], phi[j][0], plo[j][0]);
                    pyfa_split2<KVDT>(x[j][2], x[j][3], phi[j][1], plo[j][1]);
                }
#pragma unroll
                for (int i = 0; i < S::MB; i++) {
                    const int mb = warp + NW * i;
                    if (S::KSTEPS % NW == 0 || mb < S::KSTEPS) {
                        acc[i][0] *= a0, acc[i][1] *= a1, acc[i][2] *= a0, acc[i][3] *= a1;
                        const uint32_t vcol = (2u * mb ^ vswz) << 4;
#pragma unroll
                        for (int j = 0; j < J; j++) {
                            uint32_t fv[4];
                            ldsm_x4_trans(vrow + j * 16 * LD + vcol, fv[0], fv[1], fv[2], fv[3]);
                            mma16816<KVDT>(acc[i], fv, phi[j][0], phi[j][1]);
                            mma16816<KVDT>(acc[i], fv, plo[j][0], plo[j][1]);
                        }
                    }
                }
            }
        }

        if constexpr (S::PER_WARP) {
            /* Block i's fragment rows g and g + 8 are dims 16 i + g and + 8. */
            vec_mma::finish_pass_per_warp<D, 8>(a, p, s_acc, s_ms, acc, [&](int i) { return 16 * i + g; }, m, s, gn,
                                                row0, iwg, DIRECT, ODT, LSE);
        } else {
            /* Block i = m-block warp + NW i: fragment rows g and g + 8 are dims 16 mb + g and + 8. */
            vec_mma::finish_pass<D, 8>(a, p, s_acc, s_ms, acc, [&](int i) {
                const int mb = warp + NW * i;
                return S::KSTEPS % NW == 0 || mb < S::KSTEPS ? mb * 16 + g : -1;
            }, m, s, gn, row0, iwg, DIRECT, ODT, LSE);
        }
    }
}
