/*
 * Parameter structs, argument slots and function-constant indices shared by
 * every kernel language (C CPU kernels, CUDA C++, MSL) and by Swift through
 * the PyfaShaderCommon module. Each struct is defined here and nowhere else;
 * tests pin every size (params_layout.c at compile time, the Swift and
 * Python suites at run time).
 *
 * Fixed-width fields only, naturally aligned, no implicit padding.
 */
#pragma once

#if !defined(__METAL_VERSION__) && !defined(__CUDACC_RTC__)
#include <stdint.h>
#endif

/* Element types, the same codes as pyfa_dtype in pyfa.h. */
#define PYFA_DTYPE_F32 0
#define PYFA_DTYPE_F16 1
#define PYFA_DTYPE_BF16 2
#define PYFA_DTYPE_U8 3
#define PYFA_DTYPE_U16 4
#define PYFA_DTYPE_U32 5
#define PYFA_DTYPE_I32 6

/* What the attention kernels are built for, listed once. Each X-macro
 * expands X(value) per supported value, in increasing order; C switches and
 * tables use them directly, and pyfa_supported() in pyfa.h reports the same
 * lists as text for Swift and Python. */
#define PYFA_FOR_EACH_HEAD_DIM(X) X(64) X(80) X(96) X(128) X(192) X(256) X(512)
#define PYFA_FOR_EACH_ATTN_DTYPE(X) X(PYFA_DTYPE_F32) X(PYFA_DTYPE_F16) X(PYFA_DTYPE_BF16)
#define PYFA_MAX_HEAD_DIM 512

/* ---------------------------------------------------------------------------
 * flash_attn_vec: decode, one query row per head against a KV cache.
 *   q   [batch, num_heads, head_dim]                 f32 | f16 | bf16
 *   k,v [batch, num_kv_heads, kv_capacity, head_dim] f32 | f16 | bf16
 *   kv_len, ring_start [batch]                       u32
 *   tmp (nwg > 1) partial outputs [batch*num_heads, nwg, head_dim] f32,
 *       then (S, M) pairs [batch*num_heads, nwg, 2] f32 (natural-log
 *       domain: S = sum of exp(s - M) over the workgroup's keys, M their
 *       largest score); with nwg == 1 the dispatcher binds out in this slot
 *       (never written there)
 *   out [batch, num_heads, head_dim]                 f32 | f16 | bf16
 *   lse [batch * num_heads]                          f32, optional
 * Sequence b holds kv_len[b] positions; logical position p (0 the oldest) is
 * in slot (ring_start[b] + p) mod kv_capacity. A full ring starts anywhere;
 * a shorter run may too (e.g. a left-padded sequence's first real token), and
 * slots outside the run are not read. With window > 0 only the last `window`
 * logical positions are visible.
 * Scores s = scale * q.k, then softcap * tanh(s / softcap) if softcap > 0.
 * Accumulation and softmax statistics are f32; only the final store converts
 * out to its dtype (round to nearest even). lse = log(sum_j exp(s_j)) over
 * the row's visible keys (natural log, the maximum included: M + log(S)). A
 * row with no visible key writes out = 0 and lse = -inf: the conventions of
 * flash_attn_prefill, so merge_attention_states combines either kind of
 * state.
 * kv_len and ring_start are read when the dispatch runs, not when it is
 * recorded (the dispatcher checks them at record time only where they are
 * host-visible, and there requires 1 <= kv_len <= kv_capacity). Every
 * backend's kernel clamps the values it reads, so no value makes it read
 * outside the cache: kv_len[b] negative as an int32 is 0 (no visible key:
 * out is 0, lse -inf), above kv_capacity is kv_capacity; ring_start[b] at or
 * above kv_capacity is 0.
 * nwg == 1 (PYFA_VEC_FC_DIRECT_OUT = 1): the kernel normalises into out and
 * writes lse. nwg > 1: it writes its partial state to tmp, and
 * flash_attn_vec_reduce writes out and lse; or, with PYFA_VEC_FC_DIRECT_OUT
 * = 2 (backends whose plan says so), the workgroup that finishes a row's
 * partials last merges them as flash_attn_vec_reduce would (the same bits)
 * into out and lse: tickets [batch * num_heads] u32 counts the workgroups
 * done with each row, zero before a dispatch and left zero after it (a
 * plan's memory, zeroed once: dispatches sharing it run in stream order).
 * Grid: (nwg, num_kv_heads, batch); one workgroup serves the
 * num_heads/num_kv_heads query heads that share a KV head.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_flash_attn_vec_params {
    uint32_t batch;        /**< sequences in the batch */
    uint32_t num_heads;    /**< query heads */
    uint32_t num_kv_heads; /**< KV heads; num_heads % num_kv_heads == 0 */
    uint32_t head_dim;     /**< one of 64, 80, 96, 128, 192, 256, 512 */
    uint32_t kv_capacity;  /**< positions per (sequence, KV head): the row stride */
    uint32_t nwg;          /**< workgroups per sequence; 0 asks the backend's plan */
    uint32_t window;       /**< 0 = all positions; else the last `window` positions */
    float scale;           /**< multiplies q.k (natural-log domain) */
    float softcap;         /**< > 0: s = softcap * tanh(s / softcap); 0 disables */
    uint32_t reserved;     /**< zero */
} pyfa_flash_attn_vec_params;

#define PYFA_VEC_ARG_PARAMS 0
#define PYFA_VEC_ARG_Q 1
#define PYFA_VEC_ARG_K 2
#define PYFA_VEC_ARG_V 3
#define PYFA_VEC_ARG_KV_LEN 4
#define PYFA_VEC_ARG_RING_START 5
#define PYFA_VEC_ARG_TMP 6
#define PYFA_VEC_ARG_OUT 7
#define PYFA_VEC_ARG_LSE 8 /**< without an lse the dispatcher binds out here (never written) */
#define PYFA_VEC_ARG_TICKETS 15 /**< DIRECT_OUT = 2 only (slots 9-14: TurboQuant's and the paged decode's) */

/* Function constants of flash_attn_vec. OUT_DTYPE and HAS_LSE concern the
 * kernels that write out (DIRECT_OUT 1 or 2): with DIRECT_OUT 0 they are
 * PYFA_DTYPE_F32 and 0, so the split path has one specialisation whatever the
 * reduce writes. */
#define PYFA_VEC_FC_Q_DTYPE 0     /**< dtype code of q */
#define PYFA_VEC_FC_KV_DTYPE 1    /**< dtype code of k and v */
#define PYFA_VEC_FC_HEAD_DIM 2    /**< head_dim, so loops have a known trip count */
#define PYFA_VEC_FC_HAS_SOFTCAP 3 /**< bool */
#define PYFA_VEC_FC_DIRECT_OUT 4  /**< 1: nwg == 1, normalise into out; 2: nwg > 1, the last workgroup merges; 0: reduce */
#define PYFA_VEC_FC_VARIANT 5     /**< kernel variant the backend's plan picked (below) */
#define PYFA_VEC_FC_OUT_DTYPE 6   /**< dtype code of out (f32, f16 or bf16) */
#define PYFA_VEC_FC_HAS_LSE 7     /**< bool: an lse buffer is bound */
#define PYFA_VEC_FC_PAGED 8       /**< bool: k / v are paged pools (paged_kv_params.h) */
#define PYFA_VEC_FC_COUNT 9

/* Variants of flash_attn_vec: one contract, different hardware routes. A
 * backend's plan picks one per dispatch; backends without a variant run the
 * portable kernel for every value. */
#define PYFA_VEC_VARIANT_PORTABLE 0 /**< vector units, any cache dtype */
#define PYFA_VEC_VARIANT_MMA 1      /**< tensor cores over 16-bit caches (CUDA) */

/* ---------------------------------------------------------------------------
 * flash_attn_vec_reduce: merges the nwg partial (o, S, M) states of each row.
 *   tmp as above; out [nrows, head_dim] f32 | f16 | bf16 (PYFA_REDUCE_FC_OUT_DTYPE);
 *   lse [nrows] f32 when PYFA_REDUCE_FC_HAS_LSE (max_w M_w + log(sum_w S_w
 *   exp(M_w - max_w M_w)) over the states with S > 0). Grid: (nrows, 1, 1).
 * A row whose workgroups all saw no key (S == 0 everywhere) becomes zeros,
 * lse -inf.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_attn_reduce_params {
    uint32_t nrows;    /**< batch * num_heads */
    uint32_t head_dim; /**< values per row */
    uint32_t nwg;      /**< partial states per row */
    uint32_t reserved; /**< zero */
} pyfa_attn_reduce_params;

#define PYFA_REDUCE_FC_HEAD_DIM 0  /**< == params.head_dim */
#define PYFA_REDUCE_FC_OUT_DTYPE 1 /**< dtype code of out (f32, f16 or bf16) */
#define PYFA_REDUCE_FC_HAS_LSE 2   /**< bool: an lse buffer is bound */
#define PYFA_REDUCE_FC_COUNT 3

#define PYFA_REDUCE_ARG_PARAMS 0
#define PYFA_REDUCE_ARG_TMP 1
#define PYFA_REDUCE_ARG_OUT 2
#define PYFA_REDUCE_ARG_LSE 3 /**< without an lse the dispatcher binds out here (never written) */

/* ---------------------------------------------------------------------------
 * kv_append: writes num_tokens rows per KV head into a dense cache (K or V).
 *   src   [num_tokens, num_kv_heads, head_dim]               f32 | f16 | bf16
 *   cache [batch, num_kv_heads, kv_capacity, head_dim]       f32 | f16 | bf16 (written)
 * Token i of KV head h lands in slot (position + i) mod kv_capacity of
 * sequence `sequence`; num_tokens <= kv_capacity so no two tokens share a
 * slot, and nothing else of the cache is written. `position` is the int32
 * argument PYFA_KV_APPEND_ARG_POSITION: the launch's copy of write_pos, or
 * the write_pos of a cache's device state (pyfa_kv_state, set by
 * kv_advance); a value outside 0..kv_capacity-1 writes nothing. src and cache dtypes are
 * independent: each element is widened to f32 (exact), then rounded to the
 * cache dtype to nearest even (overflow becomes +-inf, NaN stays a NaN of
 * unspecified payload); equal dtypes copy the bits. src must not overlap
 * the cache. Any head_dim >= 1.
 * Grid: (num_tokens, num_kv_heads, 1); one workgroup writes one row.
 * Backends whose plan says so (BackendPlan.appendsInOneDispatch) also take
 * K and V in one dispatch: grid z = 2, workgroups of z = 1 writing src_v
 * into cache_v (same dtypes, same positions); and, given tickets, the
 * dispatch advances the state at POSITION itself (kv_advance's rule, params
 * at ADVANCE): every workgroup writes at the advanced state's write_pos,
 * and the last to finish (tickets u32 [1], zero before and after) stores
 * the advanced state.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_kv_append_params {
    uint32_t num_tokens;   /**< rows per KV head, 1..kv_capacity */
    uint32_t num_kv_heads;
    uint32_t head_dim;     /**< elements per row, >= 1 */
    uint32_t kv_capacity;  /**< slots per (sequence, KV head): the cache's row stride */
    uint32_t write_pos;    /**< slot of token 0, < kv_capacity (the dispatcher sends it as the position) */
    uint32_t sequence;     /**< index into the cache's batch dimension */
} pyfa_kv_append_params;

#define PYFA_KV_APPEND_ARG_PARAMS 0
#define PYFA_KV_APPEND_ARG_SRC 1
#define PYFA_KV_APPEND_ARG_CACHE 2
#define PYFA_KV_APPEND_ARG_POSITION 3 /**< int32 [1]: the slot of token 0 (launch bytes or memory) */
#define PYFA_KV_APPEND_ARG_SRC_V 4    /**< one dispatch for K and V (grid z = 2): V's rows */
#define PYFA_KV_APPEND_ARG_CACHE_V 5  /**< one dispatch for K and V: V's cache */
#define PYFA_KV_APPEND_ARG_ADVANCE 6  /**< with TICKETS: pyfa_kv_advance_params of the state at POSITION */
#define PYFA_KV_APPEND_ARG_TICKETS 7  /**< u32 [1]: the dispatch advances the state itself */

/* ---------------------------------------------------------------------------
 * A single-sequence cache's length kept in device memory, so appends and
 * attends read it when they run (a CUDA graph replays them without the
 * host): int32 [4] as below. kv_len and ring_start are what flash_attn_vec
 * reads (pass their addresses as its per-sequence values); write_pos is the
 * slot the last append's first written row went to, -1 when that append was
 * dropped.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_kv_state {
    int32_t write_pos;  /**< slot of the last append's first written row; -1: dropped */
    int32_t kv_len;     /**< rows stored, 0..kv_capacity */
    int32_t ring_start; /**< slot of the oldest row once the ring is full, else 0 */
    int32_t dropped;    /**< appends dropped for want of room (no ring), counted */
} pyfa_kv_state;

/* ---------------------------------------------------------------------------
 * kv_advance: moves a cache's pyfa_kv_state past an append of num_tokens
 * rows, before the append's kernels run (they read state.write_pos), as
 * pyfa_kv_advanced below:
 *   state  pyfa_kv_state (read and written)
 * write_pos becomes the slot the appended rows start at: kv_len while the
 * cache has room, else ring_start; a ring (`ring` 1) keeps the last
 * kv_capacity of more than kv_capacity rows, so it starts num_tokens -
 * kv_capacity later. Without a ring an append past kv_capacity is dropped:
 * write_pos -1, dropped + 1, kv_len and ring_start unchanged. kv_len and
 * ring_start read outside their ranges are clamped first (0..kv_capacity,
 * 0..kv_capacity-1), so no slot outside the cache is ever named.
 * Grid: (1, 1, 1); one thread works.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_kv_advance_params {
    uint32_t kv_capacity; /**< >= 1 */
    uint32_t num_tokens;  /**< rows the append was given, >= 1 */
    uint32_t ring;        /**< 1: a ring buffer (a sliding-window cache); 0: appends past capacity drop */
    uint32_t reserved;    /**< zero */
} pyfa_kv_advance_params;

#define PYFA_KV_ADVANCE_ARG_PARAMS 0
#define PYFA_KV_ADVANCE_ARG_STATE 1

/* Shared by the kernel languages; not part of the C ABI (pyfa/_native.py's
 * cdef leaves out blocks guarded by PYFA_ABI_DECLARATIONS_ONLY). */
#ifndef PYFA_ABI_DECLARATIONS_ONLY
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define PYFA_PARAMS_FN __host__ __device__ inline
#elif defined(__METAL_VERSION__)
#define PYFA_PARAMS_FN inline
#else
#define PYFA_PARAMS_FN static inline
#endif

/* kv_advance's whole work, which every backend's kernel applies to the state
 * it reads: the state after an append of p.num_tokens rows. 32-bit
 * arithmetic that cannot overflow: lengths are at most INT32_MAX, and
 * num_tokens enters only compared with the room left or modulo kv_capacity. */
PYFA_PARAMS_FN pyfa_kv_state pyfa_kv_advanced(pyfa_kv_state s, pyfa_kv_advance_params p) {
    const uint32_t cap = p.kv_capacity, n = p.num_tokens;
    const uint32_t len = s.kv_len < 0 ? 0u : ((uint32_t)s.kv_len > cap ? cap : (uint32_t)s.kv_len);
    const uint32_t oldest = (len == cap && s.ring_start >= 0 && (uint32_t)s.ring_start < cap) ? (uint32_t)s.ring_start : 0u;
    const uint32_t start = len < cap ? len : oldest; /* where the next row goes */
    const int fits = n <= cap - len;
    pyfa_kv_state out = s;
    if (!fits && p.ring == 0u) {
        out.write_pos = -1;
        out.dropped = s.dropped + 1;
        return out;
    }
    const uint32_t skip = n > cap ? n - cap : 0u; /* rows a ring overwrites within this append */
    out.write_pos = (int32_t)((start + skip % cap) % cap);
    out.kv_len = (int32_t)(fits ? len + n : cap);
    out.ring_start = (int32_t)(fits ? 0u : (start + n % cap) % cap);
    return out;
}
#endif /* PYFA_ABI_DECLARATIONS_ONLY */

#define PYFA_KV_APPEND_FC_SRC_DTYPE 0   /**< dtype code of src */
#define PYFA_KV_APPEND_FC_CACHE_DTYPE 1 /**< dtype code of the cache */
#define PYFA_KV_APPEND_FC_COUNT 2

#include "flash_attn_prefill_params.h"
#include "turboquant_params.h"
#include "paged_kv_params.h"
