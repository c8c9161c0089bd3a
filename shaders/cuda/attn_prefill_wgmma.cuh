/*
 * flash_attn_prefill's f16 / bf16 path on Hopper warpgroup MMA (sm_90a,
 * D <= 256). Part of attn_prefill.cu, whose block_info and tile steps
 * (finish_tile, softmax_tile, p_fragment, store_rows) it shares with the
 * mma.sync path; the CUDA plan picks it through the tile:
 * BQ = pyfa_cuda_prefill_wgmma_block_q (128; 192 at D 64 beside the
 * producer) here, 64 for the mma.sync path.
 * Contract, features and numerics are prefill_mma's: masks and blk, causal,
 * window, softcap, LSE, f32 out, the packed modes, P in one or two 16-bit
 * terms (PYFA_PREFILL_P_TERMS).
 *
 * Block = 2 consumer warpgroups (3 at D 64 beside the producer) = 128
 * (192) query rows of one (head, sequence), 64 per warpgroup. Tiles the
 * threads copy sit in shared memory as core matrices (8 rows
 * of 16 bytes, 128 contiguous bytes) ordered [row / 8][col / 8][row % 8]
 * [col % 8], with no padding: the same layout is the K-major operand (Q as A,
 * K as B of S = Q Kᵀ) and the N-major operand (V as B of O += P V), and the
 * wgmma reads whole 128-byte core matrices, free of bank conflicts. The
 * tile copies (load_core_tile) read whole 32-byte sectors of global memory.
 * Tiles TMA may bring (K and V stages from D 64; Q beside the producer from
 * D 80, and at D 64 in causal calls and persistent blocks:
 * pyfa_cuda_prefill_wgmma_q_tma) sit in
 * the swizzled layout TMA writes (load_swizzled_stage where the threads copy
 * them instead), except Q in a body without the maps (MAPS 0), which keeps
 * core matrices.
 *
 * Per key tile: S = Q Kᵀ as KD products m64nBKk16 from shared memory, the
 * scores finished and the online softmax run in registers by the mma path's
 * steps (the wgmma accumulator layout is mma.sync's, repeated over columns),
 * then O += P V as BK/16 products m64nDk16 with P taken from the score
 * registers (their layout is the A fragment's). The P V of a tile is issued
 * with the next tile's S and runs on the tensor cores during that tile's
 * softmax, so the tensor cores do not idle through every softmax. K and V
 * stream through rings of two stages each, V one tile behind K: iteration i
 * reads K_i and V_{i-1} while K_{i+1} and V_i are copied into the stages of
 * K_{i-1} and V_{i-2}. With the threads' copies one barrier per iteration
 * publishes the tiles and frees those stages; with TMA each stage has a full
 * and a released mbarrier instead, and the warpgroups run apart, taking turns
 * to issue their products in a round (tiles_landed in prefill_wgmma). In
 * rectangular mode one more warpgroup, the producer, issues those TMA copies
 * and waits for the releases, with 24 registers a thread (32 beside three
 * consumers); the consumer warpgroups take 240 (160) (setmaxnreg;
 * cuda_layout.h).
 */
#pragma once
#include "pyfa_tma.cuh"
#include "pyfa_wgmma.cuh"

namespace prefill {
template <int D, int KV_MODE>
struct wgmma_shape {
    static constexpr int BQ = pyfa_cuda_prefill_wgmma_block_q(D, KV_MODE);
    static constexpr int CONSUMERS = pyfa_cuda_prefill_wgmma_consumers(D, KV_MODE); /* warpgroups of 64 rows */
    static constexpr int BLOCK_THREADS = 128 * CONSUMERS; /* the consumers' threads */
    static constexpr int BK = pyfa_cuda_prefill_wgmma_block_k(D, KV_MODE);
    static constexpr int KD = D / 16;  /* k-steps of Q Kᵀ */
    static constexpr int KP = BK / 16; /* k-steps of P V */
    static constexpr int NT = BK / 8;  /* 8-column blocks of a score tile */
    static constexpr int ND = D / 8;   /* 8-column blocks of the output */
    static constexpr int GROUP = 16 * D; /* bytes between 8-row groups of a tile */
    static constexpr int STAGES = PYFA_CUDA_PREFILL_WGMMA_KV_STAGES;
    static constexpr int Q_BYTES = BQ * D * 2, KV_BYTES = BK * D * 2;
    /* A TMA-able head dim; prefill_wgmma's SWIZZLED adds the KV mode. */
    static constexpr bool SWIZZLED = pyfa_cuda_prefill_wgmma_tma(D) != 0;
    static constexpr int SPAN = pyfa_cuda_prefill_wgmma_swizzle_bytes(D); /* the swizzle's bytes a key */
    static constexpr int BLOCK = BK * SPAN; /* swizzled stages: bytes between blocks of SPAN / 2 coordinates */
    static_assert(STAGES == 2, "two K stages and two V stages: the loop indexes them by tile parity");
    static_assert(Q_BYTES + 2 * STAGES * KV_BYTES == pyfa_cuda_prefill_wgmma_smem_bytes(D, KV_MODE),
                  "the plan sizes this path with pyfa_cuda_prefill_wgmma_smem_bytes");
    static_assert(D % 16 == 0 && D <= PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM, "wgmma path: D a multiple of 16, <= 256");
    static_assert((CONSUMERS == 2 || CONSUMERS == 3) && BQ == 64 * CONSUMERS, "wgmma path: 2 or 3 warpgroups of 64 rows");
};

/* A tile in the mma accumulator layout ([n][e], attn_prefill.cu) as the flat
 * register list of a wgmma accumulator (element 4n + e). */
template <int N>
__device__ __forceinline__ float (&flat(float (&x)[N][4]))[4 * N] {
    return reinterpret_cast<float (&)[4 * N]>(x);
}

/* Pins the operands of O += P V (the accumulators and P's fragments). */
template <int P_TERMS, int ND, int KP>
__device__ __forceinline__ void pin_operands(float (&o)[ND][4], uint32_t (&pa)[KP][4], uint32_t (&pl)[KP][4]) {
    pyfa_wgmma_pin(flat(o));
#pragma unroll
    for (int t = 0; t < KP; t++) {
        pyfa_wgmma_pin(pa[t]);
        if constexpr (P_TERMS == 2) pyfa_wgmma_pin(pl[t]);
    }
}

/* Copies rows [0, n) of a ROWS x C tile (16-bit elements; row r starts at
 * row_src(r)) into the core-matrix layout at dst, rows [n, ROWS) as zeros:
 * 16-byte chunk ch of row r goes to dst + ((r / 8) CH + ch) 128 + (r % 8) 16.
 * Copy i takes, in its 8-thread phase (the unit a 16-byte copy is served in),
 * two neighbouring chunks of four rows: four whole 32-byte sectors of global
 * memory (the two chunks of a row land 128 bytes apart in shared memory, a
 * 2-way bank conflict). The copies go through L1 (cp.async.ca): through the
 * L1 bypass (.cg) every sector was fetched from L2 twice (Nsight Compute: 50%
 * excessive sectors, L2 the busiest unit; H200, D 128, 16K: 255 -> 399 TF). */
/* Copy i of a tile with CH chunks a row: row r, chunk ch, and its byte
 * offset in the core-matrix layout. i = (row group, chunk pair, row half,
 * row in half, chunk in pair). */
template <int CH>
struct core_chunk {
    int r, ch, offset;
    __device__ __forceinline__ explicit core_chunk(int i) {
        const int rin = ((i >> 3) & 1) * 4 + ((i >> 1) & 3), pair = (i >> 4) % (CH / 2), rg = (i >> 4) / (CH / 2);
        r = rg * 8 + rin;
        ch = pair * 2 + (i & 1);
        offset = ((rg * CH + ch) * 8 + rin) * 16;
    }
};

template <int C, int ROWS, int BLOCK_THREADS, class RowSrc>
__device__ __forceinline__ void load_core_tile(char *dst, RowSrc row_src, const char *any, uint32_t n) {
    constexpr int CH = C / 8, CHUNKS = ROWS * CH;
    static_assert(CHUNKS % BLOCK_THREADS == 0, "every thread copies the same number of chunks");
    static_assert(CH % 2 == 0, "rows of whole 32-byte sectors");
#pragma unroll
    for (int k = 0; k < CHUNKS / BLOCK_THREADS; k++) {
        const core_chunk<CH> c((int)threadIdx.x + k * BLOCK_THREADS);
        const bool live = (uint32_t)c.r < n;
        pyfa_cp_async16_ca(dst + c.offset, live ? row_src(c.r) + c.ch * 16 : any, live ? 16u : 0u);
    }
}

/* load_core_tile for rows rowb bytes apart from row0. Where a thread's
 * copies k = 0, 1, ... take the same chunk of rows a fixed step apart (the
 * copies of a thread then differ by one 64-bit add), the addresses are
 * stepped instead of recomputed: ~15 instructions per copy become ~5. */
template <int C, int ROWS, int BLOCK_THREADS>
__device__ __forceinline__ void load_core_tile_strided(char *dst, const char *row0, int64_t rowb, uint32_t n) {
    constexpr int CH = C / 8, CHUNKS = ROWS * CH;
    if constexpr ((BLOCK_THREADS / 16) % (CH / 2) == 0) {
        static_assert(CHUNKS % BLOCK_THREADS == 0, "every thread copies the same number of chunks");
        constexpr int ROW_STEP = BLOCK_THREADS / CH;      /* rows between a thread's copies */
        constexpr int DST_STEP = ROW_STEP / 8 * CH * 128; /* their shared-memory distance */
        const core_chunk<CH> c((int)threadIdx.x);         /* copy k = 0 */
        const char *src = row0 + (int64_t)c.r * rowb + c.ch * 16;
        const int64_t step = (int64_t)ROW_STEP * rowb;
#pragma unroll
        for (int k = 0; k < CHUNKS / BLOCK_THREADS; k++) {
            const bool live = (uint32_t)(c.r + k * ROW_STEP) < n;
            pyfa_cp_async16_ca(dst + c.offset + k * DST_STEP, live ? src : row0, live ? 16u : 0u);
            src += step;
        }
    } else if constexpr ((CH / 2) % (BLOCK_THREADS / 16) == 0) {
        /* Rows wider than a block's copies (D = 512): copy k = kp + PAIRS kr
         * takes the chunk pair PAIR_STEP kp further along the row, in the
         * row group kr further down. */
        static_assert(CHUNKS % BLOCK_THREADS == 0, "every thread copies the same number of chunks");
        constexpr int PAIR_STEP = BLOCK_THREADS / 16, PAIRS = CH / 2 / PAIR_STEP;
        const core_chunk<CH> c((int)threadIdx.x);
        const char *src = row0 + (int64_t)c.r * rowb + c.ch * 16;
        const int64_t group_step = 8 * rowb;
#pragma unroll
        for (int kr = 0; kr < CHUNKS / BLOCK_THREADS / PAIRS; kr++) {
            const bool live = (uint32_t)(c.r + 8 * kr) < n;
#pragma unroll
            for (int kp = 0; kp < PAIRS; kp++)
                pyfa_cp_async16_ca(dst + c.offset + kr * CH * 128 + kp * PAIR_STEP * 256, live ? src + kp * PAIR_STEP * 32 : row0,
                                   live ? 16u : 0u);
            src += group_step;
        }
    } else {
        load_core_tile<C, ROWS, BLOCK_THREADS>(dst, [&](int r) { return row0 + (int64_t)r * rowb; }, row0, n);
    }
}

/* K and V stages in wgmma's swizzled layout of span SPAN (128, 64 or 32
 * bytes: pyfa_cuda_prefill_wgmma_swizzle_bytes): per block of SPAN / 2
 * coordinates, a key's SPAN bytes with its 16-byte chunk c at
 * c ^ ((key SPAN / 128) % (SPAN / 16)); blocks KEYS x SPAN bytes apart,
 * 8-key groups 8 SPAN apart. It is the layout a TMA box {SPAN / 2, KEYS,
 * 2 D / SPAN} with SPAN-byte swizzling writes; K reads it as the K-major B of
 * S (a k-step is 32 bytes along a key, the next block after SPAN / 32), V as
 * the N-major B of P V (column blocks KEYS x SPAN bytes apart, the leading
 * offset). The stage must be 1 KiB aligned. */
template <int SPAN>
constexpr uint64_t wgmma_swizzle() { /* the descriptor's layout type, bits 62-63 */
    static_assert(SPAN == 128 || SPAN == 64 || SPAN == 32, "a swizzle of 128, 64 or 32 bytes");
    return (uint64_t)(SPAN == 128 ? 1 : SPAN == 64 ? 2 : 3) << 62;
}
template <int SPAN = 128>
__device__ __forceinline__ uint64_t swizzled_kmajor(uint32_t addr) {
    return pyfa_wgmma_desc(addr, 16, 8 * SPAN) | wgmma_swizzle<SPAN>();
}
template <int SPAN = 128>
__device__ __forceinline__ uint64_t swizzled_nmajor(uint32_t addr, uint32_t block_bytes) {
    return pyfa_wgmma_desc(addr, block_bytes, 8 * SPAN) | wgmma_swizzle<SPAN>();
}
/* Byte offset of K-major k-step kk (16 coordinates) in a swizzled stage of BLOCK-byte blocks. */
template <int SPAN, int BLOCK>
__device__ __forceinline__ constexpr uint32_t swizzled_kstep(int kk) {
    return (uint32_t)(kk * 32 / SPAN) * BLOCK + (uint32_t)(kk * 32 % SPAN);
}

/* Rows [0, n) of a KEYS-row stage into the swizzled layout by every thread's
 * cp.async copies (row r from row_src(r)), rows [n, KEYS) as zeros: the
 * stages TMA does not bring (packed modes, no tensor map). */
template <int D, int KEYS, int BLOCK_THREADS, int SPAN, class RowSrc>
__device__ __forceinline__ void load_swizzled_stage(char *dst, RowSrc row_src, const char *any, uint32_t n) {
    constexpr int CH = D / 8, CHUNKS = KEYS * CH, CB = SPAN / 16; /* chunks a row, a block's row */
    /* Rounds of one copy a thread; the last may leave threads out (three
     * consumer warpgroups' 384 threads over a 128-key stage at D 64, the
     * stages TMA did not bring). */
    constexpr int ROUNDS = (CHUNKS + BLOCK_THREADS - 1) / BLOCK_THREADS;
#pragma unroll
    for (int k = 0; k < ROUNDS; k++) {
        if (CHUNKS % BLOCK_THREADS != 0 && (int)threadIdx.x + k * BLOCK_THREADS >= CHUNKS) break;
        const core_chunk<CH> c((int)threadIdx.x + k * BLOCK_THREADS);
        const bool live = (uint32_t)c.r < n;
        /* One offset in two forms: each is the form whose kernels were measured
         * and tested on the H200 (ptxas allocates the whole kernel's registers
         * differently for the two). */
        int at;
        if constexpr (SPAN == 128)
            at = (c.ch >> 3) * (KEYS * 128) + c.r * 128 + (((c.ch & 7) ^ (c.r & 7)) << 4);
        else
            at = (c.ch / CB) * (KEYS * SPAN) + c.r * SPAN + (((c.ch % CB) ^ ((c.r * SPAN >> 7) % CB)) << 4);
        pyfa_cp_async16_ca(dst + at, live ? row_src(c.r) + c.ch * 16 : any, live ? 16u : 0u);
    }
}

/* Whether the launch carries both stage maps (the K and V tensor maps). */
__device__ __forceinline__ bool tma_maps_present(const pyfa_cuda_args &a) {
    return a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_K] != 0 && a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_V] != 0;
}

/* The K and V rings' arrival by TMA: the tensor maps the backend put in the
 * launch's inline bytes (rectangular mode), one mbarrier per stage (K stages
 * 0, 1, V stages 0, 1). The i-th K (V) tile of a block goes to stage i % 2 as
 * that stage's (i / 2)-th copy, so its wait parity is (i / 2) % 2. */
struct tma_rings {
    const void *k_map, *v_map;
    uint64_t *bar; /* [0, 4): K0, K1, V0, V1 landed; [4, 8): the same stages released */
    bool on;       /* uniform: both maps present (and allowed) */
    int issuer;    /* the thread that issues the copies */
    /* Arrivals that release a stage (releases): lane 0 of every warp of the
     * block's consumer warpgroups, 8 for two of them. */
    /* maps: 1 only where the caller found both maps present (tma_maps_present),
     * so that `on` is a constant to the compiler; -1 where this reads them. */
    __device__ __forceinline__ tma_rings(const pyfa_cuda_args &a, bool allowed, uint64_t *bars, int issuer_thread = 0,
                                         uint32_t releases = 8, int maps = -1)
        : bar(bars), issuer(issuer_thread) {
        on = allowed && (maps == 1 || tma_maps_present(a));
        k_map = a.inline_bytes + (a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_K] & ~PYFA_CUDA_INLINE_TAG); /* read only when on */
        v_map = a.inline_bytes + (a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_V] & ~PYFA_CUDA_INLINE_TAG);
        if (on) {
            if (threadIdx.x == 0) {
                for (int i = 0; i < 4; i++) pyfa_mbar_init(&bar[i], 1);
                for (int i = 4; i < 8; i++) pyfa_mbar_init(&bar[i], releases);
                pyfa_mbar_init_fence();
            }
            __syncthreads();
        }
    }
    /* The issuer: the box of keys [j0, j0 + rows) of KV head kvh, sequence b, into K (v = false) or V stage st.
     * seq >= 2 (the seq-th K or V tile, st = seq % 2): first waits until the tile seq - 2 that the stage
     * held has been released (release); seq < 0: the caller ordered the stage's reuse itself. */
    __device__ __forceinline__ void load(bool v, int st, char *dst, uint32_t bytes, uint32_t j0, uint32_t kvh,
                                         uint32_t b, int seq = -1) const {
        if ((int)threadIdx.x == issuer) {
            if (seq >= 2) pyfa_mbar_wait(&bar[4 + (v ? 2 : 0) + st], ((seq >> 1) - 1) & 1);
            uint64_t *stage_bar = &bar[(v ? 2 : 0) + st];
            pyfa_mbar_expect_tx(stage_bar, bytes);
            pyfa_tma_load_5d(dst, v ? v_map : k_map, stage_bar, 0, (int)j0, 0, (int)kvh, (int)b);
        }
    }
    /* Until K_ki and V_vi (-1: none) have landed. */
    __device__ __forceinline__ void wait(int ki, int vi) const {
        if (!on) return;
        if (ki >= 0) pyfa_mbar_wait(&bar[ki & 1], (ki >> 1) & 1);
        if (vi >= 0) pyfa_mbar_wait(&bar[2 + (vi & 1)], (vi >> 1) & 1);
    }
    /* This warp is done with the seq-th K (v = false) or V tile (its products waited for). */
    __device__ __forceinline__ void release(bool v, int seq) const {
        if (on && (threadIdx.x & 31) == 0) pyfa_mbar_arrive(&bar[4 + (v ? 2 : 0) + (seq & 1)]);
    }
};

/* Keys [j0, j0 + n) of k or v (rows rowb bytes apart from base; pool rows
 * through the block table when paged) into a KEYS-key stage, zeros past n:
 * by TMA into stage st of its ring when the rings are on, else by every
 * thread's cp.async copies, into the swizzled layout or core matrices. */
template <int D, int KEYS, int BLOCK_THREADS, int KV_MODE, bool SWIZZLED, class BlockInfo>
__device__ __forceinline__ void load_kv_stage(const tma_rings &tma, bool is_v, int st, char *dst, const pyfa_cuda_args &a,
                                              const pyfa_flash_attn_prefill_params &p, const BlockInfo &bi,
                                              const char *base, int64_t rowb, int pool_slot, uint32_t j0, uint32_t n,
                                              int seq = -1) {
    if (tma.on) {
        tma.load(is_v, st, dst, KEYS * D * 2, j0, bi.kvh, bi.b, seq);
    } else if constexpr (KV_MODE == PYFA_PREFILL_KV_PAGED) {
        const pyfa_kv_pages &pg = pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES);
        const char *pool = pyfa_ptr<const char>(a, pool_slot);
        const uint32_t shift = __ffs(pg.page_size) - 1, tmask = pg.page_size - 1;
        auto row_src = [&](int r) {
            return pool + (int64_t)paged_row(pg, bi.bt, p.num_kv_heads, bi.kvh, shift, tmask, j0 + r) * (D * 2);
        };
        if constexpr (SWIZZLED)
            load_swizzled_stage<D, KEYS, BLOCK_THREADS, pyfa_cuda_prefill_wgmma_swizzle_bytes(D)>(dst, row_src, pool, n);
        else
            load_core_tile<D, KEYS, BLOCK_THREADS>(dst, row_src, pool, n);
    } else if constexpr (SWIZZLED) {
        const char *row0 = base + (int64_t)j0 * rowb;
        load_swizzled_stage<D, KEYS, BLOCK_THREADS, pyfa_cuda_prefill_wgmma_swizzle_bytes(D)>(
            dst, [&](int r) { return row0 + (int64_t)r * rowb; }, row0, n);
    } else {
        load_core_tile_strided<D, KEYS, BLOCK_THREADS>(dst, base + (int64_t)j0 * rowb, rowb, n);
    }
}

/* The end of a key-split block's part (flash_attn_prefill_params.h,
 * pyfa_prefill_split): leaves this thread's o, row maxima and partial sums in
 * the part's state, takes the block's ticket, and in the last part to finish
 * merges every part's state into o, m and l (then stored as a whole block's)
 * and takes the tickets back. A state is (ND + 1) x THREADS float4s, n-major
 * so that a warp's stores and loads are whole lines: thread t's o[n] at
 * n THREADS + t, its (m0, m1, l0, l1) at ND THREADS + t. sync: the consumer
 * threads' barrier (the producer warpgroup has left). Returns whether this
 * part merged (alike in every thread). */
template <int ND, int THREADS, class Sync>
__device__ __forceinline__ bool merge_split_parts(const pyfa_cuda_args &a, const pyfa_prefill_split &sp, int part,
                                                  uint32_t split_index, float (&o)[ND][4], float (&m)[2],
                                                  float (&l)[2], Sync sync) {
    constexpr uint32_t STATE = (ND + 1) * THREADS; /* float4s: pyfa_cuda_prefill_split_state_floats / 4 */
    float4 *states = pyfa_ptr<float4>(a, PYFA_PREFILL_ARG_SPLIT_STATES) + (size_t)split_index * sp.parts * STATE;
    const uint32_t t = threadIdx.x;
    float4 *mine = states + (size_t)part * STATE + t;
#pragma unroll
    for (int n = 0; n < ND; n++) __stcg(mine + n * THREADS, make_float4(o[n][0], o[n][1], o[n][2], o[n][3]));
    __stcg(mine + ND * THREADS, make_float4(m[0], m[1], l[0], l[1]));
    __threadfence(); /* the state, visible to the device before the ticket */
    sync();
    __shared__ uint32_t s_last;
    if (t == 0) {
        uint32_t *ticket = pyfa_ptr<uint32_t>(a, PYFA_PREFILL_ARG_SPLIT_TICKETS) + split_index;
        s_last = atomicAdd(ticket, 1u) == sp.parts - 1;
        if (s_last) atomicSub(ticket, sp.parts); /* back to zero for the next dispatch */
    }
    sync();
    if (!s_last) return false; /* uniform */
    __threadfence(); /* the other parts' states, seen after their tickets */
    /* Row maxima over the parts; a part that saw no key has -inf and weighs 0. The sums run over
     * the parts in their order, whichever part merges (this one's from its registers), so a
     * call's bits do not depend on which part finished last. */
    float mx[2] = {m[0], m[1]};
    for (uint32_t q = 0; q < sp.parts; q++) {
        if ((int)q == part) continue;
        const float4 ml = __ldcg(states + (size_t)q * STATE + ND * THREADS + t);
        mx[0] = fmaxf(mx[0], ml.x);
        mx[1] = fmaxf(mx[1], ml.y);
    }
    auto weight = [&](float mq, int r) { return mq == -INFINITY ? 0.0f : exp2f(mq - mx[r]); };
    float acc[ND][4], lsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < ND; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (uint32_t q = 0; q < sp.parts; q++) {
        const bool own = (int)q == part;
        const float4 *state = states + (size_t)q * STATE + t;
        const float4 ml = own ? make_float4(m[0], m[1], l[0], l[1]) : __ldcg(state + ND * THREADS);
        const float u0 = weight(ml.x, 0), u1 = weight(ml.y, 1);
        lsum[0] = fmaf(ml.z, u0, lsum[0]);
        lsum[1] = fmaf(ml.w, u1, lsum[1]);
#pragma unroll
        for (int n = 0; n < ND; n++) {
            const float4 x = own ? make_float4(o[n][0], o[n][1], o[n][2], o[n][3]) : __ldcg(state + n * THREADS);
            acc[n][0] = fmaf(x.x, u0, acc[n][0]);
            acc[n][1] = fmaf(x.y, u0, acc[n][1]);
            acc[n][2] = fmaf(x.z, u1, acc[n][2]);
            acc[n][3] = fmaf(x.w, u1, acc[n][3]);
        }
    }
#pragma unroll
    for (int n = 0; n < ND; n++) {
        o[n][0] = acc[n][0];
        o[n][1] = acc[n][1];
        o[n][2] = acc[n][2];
        o[n][3] = acc[n][3];
    }
    l[0] = lsum[0];
    l[1] = lsum[1];
    m[0] = mx[0];
    m[1] = mx[1];
    return true;
}

/* The output of warpgroup wg's 64 rows (o, m, l as store_rows takes them)
 * through shared memory: its Q rows (free once its last S has completed and
 * every thread's copies of Q have landed: the caller orders both) take o
 * normalised and rounded, 16-byte chunk c of local row r at chunk c ^ (r % 8)
 * (a warp's fragment writes then hit 32 distinct banks), and the warpgroup
 * writes each row in 16-byte stores, a warp's instruction two or more whole
 * rows. store_rows writes the fragments themselves: four times the store
 * instructions, each touching 8 rows. For 16-bit outputs whose base and row stride are 16-byte aligned
 * and D a multiple of 64 (the XOR stays within a row's chunks); returns
 * false, storing nothing, elsewhere. bar: a named barrier id of this
 * warpgroup's own. */
template <int DT, int D, int BQ, bool Q_SWIZZLED, class BlockInfo>
__device__ __forceinline__ bool store_rows_staged(const pyfa_cuda_args &a, const pyfa_flash_attn_prefill_params &p,
                                                  const flags &f, const BlockInfo &bi, char *sq, int wg, uint32_t bar,
                                                  const float (&o)[D / 8][4], const float (&m)[2], const float (&l)[2],
                                                  const int (&row)[2], int t4) {
    constexpr int ND = D / 8, ROW_BYTES = D * 2;
    static_assert(ND % 8 == 0, "chunks XOR row % 8 within a row");
    static_assert(!Q_SWIZZLED || pyfa_cuda_prefill_wgmma_swizzle_bytes(D) == 128, "Q in 128-byte spans");
    /* Chunk c of local row lr: in Q's swizzled layout (128-byte spans, as
     * D % 64 == 0 gives: [c / 8][row][c % 8 ^ row % 8]) or, with Q in core
     * matrices, in the warpgroup's contiguous 64 rows. */
    char *stage = sq + (Q_SWIZZLED ? wg * 64 * 128 : wg * 64 * ROW_BYTES);
    auto chunk = [&](int lr, int c) {
        return Q_SWIZZLED ? stage + (c >> 3) * (BQ * 128) + lr * 128 + (((c & 7) ^ (lr & 7)) * 16)
                          : stage + lr * ROW_BYTES + ((c ^ (lr & 7)) * 16);
    };
    char *obase = pyfa_ptr<char>(a, PYFA_PREFILL_ARG_OUT) + bi.row_offset(p.out_strides, bi.h) * 2;
    const int64_t orow = p.out_strides[2] * 2;
    if (f.out_f32 || ((reinterpret_cast<size_t>(obase) | (size_t)orow) & 15) != 0) return false; /* uniform */
    pyfa_bar_sync(bar, 128); /* every warp's last S (the Q rows' last reader) has completed */
    const uint32_t tt = threadIdx.x & 127;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float total = row_sum(l[r]);
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        const int lr = row[r] - 64 * wg; /* lr % 8 = g */
#pragma unroll
        for (int n = 0; n < ND; n++)
            *reinterpret_cast<uint32_t *>(chunk(lr, n) + 4 * t4) = pyfa_pack2<DT>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (f.has_lse && t4 == 0 && (uint32_t)row[r] < bi.nq) store_lse(a, p, bi, row[r], m[r], total);
    }
    pyfa_bar_sync(bar, 128);
#pragma unroll
    for (int k = 0; k < 64 * ND / 128; k++) {
        const int idx = k * 128 + (int)tt, lr = idx / ND, c = idx % ND;
        if ((uint32_t)(64 * wg + lr) >= bi.nq) continue;
        const uint4 x = *reinterpret_cast<const uint4 *>(chunk(lr, c));
        *reinterpret_cast<uint4 *>(obase + (int64_t)(64 * wg + lr) * orow + c * 16) = x;
    }
    return true;
}

/* The block of a launch's rank: a grid launch's own block (its split part
 * where the dispatch bound a split), a persistent launch's rank `rank` of the
 * 3-d grid (pyfa_prefill_persist). */
template <bool PERSIST, int KV_MODE>
__device__ __forceinline__ block_info<KV_MODE> launch_block(const pyfa_flash_attn_prefill_params &p,
                                                          const pyfa_cuda_args &a, const flags &f, uint32_t BQ,
                                                          uint32_t BK, const pyfa_prefill_split *split, uint32_t rank) {
    if constexpr (PERSIST)
        return block_info<KV_MODE>(p, a, f, BQ, BK, 2, tile_slot(p, rank), nullptr);
    else
        return block_info<KV_MODE>(p, a, f, BQ, BK, 2, split);
}

/* MAPS: 1 where the caller checked tma_maps_present, 0 where it found a map
 * missing, -1 where the kernel reads them as it starts (every body in one).
 * CAUSAL: the entry's constant (pyfa_cuda_prefill_wgmma_q_tma reads it).
 * PERSIST: a persistent launch (flash_attn_prefill_persistent: the kernels
 * pyfa_cuda_prefill_persists names). Each block takes one rank of the grid's
 * `ranks` a round (rank_of), in turn. The K and V rings' sequence numbers run
 * on across ranks, so the producer copies the next rank's stages while the
 * consumers finish this one. Q has two buffers (the second after the V
 * stages): once the producer has issued a rank's last K and V copies, it
 * copies the next rank's query tile into the other buffer, which the rank
 * before has released by then or releases when its output is stored. A
 * block's start and end then overlap its neighbours' work instead of leaving
 * the tensor cores idle once a rank. */
template <int DT, int D, int KV_MODE, int CAUSAL, int MAPS = -1, bool PERSIST = false>
__device__ PYFA_PREFILL_IMPL_INLINE void prefill_wgmma(const pyfa_cuda_args &a, const flags f) {
    static_assert(MAPS == -1 || KV_MODE == PYFA_PREFILL_KV_RECT, "stage maps exist in rectangular mode only");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using S = wgmma_shape<D, KV_MODE>;
    /* K and V stages swizzled: in rectangular mode wherever TMA may bring them,
     * in the packed modes (every thread's cp.async copies) from D = 128; D 80
     * and 96 keep core matrices there, whose copies step their addresses
     * (load_core_tile_strided) where the swizzled copies recompute each. */
    constexpr bool SWIZZLED = S::SWIZZLED && (KV_MODE == PYFA_PREFILL_KV_RECT || D >= 128);
    constexpr int BQ = S::BQ, BK = S::BK, BLOCK_THREADS = S::BLOCK_THREADS, KD = S::KD, KP = S::KP, NT = S::NT,
                  ND = S::ND, CONSUMERS = S::CONSUMERS;
    constexpr int GROUP = S::GROUP;
    /* A producer warpgroup (warpgroup CONSUMERS) issues the TMA copies: cuda_layout.h. */
    constexpr bool PRODUCER = pyfa_cuda_prefill_wgmma_producer(D, KV_MODE) != 0;
    static_assert(PYFA_PREFILL_KV_RECT == 0, "pyfa_cuda_prefill_wgmma_producer names the rectangular mode 0");
    static_assert(!PRODUCER || SWIZZLED, "the producer's copies are TMA's, into swizzled stages");
    static_assert(!PERSIST || (pyfa_cuda_prefill_persists(D, KV_MODE) && MAPS != -1),
                  "persistent blocks: the kernels pyfa_cuda_prefill_persists names, a body with all maps or none");
    constexpr int P_TERMS = PYFA_PREFILL_P_TERMS;
    constexpr float SLACK = prefill_max_slack(D);
    static_assert(P_TERMS == 1 || P_TERMS == 2, "PYFA_PREFILL_P_TERMS: 1 or 2");
    const pyfa_flash_attn_prefill_params &p = pyfa_param<pyfa_flash_attn_prefill_params>(a, PYFA_PREFILL_ARG_PARAMS);
    /* A key split (pyfa_prefill_split) where the dispatch bound one, in the kernels that take it
     * (cuda_layout.h, pyfa_cuda_prefill_splits); elsewhere none, and no code for one. A
     * persistent launch has none. */
    constexpr bool SPLITS = pyfa_cuda_prefill_splits(D, KV_MODE) != 0 && !PERSIST;
    static_assert(!SPLITS || PRODUCER, "a split part's merge waits on the consumers' barrier");
    const pyfa_prefill_split *split =
        SPLITS && a.arg[PYFA_PREFILL_ARG_SPLIT] != 0 ? &pyfa_param<pyfa_prefill_split>(a, PYFA_PREFILL_ARG_SPLIT) : nullptr;
    static_assert(!SPLITS || pyfa_cuda_prefill_split_state_floats(D, KV_MODE) == 4 * (ND + 1) * BLOCK_THREADS,
                  "merge_split_parts: a part's state as the plan sizes it");
    /* The launch's ranks (a grid launch's block is one), and the persistent
     * block's r-th: rank G r + x in even rounds r, G r + G - 1 - x in odd
     * ones (G blocks, x this one), so that under causal masking, whose ranks
     * run from the longest query tiles to the shortest, every block's share
     * of the work is about the same. */
    const uint32_t ranks = PERSIST ? pyfa_param<pyfa_prefill_persist>(a, PYFA_PREFILL_ARG_PERSIST).ranks : 1;
    auto rank_of = [](uint32_t r) { return r * gridDim.x + ((r & 1) != 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x); };
    block_info<KV_MODE> bi = launch_block<PERSIST, KV_MODE>(p, a, f, BQ, BK, split, blockIdx.x);
    if constexpr (KV_MODE != PYFA_PREFILL_KV_RECT) {
        if (!bi.live()) return; /* uniform per block, before any barrier */
    }
    if constexpr (PERSIST) {
        if (blockIdx.x >= ranks) return; /* uniform per block, before any barrier */
    }
    /* The warpgroup through a shuffle, which the compiler knows to be uniform
     * across the warp: the descriptors built from it then live in uniform
     * registers (threadIdx.x >> 7 put each in vector registers, moved over
     * per product). */
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0), warp = (threadIdx.x >> 5) & 3,
              lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;

    extern __shared__ __align__(1024) uint4 smem_wgmma[]; /* swizzled stages: 1 KiB aligned */
    char *sq = reinterpret_cast<char *>(smem_wgmma);
    /* Two K stages, then two V stages. */
    auto sk = [&](int st) { return sq + S::Q_BYTES + st * S::KV_BYTES; };
    auto sv = [&](int st) { return sq + S::Q_BYTES + (2 + st) * S::KV_BYTES; };
    /* The query tile of the block's r-th rank: a persistent block's odd ranks
     * take the second buffer, after the V stages
     * (pyfa_cuda_prefill_persistent_smem_bytes). */
    constexpr uint32_t Q1 = S::Q_BYTES + 2 * S::STAGES * S::KV_BYTES;
    auto q_buffer = [&](uint32_t r) { return PERSIST && (r & 1) != 0 ? sq + Q1 : sq; };
    /* Descriptor bases: this warpgroup's 64 Q rows (8 row groups on), K, V.
     * K-major (Q, K): core matrices 128 bytes apart along K, row groups GROUP
     * apart; N-major (V): 8-key groups GROUP apart along K, core matrices 128
     * bytes apart along N. */
    auto kmajor = [](uint32_t addr) { return pyfa_wgmma_desc(addr, 128, GROUP); };
    auto nmajor = [](uint32_t addr) { return pyfa_wgmma_desc(addr, GROUP, 128); };
    /* The descriptors of this warpgroup's Q rows, K stage 0 and V stage 0,
     * built once; a product's is one of them advanced (pyfa_wgmma_desc_add)
     * by its stage (KV_BYTES apart) and its k-step. */
    /* Q_TMA (pyfa_cuda_prefill_wgmma_q_tma, in the bodies for launches with the
     * stage maps): Q in the K stages' swizzled layout ([D / (SPAN / 2) blocks][BQ
     * rows][SPAN bytes]; its descriptor and k-steps K's, blocks BQ SPAN bytes
     * apart), brought by one TMA copy where the backend encoded q's tensor map
     * (PYFA_CUDA_PREFILL_ARG_TMAP_Q), else by the consumers' copies. Elsewhere
     * core matrices by the consumers' copies. */
    constexpr bool Q_TMA = pyfa_cuda_prefill_wgmma_q_tma(D, KV_MODE, CAUSAL, PERSIST) != 0 && MAPS != 0;
    const uint64_t q_desc0 = Q_TMA ? swizzled_kmajor<S::SPAN>(smem_addr(sq) + wg * 64 * S::SPAN)
                                   : kmajor(smem_addr(sq) + wg * 8 * GROUP);
    uint64_t k_desc, v_desc;
    if constexpr (SWIZZLED) {
        k_desc = swizzled_kmajor<S::SPAN>(smem_addr(sk(0)));
        v_desc = swizzled_nmajor<S::SPAN>(smem_addr(sv(0)), S::BLOCK);
    } else {
        k_desc = kmajor(smem_addr(sk(0)));
        v_desc = nmajor(smem_addr(sv(0)));
    }

    /* The rank's rows of q, K and V (set again at each rank of a persistent block). */
    const char *qbase, *kbase, *vbase;
    auto set_bases = [&]() {
        qbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_Q) + bi.row_offset(p.q_strides, bi.h) * 2;
        kbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K) + bi.key_offset(p.k_strides) * 2;
        vbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V) + bi.key_offset(p.v_strides) * 2;
    };
    set_bases();
    const int64_t qrow = p.q_strides[2] * 2, krow = p.k_strides[2] * 2, vrow = p.v_strides[2] * 2;
    const float scale_log2 = p.scale * PYFA_LOG2E;

    /* This lane's two query rows (local index, absolute position, mask row). */
    int row[2];
    int64_t pos[2];
    const char *mrow[2];
    auto set_rows = [&]() {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            row[r] = wg * 64 + warp * 16 + g + 8 * r;
            pos[r] = bi.p_lo + row[r];
            mrow[r] = bi.mbase != nullptr && (uint32_t)row[r] < bi.nq
                          ? bi.mbase + (int64_t)row[r] * p.mask_strides[2] * (f.bool_mask ? 1 : 2)
                          : nullptr;
        }
    };
    set_rows();

    __shared__ uint64_t stage_bars[8];
    /* Q's arrival by TMA (one phase a block; in a persistent block one phase a
     * rank of each of the two buffers, and their release by every consumer
     * warp), initialised beside the rings' barriers: their constructor's fence
     * and block barrier publish them. */
    __shared__ uint64_t q_bar, q_bars[3]; /* q_bars: a persistent block's second buffer's, the releases */
    auto q_full = [&](uint32_t r) { return PERSIST && (r & 1) != 0 ? &q_bars[0] : &q_bar; };
    auto q_free = [&](uint32_t r) { return &q_bars[1 + (r & 1)]; };
    /* The wait parity of rank r's Q: its buffer's (r / 2)-th phase. */
    auto q_parity = [](uint32_t r) { return PERSIST ? (r >> 1) & 1 : 0u; };
    /* Read from the arguments where used (uniform), not kept live through the
     * loop; a persistent body with the maps has q's (its entry checked). */
    auto q_tma = [&]() {
        return Q_TMA && ((PERSIST && MAPS == 1) ||
                         (a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_Q] != 0 && (MAPS == 1 || tma_maps_present(a))));
    };
    if (q_tma() && threadIdx.x == 0) {
        pyfa_mbar_init(q_full(0), 1);
        if constexpr (PERSIST) {
            pyfa_mbar_init(q_full(1), 1);
            pyfa_mbar_init(q_free(0), BLOCK_THREADS / 32);
            pyfa_mbar_init(q_free(1), BLOCK_THREADS / 32);
        }
    }
    /* The producer's first thread issues the copies (every kernel here whose
     * stages TMA may bring has the producer); every consumer warp releases
     * each stage. */
    const tma_rings tma(a, SWIZZLED && KV_MODE == PYFA_PREFILL_KV_RECT && MAPS != 0, stage_bars,
                        PRODUCER ? BLOCK_THREADS : 0, BLOCK_THREADS / 32, MAPS);

    /* K or V rows of key tile t, the seq-th K or V tile of the block, into stage seq % 2 of dst's ring. */
    auto load_kv = [&](bool is_v, int seq, char *dst, const char *base, int64_t rowb, int pool_slot, uint32_t t) {
        const uint32_t j0 = t * BK, n = bi.keys(p) - j0 < (uint32_t)BK ? bi.keys(p) - j0 : BK;
        load_kv_stage<D, BK, BLOCK_THREADS, KV_MODE, SWIZZLED>(tma, is_v, seq & 1, dst, a, p, bi, base, rowb,
                                                                   pool_slot, j0, n, seq);
    };
    /* Rank r's query tile by one TMA copy: the box {SPAN / 2, BQ, 2 D / SPAN}
     * at row i0 of head h, sequence b; rows past q_len as zeros. */
    auto load_q = [&](uint32_t r) {
        pyfa_mbar_expect_tx(q_full(r), S::Q_BYTES);
        const void *q_map = a.inline_bytes + (a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_Q] & ~PYFA_CUDA_INLINE_TAG);
        pyfa_tma_load_5d(q_buffer(r), q_map, q_full(r), 0, (int)bi.i0, 0, (int)bi.h, (int)bi.b);
    };

    if constexpr (PRODUCER) {
        if (wg == CONSUMERS) {
            /* The producer: K of every live tile in order, each followed by
             * the V of the tile before it (the consumers' order: iteration i
             * reads K_i and V_{i-1}); a stage's copy waits for the consumers'
             * release of the tile it held. Without TMA (a map the backend
             * could not build) the consumers copy their stages themselves.
             * A rank's tiles are the seq0-th K and V tiles of the block on;
             * returns their count. */
            pyfa_setmaxnreg_dec<pyfa_cuda_prefill_wgmma_producer_regs(CONSUMERS)>();
            auto produce = [&](int seq0) {
                uint32_t t = bi.next_tile(bi.t_begin), prev = bi.t_end;
                for (int seq = 0;; seq++) {
                    if (t < bi.t_end)
                        load_kv(false, seq0 + seq, sk((seq0 + seq) & 1), kbase, krow, PYFA_PREFILL_ARG_K, t);
                    if (prev < bi.t_end)
                        load_kv(true, seq0 + seq - 1, sv((seq0 + seq - 1) & 1), vbase, vrow, PYFA_PREFILL_ARG_V, prev);
                    if (t >= bi.t_end) return seq;
                    prev = t;
                    t = bi.next_tile(t + 1);
                }
            };
            if (tma.on && (int)threadIdx.x == tma.issuer) {
                if constexpr (PERSIST) {
                    int seq0 = 0;
                    for (uint32_t r = 0; rank_of(r) < ranks; r++) {
                        if (r > 0) {
                            bi = launch_block<PERSIST, KV_MODE>(p, a, f, BQ, BK, nullptr, rank_of(r));
                            set_bases();
                        }
                        if (q_tma()) {
                            if (r >= 2) pyfa_mbar_wait(q_free(r), ((r >> 1) - 1) & 1); /* rank r - 2's output stored */
                            load_q(r);
                        }
                        seq0 += produce(seq0);
                    }
                } else {
                    produce(0);
                }
            }
            return;
        }
        pyfa_setmaxnreg_inc<pyfa_cuda_prefill_wgmma_consumer_regs(CONSUMERS)>();
    }
    /* The consumer warpgroups' barrier (the producer has left); ids 1 to
     * CONSUMERS are the turns'. */
    auto consumers_sync = [&]() {
        if constexpr (PRODUCER)
            pyfa_bar_sync(1 + CONSUMERS, BLOCK_THREADS);
        else
            __syncthreads();
    };
    const bool turns = tma.on; /* uniform */
    auto my_turn = [&]() { if (turns) pyfa_bar_sync(1 + wg, 2 * 128); };
    auto your_turn = [&]() {
        if (turns) pyfa_bar_arrive(CONSUMERS == 2 ? 2 - wg : wg == CONSUMERS - 1 ? 1 : 2 + wg, 2 * 128);
    };

    /* The block's r-th rank, whose K and V tiles are the seq0-th of the block
     * on: returns the sequence number after its last (the loop counts in the
     * block's sequence, so that seq0 is not live through it). */
    auto consume = [&](uint32_t r, int seq0) -> int {
        /* (A grid launch's descriptor as built: an added 0 moved ptxas's choices.) */
        const uint64_t q_desc = PERSIST ? pyfa_wgmma_desc_add(q_desc0, (uint32_t)(q_buffer(r) - sq)) : q_desc0;
        if constexpr (Q_TMA) {
            /* One copy, issued by consumer thread 0 where the threads' copies would be
             * (a persistent block's producer issues it, ahead of the rank). */
            if (q_tma()) {
                if (!PERSIST && threadIdx.x == 0) load_q(r);
            } else {
                load_swizzled_stage<D, BQ, BLOCK_THREADS, S::SPAN>(
                    q_buffer(r), [&](int rr) { return qbase + (int64_t)rr * qrow; }, qbase, bi.nq);
            }
        } else {
            /* A persistent block's consumers (its body without the maps) meet
             * first: their copies cross warpgroups, and the other may still
             * read rank r - 2's Q. */
            if constexpr (PERSIST) consumers_sync();
            load_core_tile_strided<D, BQ, BLOCK_THREADS>(q_buffer(r), qbase, qrow, bi.nq);
        }
        /* Q's copies in a group of their own where the producer copies K and V
         * (issue then commits none; the waits cover committed groups only). */
        if constexpr (PRODUCER) pyfa_cp_async_commit();

        float o[ND][4];
#pragma unroll
        for (int n = 0; n < ND; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

        /* One commit group per iteration: K of the next live tile (none past the
         * last), the kseq-th, into K stage kseq % 2 and V of tile `vt`, the
         * vseq-th, into V stage vseq % 2. */
        uint32_t kt = bi.next_tile(bi.t_begin);
        uint32_t issued = kt; /* the next K tile to copy */
        auto issue = [&](int kseq, int vseq, uint32_t vt) {
            if (PRODUCER && tma.on) return; /* the producer's */
            if (issued < bi.t_end) {
                load_kv(false, kseq, sk(kseq & 1), kbase, krow, PYFA_PREFILL_ARG_K, issued);
                issued = bi.next_tile(issued + 1);
            }
            if (vt < bi.t_end) load_kv(true, vseq, sv(vseq & 1), vbase, vrow, PYFA_PREFILL_ARG_V, vt);
            pyfa_cp_async_commit();
        };
        issue(seq0, seq0, bi.t_end); /* the first K tile, where the threads copy it (and Q's copies into its group) */

        /* P V of tile i - 1 runs on the tensor cores while tile i's softmax runs
         * on the ALUs: iteration i issues S_i = Q K_iᵀ, then P_{i-1} V_{i-1},
         * waits for S_i alone, and waits for P V only before rescaling o. The
         * first tile is peeled so that the loop has no branch between a product
         * and its wait: ptxas serialises every product of a loop it cannot follow. */
        uint32_t pa[KP][4], pl[KP][4]; /* P of the previous tile; pl: the residual terms, P_TERMS = 2 only */
        /* K_ki and V_vi (-1: none; the block's sequence numbers) landed: the
         * threads' copies (and Q's), or TMA's. With the threads' copies a block
         * barrier orders every stage's reuse. With TMA only the rank's first
         * tile needs one (Q's copies; a persistent rank's turns start balanced):
         * the warpgroups release each stage on its mbarrier (tma.release) and the
         * issuer waits for that before copying into it, so the warpgroups run
         * apart, and they take turns issuing their products in a round, 0, 1 (,
         * 2), 0, ... (named barrier 1 + w is warpgroup w's turn; the one before it
         * in the round arrives there when its turn ends, as FlashAttention-3's
         * scheduler barriers): one's softmax runs while the others' products do. */
        auto tiles_landed = [&](int ki, int vi, bool first) {
            pyfa_cp_async_wait<0>();
            pyfa_fence_proxy_async(); /* this thread's copies, visible to the tensor cores */
            tma.wait(ki, vi);
            /* every thread's copies landed (Q's, the first time, where the threads copy
             * Q; else Q's TMA copy); with the threads' copies, every warpgroup is also
             * done with the products before */
            if (first && q_tma()) pyfa_mbar_wait(q_full(r), q_parity(r));
            if (!tma.on || first) consumers_sync();
        };
        /* A score tile of zeros, pinned before the fence that precedes its product. */
        auto zero_scores = [](float (&s)[NT][4]) {
#pragma unroll
            for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            pyfa_wgmma_pin(flat(s));
        };
        /* Issues S = Q Kᵀ of the tile in K stage st (after the fence). */
        auto issue_s = [&](float (&s)[NT][4], int st) {
            const uint64_t k_stage = pyfa_wgmma_desc_add(k_desc, (uint32_t)st * S::KV_BYTES);
            /* Q's descriptor as a value of this iteration: left loop-invariant,
             * ptxas hoisted every k-step's Q descriptor out of the loop into
             * uniform registers, and at D 256 (16 k-steps) spilled. */
            uint64_t q_now = q_desc;
            asm volatile("mov.b64 %0, %0;" : "+l"(q_now));
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                const uint32_t k_step = SWIZZLED ? swizzled_kstep<S::SPAN, S::BLOCK>(kk) : 256 * kk;
                const uint32_t q_step = Q_TMA ? swizzled_kstep<S::SPAN, BQ * S::SPAN>(kk) : 256 * kk;
                pyfa_wgmma_ss<DT>(flat(s), pyfa_wgmma_desc_add(q_now, q_step), pyfa_wgmma_desc_add(k_stage, k_step),
                                  kk > 0 ? 1u : 0u);
            }
            pyfa_wgmma_commit();
        };
        /* Issues O += P V of the tile in V stage st (after the fence). */
        auto issue_pv = [&](int st) {
            const uint64_t v_stage = pyfa_wgmma_desc_add(v_desc, (uint32_t)st * S::KV_BYTES);
#pragma unroll
            for (int t = 0; t < KP; t++) {
                /* keys 16t ...: two 8-row groups */
                const uint64_t vd = pyfa_wgmma_desc_add(v_stage, SWIZZLED ? 16 * S::SPAN * t : 2 * GROUP * t);
                pyfa_wgmma_rs<DT>(flat(o), pa[t], vd, 1u);
                if constexpr (P_TERMS == 2) pyfa_wgmma_rs<DT>(flat(o), pl[t], vd, 1u);
            }
            pyfa_wgmma_commit();
        };
        /* Where the next tiles' copies are issued: after the products from D = 128
         * on, so their ~300 instructions run while the tensor cores work on S
         * (H200, 16K: D 256 +5-10%, D 128 -1 to +6%), and wherever TMA may bring
         * them (one instruction); before them below, where S is shorter than the
         * threads' copies' issue (D 64: 3% slower after). */
        constexpr bool COPIES_UNDER_S = D >= 128 || (SWIZZLED && KV_MODE == PYFA_PREFILL_KV_RECT);
        int next_seq = seq0;
        /* Operands are written before the fence and read after the wait: the pins
         * keep the compiler from moving those accesses across either. */
        if (kt < bi.t_end) {
            tiles_landed(seq0, -1, true);
            if (wg == CONSUMERS - 1) your_turn(); /* warpgroup 0 issues first */
            {
                float s[NT][4];
                zero_scores(s);
                pyfa_wgmma_fence();
                if constexpr (!COPIES_UNDER_S) issue(seq0 + 1, seq0, kt); /* K_1, V_0 */
                my_turn();
                issue_s(s, seq0 & 1);
                your_turn();
                if constexpr (COPIES_UNDER_S) issue(seq0 + 1, seq0, kt);
                pyfa_wgmma_wait<0>();
                pyfa_wgmma_pin(flat(s));
                tma.release(false, seq0);
                finish_tile<DT, KV_MODE>(s, p, f, bi, kt, BK, scale_log2, mrow, pos, t4);
                float alpha[2]; /* o is still 0 */
                softmax_scores(s, m, l, alpha, SLACK);
#pragma unroll
                for (int t = 0; t < KP; t++) p_fragment<DT, P_TERMS>(s, t, pa[t], pl[t]);
            }
            kt = bi.next_tile(kt + 1);
            int i = seq0 + 1; /* K_i and V_{i-1} in the block's sequence */
            tile_rules tr;
            /* The factor o takes before the next P V (the previous tile's softmax
             * moved the maximum). o is rescaled ahead of that product's issue, as
             * FlashAttention-3 does, so that after the wait for P V only P's
             * fragments remain. */
            float alpha[2] = {1.0f, 1.0f};
            /* Plain tiles of a call without a mask and with a positive scale go
             * to softmax_scores as raw dot products (RAW: one fma an exponent).
             * A masked call keeps the scaled scores in every tile: a tile whose
             * mask blk calls all zeros, read or not, then gives the same bits. */
            const bool raw_plain = !f.has_mask && scale_log2 > 0.0f; /* uniform */
            /* One iteration; PLAIN: tile kt takes the scale alone (plain_tile) and raw_plain holds.
             * Plain and other tiles run separate copies of the iteration, each
             * without a branch between the products' issue and the last wait:
             * where the score finish branched, ptxas put the wait for P V at the
             * branches' join, before the softmax, which then no longer ran under
             * P V (SASS: every MUFU.EX2 after the WARPGROUP.DEPBAR). */
            auto iteration = [&](auto plain) {
                constexpr bool PLAIN = decltype(plain)::value;
                tiles_landed(i, i - 1, false); /* K_i and V_{i-1} landed */
                float s[NT][4];
                zero_scores(s);
                rescale_after<(SLACK > 0.0f)>(o, alpha);
                pin_operands<P_TERMS>(o, pa, pl);
                if constexpr (!COPIES_UNDER_S) issue(i + 1, i, kt); /* K_{i+1}, V_i into the free stages */
                pyfa_wgmma_fence();
                my_turn();
                issue_s(s, i & 1);
                issue_pv((i - 1) & 1);
                your_turn();
                if constexpr (COPIES_UNDER_S) issue(i + 1, i, kt);
                pyfa_wgmma_wait<1>(); /* S_i done; P V_{i-1} may still run */
                pyfa_wgmma_pin(flat(s));
                tma.release(false, i);
                if constexpr (!PLAIN)
                    finish_keys<DT, KV_MODE>(s, p, f, bi, tr, (int64_t)kt * BK, scale_log2, mrow, pos, t4);
                softmax_scores<PLAIN>(s, m, l, alpha, SLACK, scale_log2);
                pyfa_wgmma_wait<0>();
                pin_operands<P_TERMS>(o, pa, pl);
                tma.release(true, i - 1);
#pragma unroll
                for (int t = 0; t < KP; t++) p_fragment<DT, P_TERMS>(s, t, pa[t], pl[t]);
            };
#pragma unroll 1
            for (; kt < bi.t_end; i++) {
                tr = bi.rules(p, f, kt, BK);
                if (raw_plain && plain_tile(f, tr))
                    iteration(bool_tag<true>{});
                else
                    iteration(bool_tag<false>{});
                kt = bi.next_tile(kt + 1);
            }
            tiles_landed(-1, i - 1, false); /* the last V */
            rescale_after<(SLACK > 0.0f)>(o, alpha);
            pin_operands<P_TERMS>(o, pa, pl);
            pyfa_wgmma_fence();
            my_turn();
            issue_pv((i - 1) & 1);
            your_turn();
            pyfa_wgmma_wait<0>();
            pin_operands<P_TERMS>(o, pa, pl);
            /* The last V stage, released for the next rank's copy (a grid launch's block ends here). */
            if constexpr (PERSIST) tma.release(true, i - 1);
            if (wg == 0) my_turn(); /* the last warpgroup's last pass, so the named barriers end balanced */
            next_seq = i;
        }
        pyfa_cp_async_wait<0>();
        /* Q's TMA has landed before a block leaves or stores over Q (a block without key tiles never waited). */
        if (q_tma()) pyfa_mbar_wait(q_full(r), q_parity(r));

        if constexpr (SPLITS) {
            if (bi.part >= 0 &&
                !merge_split_parts<ND, BLOCK_THREADS>(a, *split, bi.part, bi.split_index, o, m, l, consumers_sync))
                return next_seq; /* another part of this query tile merges */
        }
        /* Rectangular mode only: the packed modes' kernels (no producer, 255
         * registers) spill with the staged store. Named barrier 8 + wg is
         * warpgroup wg's own (1 to CONSUMERS + 1 are the turns' and the consumers').
         * Where the threads copy Q their copies cross warpgroups, and a block
         * without key tiles has not waited for every thread's: the consumers meet
         * before any warpgroup stores over Q's rows (with Q by TMA every thread
         * has waited for it above). A flag for "no key tile" kept through the loop
         * cost the D 128 loop local loads. */
        bool stored = false;
        if constexpr (ND % 8 == 0 && KV_MODE == PYFA_PREFILL_KV_RECT) {
            if (!q_tma()) consumers_sync();
            stored = store_rows_staged<DT, D, BQ, Q_TMA>(a, p, f, bi, q_buffer(r), wg, 8 + wg, o, m, l, row, t4);
        }
        if (!stored) store_rows<DT>(a, p, f, bi, o, m, l, row, t4, 0, true);
        if constexpr (PERSIST) {
            /* The rank's Q buffer is free for rank r + 2's copy once every
             * consumer warp has read back its staged rows (its products were
             * waited for before): the threads' writes ordered before the async
             * proxy's copy, then one arrival a warp. */
            if (q_tma()) {
                pyfa_fence_proxy_async();
                __syncwarp();
                if (lane == 0) pyfa_mbar_arrive(q_free(r));
            }
        }
        return next_seq;
    };

    /* The ranks in turn, as the producer's loop takes them, each also setting
     * the lanes' rows (a helper for both loops changed ptxas's code of every
     * body, the grid launch's too). */
    if constexpr (PERSIST) {
        int seq0 = 0;
        for (uint32_t r = 0; rank_of(r) < ranks; r++) {
            if (r > 0) {
                bi = launch_block<PERSIST, KV_MODE>(p, a, f, BQ, BK, nullptr, rank_of(r));
                set_bases();
                set_rows();
            }
            seq0 = consume(r, seq0);
        }
    } else {
        consume(0, 0);
    }
#else
    __trap(); /* the plan picks this tile on sm_90a only */
#endif
}
} // namespace prefill
