/*
 * flash_attn_prefill's f16 / bf16 path at D = 512 on Hopper warpgroup MMA
 * (sm_90a). Part of attn_prefill.cu, after attn_prefill_wgmma.cuh, whose
 * tile loaders and wgmma operand layout it shares; the CUDA plan picks it
 * through the tile (BQ 64, BK 64; the mma.sync path's D = 512 tile is BQ 64,
 * BK 32). Contract, features and numerics are prefill_mma's.
 *
 * A warpgroup's output accumulator holds 64 rows x N columns in N / 2
 * registers a thread, so one warpgroup cannot hold 512 columns, and the
 * mma.sync path's answer (two passes over the keys, each for half of the
 * columns) computes every score twice. Here the two warpgroups of a block
 * share the same 64 query rows and split the head dim instead: warpgroup w
 * owns output columns [256 w, 256 w + 256) and computes the half of every
 * dot product over those coordinates, S_w = Q[:, half w] K[:, half w]ᵀ. The
 * halves meet in shared memory (each warpgroup writes its S_w, reads the
 * other's and adds it: a + b = b + a in f32, so both hold the same S bit
 * for bit), both run the same online softmax, and each adds P V[:, half w]
 * into its own columns. Every score is computed once and P V's work is
 * split evenly; the price is the exchange (8 KiB a warpgroup per stage) and a
 * softmax run twice.
 *
 * Shared memory: Q [64][512] (64 KiB) leaves room for four 32 KiB stages, so
 * the 64-key tile (the unit of the causal / window bounds and of the blk
 * bytes) streams in stages of 32 keys: K and V rings of two stages each, V
 * one stage behind K, as in attn_prefill_wgmma.cuh (iteration i issues
 * S_i and P_{i-1} V_{i-1}, waits for S_i alone, and P V runs under the
 * softmax). Q is laid out as in that file (core matrices, GROUP = 16 D bytes
 * between 8-row groups; a half of the head dim starts 4 KiB into each group).
 * A K or V stage is in attn_prefill_wgmma.cuh's 128-byte swizzled layout
 * (blocks of 64 head-dim coordinates 128 KS bytes apart). In rectangular
 * mode, with the tensor maps the backend encodes (cuda_layout.h), one thread
 * copies each stage by TMA (a 32 KiB box of the 5-d view of k or v, rows
 * past kv_len read as zeros) and the block awaits it on the stage's
 * mbarrier: the load/store pipe, which the cp.async copies of the stages
 * kept ~80% busy (Nsight Compute, H200), no longer carries them.
 * Without the maps (packed modes, a driver without TMA encoding) every thread
 * copies its share with cp.async into the same layout.
 */
#pragma once

namespace prefill {
struct wgmma_split_shape {
    static constexpr int D = PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM, DH = D / 2; /* columns of a warpgroup */
    /* The tile and stages are the same in every KV mode at this head dim. */
    static constexpr int BQ = pyfa_cuda_prefill_wgmma_block_q(D, PYFA_PREFILL_KV_RECT);
    static constexpr int BK = pyfa_cuda_prefill_wgmma_block_k(D, PYFA_PREFILL_KV_RECT);
    static constexpr int KS = pyfa_cuda_prefill_wgmma_stage_keys(D, PYFA_PREFILL_KV_RECT); /* keys of a stage */
    static constexpr int BLOCK_THREADS = PYFA_CUDA_PREFILL_WGMMA_THREADS;
    static constexpr int KD = DH / 16;  /* k-steps of a half dot product */
    static constexpr int KP = KS / 16;  /* k-steps of P V */
    static constexpr int NT = KS / 8;   /* 8-column blocks of a stage's scores */
    static constexpr int ND = DH / 8;   /* 8-column blocks of a warpgroup's output */
    static constexpr int GROUP = 16 * D;
    static constexpr int HALF = DH / 8 * 128; /* Q: bytes from a row group's start to its second half */
    static constexpr int BLOCK = KS * 128;            /* K, V stages: bytes between 64-coordinate blocks */
    static_assert(pyfa_cuda_prefill_wgmma_swizzle_bytes(D) == 128, "128-byte swizzled stages");
    static constexpr int STAGE_HALF = DH / 64 * BLOCK; /* K, V stages: bytes to the second half */
    static constexpr int Q_BYTES = BQ * D * 2, KV_BYTES = KS * D * 2;
    static constexpr int EXCHANGE_BYTES = 2 * BQ * KS * 4;
    static_assert(PYFA_CUDA_PREFILL_WGMMA_KV_STAGES == 2, "two K stages and two V stages: indexed by parity");
    static_assert(BQ == 64 && BK == 2 * KS && BLOCK_THREADS == 2 * 128, "split path: two warpgroups, 64 rows");
    static_assert(Q_BYTES + 4 * KV_BYTES + EXCHANGE_BYTES == pyfa_cuda_prefill_wgmma_smem_bytes(D, PYFA_PREFILL_KV_RECT),
                  "the plan sizes this path with pyfa_cuda_prefill_wgmma_smem_bytes");
};

template <int DT, int KV_MODE>
__device__ PYFA_PREFILL_IMPL_INLINE void prefill_wgmma_split(const pyfa_cuda_args &a, const flags f) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using S = wgmma_split_shape;
    constexpr int D = S::D, BQ = S::BQ, BK = S::BK, KS = S::KS, BLOCK_THREADS = S::BLOCK_THREADS, KD = S::KD,
                  KP = S::KP, NT = S::NT, ND = S::ND, GROUP = S::GROUP;
    constexpr int P_TERMS = PYFA_PREFILL_P_TERMS;
    constexpr float SLACK = prefill_max_slack(D);
    static_assert(P_TERMS == 1 || P_TERMS == 2, "PYFA_PREFILL_P_TERMS: 1 or 2");
    const pyfa_flash_attn_prefill_params &p = pyfa_param<pyfa_flash_attn_prefill_params>(a, PYFA_PREFILL_ARG_PARAMS);
    const block_info<KV_MODE> bi(p, a, f, BQ, BK, 2);
    if constexpr (KV_MODE != PYFA_PREFILL_KV_RECT) {
        if (!bi.live()) return; /* uniform per block, before any barrier */
    }
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31,
              g = lane >> 2, t4 = lane & 3;

    extern __shared__ __align__(1024) uint4 smem_split[]; /* 128-byte swizzled stages: 1 KiB aligned */
    char *sq = reinterpret_cast<char *>(smem_split);
    auto sk = [&](int st) { return sq + S::Q_BYTES + st * S::KV_BYTES; };
    auto sv = [&](int st) { return sq + S::Q_BYTES + (2 + st) * S::KV_BYTES; };
    float4 *exchange = reinterpret_cast<float4 *>(sq + S::Q_BYTES + 4 * S::KV_BYTES); /* [wg][n][tid] */
    /* This warpgroup's coordinates: in every row group of Q, in a K or V stage. */
    const uint32_t q_half = wg * S::HALF, kv_half = wg * S::STAGE_HALF;
    /* K-major Q: core matrices 128 bytes apart along the head dim, row
     * groups GROUP apart; K and V: swizzled stages (attn_prefill_wgmma.cuh). */
    auto q_desc = [](uint32_t addr) { return pyfa_wgmma_desc(addr, 128, GROUP); };
    __shared__ uint64_t stage_bars[8];
    const tma_rings tma(a, KV_MODE == PYFA_PREFILL_KV_RECT, stage_bars, 0, BLOCK_THREADS / 32); /* thread 0 issues */

    const char *qbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_Q) + bi.row_offset(p.q_strides, bi.h) * 2;
    const char *kbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K) + bi.key_offset(p.k_strides) * 2;
    const char *vbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V) + bi.key_offset(p.v_strides) * 2;
    const int64_t qrow = p.q_strides[2] * 2, krow = p.k_strides[2] * 2, vrow = p.v_strides[2] * 2;
    const float scale_log2 = p.scale * PYFA_LOG2E;

    /* This lane's two query rows: the same in both warpgroups. */
    int row[2];
    int64_t pos[2];
    const char *mrow[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        row[r] = warp * 16 + g + 8 * r;
        pos[r] = bi.p_lo + row[r];
        mrow[r] = bi.mbase != nullptr && (uint32_t)row[r] < bi.nq
                      ? bi.mbase + (int64_t)row[r] * p.mask_strides[2] * (f.bool_mask ? 1 : 2)
                      : nullptr;
    }

    load_core_tile_strided<D, BQ, BLOCK_THREADS>(sq, qbase, qrow, bi.nq);

    /* Stages: stage j holds keys [j KS, j KS + KS), half j % 2 of key tile
     * j / 2. The stages of a live tile are visited in order, those past the
     * last key never (their copies would start past the keys). */
    const uint32_t keys = bi.keys(p);
    const uint32_t st_end = 2 * bi.t_end < (keys + KS - 1) / KS ? 2 * bi.t_end : (keys + KS - 1) / KS;
    auto next_stage = [&](uint32_t j) { return (j & 1) ? 2 * bi.next_tile((j >> 1) + 1) : j + 1; };

    /* Stage j of k or v into stage st of its ring (swizzled: attn_prefill_wgmma.cuh). */
    auto load_kv = [&](bool is_v, int st, char *dst, const char *base, int64_t rowb, int pool_slot, uint32_t j) {
        const uint32_t j0 = j * KS, n = keys - j0 < (uint32_t)KS ? keys - j0 : KS;
        load_kv_stage<D, KS, BLOCK_THREADS, KV_MODE, true>(tma, is_v, st, dst, a, p, bi, base, rowb, pool_slot, j0, n);
    };

    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    uint32_t kt = 2 * bi.next_tile(bi.t_begin); /* the stage of this iteration */
    if (kt > st_end) kt = st_end;
    uint32_t issued = kt; /* the next K stage to copy */
    auto issue = [&](int kst, int vst, uint32_t vt) {
        if (issued < st_end) {
            load_kv(false, kst, sk(kst), kbase, krow, PYFA_PREFILL_ARG_K, issued);
            issued = next_stage(issued);
        }
        if (vt < st_end) load_kv(true, vst, sv(vst), vbase, vrow, PYFA_PREFILL_ARG_V, vt);
        pyfa_cp_async_commit();
    };
    issue(0, 0, st_end); /* Q and the first K stage */

    uint32_t pa[KP][4], pl[KP][4];
    /* K_ki and V_vi (-1: none) have landed, and every thread is past the
     * products before and done with the exchange area's last use. */
    auto tiles_landed = [&](int ki, int vi) {
        pyfa_cp_async_wait<0>();
        pyfa_fence_proxy_async();
        tma.wait(ki, vi);
        __syncthreads();
    };
    auto zero_scores = [](float (&s)[NT][4]) {
#pragma unroll
        for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        pyfa_wgmma_pin(flat(s));
    };
    /* This warpgroup's half of S = Q Kᵀ for the K stage at k_addr. */
    auto issue_s = [&](float (&s)[NT][4], uint32_t k_addr) {
#pragma unroll
        for (int kk = 0; kk < KD; kk++)
            pyfa_wgmma_ss<DT>(flat(s), q_desc(smem_addr(sq) + q_half + 256 * kk),
                              swizzled_kmajor(k_addr + kv_half + (kk >> 2) * S::BLOCK + (kk & 3) * 32), kk > 0 ? 1u : 0u);
        pyfa_wgmma_commit();
    };
    /* O[:, half] += P V[:, half] for the V stage at v_addr. */
    auto issue_pv = [&](uint32_t v_addr) {
#pragma unroll
        for (int t = 0; t < KP; t++) {
            const uint64_t vd = swizzled_nmajor(v_addr + kv_half + 2048 * t, S::BLOCK); /* keys 16t ...: two 8-key groups */
            pyfa_wgmma_rs<DT>(flat(o), pa[t], vd, 1u);
            if constexpr (P_TERMS == 2) pyfa_wgmma_rs<DT>(flat(o), pl[t], vd, 1u);
        }
        pyfa_wgmma_commit();
    };
    /* The whole S from the two halves: publish this half, add the other's. */
    auto exchange_scores = [&](float (&s)[NT][4]) {
#pragma unroll
        for (int n = 0; n < NT; n++) exchange[(wg * NT + n) * 128 + tid] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const float4 x = exchange[((wg ^ 1) * NT + n) * 128 + tid];
            s[n][0] += x.x;
            s[n][1] += x.y;
            s[n][2] += x.z;
            s[n][3] += x.w;
        }
    };
    /* Scores of stage j: the rules of its key tile (and its blk byte), its keys. */
    auto finish_stage = [&](float (&s)[NT][4], uint32_t j) {
        finish_keys<DT, KV_MODE>(s, p, f, bi, bi.rules(p, f, j >> 1, BK), (int64_t)j * KS, scale_log2, mrow, pos, t4);
    };

    if (kt < st_end) {
        tiles_landed(0, -1);
        {
            float s[NT][4];
            zero_scores(s);
            pyfa_wgmma_fence();
            issue_s(s, smem_addr(sk(0)));
            issue(1, 0, kt); /* K_1, V_0 */
            pyfa_wgmma_wait<0>();
            pyfa_wgmma_pin(flat(s));
            exchange_scores(s);
            finish_stage(s, kt);
            float alpha[2]; /* o is still 0 */
            softmax_scores(s, m, l, alpha, SLACK);
#pragma unroll
            for (int t = 0; t < KP; t++) p_fragment<DT, P_TERMS>(s, t, pa[t], pl[t]);
        }
        kt = next_stage(kt);
        int i = 1;
#pragma unroll 1
        for (; kt < st_end; i++) {
            tiles_landed(i, i - 1); /* the stages of K_{i-1} and V_{i-2} are free */
            float s[NT][4];
            zero_scores(s);
            pin_operands<P_TERMS>(o, pa, pl);
            pyfa_wgmma_fence();
            issue_s(s, smem_addr(sk(i & 1)));
            issue_pv(smem_addr(sv((i - 1) & 1)));
            issue((i + 1) & 1, i & 1, kt);
            pyfa_wgmma_wait<1>(); /* S_i done; P V_{i-1} may still run */
            pyfa_wgmma_pin(flat(s));
            exchange_scores(s);
            finish_stage(s, kt);
            float alpha[2];
            softmax_scores(s, m, l, alpha, SLACK);
            pyfa_wgmma_wait<0>();
            pin_operands<P_TERMS>(o, pa, pl);
            rescale_after<(SLACK > 0.0f)>(o, alpha);
#pragma unroll
            for (int t = 0; t < KP; t++) p_fragment<DT, P_TERMS>(s, t, pa[t], pl[t]);
            kt = next_stage(kt);
        }
        tiles_landed(-1, i - 1); /* the last V */
        pin_operands<P_TERMS>(o, pa, pl);
        pyfa_wgmma_fence();
        issue_pv(smem_addr(sv((i - 1) & 1)));
        pyfa_wgmma_wait<0>();
        pin_operands<P_TERMS>(o, pa, pl);
    }
    pyfa_cp_async_wait<0>();

    /* Both warpgroups hold the same m and l; the first writes the LSE. */
    store_rows<DT>(a, p, f, bi, o, m, l, row, t4, (int64_t)wg * S::DH, wg == 0);
#else
    __trap(); /* the plan picks this tile on sm_90a only */
#endif
}
} // namespace prefill
