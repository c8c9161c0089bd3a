/*
 * Tensor-core TurboQuant decode (flash_attn_vec_tq at 4-bit K and V codes);
 * contracts in turboquant_params.h. The shape follows the dense tensor-core
 * decode (attn_vec_mma.cuh): 4 warps, up to HEADS = 8 query heads per pass as
 * the n = 8 of mma m16n8k16, tiles of TP = 64 positions streamed through a
 * cp.async ring of packed codes and scales, phase A = scores Sᵀ = K̂ · Qᵀ
 * (16 positions per warp), phase B = the online softmax, then Oᵀ += V̂ᵀ · Pᵀ.
 *
 * Dequantisation is one shared-memory load per code byte (two coordinates):
 * a table maps the byte to its two codebook values as one f16 pair (low
 * nibble = the even coordinate in the low half). The codebook is the one
 * rounding this kernel adds: q and P stay split in f16 hi + lo, so every
 * product of a rounded codebook value is kept to about 2^-22, and the output
 * is attention over the cache dequantized with f16 codebook values (within
 * 2^-11 relative of the f32 codebook; the tests' bounds are derived from that
 * rounding per bit width). Each entry holds COPIES = 32 copies of the pair,
 * lane l reading copy l, so a warp's lookups hit distinct banks whatever the
 * codes. K and V share the table: the op passes the codebook of their common
 * bit width for both.
 *
 * Fragments:
 * - K: an m-block is 16 positions of one warp, a register one looked-up pair
 *   (two dims of one position), straight from the load.
 * - V: an m-block is 16 dims; a register pairs two positions at one dim:
 *   the code bytes of positions p and p + 1 are re-paired by nibble (p's and
 *   p + 1's codes of dim d in one byte, of dim d + 1 in another), and the
 *   table's pair of such a byte is the register.
 *
 * The k-step columns and the output rows map to coordinates so that a lane
 * uses all four bytes of every code word it reads (32-bit loads, one
 * wavefront per warp): the kernel is bound by shared-memory wavefronts, of
 * which the lookups are most.
 */
#pragma once
#include "vec_mma_tile.cuh"

#ifndef PYFA_TQ_MMA_STAGES
#define PYFA_TQ_MMA_STAGES 0 /* by head dim: pyfa_cuda_tq_mma_stages */
#endif

namespace tq_mma {
constexpr int NW = vec_mma::NW, HEADS = vec_mma::HEADS, TP = 64, COPIES = 32;
constexpr int ENTRY = COPIES * 4; /* an entry's bytes: COPIES f16 pairs */
constexpr int STAGES_KNOB = PYFA_TQ_MMA_STAGES;

template <int D>
struct shape {
    static constexpr int STAGES = pyfa_cuda_tq_mma_stages(D, STAGES_KNOB);
    static constexpr int KSTEPS = D / 16;
    static constexpr int MB = KSTEPS / NW;               /* output m-blocks per warp */
    static constexpr int ROW = D / 2;                    /* bytes of a row's 4-bit codes */
    static constexpr int LDC = ROW + 16;                 /* padded: 8 rows' 16-byte loads hit distinct banks */
    static constexpr int V_OFF = TP * LDC, S_OFF = 2 * TP * LDC; /* V codes, then K and V scales */
    static constexpr int STAGE_BYTES = S_OFF + 2 * TP * 4;
    static constexpr int RING_BYTES = STAGES * STAGE_BYTES;
    static constexpr int TABLE_BYTES = 256 * ENTRY;
    static constexpr int Q_BYTES = KSTEPS * 32 * 16;
    /* D <= 256: each warp keeps its own softmax state and Oᵀ over every dim
     * (KSTEPS m-blocks) for its 16 positions of a tile, and the NW states
     * merge at the end of a pass; D = 512 would need 128 accumulator
     * registers, so there the warps split the dims and share one state. */
    static constexpr bool PER_WARP = D <= 256;
    static constexpr int STATES = PER_WARP ? NW : 1;
    static constexpr int ACC_BLOCKS = PER_WARP ? KSTEPS : MB; /* m-blocks a warp accumulates */
    static constexpr int SCORE_BYTES = TP * HEADS * 4;
    static constexpr int MS_BYTES = STATES * HEADS * 2 * 4;
    static constexpr int MERGE_BYTES = STATES * HEADS * D * 4;
    static constexpr int SMEM_BYTES =
        TABLE_BYTES + Q_BYTES + SCORE_BYTES + MS_BYTES + (RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES);
    static_assert(KSTEPS % NW == 0 && KSTEPS % 2 == 0, "D in {64, 128, 256, 512}");
    static_assert(RING_BYTES >= MERGE_BYTES, "the merge area overlays the drained ring");
    static_assert(RING_BYTES >= 8 * PYFA_CUDA_TQ_MERGE_MAX_NWG * NW, "the last workgroup's merge scratch fits the ring");
    static_assert(SMEM_BYTES == pyfa_cuda_tq_mma_smem_bytes(D, STAGES_KNOB) && TP == PYFA_CUDA_TQ_MMA_TILE &&
                      COPIES == PYFA_CUDA_TQ_MMA_TABLE_COPIES && ENTRY == PYFA_CUDA_TQ_MMA_TABLE_ENTRY,
                  "the plan sizes this kernel with pyfa_cuda_tq_mma_smem_bytes");
};

/* The f16 pair of byte `byte` of `word` in this lane's copy: lane_tab = the
 * table's shared address + 4 lane. */
__device__ __forceinline__ uint32_t lookup(uint32_t lane_tab, uint32_t word, int byte) {
    static_assert(ENTRY == 128, "the offset is byte << 7");
    const uint32_t code = __byte_perm(word, 0u, 0x4440u | (uint32_t)byte);
    uint32_t v;
    asm("ld.shared.u32 %0, [%1];" /* reads the table, which is written once before any lookup */
        : "=r"(v)
        : "r"(lane_tab + (code << 7)));
    return v;
}

/* Bytes of two code words of one coordinate range, re-paired across the words:
 * byte k of low_nibbles(a, b) is (low nibble of a's byte k, low nibble of b's
 * byte k), of high_nibbles(a, b) the two high nibbles. With a and b two
 * positions' words, its table pair is those positions' values at one dim. */
__device__ __forceinline__ uint32_t low_nibbles(uint32_t a, uint32_t b) {
    return (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u);
}
__device__ __forceinline__ uint32_t high_nibbles(uint32_t a, uint32_t b) {
    return ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);
}
} // namespace tq_mma

template <int D>
__device__ __forceinline__ void flash_attn_vec_tq_mma_impl(const pyfa_cuda_args &a, const bool SOFTCAP,
                                                           const bool DIRECT, const bool MERGE, const bool LSE,
                                                           const bool PAGED, const int OUT_DTYPE) {
    using S = tq_mma::shape<D>;
    constexpr int NW = tq_mma::NW, HEADS = tq_mma::HEADS, TP = tq_mma::TP, COPIES = tq_mma::COPIES;
    constexpr int STAGES = S::STAGES, LDC = S::LDC, CPR = S::ROW / 16, J = TP / 16;
    const pyfa_flash_attn_vec_tq_params &tp = pyfa_param<pyfa_flash_attn_vec_tq_params>(a, PYFA_VEC_ARG_PARAMS);
    const pyfa_flash_attn_vec_params &p = tp.attn;
    const uint32_t iwg = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const uint32_t G = p.num_heads / p.num_kv_heads, cap = p.kv_capacity, nwg = p.nwg;

    extern __shared__ __align__(16) char smem_tq[];
    { /* the plan's size (CUDAPlan.tqMmaSharedBytes) mirrors S::SMEM_BYTES: a mismatch faults, loudly */
        uint32_t dynamic_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
        if (dynamic_bytes < (uint32_t)S::SMEM_BYTES) __trap();
    }
    uint4 *s_q = reinterpret_cast<uint4 *>(smem_tq + S::TABLE_BYTES);
    float *s_score = reinterpret_cast<float *>(smem_tq + S::TABLE_BYTES + S::Q_BYTES);
    float *s_ms = s_score + TP * HEADS;
    char *s_ring = smem_tq + S::TABLE_BYTES + S::Q_BYTES + S::SCORE_BYTES + S::MS_BYTES;
    float *s_acc = reinterpret_cast<float *>(s_ring); /* [head][D], overlays the drained ring */

    const attn_vec_span span = attn_vec_workgroup_span(a, b, cap, p.window, nwg, iwg, PAGED);
    const uint32_t ring = span.ring, begin = span.begin, end = span.end;
    attn_vec_pages pg = {}; /* PAGED: codes and scales are pool rows from the pools' starts */
    if (PAGED) pg = attn_vec_pages_of(a, b, kvh, p.num_kv_heads);
    const size_t head_rows = PAGED ? 0 : ((size_t)b * p.num_kv_heads + kvh) * cap;
    const uint8_t *kcodes = pyfa_ptr<const uint8_t>(a, PYFA_VEC_ARG_K) + head_rows * S::ROW;
    const uint8_t *vcodes = pyfa_ptr<const uint8_t>(a, PYFA_VEC_ARG_V) + head_rows * S::ROW;
    const float *kscales = pyfa_ptr<const float>(a, PYFA_TQ_VEC_ARG_K_SCALES) + head_rows;
    const float *vscales = pyfa_ptr<const float>(a, PYFA_TQ_VEC_ARG_V_SCALES) + head_rows;
    const float *qrot = pyfa_ptr<const float>(a, PYFA_VEC_ARG_Q); /* q_in ROTATED */
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    const float qscale = SOFTCAP ? 1.0f : p.scale * PYFA_LOG2E;

    /* This thread's copies in a tile: code chunk k is row (tid + k NT) / CPR,
     * and scale entry tid is position tid mod TP (K scales, then V scales). */
    constexpr int NT = NW * 32, PER = TP * CPR / NT;
    static_assert(TP * CPR % NT == 0 && 2 * TP == NT, "every thread copies the same chunks per tile, one scale");
    /* PAGED: the block_table entries of this thread's copies in the next tile
     * issue() copies, loaded one tile ahead and turned into rows when used, so
     * the loads fly under a tile of work (as in attn_vec_mma.cuh). */
    uint32_t next_entry[PER], next_scale_entry = 0;
    auto look_up = [&](uint32_t base) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const uint32_t pos = base + (tid + k * NT) / CPR;
            next_entry[k] = pg.entry(pos < end ? pos : 0u);
        }
        const uint32_t pos = base + tid % TP;
        next_scale_entry = pg.entry(pos < end ? pos : 0u);
    };

    /* Copies the codes and scales of positions [base, base + TP) into ring
     * stage `stage` (rows past `end` as zeros) and commits them as one group,
     * empty for a tile wholly past `end`, which is never read. */
    auto issue = [&](uint32_t base, int stage) {
        char *dst = s_ring + stage * S::STAGE_BYTES;
        if (base < end) {
#pragma unroll
            for (int k = 0; k < PER; k++) {
                const int i = tid + k * NT, r = i / CPR, ch = i % CPR;
                const uint32_t pos = base + r;
                uint32_t slot = pos + ring;
                slot = slot >= cap ? slot - cap : slot;
                const bool live = pos < end;
                if (PAGED) slot = live ? pg.row_at(next_entry[k], pos) : 0u;
                const size_t off = (live ? (size_t)slot * S::ROW : 0) + ch * 16;
                pyfa_cp_async16(dst + r * LDC + ch * 16, kcodes + off, live ? 16u : 0u);
                pyfa_cp_async16(dst + S::V_OFF + r * LDC + ch * 16, vcodes + off, live ? 16u : 0u);
            }
            { /* K scales, then V scales */
                const int i = tid;
                const uint32_t pos = base + (i % TP);
                uint32_t slot = pos + ring;
                slot = slot >= cap ? slot - cap : slot;
                const bool live = pos < end;
                if (PAGED) slot = live ? pg.row_at(next_scale_entry, pos) : 0u;
                const float *src = (i < TP ? kscales : vscales) + (live ? slot : 0);
                tq_vec::cp_async<4>(dst + S::S_OFF + i * 4, src, live ? 4u : 0u);
            }
        }
        if (PAGED) look_up(base + TP);
        pyfa_cp_async_commit();
    };

    /* Start the first tiles' copies, then build the table while they fly. */
    if (PAGED) look_up(begin);
    for (int st = 0; st < STAGES - 1; st++) issue(begin + st * TP, st);
    { /* thread t computes entries t and t + 128 once (low nibble: the even
       * coordinate) and writes their COPIES copies four at a time, starting at
       * quad t % 8, so the 8 threads of a 16-byte store's phase hit distinct banks */
        static_assert(NW * 32 == 128 && COPIES == 32, "two entries per thread, 32 copies");
        const float *cb = &pyfa_param<float>(a, PYFA_TQ_VEC_ARG_K_CODEBOOK);
        const float even = cb[tid & 15];
        const uint32_t pair0 = pyfa_pack2<PYFA_DTYPE_F16>(even, cb[tid >> 4]);
        const uint32_t pair1 = pyfa_pack2<PYFA_DTYPE_F16>(even, cb[(tid >> 4) + 8]);
        uint4 *e0 = reinterpret_cast<uint4 *>(smem_tq + tid * tq_mma::ENTRY);
        uint4 *e1 = reinterpret_cast<uint4 *>(smem_tq + (tid + 128) * tq_mma::ENTRY);
#pragma unroll
        for (int k = 0; k < COPIES / 4; k++) {
            const int quad = (k + tid) & (COPIES / 4 - 1);
            e0[quad] = make_uint4(pair0, pair0, pair0, pair0);
            e1[quad] = make_uint4(pair1, pair1, pair1, pair1);
        }
    }
    const uint32_t lane_tab = smem_addr(smem_tq) + 4 * lane;

    /* q_in UNROTATED: the op bound its q, rotated at the start of each pass into the
     * ring's last stage, which no copy fills before the pass's first tile. */
    const bool rotate_q = tp.q_in != PYFA_TQ_Q_IN_ROTATED;
    float *s_qrot = reinterpret_cast<float *>(s_ring + (STAGES - 1) * S::STAGE_BYTES);
    static_assert(HEADS * D * 4 <= S::STAGE_BYTES && STAGES >= 2, "a pass's rotated q fits a free stage");
    bool first_pass = true;
    for (uint32_t g0 = 0; g0 < G; g0 += HEADS) {
        const uint32_t gn = G - g0 < (uint32_t)HEADS ? G - g0 : (uint32_t)HEADS;
        const size_t row0 = (size_t)b * p.num_heads + (size_t)kvh * G + g0;
        if (!first_pass) {
            if (PAGED) look_up(begin);
            for (int st = 0; st < STAGES - 1; st++) issue(begin + st * TP, st);
        }
        first_pass = false;
        if (rotate_q) {
            tq::rotate_q_rows<D>(a, tp, row0, gn, s_qrot, NW);
            __syncthreads();
        }
        /* k-step kk's columns 2c + {0, 1} and 2c + 8 + {0, 1} (fragment dims
         * d = 16 kk + ...) are bytes 2 (kk % 2) and 2 (kk % 2) + 1 of code word
         * 4 (kk / 2) + c, so a lane reads whole words of K codes (phase A). */
        vec_mma::store_q_fragments<S::KSTEPS, PYFA_DTYPE_F16>(s_q, gn, [&](int h, int d) {
            const int kk = d >> 4, r = d & 15;
            const int coord = 32 * (kk >> 1) + 8 * ((r & 7) >> 1) + 4 * (kk & 1) + 2 * (r >> 3) + (r & 1);
            return (rotate_q ? s_qrot[h * D + coord] : qrot[(row0 + h) * D + coord]) * qscale;
        });
        /* Up to D = 128 the fragments stay in registers for the pass (a
         * quarter of the shared-memory traffic of a tile otherwise). */
        constexpr bool Q_REGS = D <= 128;
        uint4 fq_reg[Q_REGS ? S::KSTEPS : 1];
        if constexpr (Q_REGS) {
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < S::KSTEPS; kk++) fq_reg[kk] = s_q[kk * 32 + lane];
        }

        float acc[S::ACC_BLOCKS][4];
#pragma unroll
        for (int i = 0; i < S::ACC_BLOCKS; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m = -INFINITY, s = 0.0f; /* head g's running max (log2 domain) and sum: this warp's, or the block's */

        int stage = 0;
        for (uint32_t base = begin; base < end; base += TP) {
            pyfa_cp_async_wait<STAGES - 2>();
            __syncthreads(); /* this tile has landed; every warp is done with the previous one */
            issue(base + (STAGES - 1) * TP, stage == 0 ? STAGES - 1 : stage - 1);
            const char *tile = s_ring + stage * S::STAGE_BYTES;
            const float *tscale = reinterpret_cast<const float *>(tile + S::S_OFF);
            stage = stage + 1 == STAGES ? 0 : stage + 1;

            /* A. Sᵀ of positions 16 warp + [0, 16): rows g and g + 8 of the
             * m-block are positions 16 warp + g and 16 warp + g + 8. Four
             * accumulators (k-step parity x q term) keep the chains of
             * dependent mmas short. */
            {
                float sp[2][2][4] = {};
                /* lane c reads code word 4j + c of its two rows: bytes 0, 1 feed
                 * k-step 2j, bytes 2, 3 k-step 2j + 1 (the q fragments' order) */
                const char *r0 = tile + (warp * 16 + g) * LDC + 4 * c, *r1 = r0 + 8 * LDC;
#pragma unroll 4
                for (int j = 0; j < S::KSTEPS / 2; j++) {
                    const uint32_t w0 = *reinterpret_cast<const uint32_t *>(r0 + 16 * j);
                    const uint32_t w1 = *reinterpret_cast<const uint32_t *>(r1 + 16 * j);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint32_t f[4] = {tq_mma::lookup(lane_tab, w0, 2 * h), tq_mma::lookup(lane_tab, w1, 2 * h),
                                               tq_mma::lookup(lane_tab, w0, 2 * h + 1),
                                               tq_mma::lookup(lane_tab, w1, 2 * h + 1)};
                        const uint4 fq = Q_REGS ? fq_reg[Q_REGS ? 2 * j + h : 0] : s_q[(2 * j + h) * 32 + lane];
                        mma16816<PYFA_DTYPE_F16>(sp[h][0], f, fq.x, fq.y);
                        mma16816<PYFA_DTYPE_F16>(sp[h][1], f, fq.z, fq.w);
                    }
                }
                /* sc: position g at heads 2c, 2c + 1, then position g + 8 */
                float sc[4];
#pragma unroll
                for (int e = 0; e < 4; e++) sc[e] = (sp[0][0][e] + sp[1][0][e]) + (sp[0][1][e] + sp[1][1][e]);
                const float k0 = tscale[warp * 16 + g] * inv_sqrt_d, k1 = tscale[warp * 16 + g + 8] * inv_sqrt_d;
                float *dst = s_score + (warp * 16 + g) * HEADS + 2 * c;
                *reinterpret_cast<float2 *>(dst) = make_float2(sc[0] * k0, sc[1] * k0);
                *reinterpret_cast<float2 *>(dst + 8 * HEADS) = make_float2(sc[2] * k1, sc[3] * k1);
            }
            if constexpr (S::PER_WARP) {
                __syncwarp(); /* this warp's scores are in s_score */
                /* B. Softmax over this warp's 16 positions, then its Oᵀ over every
                 * dim: Vᵀ of positions 16 warp + [0, 16) times Pᵀ. */
                float x[1][4];
                vec_mma::tile_scores<1, 1>(s_score + warp * 16 * HEADS, base + 16 * warp, end, SOFTCAP, p, x);
                const float2 alpha = vec_mma::softmax_step<1>(x, m, s);
                const float *vscale = tscale + TP + 16 * warp;
                /* Pᵀ fragments in hi + lo: k rows 2c, 2c + 1 (b0) and 2c + 8, 2c + 9
                 * (b1) of column g, the weights x[0][e] of positions 2c + (e & 1) + 8 (e >> 1). */
                float w[4];
#pragma unroll
                for (int e = 0; e < 4; e++) w[e] = x[0][e] * (vscale[2 * c + (e & 1) + (e >> 1) * 8] * inv_sqrt_d);
                uint32_t phi[2], plo[2];
                pyfa_split2<PYFA_DTYPE_F16>(w[0], w[1], phi[0], plo[0]);
                pyfa_split2<PYFA_DTYPE_F16>(w[2], w[3], phi[1], plo[1]);
                /* Oᵀ rows of m-block i: row g = coordinate 2 vbyte(i), row g + 8 the
                 * next, vbyte(i) = 4 (8 (i / 4) + g) + i % 4: the four m-blocks
                 * 4q..4q + 3 take the four bytes of word 8q + g of a row. */
                const char *vrows = tile + S::V_OFF + (16 * warp + 2 * c) * LDC + 4 * g;
                /* Once the running maxima settle, alpha is exactly 1 in every lane. */
                if (__any_sync(0xffffffffu, alpha.x != 1.0f || alpha.y != 1.0f)) {
#pragma unroll
                    for (int i = 0; i < S::KSTEPS; i++)
                        acc[i][0] *= alpha.x, acc[i][1] *= alpha.y, acc[i][2] *= alpha.x, acc[i][3] *= alpha.y;
                }
#pragma unroll
                for (int q4 = 0; q4 < S::KSTEPS / 4; q4++) {
                    /* positions 2c, 2c + 1, 2c + 8, 2c + 9 of the warp's 16 */
                    const uint32_t w0 = *reinterpret_cast<const uint32_t *>(vrows + 32 * q4);
                    const uint32_t w1 = *reinterpret_cast<const uint32_t *>(vrows + LDC + 32 * q4);
                    const uint32_t w8 = *reinterpret_cast<const uint32_t *>(vrows + 8 * LDC + 32 * q4);
                    const uint32_t w9 = *reinterpret_cast<const uint32_t *>(vrows + 9 * LDC + 32 * q4);
                    /* Byte u of m01[0] holds the codes of positions 2c and 2c + 1 at dim
                     * 2 vbyte (the low nibbles of byte u of w0 and w1), byte u of m01[1]
                     * those at the next dim: the table's pair of such a byte is the V
                     * fragment register itself, so the lookups feed the mma directly. */
                    const uint32_t m01[2] = {tq_mma::low_nibbles(w0, w1), tq_mma::high_nibbles(w0, w1)};
                    const uint32_t m89[2] = {tq_mma::low_nibbles(w8, w9), tq_mma::high_nibbles(w8, w9)};
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        const int i = 4 * q4 + u;
                        const uint32_t f[4] = {tq_mma::lookup(lane_tab, m01[0], u), tq_mma::lookup(lane_tab, m01[1], u),
                                               tq_mma::lookup(lane_tab, m89[0], u), tq_mma::lookup(lane_tab, m89[1], u)};
                        mma16816<PYFA_DTYPE_F16>(acc[i], f, phi[0], phi[1]);
                        mma16816<PYFA_DTYPE_F16>(acc[i], f, plo[0], plo[1]);
                    }
                }
            } else {
                __syncthreads();

                /* B. The tile's softmax for head g; the weights carry the rows' V scales. */
                float x[J][4];
                vec_mma::tile_scores<J, 1>(s_score, base, end, SOFTCAP, p, x);
                const float2 alpha = vec_mma::softmax_step<J>(x, m, s);
                const float a0 = alpha.x, a1 = alpha.y;
                uint32_t phi[J][2], plo[J][2];
                const float *vscale = tscale + TP;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    float w[4];
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        w[e] = x[j][e] * (vscale[16 * j + 2 * c + (e & 1) + (e >> 1) * 8] * inv_sqrt_d);
                    pyfa_split2<PYFA_DTYPE_F16>(w[0], w[1], phi[j][0], plo[j][0]);
                    pyfa_split2<PYFA_DTYPE_F16>(w[2], w[3], phi[j][1], plo[j][1]);
                }
                /* Oᵀ rows of m-block mb: row g = coordinate 16 mb + 2g, row g + 8 = 16 mb + 2g + 1,
                 * both in byte 8 mb + g of a row (word 2 mb + g / 4, byte g % 4). */
                const char *vt = tile + S::V_OFF;
#pragma unroll
                for (int i = 0; i < S::MB; i++) acc[i][0] *= a0, acc[i][1] *= a1, acc[i][2] *= a0, acc[i][3] *= a1;
                /* Per 16 positions: every m-block's fragments, then the two product
                 * terms each over all m-blocks, so consecutive mmas are independent. */
#pragma unroll
                for (int j = 0; j < J; j++) {
                    uint32_t f[S::MB][4];
#pragma unroll
                    for (int i = 0; i < S::MB; i++) {
                        const char *rp = vt + 4 * (2 * (warp + NW * i) + (g >> 2)) + (16 * j + 2 * c) * LDC;
                        const uint32_t w0 = *reinterpret_cast<const uint32_t *>(rp);
                        const uint32_t w1 = *reinterpret_cast<const uint32_t *>(rp + LDC);
                        const uint32_t w8 = *reinterpret_cast<const uint32_t *>(rp + 8 * LDC);
                        const uint32_t w9 = *reinterpret_cast<const uint32_t *>(rp + 9 * LDC);
                        f[i][0] = tq_mma::lookup(lane_tab, tq_mma::low_nibbles(w0, w1), g & 3);
                        f[i][1] = tq_mma::lookup(lane_tab, tq_mma::high_nibbles(w0, w1), g & 3);
                        f[i][2] = tq_mma::lookup(lane_tab, tq_mma::low_nibbles(w8, w9), g & 3);
                        f[i][3] = tq_mma::lookup(lane_tab, tq_mma::high_nibbles(w8, w9), g & 3);
                    }
#pragma unroll
                    for (int i = 0; i < S::MB; i++) mma16816<PYFA_DTYPE_F16>(acc[i], f[i], phi[j][0], phi[j][1]);
#pragma unroll
                    for (int i = 0; i < S::MB; i++) mma16816<PYFA_DTYPE_F16>(acc[i], f[i], plo[j][0], plo[j][1]);
                }
            }
        }

        /* The direct output is the rotated f32 row the undo reads (o_rot); so is a merged
         * one, which the merging workgroup then takes through the undo (the merge's scratch
         * in the drained ring: the table at the start of shared memory serves the next pass). */
        bool merged;
        if constexpr (S::PER_WARP) {
            /* Rows permuted: block i's fragment row g is dim 2 vbyte(i), g + 8 the next. */
            merged = vec_mma::finish_pass_per_warp<D, 1>(
                a, p, s_acc, s_ms, acc, [&](int i) { return 64 * (i >> 2) + 8 * g + 2 * (i & 3); }, m, s, gn,
                row0, iwg, DIRECT, PYFA_DTYPE_F32, LSE, s_acc);
        } else {
            /* Block i = m-block warp + NW i, rows permuted: g is dim 16 mb + 2g, g + 8 is the next. */
            merged = vec_mma::finish_pass<D, 1>(a, p, s_acc, s_ms, acc, [&](int i) { return (warp + NW * i) * 16 + 2 * g; },
                                                m, s, gn, row0, iwg, DIRECT, PYFA_DTYPE_F32, LSE, s_acc);
        }
        if (MERGE && merged) {
            tq_undo_merged_rows<D>(a, tp, gn, row0, OUT_DTYPE);
            __syncthreads();
        }
    }
}
