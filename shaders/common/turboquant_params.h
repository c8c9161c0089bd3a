/*
 * TurboQuant compressed KV cache: the codec (one format on every backend) and
 * the parameter structs, argument slots and function constants of its
 * kernels. Included at the end of pyfa_params.h.
 *
 * ===========================================================================
 * THE CODEC. Codes are a pure function of (row, seed, bits, norm_correction):
 * every backend must produce the same bytes. All arithmetic below is IEEE-754
 * binary32, round to nearest, in the order written, with NO FMA contraction
 * (CPU: `#pragma clang fp contract(off)`; CUDA: __fmul_rn/__fadd_rn or
 * -fmad=false; Metal: fast-math off for the encoder). sqrtf and / are
 * correctly rounded.
 *
 * Head dims: D in {64, 128, 256, 512} (a power of two for the FWHT).
 * Bits: b in {2, 3, 4, 8}; L = 2^b levels. K and V bits are independent.
 *
 * Codebook: c[0..L) = the Lloyd-Max centroids of N(0,1), sorted ascending,
 *   exactly symmetric (c[L-1-i] == -c[i]), as f32. The library computes them
 *   (pyfa_turboquant_codebook) and dispatchers pass them to kernels as an
 *   inline f32[L] argument; kernels never hold their own copy.
 *   Thresholds: th[k] = (c[k-1] + c[k]) * 0.5f for k = 1..L-1 (f32).
 *
 * Signs: s[i] for coordinate i of stream t (0 = K, 1 = V) and 64-bit seed
 *   (seed = seed_lo | seed_hi << 32):
 *     z = seed + 0x9E3779B97F4A7C15 * (((uint64)t << 32 | i) + 1)   (mod 2^64)
 *     z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
 *     z = (z ^ (z >> 27)) * 0x94D049BB133111EB
 *     z =  z ^ (z >> 31)
 *     s[i] = (z >> 63) ? -1 : +1
 *   i.e. output number ((t << 32 | i) + 1) of splitmix64 seeded with `seed`.
 *   One vector per stream, shared by every head and position.
 *
 * FWHT(u): unnormalised Walsh-Hadamard transform in natural (Sylvester)
 *   order, in place: for h = 1, 2, 4, .. D/2, for every j with (j & h) == 0:
 *   (a, b) = (u[j], u[j+h]); u[j] = a + b; u[j+h] = a - b.
 *
 * sumsq(v) / dot(v, w): 8 partial sums, p[l] = sum over k ascending of
 *   v[8k+l]*w[8k+l] (product rounded, then sum rounded), combined as
 *   ((p0+p4)+(p1+p5))+((p2+p6)+(p3+p7)).
 *
 * Encode one row x[D] (f16/bf16 inputs are first widened to f32 exactly):
 *   E = bits 23..30 (the biased exponent) of the largest |x[i]| bit pattern
 *       (x[i]'s bits & 0x7fffffff, compared as uint32), clamped to 1..254
 *   pre = the f32 with bits (255 - E) << 23     (= 2^(128 - E), a normal f32)
 *   xs[i] = x[i] * pre                          (max |xs[i]| in [2, 4): exact
 *                                                for normal rows, and sumsq
 *                                                cannot overflow or underflow)
 *   u[i] = s_K/V[i] * xs[i];  FWHT(u)          (u = sqrt(D) * H.(s . xs))
 *   norm = sqrtf(sumsq(xs)); inv = norm > 0 ? 1.0f / norm : 0
 *   t[i] = u[i] * inv                          (= y[i] * sqrt(D) / |x|)
 *   idx[i] = #{k in 1..L-1 : th[k] < t[i]}     (ties go to the lower cell)
 *   s = norm                                     norm_correction NONE
 *     = norm * sqrtf((float)D / sumsq(c[idx]))    NORM_PRESERVING (if > 0)
 *     = norm * ((float)D / dot(c[idx], t))        UNBIASED (if dot > 0)
 *   (a zero denominator leaves s = norm; a zero row gives s = 0)
 *   scale = s / pre                            (exact unless the scale itself
 *                                                leaves the f32 range)
 *   Power-of-two prescaling changes no rounding in the normal range, so a
 *   row whose sumsq(x) is a normal f32 encodes as without it; any finite
 *   row's codes are those of its direction (tiny and subnormal rows
 *   included), and its scale is finite wherever |x| is (up to ~1e37 at
 *   D = 512). Rows must be finite.
 *
 * Decode: in the rotated domain the row is y~[i] = c[idx[i]] * scale / sqrt(D);
 *   in the original domain x~[i] = s[i] * FWHT(c[idx])[i] * (scale / (float)D).
 *
 * Packing (codes row = D*b/8 bytes): each group of 8 consecutive coordinates
 *   8g..8g+7 takes b bytes at offset g*b; read as a little-endian integer w,
 *   coordinate 8g+j is (w >> (b*j)) & (L-1). So 4-bit: low nibble = even
 *   coordinate; 8-bit: one byte per coordinate; 2-bit: four per byte, lowest
 *   bits first; 3-bit: a little-endian bit stream.
 *
 * Cache buffers (one sequence; a batched cache adds a leading [batch]):
 *   codes  [num_kv_heads, kv_capacity, D*b/8] u8, one for K and one for V
 *   scales [num_kv_heads, kv_capacity] f32, one for K and one for V
 * ===========================================================================
 */

#pragma once
#include "pyfa_params.h"

/* TurboQuant head dims and bit widths, listed once (as in pyfa_params.h). */
#define PYFA_FOR_EACH_TQ_HEAD_DIM(X) X(64) X(128) X(256) X(512)
#define PYFA_FOR_EACH_TQ_BITS(X) X(2) X(3) X(4) X(8)

#define PYFA_TQ_STREAM_K 0
#define PYFA_TQ_STREAM_V 1

#define PYFA_TQ_NORM_NONE 0            /**< scale = |x| */
#define PYFA_TQ_NORM_PRESERVING 1      /**< |x~| = |x| */
#define PYFA_TQ_NORM_UNBIASED 2        /**< <x~, x> = <x, x> */

/** Bytes of one packed row. */
#define PYFA_TQ_ROW_BYTES(head_dim, bits) ((head_dim) * (bits) / 8)

/* ---------------------------------------------------------------------------
 * hadamard_quantize_kv: encodes num_tokens rows per KV head into a cache.
 *   src    [num_tokens, num_kv_heads, head_dim]  f32 | f16 | bf16
 *   codes  [batch, num_kv_heads, kv_capacity, row_bytes] u8 (written)
 *   scales [batch, num_kv_heads, kv_capacity] f32        (written)
 *   codebook: inline f32[2^bits]
 * Token i of KV head h lands in slot (position + i) mod kv_capacity of
 * sequence `sequence`; num_tokens <= kv_capacity so no two tokens share a slot.
 * `position` is the int32 argument PYFA_TQ_QUANT_ARG_POSITION, as kv_append's
 * (pyfa_params.h): write_pos, or a cache's device state; outside
 * 0..kv_capacity-1 nothing is written.
 * Grid: (num_tokens, num_kv_heads, 1); one workgroup encodes one row.
 * Backends whose plan says so (BackendPlan.appendsInOneDispatch) also take
 * K and V in one dispatch, as kv_append does: grid z = 2, workgroups of
 * z = 1 encoding src_v into codes_v / scales_v with the V sign stream (same
 * bits, src dtype and positions; `stream` then names K's); and, given
 * tickets, the dispatch advances the state at POSITION itself (kv_advance's
 * rule, params at ADVANCE; tickets u32 [1], zero before and after).
 * ------------------------------------------------------------------------- */
typedef struct pyfa_tq_quantize_params {
    uint32_t num_tokens;      /**< rows per KV head, 1..kv_capacity */
    uint32_t num_kv_heads;
    uint32_t head_dim;        /**< 64, 128, 256 or 512 */
    uint32_t kv_capacity;
    uint32_t write_pos;       /**< slot of token 0, < kv_capacity (sent as the position) */
    uint32_t bits;            /**< 2, 3, 4 or 8 */
    uint32_t stream;          /**< PYFA_TQ_STREAM_K or _V: which sign vector */
    uint32_t norm_correction; /**< PYFA_TQ_NORM_* */
    uint32_t seed_lo;
    uint32_t seed_hi;
    uint32_t sequence;        /**< index into the cache's batch dimension */
    uint32_t reserved;        /**< zero */
} pyfa_tq_quantize_params;

#define PYFA_TQ_QUANT_ARG_PARAMS 0
#define PYFA_TQ_QUANT_ARG_SRC 1
#define PYFA_TQ_QUANT_ARG_CODES 2
#define PYFA_TQ_QUANT_ARG_SCALES 3
#define PYFA_TQ_QUANT_ARG_CODEBOOK 4
#define PYFA_TQ_QUANT_ARG_POSITION 5 /**< int32 [1]: the slot of token 0 (launch bytes or memory) */
#define PYFA_TQ_QUANT_ARG_SRC_V 6    /**< one dispatch for K and V (grid z = 2): V's rows */
#define PYFA_TQ_QUANT_ARG_CODES_V 7  /**< one dispatch for K and V: V's codes */
#define PYFA_TQ_QUANT_ARG_SCALES_V 8 /**< one dispatch for K and V: V's scales */
#define PYFA_TQ_QUANT_ARG_ADVANCE 9  /**< with TICKETS: pyfa_kv_advance_params of the state at POSITION */
#define PYFA_TQ_QUANT_ARG_TICKETS 10 /**< u32 [1]: the dispatch advances the state itself */

#define PYFA_TQ_QUANT_FC_SRC_DTYPE 0 /**< dtype code of src */
#define PYFA_TQ_QUANT_FC_BITS 1      /**< == params.bits */
#define PYFA_TQ_QUANT_FC_HEAD_DIM 2  /**< == params.head_dim */
#define PYFA_TQ_QUANT_FC_COUNT 3

/* ---------------------------------------------------------------------------
 * tq_dequantize_kv: decodes num_tokens slots per KV head back to f32 rows in
 * the original domain (inspection and tests).
 *   codes, scales as above; out [num_tokens, num_kv_heads, head_dim] f32.
 * Row i reads slot (first_slot + i) mod kv_capacity of sequence `sequence`.
 * Grid: (num_tokens, num_kv_heads, 1).
 * ------------------------------------------------------------------------- */
typedef struct pyfa_tq_dequantize_params {
    uint32_t num_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint32_t kv_capacity;
    uint32_t first_slot;      /**< < kv_capacity */
    uint32_t bits;
    uint32_t stream;
    uint32_t sequence;
    uint32_t seed_lo;
    uint32_t seed_hi;
} pyfa_tq_dequantize_params;

#define PYFA_TQ_DEQUANT_ARG_PARAMS 0
#define PYFA_TQ_DEQUANT_ARG_CODES 1
#define PYFA_TQ_DEQUANT_ARG_SCALES 2
#define PYFA_TQ_DEQUANT_ARG_CODEBOOK 3
#define PYFA_TQ_DEQUANT_ARG_OUT 4

#define PYFA_TQ_DEQUANT_FC_BITS 0
#define PYFA_TQ_DEQUANT_FC_HEAD_DIM 1
#define PYFA_TQ_DEQUANT_FC_COUNT 2

/* ---------------------------------------------------------------------------
 * fwht (transform PLAIN):          dst = H.src / sqrt(D)
 * fwht_sign_premult (SIGN_PREMULT): dst = H.(s . src) / sqrt(D)   (Q in)
 * fwht_sign_undo (SIGN_UNDO):       dst = s . (H.src) / sqrt(D)   (output out)
 * with H the FWHT above and 1/sqrt(D) = 1.0f / sqrtf((float)D) applied last.
 *   src [nrows, head_dim] f32 | f16 | bf16;
 *   dst [nrows, head_dim] f32 | f16 | bf16 (PYFA_TQ_FWHT_FC_DST_DTYPE), the
 *   transform's f32 result rounded once to nearest even; dst may be src
 *   itself when both have one dtype (in place).
 * Grid: (nrows, 1, 1).
 * ------------------------------------------------------------------------- */
#define PYFA_TQ_FWHT_PLAIN 0
#define PYFA_TQ_FWHT_SIGN_PREMULT 1
#define PYFA_TQ_FWHT_SIGN_UNDO 2

typedef struct pyfa_tq_fwht_params {
    uint32_t nrows;
    uint32_t head_dim;  /**< 64, 128, 256 or 512 */
    uint32_t transform; /**< PYFA_TQ_FWHT_*: picks the kernel */
    uint32_t stream;    /**< sign stream (ignored by PLAIN) */
    uint32_t seed_lo;
    uint32_t seed_hi;
} pyfa_tq_fwht_params;

#define PYFA_TQ_FWHT_ARG_PARAMS 0
#define PYFA_TQ_FWHT_ARG_SRC 1
#define PYFA_TQ_FWHT_ARG_DST 2

#define PYFA_TQ_FWHT_FC_SRC_DTYPE 0
#define PYFA_TQ_FWHT_FC_HEAD_DIM 1
#define PYFA_TQ_FWHT_FC_DST_DTYPE 2
#define PYFA_TQ_FWHT_FC_COUNT 3

/* ---------------------------------------------------------------------------
 * flash_attn_vec_tq: decode over TurboQuant codes, in the rotated domain.
 * The same semantics, grid, nwg and tmp layout as flash_attn_vec (kv_len,
 * ring_start, window, softcap, GQA, the lse convention), with the dense
 * params as the first member. K and V rows are dequantised in registers:
 *   k~[i] = c_K[idx[i]] * scale_K / sqrt(D)   (v likewise with c_V, scale_V)
 * Slots 0..8 are flash_attn_vec's: q is the PRE-ROTATED query
 * (fwht_sign_premult, K stream) as f32 [batch, num_heads, head_dim], or,
 * with q_in = PYFA_TQ_Q_IN_UNROTATED + a dtype code, the op's q itself in
 * that dtype, which the kernel rotates with fwht_sign_premult's arithmetic
 * (the same f32 values, so the same output bits); k/v are
 * codes [batch, num_kv_heads, kv_capacity, row_bytes]; out (nwg == 1) or the
 * partials in tmp stay in the rotated domain (V stream), out in f32. The
 * rotation is orthogonal, so rotated-domain scores equal original-domain
 * ones and the kernel's lse (nwg == 1) is the lse of the whole op.
 *
 * The whole op (pyfa_flash_attn_vec_tq) runs: fwht_sign_premult(q) into the
 * q_rot region of tmp (unless the backend's plan has the decode kernel
 * rotate q: then the op sets q_in and binds q) -> flash_attn_vec_tq -> then
 *   nwg == 1:           (o_rot, lse) -> fwht_sign_undo(o_rot) into out
 *   nwg > 1, fused = 0: flash_attn_vec_reduce into (o_rot f32, lse) ->
 *                       fwht_sign_undo(o_rot) into out
 *   nwg > 1, fused = 1: flash_attn_vec_reduce_tq_hb_undo into (out, lse)
 * so out (f32 | f16 | bf16) is stored once, by the last kernel. Where the
 * backend's plan allows it (a plan's run with its tickets, fused = 1, not
 * paged), a split's last workgroup of each row instead merges the row into
 * o_rot (flash_attn_vec's DIRECT_OUT 2: attn_vec_merge_last) and takes it
 * through the undo into out (slot PYFA_TQ_VEC_ARG_MERGED_OUT, dtype
 * PYFA_TQ_VEC_FC_OUT_DTYPE), with the bits of the fused tail.
 * tmp layout: [the flash_attn_vec tmp layout (empty when nwg == 1)], padded
 *             to 16 bytes, then q_rot [batch * num_heads * head_dim] f32,
 *             then o_rot [batch * num_heads * head_dim] f32.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_flash_attn_vec_tq_params {
    pyfa_flash_attn_vec_params attn; /**< head_dim in {64, 128, 256, 512} */
    uint32_t k_bits;                 /**< 2, 3, 4 or 8 */
    uint32_t v_bits;                 /**< 2, 3, 4 or 8 */
    uint32_t seed_lo;                /**< the cache's seed (signs of Q-in and out-undo) */
    uint32_t seed_hi;
    uint32_t fused;                  /**< 1: fused reduce + undo tail (nwg > 1) */
    uint32_t q_in;                   /**< PYFA_TQ_Q_IN_*: callers pass ROTATED (0); the op sets it */
} pyfa_flash_attn_vec_tq_params;

/* flash_attn_vec_tq's q_in: what the q slot holds. ROTATED: q_rot, f32;
 * UNROTATED + dtype code (f32, f16, bf16): the op's q, rotated in the kernel. */
#define PYFA_TQ_Q_IN_ROTATED 0
#define PYFA_TQ_Q_IN_UNROTATED 1

#define PYFA_TQ_VEC_ARG_K_SCALES 9
#define PYFA_TQ_VEC_ARG_V_SCALES 10
#define PYFA_TQ_VEC_ARG_K_CODEBOOK 11 /**< inline f32[2^k_bits] */
#define PYFA_TQ_VEC_ARG_V_CODEBOOK 12 /**< inline f32[2^v_bits] */
#define PYFA_TQ_VEC_ARG_MERGED_OUT 13 /**< DIRECT_OUT 2: the op's out (a paged decode's PYFA_VEC_ARG_PAGES slot: never both) */

#define PYFA_TQ_VEC_FC_K_BITS 0
#define PYFA_TQ_VEC_FC_V_BITS 1
#define PYFA_TQ_VEC_FC_HEAD_DIM 2    /**< == PYFA_VEC_FC_HEAD_DIM */
#define PYFA_TQ_VEC_FC_HAS_SOFTCAP 3 /**< == PYFA_VEC_FC_HAS_SOFTCAP */
#define PYFA_TQ_VEC_FC_DIRECT_OUT 4  /**< as PYFA_VEC_FC_DIRECT_OUT (2: the last workgroup merges and undoes) */
#define PYFA_TQ_VEC_FC_HAS_LSE 5     /**< bool: lse is bound (read only with DIRECT_OUT, else 0) */
#define PYFA_TQ_VEC_FC_PAGED 6       /**< bool: codes and scales are paged pools (paged_kv_params.h) */
#define PYFA_TQ_VEC_FC_OUT_DTYPE 7   /**< dtype code of the op's out with DIRECT_OUT 2 (f32 otherwise) */
#define PYFA_TQ_VEC_FC_COUNT 8

/* ---------------------------------------------------------------------------
 * flash_attn_vec_reduce_tq_hb_undo: flash_attn_vec_reduce then
 * fwht_sign_undo (V stream) of each row, in one pass. Its output is bit for
 * bit that of the two kernels run one after the other: both paths must run
 * the same reduce arithmetic and the same undo arithmetic.
 *   tmp, out, lse and grid as flash_attn_vec_reduce (slots PYFA_REDUCE_ARG_*,
 *   constants PYFA_REDUCE_FC_*): out in its dtype is the undone row rounded
 *   once; the undo never changes lse.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_tq_reduce_undo_params {
    pyfa_attn_reduce_params reduce; /**< nrows, head_dim, nwg */
    uint32_t seed_lo;
    uint32_t seed_hi;
    uint32_t stream;                /**< PYFA_TQ_STREAM_V */
    uint32_t reserved;              /**< zero */
} pyfa_tq_reduce_undo_params;
