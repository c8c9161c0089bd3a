/*
 * Prefill attention family: flash_attn_prefill, its tile-skip pre-pass
 * flash_attn_prefill_blk, and merge_attention_states. Included at the end of
 * pyfa_params.h; the same rules apply (fixed-width fields, no implicit
 * padding, sizes pinned in params_layout.c).
 *
 * ---------------------------------------------------------------------------
 * flash_attn_prefill: softmax(scale * q kᵀ [+ mask]) v for many query rows.
 *   q   rows [batch, num_heads, q_len, head_dim]   dtype T (f32 | f16 | bf16)
 *   k,v rows [batch, num_kv_heads, kv_len, head_dim] dtype T
 *   out rows [batch, num_heads, q_len, head_dim]   dtype T, or f32 on request
 *   mask     [.., .., q_len, kv_len]  T (additive) or u8 (boolean), optional
 *   blk      u8, optional, see flash_attn_prefill_blk below
 *   lse      [batch, num_heads, q_len] f32, contiguous, optional
 * Row addresses come from element strides (batch, head, row); the head_dim
 * axis is always contiguous. "bhsd" ([B, H, L, D]) and "bshd" ([B, L, H, D])
 * are two stride choices of the same kernel. Kernels copy rows in 16-byte
 * pieces: the stride of every axis of q, k, v and out longer than 1 is a
 * multiple of 16 bytes (a stride of an axis of extent 1 is never applied),
 * and no two elements of out share memory.
 *
 * Semantics (natural-log domain; kernels may work in base 2 internally):
 *   s = scale * q·k; if softcap > 0: s = softcap * tanh(s / softcap);
 *   additive mask: s += mask (-inf blocks, finite = bias);
 *   boolean mask: mask == 0 blocks.
 *   Query row i sits at absolute position p = q_offset + i (q_offset may be
 *   negative); key j at position j. causal: key visible iff j <= p.
 *   window > 0: key visible iff p - j < window (combined with causal this is
 *   a sliding window of `window` keys ending at p).
 *   GQA: query head h reads KV head h / (num_heads / num_kv_heads).
 *   A row with no visible key writes zeros and lse = -inf.
 *   Accumulation and softmax statistics are f32; out is stored as its own
 *   dtype (T, or f32 for f16 / bf16 I/O), rounded once to nearest even.
 *   lse = log(sum_j exp(s_j)) over visible keys (natural log).
 *
 * Tiling: the backend's plan picks (block_q, block_k); pyfa_flash_attn_prefill_plan
 * returns them. num_q_blocks = ceil(q_len / block_q), num_k_blocks likewise.
 * Grid: (num_q_blocks, num_heads, batch); threadgroup (x, y, z) computes
 * query rows [x*block_q, min((x+1)*block_q, q_len)) of head y, sequence z.
 * Threads per threadgroup and threadgroup memory come from the plan.
 * ------------------------------------------------------------------------- */
#pragma once

#if !defined(__METAL_VERSION__) && !defined(__CUDACC_RTC__)
#include <stdint.h>
#endif

typedef struct pyfa_flash_attn_prefill_params {
    uint32_t batch;        /**< sequences */
    uint32_t num_heads;    /**< query heads */
    uint32_t num_kv_heads; /**< KV heads; num_heads % num_kv_heads == 0 */
    uint32_t head_dim;     /**< one of 64, 80, 96, 128, 192, 256, 512 */
    uint32_t q_len;        /**< query rows per (sequence, head), > 0 */
    uint32_t kv_len;       /**< keys per (sequence, KV head), > 0 */
    int32_t q_offset;      /**< absolute position of query row 0 (kv_len - q_len: bottom-right) */
    uint32_t window;       /**< 0 = no window; else keys with p - j < window */
    float scale;           /**< multiplies q·k (natural-log domain) */
    float softcap;         /**< > 0: s = softcap * tanh(s / softcap); 0 disables */
    uint32_t causal;       /**< 1: key j visible only if j <= q_offset + i */
    uint32_t block_q;      /**< query rows per tile; 0 asks the plan */
    uint32_t block_k;      /**< keys per tile; 0 asks the plan */
    uint32_t num_q_blocks; /**< ceil(q_len / block_q); filled by the plan */
    uint32_t num_k_blocks; /**< ceil(kv_len / block_k); filled by the plan */
    uint32_t reserved;     /**< zero */
    int64_t q_strides[3];    /**< elements between batches, heads, rows of q */
    int64_t k_strides[3];    /**< same for k (heads are KV heads) */
    int64_t v_strides[3];    /**< same for v */
    int64_t out_strides[3];  /**< same for out */
    int64_t mask_strides[3]; /**< mask: batch, head, query row; 0 broadcasts a dim; keys contiguous */
} pyfa_flash_attn_prefill_params;

#define PYFA_PREFILL_ARG_PARAMS 0
#define PYFA_PREFILL_ARG_Q 1
#define PYFA_PREFILL_ARG_K 2
#define PYFA_PREFILL_ARG_V 3
#define PYFA_PREFILL_ARG_MASK 4
#define PYFA_PREFILL_ARG_BLK 5
#define PYFA_PREFILL_ARG_OUT 6
#define PYFA_PREFILL_ARG_LSE 7

/* ---------------------------------------------------------------------------
 * Packed sequences: flash_attn_prefill with PYFA_PREFILL_FC_KV_MODE set.
 *
 * PYFA_PREFILL_KV_VARLEN (flash-attn's flash_attn_varlen_func):
 *   q   rows [total_q, num_heads, head_dim]     packed; head/row strides from
 *   k,v rows [total_k, num_kv_heads, head_dim]  q_strides[1..2] etc.; the
 *   out rows [total_q, num_heads, head_dim]     batch strides are not read
 *   cu_seqlens_q int32 [batch + 1]: sequence b owns q rows
 *     [cu_seqlens_q[b], cu_seqlens_q[b + 1]); cu_seqlens_k likewise k rows.
 * PYFA_PREFILL_KV_PAGED (flash-attn's varlen with block_table / seqused_k):
 *   q, out packed by cu_seqlens_q as above;
 *   k,v pools of paged_kv_params.h (pyfa_kv_pages at slot PAGES; rows of
 *     head_dim elements, contiguous: the strides of k and v are not read);
 *   block_table int32 [batch, pages_per_seq], kv_len int32 [batch] (slot
 *     SEQ_K): sequence b's keys are its positions [0, kv_len[b]), which
 *     include its new rows (the caller appended them before the call).
 * Both modes:
 *   params.batch is the number of sequences; params.q_len and params.kv_len
 *   are the longest sequence's (the grid's x covers ceil(q_len / block_q)
 *   tiles per sequence; a tile past its sequence's rows exits at once);
 *   params.q_offset and mask_strides are not read (no mask, no blk: the
 *   dispatchers refuse them). Sequence b with q_len_b query rows and kv_len_b
 *   keys puts query row i at position kv_len_b - q_len_b + i (bottom-right,
 *   per sequence); causal, window, softcap and GQA as above, per sequence.
 *   lse [num_heads, total_q] f32 (flash-attn's varlen layout: row r of head h
 *   at h * total_q + r), so merge_attention_states with batch 1 and seq_len
 *   total_q merges two packed calls over the same queries.
 *   The inline pyfa_prefill_packed gives total_q (and total_k for varlen).
 * Device values are clamped so no value makes a kernel touch memory outside
 * q, k, v, out, lse or the pools:
 *   sequence b's q rows are [q_begin, q_end) with q_begin = cu_seqlens_q[b]
 *   clamped to [0, total_q] and q_end = cu_seqlens_q[b + 1] clamped to
 *   [q_begin, total_q]; the same for k with total_k (varlen); paged kv_len and
 *   block_table as paged_kv_params.h says; a sequence's rows past
 *   params.q_len are not written (their positions still count all its rows).
 *   A sequence with q_len_b > kv_len_b (only from device values; the
 *   dispatchers refuse host ones) has rows before position 0: under causal
 *   they see no key (zeros, lse -inf), as flash-attn.
 * ------------------------------------------------------------------------- */
#define PYFA_PREFILL_KV_RECT 0   /**< [batch, heads, len, D] by strides, as above */
#define PYFA_PREFILL_KV_VARLEN 1 /**< packed q, k, v by cu_seqlens */
#define PYFA_PREFILL_KV_PAGED 2  /**< packed q, K/V in page pools */

typedef struct pyfa_prefill_packed {
    uint32_t total_q;  /**< rows of q and out (packed) */
    uint32_t total_k;  /**< varlen: rows of k and v; paged: 0 */
    uint32_t reserved[2];
} pyfa_prefill_packed;

/* Slots of the packed modes (bound in every dispatch: without KV_MODE they
 * hold stand-ins the kernels do not read). */
#define PYFA_PREFILL_ARG_CU_SEQLENS_Q 8 /**< int32 [batch + 1] */
#define PYFA_PREFILL_ARG_SEQ_K 9        /**< varlen: cu_seqlens_k [batch + 1]; paged: kv_len [batch] */
#define PYFA_PREFILL_ARG_BLOCK_TABLE 10 /**< paged: int32 [batch, pages_per_seq] */
#define PYFA_PREFILL_ARG_PAGES 11       /**< inline pyfa_kv_pages (paged; zeros otherwise) */
#define PYFA_PREFILL_ARG_PACKED 12      /**< inline pyfa_prefill_packed (zeros in rectangular mode) */

/* ---------------------------------------------------------------------------
 * Key-split blocks (rectangular mode; bound only where a backend's plan splits:
 * BackendPlan.prefillSplit). A grid whose last wave would leave SMs idle runs
 * its blocks of launch rank >= first_rank in `parts` blocks each, every one
 * over a contiguous share of the key tiles [t_begin, t_end) (part i takes
 * tiles t_begin + n i / parts up to t_begin + n (i + 1) / parts, n the
 * block's tiles). Each part leaves its unnormalised state (o, the row maxima
 * in the log2 domain, the partial sums) in SPLIT_STATES and takes a ticket in
 * SPLIT_TICKETS; the last of a block's parts merges them and writes out and
 * lse as the whole block would have, and takes the tickets back (so they stay
 * zero between dispatches). The launch is then one-dimensional: blocks
 * first_rank + parts (logical_rank - first_rank) + part, ranks as the 3-d
 * grid's (query tile slowest, highest first, then sequence, then head).
 *   SPLIT_TICKETS u32 [split blocks], zero before the dispatch;
 *   SPLIT_STATES  f32 [split blocks][parts][state_floats], the backend's layout.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_prefill_split {
    uint32_t first_rank;   /**< launch ranks below run whole */
    uint32_t parts;        /**< >= 2: blocks a later rank's keys are split over */
    uint32_t blocks;       /**< grid blocks in all: first_rank + parts * split blocks */
    uint32_t state_floats; /**< floats of one part's state in SPLIT_STATES */
} pyfa_prefill_split;

#define PYFA_PREFILL_ARG_SPLIT 15         /**< inline pyfa_prefill_split */
#define PYFA_PREFILL_ARG_SPLIT_TICKETS 16 /**< u32 [split blocks] */
#define PYFA_PREFILL_ARG_SPLIT_STATES 17  /**< f32 [split blocks][parts][state_floats] */

/* ---------------------------------------------------------------------------
 * Persistent blocks (rectangular mode; a kernel of its own,
 * flash_attn_prefill_persistent, dispatched only where a backend's plan runs
 * it: BackendPlan.prefillPersistent). A one-dimensional launch of G blocks
 * runs the `ranks` blocks of the 3-d grid, ranks as the key split's (query
 * tile slowest, highest first, then sequence, then head; no split with it):
 * block x takes rank G r + x in even rounds r and G r + G - 1 - x in odd ones
 * (while below `ranks`), in turn, starting each one's copies while the one
 * before finishes.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_prefill_persist {
    uint32_t ranks; /**< the 3-d grid's blocks: num_q_blocks * num_heads * batch, <= INT32_MAX */
} pyfa_prefill_persist;

#define PYFA_PREFILL_ARG_PERSIST 19 /**< inline pyfa_prefill_persist */

/* Function constants of flash_attn_prefill (flash_attn_prefill_blk reads
 * DTYPE, MASK_KIND, BLOCK_Q and BLOCK_K). Booleans are 0/1. */
#define PYFA_PREFILL_FC_DTYPE 0       /**< dtype code of q, k, v (and an additive mask) */
#define PYFA_PREFILL_FC_HEAD_DIM 1    /**< head_dim */
#define PYFA_PREFILL_FC_BLOCK_Q 2     /**< block_q of the plan */
#define PYFA_PREFILL_FC_BLOCK_K 3     /**< block_k of the plan */
#define PYFA_PREFILL_FC_HAS_MASK 4    /**< a mask is bound */
#define PYFA_PREFILL_FC_MASK_KIND 5   /**< PYFA_MASK_ADDITIVE or PYFA_MASK_BOOL */
#define PYFA_PREFILL_FC_DO_CAUSAL 6   /**< params.causal != 0 */
#define PYFA_PREFILL_FC_HAS_WINDOW 7  /**< params.window > 0 */
#define PYFA_PREFILL_FC_HAS_SOFTCAP 8 /**< params.softcap > 0 */
#define PYFA_PREFILL_FC_HAS_BLK 9     /**< a blk buffer is bound */
#define PYFA_PREFILL_FC_HAS_LSE 10    /**< an lse buffer is bound */
#define PYFA_PREFILL_FC_OUT_DTYPE 11  /**< dtype code of out: PREFILL_FC_DTYPE's or PYFA_DTYPE_F32 */
#define PYFA_PREFILL_FC_KV_MODE 12     /**< PYFA_PREFILL_KV_RECT, _VARLEN or _PAGED */
#define PYFA_PREFILL_FC_COUNT 13

/* Function constants of flash_attn_prefill_blk: the tile of the prefill
 * dispatch it serves and how to read the mask. */
#define PYFA_BLK_FC_DTYPE 0     /**< dtype code of the prefill I/O (an additive mask's dtype) */
#define PYFA_BLK_FC_BLOCK_Q 1   /**< block_q of the plan */
#define PYFA_BLK_FC_BLOCK_K 2   /**< block_k of the plan */
#define PYFA_BLK_FC_MASK_KIND 3 /**< PYFA_MASK_ADDITIVE or PYFA_MASK_BOOL */
#define PYFA_BLK_FC_COUNT 4

#define PYFA_MASK_ADDITIVE 0 /**< mask in the I/O dtype, added to the scores */
#define PYFA_MASK_BOOL 1     /**< u8 mask, non-zero = attend */

/* ---------------------------------------------------------------------------
 * flash_attn_prefill_blk: classifies every (query tile, key tile) of the mask.
 * Same params struct (q_len, kv_len, block_q, block_k, num_*_blocks,
 * mask_strides, batch, num_heads are read) and slots MASK / BLK.
 *   mask_batch = mask_strides[0] ? batch : 1;  mask_heads = mask_strides[1] ? num_heads : 1
 *   blk [mask_batch, mask_heads, num_q_blocks, num_k_blocks] u8, contiguous:
 *     PYFA_BLK_SKIP  every entry of the tile blocks (additive -inf / bool 0)
 *     PYFA_BLK_MIXED anything else
 *     PYFA_BLK_ZERO  every entry is additive +-0 / bool non-zero (no-op mask)
 *   Only entries inside [0, q_len) x [0, kv_len) count. SKIP means exactly
 *   -inf (bit pattern), not "very negative": a finite value is a bias, and a
 *   row made only of large negative biases still has a softmax.
 * flash_attn_prefill with blk skips SKIP tiles and the mask read of ZERO
 * tiles; its result is bit-identical to the run without blk.
 * Grid: (num_q_blocks * num_k_blocks, mask_heads, mask_batch); threadgroup
 * (x, y, z) writes byte x of mask plane (z, y): query tile x / num_k_blocks,
 * key tile x % num_k_blocks (one tile a threadgroup, so that a mask shared by
 * every head still fills the GPU). num_q_blocks * num_k_blocks <= INT32_MAX,
 * else the pass (and a plan that asks for it) is refused.
 * ------------------------------------------------------------------------- */
#define PYFA_BLK_SKIP 0
#define PYFA_BLK_MIXED 1
#define PYFA_BLK_ZERO 2

/* ---------------------------------------------------------------------------
 * merge_attention_states: combines two attentions of the same queries over
 * disjoint key sets.
 *   o_a, o_b rows [batch, num_heads, seq_len, head_dim] via o_strides, dtype T
 *   out      rows the same, dtype T or f32 (stored once, round to nearest even)
 *   lse_a, lse_b, lse_out [batch, num_heads, seq_len] f32, contiguous
 *   m = max(lse_a, lse_b); w_x = exp(lse_x - m);
 *   out = (w_a o_a + w_b o_b) / (w_a + w_b); lse_out = m + log(w_a + w_b);
 *   both -inf: out = 0, lse_out = -inf.
 *   +inf (a state of infinite weight) dominates: out = the o of the side(s)
 *   whose lse is +inf (both: their mean), lse_out = +inf. NaN in, NaN out.
 * Grid: (seq_len, num_heads, batch); one threadgroup per row.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_merge_attn_params {
    uint32_t batch;        /**< sequences */
    uint32_t num_heads;    /**< heads */
    uint32_t seq_len;      /**< rows per (sequence, head) */
    uint32_t head_dim;     /**< values per row; a multiple of 8 */
    int64_t o_strides[3];  /**< elements between batches, heads, rows of o_a, o_b and out */
} pyfa_merge_attn_params;

#define PYFA_MERGE_ARG_PARAMS 0
#define PYFA_MERGE_ARG_O_A 1
#define PYFA_MERGE_ARG_LSE_A 2
#define PYFA_MERGE_ARG_O_B 3
#define PYFA_MERGE_ARG_LSE_B 4
#define PYFA_MERGE_ARG_OUT 5
#define PYFA_MERGE_ARG_LSE_OUT 6

#define PYFA_MERGE_FC_DTYPE 0     /**< dtype code of o_a and o_b */
#define PYFA_MERGE_FC_HAS_LSE 1   /**< lse_out is bound */
#define PYFA_MERGE_FC_OUT_DTYPE 2 /**< dtype code of out: MERGE_FC_DTYPE's or PYFA_DTYPE_F32 */
#define PYFA_MERGE_FC_COUNT 3
