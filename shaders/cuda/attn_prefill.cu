/*
 * Prefill attention on CUDA: flash_attn_prefill, its blk pre-pass and
 * merge_attention_states. Contracts in flash_attn_prefill_params.h; the CUDA
 * plan (CUDAPlan.flashAttnPrefill) picks the tiles below and sizes shared
 * memory with the same formulas (prefill_smem_bytes).
 *
 * f16 / bf16: FA2-style. Block = 4 warps = BQ = 64 query rows of one (head,
 * sequence), 16 rows per warp. Q stays in shared memory; K and V tiles of BK
 * keys are cp.async copies into one buffer each, issued so that V[t] loads
 * while Q K[t]ᵀ runs and K[t+1] loads while P V[t] runs. Both products are
 * mma.sync m16n8k16 with f32 accumulators, fragments read with ldmatrix
 * (.trans for V); shared rows are padded by 16 bytes so ldmatrix is free of
 * bank conflicts. The score accumulator becomes the A operand of P V in
 * registers. Online softmax in f32 registers, base 2 (scores scaled by
 * scale*log2(e) after the f32 dot product); row statistics live in the quad
 * of lanes that holds a row.
 * The output accumulator is 16 x DO f32 per warp (DO/2 registers a lane):
 * for D = 512 that is too many, so D = 512 runs two passes over the key
 * tiles, each producing one half of the output columns (the scores are
 * recomputed, bit-identically, in the second pass: 1.5x the FLOPs of one pass).
 *
 * sm_90a, f16 / bf16, D <= 256 (when the CUDA plan picks its tile, BQ = 128):
 * the same algorithm on warpgroup MMA, attn_prefill_wgmma.cuh; D = 512 (tile
 * BQ 64, BK 64) on warpgroup MMA with the head dim split between two
 * warpgroups, attn_prefill_wgmma_split.cuh.
 *
 * f32: a SIMT FMA path (tf32 would miss f32 tolerances): BQ = 16 rows, BK =
 * 32 keys, 8 lanes per query row, scores and P through shared memory.
 *
 * Every path skips key tiles no row of the query tile can see (causal,
 * window) and blk SKIP tiles, and skip the mask read of blk ZERO tiles. A
 * skipped tile would have been a no-op (its scores are all -inf: the running
 * max is unchanged, the rescale factor is exactly 1, every p is 0), so the
 * result with blk is bit-identical to the result without.
 *
 * Packed modes (KV_MODE, flash_attn_prefill_params.h "Packed sequences"):
 * block_info<VARLEN | PAGED> resolves the block's sequence (rows, keys,
 * position of row 0, first packed rows, block_table row) from the clamped
 * metadata; varlen K/V rows are the packed rows, paged K/V rows are
 * addressed per row in the cp.async loop (load_tile_paged). Rectangular mode
 * keeps its block_info and every kernel expression (the packed ones are under
 * `if constexpr`): its specialisations compile to the same PTX as before the
 * packed modes existed (checked by diffing NVRTC's PTX).
 *
 * Row strides of q, k, v and out are multiples of 16 bytes (cp.async copies
 * 16-byte chunks): the contract's rule, checked by the dispatcher.
 */
#include "pyfa_mma.cuh"

/* Terms of P in the I/O dtype for P V (NVRTC -D option from the CUDA plan):
 * 1 (default) rounds P to f16 / bf16 as FlashAttention does (a relative
 * error of half an ulp per weight, up to ROUND * max|v| in the output: the
 * accuracy rule of flash-attn's tests); 2 adds the rounding residual as a
 * second product (P exact to ~2^-17, f32-grade output; the P V tensor-core
 * work doubles). */
#ifndef PYFA_PREFILL_P_TERMS
#define PYFA_PREFILL_P_TERMS 1
#endif
/* The running maximum's slack from D = 256, log2 units (prefill_max_slack). */
#ifndef PYFA_PREFILL_MAX_SLACK
#define PYFA_PREFILL_MAX_SLACK 8.0f
#endif

#ifdef PYFA_COMPILE_CHECK
#define PYFA_PREFILL_IMPL_INLINE __noinline__
#else
#define PYFA_PREFILL_IMPL_INLINE __forceinline__
#endif

namespace prefill {
constexpr int THREADS = 128;

/* Variant flags: function constants, folded when the impl is inlined into an
 * entry. out_f32: out is f32 rather than the I/O dtype. */
struct flags {
    bool has_mask, bool_mask, causal, has_window, has_softcap, has_blk, has_lse, out_f32;
};

/* A compile-time bool as a value: the argument that picks a generic lambda's copy. */
template <bool B>
struct bool_tag {
    static constexpr bool value = B;
};

/* What one key tile needs beyond the scaled dot product (uniform per block). */
struct tile_rules {
    bool read_mask, kv_edge, causal_edge, window_edge;
};

/* softcap * tanh(dot * scale / softcap) * log2(e) for the 16-bit paths, with
 * t = dot * scale / softcap, c = softcap log2(e): c tanh(t), tanh(t) as
 * 1 - 2 / (1 + 2^(2 log2(e) t)) (ex2, rcp: error a few f32 ulps of 1) where
 * |t| >= 1/8, and as t - t^3/3 + 2 t^5/15 - 17 t^7/315 (relative error under
 * 2e-9) below, where that form's error would not be small next to tanh(t).
 * So the score's error is relative, under 3e-6, whatever the cap. Both are
 * computed and one selected (no branch): two MUFU ops and about ten others,
 * where tanhf takes two and about fifteen. */
__device__ __forceinline__ float softcap_log2_16(float dot, float scale_over_cap, float c) {
    const float t = dot * scale_over_cap, t2 = t * t;
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t * (2.0f * PYFA_LOG2E)));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    const float big = fmaf(-2.0f, r, 1.0f);
    const float small = t * fmaf(t2, fmaf(t2, fmaf(t2, -17.0f / 315.0f, 2.0f / 15.0f), -1.0f / 3.0f), 1.0f);
    return c * (fabsf(t) < 0.125f ? small : big);
}

/* The score of (query row at absolute position pos, key) in the log2 domain:
 * scale (or softcap), mask, and the -inf rules. mrow is the query row's mask
 * row (nullptr: no read). */
template <int DT, int KV_MODE>
__device__ __forceinline__ float finish_score(float dot, const pyfa_flash_attn_prefill_params &p, const flags &f,
                                              const tile_rules &tr, float scale_log2, const char *mrow, int64_t key,
                                              int64_t pos, uint32_t seq_kv_len) {
    /* The sequence's keys: params' in rectangular mode (read where the test is), else the block's sequence's. */
    auto kv_len = [&]() -> int64_t {
        if constexpr (KV_MODE == PYFA_PREFILL_KV_RECT)
            return (int64_t)p.kv_len;
        else
            return (int64_t)seq_kv_len;
    };
    float x = dot * scale_log2;
    if (f.has_softcap) {
        if constexpr (DT == PYFA_DTYPE_F32)
            x = p.softcap * tanhf(dot * (p.scale / p.softcap)) * PYFA_LOG2E;
        else
            x = softcap_log2_16(dot, p.scale / p.softcap, p.softcap * PYFA_LOG2E);
    }
    if (tr.read_mask && mrow != nullptr && key < kv_len()) {
        if (f.bool_mask) {
            if (reinterpret_cast<const uint8_t *>(mrow)[key] == 0) x = -INFINITY;
        } else {
            x += pyfa_load_f32<DT>(mrow, (uint32_t)key) * PYFA_LOG2E;
        }
    }
    if (tr.kv_edge && key >= kv_len()) x = -INFINITY;
    if (tr.causal_edge && key > pos) x = -INFINITY;
    if (tr.window_edge && pos - key >= (int64_t)p.window) x = -INFINITY;
    return x;
}

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* The block's (query tile, head, sequence). The grid is (num_q_blocks, heads,
 * batch), and blocks start in about the order of their linear index; that
 * index is read with the query tile slowest and highest first, so under
 * causal masking the tiles with the most keys start first across every head
 * and sequence and the shortest start last (longest-processing-time-first),
 * in sections of heads whose K and V fit L2 (cuda_layout.h,
 * pyfa_cuda_prefill_rank_slot). Read x-fastest, a head's long tiles started
 * after every earlier head's short ones and ran on after them (4K causal: 512
 * blocks on 132 SMs).
 * Launched in clusters of 2 along y (cuda_layout.h,
 * pyfa_cuda_prefill_wgmma_cluster_heads) the index is the cluster's, times
 * 2, plus the block's rank in it (pyfa_cuda_prefill_block_rank): the two
 * blocks of a cluster take one query tile, an even head and the next (of one
 * KV head where the query heads per KV head are even). */
struct tile_slot {
    uint32_t qtile, h, b;
    int part = -1;              /* key-split launches: this block's part of its logical block, -1 whole */
    uint32_t split_index = 0;   /* and that block's index among the split ones */
    /* A key-split launch (flash_attn_prefill_params.h, pyfa_prefill_split):
     * one-dimensional, in rank order, each split block's parts neighbours. */
    __device__ __forceinline__ tile_slot(const pyfa_flash_attn_prefill_params &p, const pyfa_prefill_split &sp) {
        uint32_t rank = blockIdx.x;
        if (rank >= sp.first_rank) {
            const uint32_t j = rank - sp.first_rank;
            part = (int)(j % sp.parts);
            split_index = j / sp.parts;
            rank = sp.first_rank + split_index;
        }
        place(p, rank);
    }
    /* A persistent launch's rank r of the 3-d grid (pyfa_prefill_persist): the
     * key split's rank order, without parts. */
    __device__ __forceinline__ tile_slot(const pyfa_flash_attn_prefill_params &p, uint32_t rank) { place(p, rank); }
    /* Every launch's rank order (pyfa_cuda_prefill_rank_slot): query tile
     * slowest, highest first, then sequence, then head, in sections of heads. */
    __device__ __forceinline__ void place(const pyfa_flash_attn_prefill_params &p, uint32_t rank) {
        const uint32_t planes = p.num_heads * p.batch;
        const uint64_t slot = pyfa_cuda_prefill_rank_slot(
            rank, p.num_q_blocks, planes,
            pyfa_cuda_prefill_section_planes(planes, p.num_heads / p.num_kv_heads, p.kv_len, p.head_dim, p.causal));
        qtile = (uint32_t)(slot >> 32);
        const uint32_t plane = (uint32_t)slot;
        h = plane % p.num_heads;
        b = plane / p.num_heads;
    }
    /* A grid launch's block (the grid is (num_q_blocks, num_heads, batch)). */
    __device__ __forceinline__ explicit tile_slot(const pyfa_flash_attn_prefill_params &p) {
        uint32_t cluster_y = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(cluster_y));
#endif
        place(p, (uint32_t)pyfa_cuda_prefill_block_rank(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y,
                                                         cluster_y)); /* below 2^32: pyfa_cuda_prefill_rank_slot */
    }
};

/* The geometry of one block: its query tile, the key tiles it visits, its
 * mask and blk rows. This primary template serves the packed modes (no mask,
 * no blk; the sequence's rows and keys from the clamped metadata of
 * flash_attn_prefill_params.h); rectangular mode has its own below. */
template <int KV_MODE>
struct block_info {
    static_assert(KV_MODE == PYFA_PREFILL_KV_VARLEN || KV_MODE == PYFA_PREFILL_KV_PAGED, "block_info: packed modes");
    uint32_t qtile, h, b, kvh, i0, nq;
    uint32_t q_len, kv_len;   /* the sequence's query rows (<= params.q_len) and keys */
    int64_t p_lo, p_hi;
    int64_t q_row0, k_row0;   /* packed q row of the sequence's row 0; varlen: k row of its key 0 */
    const int32_t *bt;        /* paged: the sequence's block_table row */
    uint32_t t_begin, t_end;  /* key tiles [t_begin, t_end) may hold visible keys */
    const char *mbase;        /* nullptr: no mask in the packed modes */
    const uint8_t *blk_row;   /* nullptr */
    int part = -1;            /* no key split in the packed modes */
    uint32_t split_index = 0;

    __device__ __forceinline__ block_info(const pyfa_flash_attn_prefill_params &p, const pyfa_cuda_args &a,
                                          const flags &f, uint32_t BQ, uint32_t BK, uint32_t,
                                          const pyfa_prefill_split * = nullptr) {
        const tile_slot slot(p);
        qtile = slot.qtile;
        h = slot.h;
        b = slot.b;
        kvh = h / (p.num_heads / p.num_kv_heads);
        i0 = qtile * BQ;
        const pyfa_prefill_packed &pk = pyfa_param<pyfa_prefill_packed>(a, PYFA_PREFILL_ARG_PACKED);
        const int32_t *cu_q = pyfa_ptr<const int32_t>(a, PYFA_PREFILL_ARG_CU_SEQLENS_Q);
        const int32_t *seq_k = pyfa_ptr<const int32_t>(a, PYFA_PREFILL_ARG_SEQ_K);
        const int64_t q_begin = clamp64(cu_q[b], 0, pk.total_q), q_end = clamp64(cu_q[b + 1], q_begin, pk.total_q);
        int64_t keys;
        k_row0 = 0;
        bt = nullptr;
        if constexpr (KV_MODE == PYFA_PREFILL_KV_VARLEN) {
            k_row0 = clamp64(seq_k[b], 0, pk.total_k);
            keys = clamp64(seq_k[b + 1], k_row0, pk.total_k) - k_row0;
        } else {
            const pyfa_kv_pages &g = pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES);
            keys = clamp64(seq_k[b], 0, (int64_t)g.pages_per_seq * g.page_size);
            bt = pyfa_ptr<const int32_t>(a, PYFA_PREFILL_ARG_BLOCK_TABLE) + (size_t)b * g.pages_per_seq;
        }
        q_row0 = q_begin;
        q_len = (uint32_t)(q_end - q_begin < (int64_t)p.q_len ? q_end - q_begin : p.q_len);
        kv_len = (uint32_t)keys;
        /* A tile past the sequence's rows has nq 0 (live() is false). */
        nq = i0 >= q_len ? 0 : q_len - i0 < BQ ? q_len - i0 : BQ;
        p_lo = keys - (q_end - q_begin) + i0;
        p_hi = p_lo + nq - 1;
        int64_t k_begin = 0, k_end = keys;
        if (f.causal && p_hi + 1 < k_end) k_end = p_hi + 1;
        if (f.has_window && p_lo - (int64_t)p.window + 1 > k_begin) k_begin = p_lo - (int64_t)p.window + 1;
        if (k_end > k_begin) {
            t_begin = (uint32_t)(k_begin / BK);
            t_end = (uint32_t)((k_end + BK - 1) / BK);
        } else {
            t_begin = t_end = 0;
        }
        mbase = nullptr;
        blk_row = nullptr;
    }

    __device__ __forceinline__ bool live() const { return nq > 0; }

    /* The sequence's keys. */
    __device__ __forceinline__ uint32_t seq_kv_len() const { return kv_len; }
    __device__ __forceinline__ uint32_t keys(const pyfa_flash_attn_prefill_params &) const { return kv_len; }

    /* Element offset of the block's row r in q / out (packed rows; no batch stride). */
    __device__ __forceinline__ int64_t row_offset(const int64_t (&st)[3], uint32_t head, int r = 0) const {
        return (int64_t)head * st[1] + (q_row0 + i0 + r) * st[2];
    }

    /* Element offset of key 0 of KV head kvh in k / v (varlen: packed rows). */
    __device__ __forceinline__ int64_t key_offset(const int64_t (&st)[3]) const {
        return k_row0 * st[2] + (int64_t)kvh * st[1];
    }

    /* Index of the block's row 0 in lse [num_heads, total_q]. */
    __device__ __forceinline__ size_t lse_index(const pyfa_flash_attn_prefill_params &, const pyfa_cuda_args &a) const {
        return (size_t)h * pyfa_param<pyfa_prefill_packed>(a, PYFA_PREFILL_ARG_PACKED).total_q + (size_t)(q_row0 + i0);
    }

    __device__ __forceinline__ uint32_t next_tile(uint32_t t) const { return t; }

    __device__ __forceinline__ tile_rules rules(const pyfa_flash_attn_prefill_params &p, const flags &f, uint32_t t,
                                                uint32_t BK) const {
        const int64_t j0 = (int64_t)t * BK, j_last = j0 + BK - 1;
        tile_rules r;
        r.read_mask = false;
        r.kv_edge = j_last >= (int64_t)kv_len;
        r.causal_edge = f.causal && j_last > p_lo;
        r.window_edge = f.has_window && j0 <= p_hi - (int64_t)p.window;
        return r;
    }
};

/* Rectangular mode: the block_info of the rectangular kernel as it was before
 * the packed modes, verbatim, with the accessors the kernels call, which
 * reduce to the expressions the kernels used (so its code is unchanged). */
template <>
struct block_info<PYFA_PREFILL_KV_RECT> {
    uint32_t qtile, h, b, kvh, i0, nq;
    int64_t p_lo, p_hi;
    uint32_t t_begin, t_end;  /* key tiles [t_begin, t_end) may hold visible keys */
    const char *mbase;        /* mask at (b, h, row i0), or nullptr */
    const uint8_t *blk_row;   /* blk bytes of this query tile, or nullptr */
    int part;                 /* split: this block's part of its query tile's keys; -1: all of them */
    uint32_t split_index;     /* split: the index of that query tile's block among the split ones */

    /* split: the launch's key split (pyfa_prefill_split), where the kernel takes one and the
     * dispatch bound it; nullptr otherwise. */
    __device__ __forceinline__ block_info(const pyfa_flash_attn_prefill_params &p, const pyfa_cuda_args &a,
                                          const flags &f, uint32_t BQ, uint32_t BK, uint32_t es,
                                          const pyfa_prefill_split *split = nullptr)
        : block_info(p, a, f, BQ, BK, es, split != nullptr ? tile_slot(p, *split) : tile_slot(p), split) {}
    /* The block of `slot` (a persistent launch's rank: split nullptr). */
    __device__ __forceinline__ block_info(const pyfa_flash_attn_prefill_params &p, const pyfa_cuda_args &a,
                                          const flags &f, uint32_t BQ, uint32_t BK, uint32_t es, const tile_slot &slot,
                                          const pyfa_prefill_split *split) {
        qtile = slot.qtile;
        h = slot.h;
        b = slot.b;
        part = slot.part;
        split_index = slot.split_index;
        kvh = h / (p.num_heads / p.num_kv_heads);
        i0 = qtile * BQ;
        nq = p.q_len - i0 < BQ ? p.q_len - i0 : BQ;
        p_lo = (int64_t)p.q_offset + i0;
        p_hi = p_lo + nq - 1;
        int64_t k_begin = 0, k_end = p.kv_len;
        if (f.causal && p_hi + 1 < k_end) k_end = p_hi + 1;
        if (f.has_window && p_lo - (int64_t)p.window + 1 > k_begin) k_begin = p_lo - (int64_t)p.window + 1;
        if (k_end > k_begin) {
            t_begin = (uint32_t)(k_begin / BK);
            t_end = (uint32_t)((k_end + BK - 1) / BK);
        } else {
            t_begin = t_end = 0;
        }
        if (part >= 0) {
            const uint32_t n = t_end - t_begin, first = t_begin;
            t_begin = first + (uint32_t)((uint64_t)n * (uint32_t)part / split->parts);
            t_end = first + (uint32_t)((uint64_t)n * (uint32_t)(part + 1) / split->parts);
        }
        mbase = nullptr;
        blk_row = nullptr;
        if (f.has_mask) {
            const uint32_t mes = f.bool_mask ? 1 : es;
            mbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_MASK) +
                    ((int64_t)b * p.mask_strides[0] + (int64_t)h * p.mask_strides[1] + (int64_t)i0 * p.mask_strides[2]) * mes;
            if (f.has_blk) {
                const uint32_t mask_heads = p.mask_strides[1] ? p.num_heads : 1;
                const uint64_t plane = (uint64_t)(p.mask_strides[0] ? b : 0) * mask_heads + (p.mask_strides[1] ? h : 0);
                blk_row = pyfa_ptr<const uint8_t>(a, PYFA_PREFILL_ARG_BLK) + (plane * p.num_q_blocks + qtile) * (uint64_t)p.num_k_blocks;
            }
        }
    }

    /* Not read: finish_score reads params.kv_len in this mode. */
    __device__ __forceinline__ uint32_t seq_kv_len() const { return 0; }

    __device__ __forceinline__ uint32_t keys(const pyfa_flash_attn_prefill_params &p) const { return p.kv_len; }

    /* Element offset of the block's row r in q / out. */
    __device__ __forceinline__ int64_t row_offset(const int64_t (&st)[3], uint32_t head, int r = 0) const {
        return (int64_t)b * st[0] + (int64_t)head * st[1] + (int64_t)(i0 + r) * st[2];
    }

    __device__ __forceinline__ int64_t key_offset(const int64_t (&st)[3]) const {
        return (int64_t)b * st[0] + (int64_t)kvh * st[1];
    }

    __device__ __forceinline__ size_t lse_index(const pyfa_flash_attn_prefill_params &p, const pyfa_cuda_args &) const {
        return ((size_t)b * p.num_heads + h) * p.q_len + i0;
    }

    /* The first key tile >= t that is not a blk SKIP tile (t_end if none). */
    __device__ __forceinline__ uint32_t next_tile(uint32_t t) const {
        if (blk_row != nullptr)
            while (t < t_end && blk_row[t] == PYFA_BLK_SKIP) t++;
        return t;
    }

    __device__ __forceinline__ tile_rules rules(const pyfa_flash_attn_prefill_params &p, const flags &f, uint32_t t,
                                                uint32_t BK) const {
        const int64_t j0 = (int64_t)t * BK, j_last = j0 + BK - 1;
        tile_rules r;
        r.read_mask = f.has_mask && (blk_row == nullptr || blk_row[t] != PYFA_BLK_ZERO);
        r.kv_edge = j_last >= (int64_t)p.kv_len;
        r.causal_edge = f.causal && j_last > p_lo;
        r.window_edge = f.has_window && j0 <= p_hi - (int64_t)p.window;
        return r;
    }
};


/* Copies rows [0, n) of a tile of `rows` rows (CH 16-byte chunks from chunk c0
 * of each source row) into shared memory with row pitch `ld` bytes; rows
 * [n, rows) are zero-filled. */
template <int CH>
__device__ __forceinline__ void load_tile(char *dst, int ld, const char *src, int64_t row_bytes, uint32_t c0, int rows,
                                          uint32_t n) {
    for (int idx = threadIdx.x; idx < rows * CH; idx += THREADS) {
        const int r = idx / CH, c = idx % CH;
        const bool live = (uint32_t)r < n;
        pyfa_cp_async16(dst + r * ld + c * 16, src + (live ? r * row_bytes : 0) + (int64_t)(c0 + c) * 16, live ? 16u : 0u);
    }
}

/* The pool row of key s of a paged sequence (its block_table row bt) for KV
 * head kvh; a block_table entry outside the pool reads the last page.
 * shift, tmask: log2(page_size) and page_size - 1 (page_size: a power of two). */
__device__ __forceinline__ uint32_t paged_row(const pyfa_kv_pages &g, const int32_t *bt, uint32_t num_kv_heads,
                                              uint32_t kvh, uint32_t shift, uint32_t tmask, uint32_t s) {
    int32_t page = bt[s >> shift];
    if (page < 0 || (uint32_t)page >= g.num_pages) page = (int32_t)g.num_pages - 1;
    return PYFA_PAGE_ROW(g.layout, g.page_size, num_kv_heads, (uint32_t)page, s & tmask, kvh);
}

/* load_tile for keys [j0, j0 + n) of a paged sequence: row r's source is its
 * pool row (paged_row; row_bytes apart). */
template <int CH>
__device__ __forceinline__ void load_tile_paged(char *dst, int ld, const char *pool, int64_t row_bytes,
                                                const pyfa_kv_pages &g, const int32_t *bt, uint32_t num_kv_heads,
                                                uint32_t kvh, uint32_t j0, uint32_t c0, int rows, uint32_t n) {
    const uint32_t shift = __ffs(g.page_size) - 1, tmask = g.page_size - 1;
    for (int idx = threadIdx.x; idx < rows * CH; idx += THREADS) {
        const int r = idx / CH, c = idx % CH;
        const bool live = (uint32_t)r < n;
        int64_t off = 0;
        if (live) off = (int64_t)paged_row(g, bt, num_kv_heads, kvh, shift, tmask, j0 + r) * row_bytes;
        pyfa_cp_async16(dst + r * ld + c * 16, pool + off + (int64_t)(c0 + c) * 16, live ? 16u : 0u);
    }
}

/* ---------------------------------------------------------------- mma path */
/* 2^x in one MUFU op (relative error ~2^-22; results below 2^-126 flush to
 * 0, exp2(-inf) = 0): the per-score exponential of the 16-bit path, whose
 * P feeds a 16-bit product anyway. */
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Both 16-bit paths hold a score tile and an output tile in the mma
 * accumulator layout: x[n][e] is this lane's query row r = e >> 1 (rows g
 * and g + 8 of its 16-row slice) at column 8n + 2 t4 + (e & 1). */

/* Whether a key tile's scores take the scale alone (no soft cap, no mask
 * read, no -inf rule). */
__device__ __forceinline__ bool plain_tile(const flags &f, const tile_rules &tr) {
    return !(f.has_softcap || tr.read_mask || tr.kv_edge || tr.causal_edge || tr.window_edge);
}

template <int NT>
__device__ __forceinline__ void scale_scores(float (&s)[NT][4], float scale_log2) {
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] *= scale_log2;
}

/* The scores of keys j0 ... j0 + 8 NT - 1 in the log2 domain: scale (or
 * softcap), mask and the -inf rules where tr (the rules of a key tile holding
 * them) asks for them, the scale alone otherwise. */
template <int DT, int KV_MODE, int NT, class BlockInfo>
__device__ __forceinline__ void finish_keys(float (&s)[NT][4], const pyfa_flash_attn_prefill_params &p, const flags &f,
                                            const BlockInfo &bi, const tile_rules &tr, int64_t j0, float scale_log2,
                                            const char *const (&mrow)[2], const int64_t (&pos)[2], int t4) {
    if (!plain_tile(f, tr)) {
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                const int64_t key = j0 + n * 8 + 2 * t4 + (e & 1);
                s[n][e] = finish_score<DT, KV_MODE>(s[n][e], p, f, tr, scale_log2, mrow[r], key, pos[r], bi.seq_kv_len());
            }
    } else { /* an interior tile: scale only */
        scale_scores(s, scale_log2);
    }
}

/* Key tile kt's scores (finish_keys over the whole tile). */
template <int DT, int KV_MODE, int NT, class BlockInfo>
__device__ __forceinline__ void finish_tile(float (&s)[NT][4], const pyfa_flash_attn_prefill_params &p, const flags &f,
                                            const BlockInfo &bi, uint32_t kt, uint32_t BK, float scale_log2,
                                            const char *const (&mrow)[2], const int64_t (&pos)[2], int t4) {
    finish_keys<DT, KV_MODE>(s, p, f, bi, bi.rules(p, f, kt, BK), (int64_t)kt * BK, scale_log2, mrow, pos, t4);
}

/* A row's maximum or sum over 16 or more score blocks runs in ROW_CHAINS
 * interleaved chains (block n into chain n % ROW_CHAINS), folded at the end:
 * a dependent chain of about NT / ROW_CHAINS operations instead of NT, which
 * the two warps a scheduler holds do not hide. Tiles of 8 blocks keep one
 * chain (H200: D 256 causal measured 8-10% slower with chains, D 64 level). */
constexpr int ROW_CHAINS = 4;
/* The running maximum's slack (log2 units) for a head dim: from D = 256 a
 * row's maximum moves only when a tile's exceeds it by more than
 * PYFA_PREFILL_MAX_SLACK, so P stays under 2^SLACK (exact in the 16-bit P
 * and the f32 sums) and o, 128 or more registers a thread, is rescaled only
 * when some row of the warp moved (FlashAttention-4 keeps a stale maximum
 * the same way). Smaller D keep the exact maximum: there the vote measured
 * level at D 128 and 5-8% slower at D 64 4K causal (H200). */
constexpr float prefill_max_slack(int D) { return D > 128 ? PYFA_PREFILL_MAX_SLACK : 0.0f; }
/* One softmax step over a score tile in the log2 domain. RAW: s holds the
 * raw dot products of a plain tile and scale_log2 > 0; the row maximum is
 * taken on them and scaled (the same maximum: rounding is monotone), and each
 * exponent is one fma(dot, scale_log2, -m), as FlashAttention does, where the
 * scaled scores take a multiply and a subtract (H200, D 128: 64 instructions
 * a thread and tile fewer). */
template <bool RAW = false, int NT>
__device__ __forceinline__ void softmax_scores(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               float slack = 0.0f, float scale_log2 = 1.0f) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        constexpr int C = NT >= 16 ? ROW_CHAINS : 1;
        float part[C];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const float x = fmaxf(s[n][2 * r], s[n][2 * r + 1]);
            part[n % C] = n < C ? x : fmaxf(part[n % C], x);
        }
#pragma unroll
        for (int c = 1; c < C; c++) part[0] = fmaxf(part[0], part[c]);
        float mx = part[0];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if constexpr (RAW) mx *= scale_log2;
        const float m_new = slack > 0.0f ? (mx > m[r] + slack ? mx : m[r]) : fmaxf(m[r], mx);
        /* Exactly 1 when the max does not move (an all -inf tile is a no-op). */
        alpha[r] = m_new == m[r] ? 1.0f : exp2f(m[r] - m_new);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            if constexpr (RAW) {
                s[n][2 * r] = exp2_approx(fmaf(s[n][2 * r], scale_log2, -m_use));
                s[n][2 * r + 1] = exp2_approx(fmaf(s[n][2 * r + 1], scale_log2, -m_use));
            } else {
                s[n][2 * r] = exp2_approx(s[n][2 * r] - m_use);
                s[n][2 * r + 1] = exp2_approx(s[n][2 * r + 1] - m_use);
            }
            const float x = s[n][2 * r] + s[n][2 * r + 1];
            part[n % C] = n < C ? x : part[n % C] + x;
        }
        float sum = part[0];
#pragma unroll
        for (int c = 1; c < C; c++) sum += part[c];
        l[r] = l[r] * alpha[r] + sum;
        m[r] = m_new;
    }
}

template <int ND>
__device__ __forceinline__ void rescale_rows(float (&o)[ND][4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < ND; n++) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
    }
}

/* o's rescale after a softmax step; with slack (prefill_max_slack) only
 * where some row of this warp moved its maximum (alpha is exactly 1
 * elsewhere, and a product of 1 is a no-op). */
template <bool SLACK, int ND>
__device__ __forceinline__ void rescale_after(float (&o)[ND][4], const float (&alpha)[2]) {
    if (!SLACK || __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale_rows(o, alpha);
}

/* Both steps at once, for a loop whose product into o is not in flight. */
template <int NT, int ND>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&o)[ND][4], float (&m)[2], float (&l)[2]) {
    float alpha[2];
    softmax_scores(s, m, l, alpha);
    rescale_rows(o, alpha);
}

/* P of keys 16 kc ... as the A fragment of a 16-bit product (the score
 * blocks 2 kc and 2 kc + 1); with P_TERMS = 2 also the rounding residual, so
 * P = hi + lo in the I/O dtype. */
template <int DT, int P_TERMS, int NT>
__device__ __forceinline__ void p_fragment(const float (&s)[NT][4], int kc, uint32_t (&pa)[4], uint32_t (&pl)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float x0 = s[2 * kc + (i >> 1)][2 * (i & 1)], x1 = s[2 * kc + (i >> 1)][2 * (i & 1) + 1];
        pa[i] = pyfa_pack2<DT>(x0, x1);
        if constexpr (P_TERMS == 2) {
            float h0, h1;
            pyfa_unpack2<DT>(pa[i], h0, h1);
            pl[i] = pyfa_pack2<DT>(x0 - h0, x1 - h1);
        }
    }
}

/* A row's softmax sum from this lane's part: the sum over the row's four
 * lanes (every lane of the warp calls it). */
__device__ __forceinline__ float row_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    return l + __shfl_xor_sync(0xffffffffu, l, 2);
}

/* The LSE of the block's row `row` from its maximum (log2 domain) and sum
 * (-inf for a row that saw no key). */
template <class BlockInfo>
__device__ __forceinline__ void store_lse(const pyfa_cuda_args &a, const pyfa_flash_attn_prefill_params &p,
                                          const BlockInfo &bi, int row, float m, float total) {
    float *lse = pyfa_ptr<float>(a, PYFA_PREFILL_ARG_LSE);
    lse[bi.lse_index(p, a) + row] = total > 0.0f ? (m + log2f(total)) * PYFA_LN2 : -INFINITY;
}

/* This lane's two rows of an output tile, columns col0 + 8n + 2 t4 (+ 1),
 * divided by their softmax sums (0 for a row that saw no key), and with
 * write_lse their LSE. */
template <int DT, int ND, class BlockInfo>
__device__ __forceinline__ void store_rows(const pyfa_cuda_args &a, const pyfa_flash_attn_prefill_params &p,
                                           const flags &f, const BlockInfo &bi, const float (&o)[ND][4],
                                           const float (&m)[2], const float (&l)[2], const int (&row)[2], int t4,
                                           int64_t col0, bool write_lse) {
    const int64_t oes = f.out_f32 ? 4 : 2;
    char *obase = pyfa_ptr<char>(a, PYFA_PREFILL_ARG_OUT) + bi.row_offset(p.out_strides, bi.h) * oes;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float total = row_sum(l[r]);
        if ((uint32_t)row[r] >= bi.nq) continue;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        char *orow = obase + ((int64_t)row[r] * p.out_strides[2] + col0) * oes;
#pragma unroll
        for (int n = 0; n < ND; n++) {
            const float x0 = o[n][2 * r] * inv, x1 = o[n][2 * r + 1] * inv;
            if (f.out_f32)
                *reinterpret_cast<float2 *>(orow + (n * 8 + 2 * t4) * 4) = make_float2(x0, x1);
            else
                *reinterpret_cast<uint32_t *>(orow + (n * 8 + 2 * t4) * 2) = pyfa_pack2<DT>(x0, x1);
        }
        if (f.has_lse && write_lse && t4 == 0) store_lse(a, p, bi, row[r], m[r], total);
    }
}

/* Tile shape of the mma path: BQ = 64 (4 warps x 16 rows), BK from the plan
 * (64; 32 from D = 256); D = 512 in two passes of DO = 256 output columns.
 * Shared bytes: Q [BQ][D+8], K [BK][D+8], V [BK][DO+8] (16-bit). */
template <int D, int BQ, int BK>
struct mma_shape {
    static constexpr int NPASS = D > 256 ? 2 : 1;
    static constexpr int DO = D / NPASS;
    static constexpr int LDQ = D + 8, LDK = D + 8, LDV = DO + 8; /* elements */
    static constexpr int NT = BK / 8;                             /* score n-tiles */
    static constexpr int KD = D / 16;                             /* k-steps of Q Kᵀ */
    static constexpr int ND = DO / 8;                             /* output n-tiles */
    static_assert(BQ == 64, "mma path: 4 warps x 16 rows");
    static_assert(BK % 16 == 0 && DO % 16 == 0 && D % 16 == 0, "mma path: 16-multiples");
};

template <int DT, int D, int BQ, int BK, int KV_MODE>
__device__ PYFA_PREFILL_IMPL_INLINE void prefill_mma(const pyfa_cuda_args &a, const flags f) {
    using S = mma_shape<D, BQ, BK>;
    constexpr int P_TERMS = PYFA_PREFILL_P_TERMS;
    static_assert(P_TERMS == 1 || P_TERMS == 2, "PYFA_PREFILL_P_TERMS: 1 or 2");
    constexpr int NPASS = S::NPASS, DO = S::DO, LDQ = S::LDQ, LDK = S::LDK, LDV = S::LDV, NT = S::NT, KD = S::KD,
                  ND = S::ND;
    const pyfa_flash_attn_prefill_params &p = pyfa_param<pyfa_flash_attn_prefill_params>(a, PYFA_PREFILL_ARG_PARAMS);
    const block_info<KV_MODE> bi(p, a, f, BQ, BK, 2);
    if constexpr (KV_MODE != PYFA_PREFILL_KV_RECT) {
        if (!bi.live()) return; /* uniform per block, before any barrier */
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;

    extern __shared__ uint4 smem_raw[];
    char *sq = reinterpret_cast<char *>(smem_raw);
    char *sk = sq + BQ * LDQ * 2;
    char *sv = sk + BK * LDK * 2;

    const char *qbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_Q) + bi.row_offset(p.q_strides, bi.h) * 2;
    const char *kbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K) + bi.key_offset(p.k_strides) * 2;
    const char *vbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V) + bi.key_offset(p.v_strides) * 2;
    const int64_t krow = p.k_strides[2] * 2, vrow = p.v_strides[2] * 2;
    const float scale_log2 = p.scale * PYFA_LOG2E;

    /* Per-lane ldmatrix offsets (bytes). Q: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15);
     * K: (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15);
     * V (trans): (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15). */
    const int l8 = lane & 7, b3 = (lane >> 3) & 1, b4 = lane >> 4;
    const uint32_t q_lane = smem_addr(sq) + ((warp * 16 + l8 + b3 * 8) * LDQ + b4 * 8) * 2;
    const uint32_t k_lane = smem_addr(sk) + ((l8 + b4 * 8) * LDK + b3 * 8) * 2;
    const uint32_t v_lane = smem_addr(sv) + ((l8 + b3 * 8) * LDV + b4 * 8) * 2;

    /* This lane's two query rows (local index, absolute position, mask row). */
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

    load_tile<D / 8>(sq, LDQ * 2, qbase, p.q_strides[2] * 2, 0, BQ, bi.nq);

#pragma unroll 1
    for (int pass = 0; pass < NPASS; pass++) {
        float o[ND][4];
#pragma unroll
        for (int n = 0; n < ND; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

        uint32_t kt = bi.next_tile(bi.t_begin);
        auto load_k = [&](uint32_t t) {
            const uint32_t j0 = t * BK, n = bi.keys(p) - j0 < (uint32_t)BK ? bi.keys(p) - j0 : BK;
            if constexpr (KV_MODE == PYFA_PREFILL_KV_PAGED)
                load_tile_paged<D / 8>(sk, LDK * 2, pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K), (int64_t)D * 2,
                                       pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES), bi.bt, p.num_kv_heads,
                                       bi.kvh, j0, 0, BK, n);
            else
                load_tile<D / 8>(sk, LDK * 2, kbase + (int64_t)j0 * krow, krow, 0, BK, n);
        };
        auto load_v = [&](uint32_t t) {
            const uint32_t j0 = t * BK, n = bi.keys(p) - j0 < (uint32_t)BK ? bi.keys(p) - j0 : BK;
            if constexpr (KV_MODE == PYFA_PREFILL_KV_PAGED)
                load_tile_paged<DO / 8>(sv, LDV * 2, pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V), (int64_t)D * 2,
                                        pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES), bi.bt, p.num_kv_heads,
                                        bi.kvh, j0, pass * (DO / 8), BK, n);
            else
                load_tile<DO / 8>(sv, LDV * 2, vbase + (int64_t)j0 * vrow, vrow, pass * (DO / 8), BK, n);
        };
        if (kt < bi.t_end) load_k(kt);
        pyfa_cp_async_commit();

#pragma unroll 1
        while (kt < bi.t_end) {
            pyfa_cp_async_wait<0>();
            __syncthreads(); /* K[kt] (and Q) landed; every warp is done with the previous V */
            load_v(kt);
            pyfa_cp_async_commit();

            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t qa[4];
                ldsm_x4(q_lane + kk * 32, qa[0], qa[1], qa[2], qa[3]);
#pragma unroll
                for (int n2 = 0; n2 < NT / 2; n2++) {
                    uint32_t b0, b1, b2, b3r;
                    ldsm_x4(k_lane + (n2 * 16 * LDK + kk * 16) * 2, b0, b1, b2, b3r);
                    mma16816<DT>(s[2 * n2], qa, b0, b1);
                    mma16816<DT>(s[2 * n2 + 1], qa, b2, b3r);
                }
            }

            finish_tile<DT, KV_MODE>(s, p, f, bi, kt, BK, scale_log2, mrow, pos, t4);
            softmax_tile(s, o, m, l);

            pyfa_cp_async_wait<0>();
            __syncthreads(); /* V[kt] landed; every warp is done with K[kt] */
            const uint32_t next = bi.next_tile(kt + 1);
            if (next < bi.t_end) load_k(next);
            pyfa_cp_async_commit();

#pragma unroll
            for (int kc = 0; kc < BK / 16; kc++) {
                /* P as the A operand (the score accumulator's layout is the A fragment's). */
                uint32_t pa[4], pl[4];
                p_fragment<DT, P_TERMS>(s, kc, pa, pl);
#pragma unroll
                for (int n2 = 0; n2 < ND / 2; n2++) {
                    uint32_t b0, b1, b2, b3r;
                    ldsm_x4_trans(v_lane + (kc * 16 * LDV + n2 * 16) * 2, b0, b1, b2, b3r);
                    mma16816<DT>(o[2 * n2], pa, b0, b1);
                    mma16816<DT>(o[2 * n2 + 1], pa, b2, b3r);
                    if constexpr (P_TERMS == 2) {
                        mma16816<DT>(o[2 * n2], pl, b0, b1);
                        mma16816<DT>(o[2 * n2 + 1], pl, b2, b3r);
                    }
                }
            }
            kt = next;
        }
        pyfa_cp_async_wait<0>();
        __syncthreads(); /* the next pass reloads K and V */

        store_rows<DT>(a, p, f, bi, o, m, l, row, t4, (int64_t)pass * DO, pass == NPASS - 1);
    }
}

/* --------------------------------------------------------------- SIMT path */
/* f32: BQ = 16 rows, BK = 32 keys; lane group (8 lanes) r owns query row r:
 * keys c8 + 8i of each score tile and output columns c8 + 8u. Shared floats:
 * Q [BQ][D+4], K or V [BK][D+4] (one buffer, loaded in turn), P [BQ][BK]. */
template <int D, int BQ, int BK, int KV_MODE>
__device__ PYFA_PREFILL_IMPL_INLINE void prefill_simt(const pyfa_cuda_args &a, const flags f) {
    static_assert(BQ == 16 && BK == 32, "SIMT path: 16 rows x 8 lanes, 4 keys per lane");
    constexpr int LD = D + 4, KPL = BK / 8, CPL = D / 8;
    const pyfa_flash_attn_prefill_params &p = pyfa_param<pyfa_flash_attn_prefill_params>(a, PYFA_PREFILL_ARG_PARAMS);
    const block_info<KV_MODE> bi(p, a, f, BQ, BK, 4);
    if constexpr (KV_MODE != PYFA_PREFILL_KV_RECT) {
        if (!bi.live()) return; /* uniform per block, before any barrier */
    }
    const int r = threadIdx.x >> 3, c8 = threadIdx.x & 7;

    extern __shared__ uint4 smem_raw[];
    float *sq = reinterpret_cast<float *>(smem_raw);
    float *skv = sq + BQ * LD;
    float *sp = skv + BK * LD;

    const char *qbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_Q) + bi.row_offset(p.q_strides, bi.h) * 4;
    const char *kbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K) + bi.key_offset(p.k_strides) * 4;
    const char *vbase = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V) + bi.key_offset(p.v_strides) * 4;
    const int64_t krow = p.k_strides[2] * 4, vrow = p.v_strides[2] * 4;
    const float scale_log2 = p.scale * PYFA_LOG2E;
    const int64_t pos = bi.p_lo + r;
    const char *mrow = bi.mbase != nullptr && (uint32_t)r < bi.nq
                           ? bi.mbase + (int64_t)r * p.mask_strides[2] * (f.bool_mask ? 1 : 4)
                           : nullptr;

    load_tile<D / 4>(reinterpret_cast<char *>(sq), LD * 4, qbase, p.q_strides[2] * 4, 0, BQ, bi.nq);
    pyfa_cp_async_commit();

    float o[CPL];
#pragma unroll
    for (int u = 0; u < CPL; u++) o[u] = 0.0f;
    float m = -INFINITY, l = 0.0f;

#pragma unroll 1
    for (uint32_t kt = bi.next_tile(bi.t_begin); kt < bi.t_end; kt = bi.next_tile(kt + 1)) {
        const uint32_t j0 = kt * BK, n = bi.keys(p) - j0 < (uint32_t)BK ? bi.keys(p) - j0 : BK;
        if constexpr (KV_MODE == PYFA_PREFILL_KV_PAGED)
            load_tile_paged<D / 4>(reinterpret_cast<char *>(skv), LD * 4, pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_K),
                                   (int64_t)D * 4, pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES), bi.bt,
                                   p.num_kv_heads, bi.kvh, j0, 0, BK, n);
        else
            load_tile<D / 4>(reinterpret_cast<char *>(skv), LD * 4, kbase + (int64_t)j0 * krow, krow, 0, BK, n);
        pyfa_cp_async_commit();
        pyfa_cp_async_wait<0>();
        __syncthreads(); /* K (and Q) landed */

        float s[KPL];
#pragma unroll
        for (int i = 0; i < KPL; i++) s[i] = 0.0f;
        const float *qr = sq + r * LD;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float4 q4 = *reinterpret_cast<const float4 *>(qr + d);
#pragma unroll
            for (int i = 0; i < KPL; i++) {
                const float4 k4 = *reinterpret_cast<const float4 *>(skv + (c8 + 8 * i) * LD + d);
                s[i] = fmaf(q4.x, k4.x, s[i]);
                s[i] = fmaf(q4.y, k4.y, s[i]);
                s[i] = fmaf(q4.z, k4.z, s[i]);
                s[i] = fmaf(q4.w, k4.w, s[i]);
            }
        }
        const tile_rules tr = bi.rules(p, f, kt, BK);
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            s[i] = finish_score<PYFA_DTYPE_F32, KV_MODE>(s[i], p, f, tr, scale_log2, mrow, (int64_t)j0 + c8 + 8 * i, pos,
                                                         bi.seq_kv_len());
            mx = fmaxf(mx, s[i]);
        }
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o8));
        const float m_new = fmaxf(m, mx);
        const float alpha = m_new == m ? 1.0f : exp2f(m - m_new);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < KPL; i++) {
            s[i] = exp2f(s[i] - m_use);
            sum += s[i];
            sp[r * BK + c8 + 8 * i] = s[i];
        }
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o8);
        l = l * alpha + sum;
        m = m_new;
        __syncthreads(); /* every lane is done with K; P is written */

        if constexpr (KV_MODE == PYFA_PREFILL_KV_PAGED)
            load_tile_paged<D / 4>(reinterpret_cast<char *>(skv), LD * 4, pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_V),
                                   (int64_t)D * 4, pyfa_param<pyfa_kv_pages>(a, PYFA_PREFILL_ARG_PAGES), bi.bt,
                                   p.num_kv_heads, bi.kvh, j0, 0, BK, n);
        else
            load_tile<D / 4>(reinterpret_cast<char *>(skv), LD * 4, vbase + (int64_t)j0 * vrow, vrow, 0, BK, n);
        pyfa_cp_async_commit();
        pyfa_cp_async_wait<0>();
        __syncthreads(); /* V landed */
#pragma unroll
        for (int u = 0; u < CPL; u++) o[u] *= alpha;
#pragma unroll 4
        for (int j = 0; j < BK; j++) {
            const float pj = sp[r * BK + j];
#pragma unroll
            for (int u = 0; u < CPL; u++) o[u] = fmaf(pj, skv[j * LD + c8 + 8 * u], o[u]);
        }
        __syncthreads(); /* every lane is done with V and P */
    }
    pyfa_cp_async_wait<0>();

    if ((uint32_t)r < bi.nq) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *orow = pyfa_ptr<float>(a, PYFA_PREFILL_ARG_OUT) + bi.row_offset(p.out_strides, bi.h, r);
#pragma unroll
        for (int u = 0; u < CPL; u++) orow[c8 + 8 * u] = o[u] * inv;
        if (f.has_lse && c8 == 0) {
            float *lse = pyfa_ptr<float>(a, PYFA_PREFILL_ARG_LSE);
            lse[bi.lse_index(p, a) + r] = l > 0.0f ? (m + log2f(l)) * PYFA_LN2 : -INFINITY;
        }
    }
}

/* ---------------------------------------------------------------- blk pass */
/* Folds one 32-bit word of mask entries into a tile's flags: open if an entry
 * does not block, active if an entry is not a no-op (bit patterns: exact
 * -inf blocks, +-0 is a no-op; bool 0 blocks, non-zero is a no-op). */
__device__ __forceinline__ void blk_fold_word(const uint32_t w, const bool bool_mask, const uint32_t es,
                                              const uint32_t ninf16, bool &open, bool &active) {
    if (bool_mask) {
        open |= w != 0u;
        active |= ((w - 0x01010101u) & ~w & 0x80808080u) != 0u; /* some byte is zero (exact) */
    } else if (es == 4) {
        open |= w != 0xff800000u;
        active |= (w & 0x7fffffffu) != 0u;
    } else {
        open |= (w & 0xffffu) != ninf16 || (w >> 16) != ninf16;
        active |= (w & 0x7fff7fffu) != 0u;
    }
}

/* Classifies one (query tile, key tile) of mask plane (z, y): blockIdx.x is
 * query tile x / num_k_blocks, key tile x % num_k_blocks. The tile's entries
 * are read as units, whole 32-bit words where every row segment is aligned
 * to them, else one entry each; a warp's lanes take consecutive units (a
 * row's run across lanes), each lane BLK_UNROLL of them before it folds any,
 * so that the loads are in flight together. A warp stops at the first round
 * that makes its part MIXED; the block then votes. */
#define BLK_UNROLL 8
__device__ PYFA_PREFILL_IMPL_INLINE void prefill_blk(const pyfa_cuda_args &a, const int dt, const bool bool_mask,
                                                      const uint32_t BQ, const uint32_t BK) {
    const pyfa_flash_attn_prefill_params &p = pyfa_param<pyfa_flash_attn_prefill_params>(a, PYFA_PREFILL_ARG_PARAMS);
    const uint32_t es = bool_mask ? 1 : (dt == PYFA_DTYPE_F32 ? 4 : 2);
    const uint32_t x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
    const uint32_t qt = x / p.num_k_blocks, kt = x % p.num_k_blocks;
    const uint32_t i0 = qt * BQ, nq = p.q_len - i0 < BQ ? p.q_len - i0 : BQ;
    const uint32_t j0 = kt * BK, nk = p.kv_len - j0 < BK ? p.kv_len - j0 : BK;
    const uint32_t mask_heads = p.mask_strides[1] ? p.num_heads : 1;
    const char *base = pyfa_ptr<const char>(a, PYFA_PREFILL_ARG_MASK) +
                       ((int64_t)z * p.mask_strides[0] + (int64_t)y * p.mask_strides[1] + (int64_t)i0 * p.mask_strides[2] + j0) * es;
    const int64_t row_step = p.mask_strides[2] * (int64_t)es;
    const uint32_t ninf16 = dt == PYFA_DTYPE_F16 ? 0xfc00u : 0xff80u;
    const bool words = ((unsigned long long)base | (unsigned long long)row_step | (nk * es)) % 4 == 0;
    const uint32_t unit = words ? 4 : es, per_row = nk * es / unit, units = nq * per_row;
    const uint32_t lane = threadIdx.x % 32, warps = blockDim.x / 32;
    bool open = false, active = false;
    for (uint32_t f0 = threadIdx.x / 32 * (32 * BLK_UNROLL); f0 < units; f0 += warps * (32 * BLK_UNROLL)) {
        uint32_t w[BLK_UNROLL];
#pragma unroll
        for (int u = 0; u < BLK_UNROLL; u++) {
            const uint32_t f = f0 + u * 32 + lane, r = f / per_row;
            const char *e = base + r * row_step + (f - r * per_row) * unit;
            w[u] = f >= units ? 0u
                 : unit == 4 ? *reinterpret_cast<const uint32_t *>(e)
                 : unit == 2 ? *reinterpret_cast<const uint16_t *>(e)
                             : *reinterpret_cast<const uint8_t *>(e);
        }
#pragma unroll
        for (int u = 0; u < BLK_UNROLL; u++) {
            if (f0 + u * 32 + lane >= units) break;
            /* A single 8- or 16-bit entry, repeated to fill a word, folds as a word of such entries. */
            blk_fold_word(unit == 4 ? w[u] : w[u] * (unit == 1 ? 0x01010101u : 0x00010001u), bool_mask, es, ninf16,
                          open, active);
        }
        if (__any_sync(0xffffffffu, open) && __any_sync(0xffffffffu, active)) break;
    }
    const int any_open = __syncthreads_or(open), any_active = __syncthreads_or(active);
    if (threadIdx.x == 0)
        pyfa_ptr<uint8_t>(a, PYFA_PREFILL_ARG_BLK)[((uint64_t)z * mask_heads + y) * p.num_q_blocks * (uint64_t)p.num_k_blocks + x] =
            !any_open ? PYFA_BLK_SKIP : !any_active ? PYFA_BLK_ZERO : PYFA_BLK_MIXED;
}
#undef BLK_UNROLL

/* -------------------------------------------------------------- merge pass */
/* Merges row (blockIdx.z, blockIdx.y, blockIdx.x) of two partial attentions
 * of dtype DT into out of DT or (out_f32) f32. */
template <int DT>
__device__ PYFA_PREFILL_IMPL_INLINE void merge_states(const pyfa_cuda_args &a, const bool has_lse, const bool out_f32) {
    const pyfa_merge_attn_params &p = pyfa_param<pyfa_merge_attn_params>(a, PYFA_MERGE_ARG_PARAMS);
    constexpr int64_t es = DT == PYFA_DTYPE_F32 ? 4 : 2;
    const uint32_t x = blockIdx.x, y = blockIdx.y, z = blockIdx.z, D = p.head_dim;
    const size_t idx = ((size_t)z * p.num_heads + y) * p.seq_len + x;
    const int64_t off = (int64_t)z * p.o_strides[0] + (int64_t)y * p.o_strides[1] + (int64_t)x * p.o_strides[2];
    const char *oa = pyfa_ptr<const char>(a, PYFA_MERGE_ARG_O_A) + off * es;
    const char *ob = pyfa_ptr<const char>(a, PYFA_MERGE_ARG_O_B) + off * es;
    char *out = pyfa_ptr<char>(a, PYFA_MERGE_ARG_OUT) + off * (out_f32 ? 4 : es);
    const float la = pyfa_ptr<const float>(a, PYFA_MERGE_ARG_LSE_A)[idx];
    const float lb = pyfa_ptr<const float>(a, PYFA_MERGE_ARG_LSE_B)[idx];
    const float mx = fmaxf(la, lb);
    const bool none = !(mx > -INFINITY); /* neither side saw a key */
    const bool top = mx == INFINITY; /* +inf dominates: weight 1 for each +inf side, 0 for the other */
    const float wa = none ? 0.0f : top ? (la == INFINITY ? 1.0f : 0.0f) : expf(la - mx);
    const float wb = none ? 0.0f : top ? (lb == INFINITY ? 1.0f : 0.0f) : expf(lb - mx);
    const float total = wa + wb;
    const float fa = none ? 0.0f : wa / total, fb = none ? 0.0f : wb / total;
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) {
        const float o = none ? 0.0f : fa * pyfa_load_f32<DT>(oa, d) + fb * pyfa_load_f32<DT>(ob, d);
        if (out_f32) pyfa_store_f32<PYFA_DTYPE_F32>(out, d, o);
        else pyfa_store_f32<DT>(out, d, o);
    }
    if (has_lse && threadIdx.x == 0)
        pyfa_ptr<float>(a, PYFA_MERGE_ARG_LSE_OUT)[idx] = none ? -INFINITY : mx + logf(total);
}
} // namespace prefill

#include "attn_prefill_wgmma.cuh"
#include "attn_prefill_wgmma_split.cuh"

/* Threads a block: the warpgroup-MMA tile's (with its producer warpgroup
 * where it has one), else 256 (the split path's; the mma.sync and SIMT
 * paths launch 128). The entry's launch bound caps registers by it. */
#define PYFA_MAX_THREADS_flash_attn_prefill(DT, D, BQ, BK, HAS_MASK, MASK_KIND, DO_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_BLK, \
                                            HAS_LSE, OUT_DT, KV_MODE)                                                   \
    ((DT) != PYFA_DTYPE_F32 && (D) <= PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM &&                                         \
             (BQ) == pyfa_cuda_prefill_wgmma_block_q(D, KV_MODE)                                                        \
         ? pyfa_cuda_prefill_wgmma_block_threads(D, KV_MODE)                                                            \
         : PYFA_CUDA_PREFILL_WGMMA_THREADS)

/* Entry bodies: function constants in the dispatchers' order. The tile
 * (BQ, BK) comes from the plan; the impls check it is one they are built for. */
template <int DT, int D, int BQ, int BK, int HAS_MASK, int MASK_KIND, int DO_CAUSAL, int HAS_WINDOW,
          int HAS_SOFTCAP, int HAS_BLK, int HAS_LSE, int OUT_DT, int KV_MODE>
__device__ __forceinline__ void flash_attn_prefill_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(DT) && pyfa_is_head_dim(D), "flash_attn_prefill: dtype / head_dim");
    static_assert(MASK_KIND == PYFA_MASK_ADDITIVE || MASK_KIND == PYFA_MASK_BOOL, "flash_attn_prefill: mask kind");
    static_assert(OUT_DT == DT || OUT_DT == PYFA_DTYPE_F32, "flash_attn_prefill: out dtype (the I/O dtype or f32)");
    static_assert(KV_MODE == PYFA_PREFILL_KV_RECT || (KV_MODE == PYFA_PREFILL_KV_VARLEN || KV_MODE == PYFA_PREFILL_KV_PAGED) &&
                  HAS_MASK == 0 && HAS_BLK == 0, "flash_attn_prefill: KV mode (the packed modes take no mask)");
    const prefill::flags f = {HAS_MASK != 0, HAS_MASK != 0 && MASK_KIND == PYFA_MASK_BOOL, DO_CAUSAL != 0,
                              HAS_WINDOW != 0, HAS_SOFTCAP != 0, HAS_MASK != 0 && HAS_BLK != 0, HAS_LSE != 0,
                              OUT_DT == PYFA_DTYPE_F32};
    if constexpr (DT == PYFA_DTYPE_F32) {
        prefill::prefill_simt<D, BQ, BK, KV_MODE>(a, f);
    } else if constexpr (D == PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM && BQ == pyfa_cuda_prefill_wgmma_block_q(D, KV_MODE) &&
                         BK == pyfa_cuda_prefill_wgmma_block_k(D, KV_MODE)) {
        prefill::prefill_wgmma_split<DT, KV_MODE>(a, f); /* the mma.sync path's D = 512 tile has BK 32 */
    } else if constexpr (D <= PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM && BQ == pyfa_cuda_prefill_wgmma_block_q(D, KV_MODE)) {
        static_assert(BK == pyfa_cuda_prefill_wgmma_block_k(D, KV_MODE), "flash_attn_prefill: the wgmma path's key tile");
        if constexpr (pyfa_cuda_prefill_wgmma_consumers(D, KV_MODE) == 3) {
            /* One body with the stage maps, one without: the consumers of the
             * first keep no registers for the threads' copies, which their
             * 160 registers could not spare. */
            if (prefill::tma_maps_present(a))
                prefill::prefill_wgmma<DT, D, KV_MODE, DO_CAUSAL, 1>(a, f);
            else
                prefill::prefill_wgmma<DT, D, KV_MODE, DO_CAUSAL, 0>(a, f);
        } else {
            prefill::prefill_wgmma<DT, D, KV_MODE, DO_CAUSAL>(a, f);
        }
    } else {
        prefill::prefill_mma<DT, D, BQ, BK, KV_MODE>(a, f);
    }
}

/* Persistent blocks (flash_attn_prefill_params.h, pyfa_prefill_persist): the
 * warpgroup-MMA tiles pyfa_cuda_prefill_persists names, without a mask (the
 * constants flash_attn_prefill's dispatcher builds for such a call). */
#define PYFA_MAX_THREADS_flash_attn_prefill_persistent(DT, D, BQ, BK, HAS_MASK, MASK_KIND, DO_CAUSAL, HAS_WINDOW, \
                                                       HAS_SOFTCAP, HAS_BLK, HAS_LSE, OUT_DT, KV_MODE)          \
    pyfa_cuda_prefill_wgmma_block_threads(D, KV_MODE)
template <int DT, int D, int BQ, int BK, int HAS_MASK, int MASK_KIND, int DO_CAUSAL, int HAS_WINDOW,
          int HAS_SOFTCAP, int HAS_BLK, int HAS_LSE, int OUT_DT, int KV_MODE>
__device__ __forceinline__ void flash_attn_prefill_persistent_body(const pyfa_cuda_args &a) {
    static_assert(DT != PYFA_DTYPE_F32 && KV_MODE == PYFA_PREFILL_KV_RECT && pyfa_cuda_prefill_persists(D, KV_MODE) &&
                      BQ == pyfa_cuda_prefill_wgmma_block_q(D, KV_MODE) && BK == pyfa_cuda_prefill_wgmma_block_k(D, KV_MODE),
                  "flash_attn_prefill_persistent: the warpgroup-MMA tiles pyfa_cuda_prefill_persists names");
    static_assert(HAS_MASK == 0 && HAS_BLK == 0, "flash_attn_prefill_persistent: no mask");
    static_assert(OUT_DT == DT || OUT_DT == PYFA_DTYPE_F32, "flash_attn_prefill_persistent: out dtype (the I/O dtype or f32)");
    const prefill::flags f = {false, false, DO_CAUSAL != 0, HAS_WINDOW != 0, HAS_SOFTCAP != 0, false, HAS_LSE != 0,
                              OUT_DT == PYFA_DTYPE_F32};
    /* A body for launches with the three tensor maps, and one for launches
     * without (the consumers copy every tile): a body that could take either
     * kept the registers of the threads' copies through its loop, and ptxas
     * then put the wait for P V before the softmax (H200, D 128 4K
     * non-causal: 7% slower than the grid launch). */
    if (prefill::tma_maps_present(a) && a.arg[PYFA_CUDA_PREFILL_ARG_TMAP_Q] != 0)
        prefill::prefill_wgmma<DT, D, KV_MODE, DO_CAUSAL, 1, true>(a, f);
    else
        prefill::prefill_wgmma<DT, D, KV_MODE, DO_CAUSAL, 0, true>(a, f);
}

template <int DT, int BQ, int BK, int MASK_KIND>
__device__ __forceinline__ void flash_attn_prefill_blk_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(DT), "flash_attn_prefill_blk: dtype");
    static_assert(MASK_KIND == PYFA_MASK_ADDITIVE || MASK_KIND == PYFA_MASK_BOOL, "flash_attn_prefill_blk: mask kind");
    prefill::prefill_blk(a, DT, MASK_KIND == PYFA_MASK_BOOL, BQ, BK);
}

template <int DT, int HAS_LSE, int OUT_DT>
__device__ __forceinline__ void merge_attention_states_body(const pyfa_cuda_args &a) {
    static_assert(pyfa_is_float_dtype(DT), "merge_attention_states: dtype"); /* D: the row loop reads params */
    static_assert(OUT_DT == DT || OUT_DT == PYFA_DTYPE_F32, "merge_attention_states: out dtype (DT or f32)");
    prefill::merge_states<DT>(a, HAS_LSE != 0, OUT_DT == PYFA_DTYPE_F32);
}
