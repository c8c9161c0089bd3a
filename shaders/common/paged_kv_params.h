/*
 * Paged KV: the layout every paged op shares (decode, TurboQuant decode,
 * appends, chunked prefill). Included at the end of pyfa_params.h; the same
 * rules apply (fixed-width fields, no implicit padding, sizes pinned in
 * params_layout.c).
 *
 * A pool holds the K rows (and a second pool the V rows) of one layer for
 * every sequence of a batch, in pages of page_size tokens x num_kv_heads
 * heads:
 *   PYFA_PAGES_NHD: [num_pages, page_size, num_kv_heads, head_dim]
 *     flash-attn's paged k_cache / v_cache (with block_table), vLLM's
 *     FlashAttention backend and FlashInfer's "NHD" layout;
 *   PYFA_PAGES_HND: [num_pages, num_kv_heads, page_size, head_dim]
 *     FlashInfer's "HND" layout.
 * A row is head_dim elements of the pool's dtype, or for a TurboQuant pool
 * PYFA_TQ_ROW_BYTES(head_dim, bits) bytes of codes; a TurboQuant pool's f32
 * scales are paged the same way with one value per row
 * ([num_pages, page_size, num_kv_heads] or [num_pages, num_kv_heads, page_size]).
 *
 * Per sequence b of a batch:
 *   block_table [batch, pages_per_seq] int32: entry i is the pool page that
 *     holds the sequence's positions [i * page_size, (i + 1) * page_size);
 *   kv_len [batch] int32: positions the sequence holds, so position s lives
 *     in page block_table[b][s / page_size], token s % page_size.
 * A paged sequence is never a ring: positions are in order from 0.
 *
 * Appends name their destinations by flat slot (vLLM's slot_mapping):
 *   slot_mapping [num_tokens] int32: token i goes to pool slot
 *     page * page_size + t (page `page`, token t of it).
 *
 * Host values are checked where they are on the host (each op says how).
 * Device values are read when a dispatch runs and clamped, so no value makes
 * a kernel touch memory outside the pool:
 *   - a block_table entry outside 0..num_pages-1 reads page num_pages - 1;
 *   - kv_len[b] negative as an int32 is 0 (no key: out 0, lse -inf), above
 *     pages_per_seq * page_size is pages_per_seq * page_size;
 *   - a slot_mapping value outside 0..num_pages*page_size - 1 (vLLM marks
 *     padding tokens with -1) writes nothing.
 * num_pages * page_size * num_kv_heads fits 32 bits (the dispatchers check),
 * so PYFA_PAGE_ROW is exact in 32-bit arithmetic; kernels widen the row to
 * 64 bits before multiplying it by a row's bytes.
 * ------------------------------------------------------------------------- */
#pragma once

#if !defined(__METAL_VERSION__) && !defined(__CUDACC_RTC__)
#include <stdint.h>
#endif

#define PYFA_PAGES_NHD 0
#define PYFA_PAGES_HND 1

/* Page sizes the kernels take: a power of two from 1 to PYFA_MAX_PAGE_SIZE. */
#define PYFA_MAX_PAGE_SIZE 1024

typedef struct pyfa_kv_pages {
    uint32_t page_size;     /**< tokens per page: a power of two, 1..PYFA_MAX_PAGE_SIZE */
    uint32_t num_pages;     /**< pages in the pool, >= 1 */
    uint32_t pages_per_seq; /**< columns of block_table, >= 1 */
    uint32_t layout;        /**< PYFA_PAGES_NHD or PYFA_PAGES_HND */
} pyfa_kv_pages;

/* Row of token t (0..page_size-1) of pool page `page`, KV head h, in rows
 * of the pool (head_dim elements, a TurboQuant row of codes, or one scale). */
#define PYFA_PAGE_ROW(layout, page_size, num_kv_heads, page, t, h)                         \
    ((layout) == PYFA_PAGES_NHD ? ((page) * (page_size) + (t)) * (num_kv_heads) + (h) \
                                : ((page) * (num_kv_heads) + (h)) * (page_size) + (t))

/* Slots of the paged decode kernels (flash_attn_vec and flash_attn_vec_tq
 * with their PAGED function constant set): the pool geometry as an inline
 * pyfa_kv_pages and the block table. Without PAGED the dispatchers bind a
 * zero pyfa_kv_pages and an unread buffer there (every declared slot is
 * bound). With PAGED: k / v (codes and scales for TurboQuant) are the
 * pools, params.kv_capacity is pages_per_seq * page_size, and ring_start
 * is not read (paged sequences are not rings). */
#define PYFA_VEC_ARG_PAGES 13
#define PYFA_VEC_ARG_BLOCK_TABLE 14

/* ---------------------------------------------------------------------------
 * kv_append_paged: writes num_tokens K rows and V rows into a dense pool pair
 * in one dispatch.
 *   src_k, src_v [num_tokens, num_kv_heads, head_dim]        f32 | f16 | bf16 (one dtype)
 *   k_pages, v_pages: pools of the layout above               f32 | f16 | bf16 (one dtype)
 *   slot_mapping [num_tokens] int32: token i of KV head h goes to row
 *     PYFA_PAGE_ROW(layout, page_size, num_kv_heads, slot / page_size,
 *     slot % page_size, h); a value outside 0..num_pages*page_size - 1
 *     writes nothing (padding).
 * Conversion as kv_append: widened to f32 (exact), rounded to the pool's
 * dtype to nearest even; equal dtypes copy the bits. Nothing else of the
 * pools is written. Host-visible slot_mapping values are checked by the
 * dispatcher: each is a slot of the pool or negative (padding), and no two
 * tokens name one slot (the result would depend on scheduling). Device
 * values are only clamped as above: two tokens naming one slot write it in
 * an unspecified order (the last writer is unspecified, row by row). src
 * must not overlap the pools, nor the pools each other or slot_mapping.
 * pages.pages_per_seq is not read (appends take no block_table): 0.
 * Grid: (num_tokens, num_kv_heads, 2); z = 0 writes K, z = 1 writes V.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_kv_append_paged_params {
    pyfa_kv_pages pages;   /**< page_size, num_pages, layout of both pools */
    uint32_t num_tokens;   /**< rows per KV head, >= 1 */
    uint32_t num_kv_heads;
    uint32_t head_dim;     /**< elements per row, >= 1 */
    uint32_t reserved;     /**< zero */
} pyfa_kv_append_paged_params;

#define PYFA_KV_APPEND_PAGED_ARG_PARAMS 0
#define PYFA_KV_APPEND_PAGED_ARG_SRC_K 1
#define PYFA_KV_APPEND_PAGED_ARG_SRC_V 2
#define PYFA_KV_APPEND_PAGED_ARG_K_PAGES 3
#define PYFA_KV_APPEND_PAGED_ARG_V_PAGES 4
#define PYFA_KV_APPEND_PAGED_ARG_SLOT_MAPPING 5

/* The indices of kv_append's constants (the two kernels share a Metal source). */
#define PYFA_KV_APPEND_PAGED_FC_SRC_DTYPE 0   /**< dtype code of src_k and src_v */
#define PYFA_KV_APPEND_PAGED_FC_CACHE_DTYPE 1 /**< dtype code of the pools */
#define PYFA_KV_APPEND_PAGED_FC_COUNT 2

/* ---------------------------------------------------------------------------
 * tq_quantize_paged: encodes num_tokens K rows and V rows into a TurboQuant
 * pool pair in one dispatch, with the codec of turboquant_params.h: the
 * codes and scale of a row are those hadamard_quantize_kv stores for it
 * (K rows with the K stream and k_bits, V rows with the V stream and v_bits,
 * the same seed and norm_correction).
 *   src_k, src_v [num_tokens, num_kv_heads, head_dim]  f32 | f16 | bf16 (one dtype)
 *   k_codes [pool rows, PYFA_TQ_ROW_BYTES(head_dim, k_bits)] u8, k_scales
 *   [pool rows] f32 (v_codes, v_scales with v_bits), pool rows in the
 *   layout above ([num_pages, page_size, num_kv_heads] for NHD);
 *   slot_mapping as kv_append_paged's (same rules, same padding);
 *   k_codebook, v_codebook: inline f32[2^k_bits], f32[2^v_bits].
 * Grid: (num_tokens, num_kv_heads, 2); z = 0 encodes K, z = 1 encodes V.
 * ------------------------------------------------------------------------- */
typedef struct pyfa_tq_quantize_paged_params {
    pyfa_kv_pages pages;      /**< page_size, num_pages, layout of the four pools */
    uint32_t num_tokens;      /**< rows per KV head, >= 1 */
    uint32_t num_kv_heads;
    uint32_t head_dim;        /**< 64, 128, 256 or 512 */
    uint32_t k_bits;          /**< 2, 3, 4 or 8 */
    uint32_t v_bits;          /**< 2, 3, 4 or 8 */
    uint32_t norm_correction; /**< PYFA_TQ_NORM_* */
    uint32_t seed_lo;
    uint32_t seed_hi;
} pyfa_tq_quantize_paged_params;

#define PYFA_TQ_QUANT_PAGED_ARG_PARAMS 0
#define PYFA_TQ_QUANT_PAGED_ARG_SRC_K 1
#define PYFA_TQ_QUANT_PAGED_ARG_SRC_V 2
#define PYFA_TQ_QUANT_PAGED_ARG_K_CODES 3
#define PYFA_TQ_QUANT_PAGED_ARG_K_SCALES 4
#define PYFA_TQ_QUANT_PAGED_ARG_V_CODES 5
#define PYFA_TQ_QUANT_PAGED_ARG_V_SCALES 6
#define PYFA_TQ_QUANT_PAGED_ARG_SLOT_MAPPING 7
#define PYFA_TQ_QUANT_PAGED_ARG_K_CODEBOOK 8
#define PYFA_TQ_QUANT_PAGED_ARG_V_CODEBOOK 9

/* Indices 0..2 are hadamard_quantize_kv's (src dtype, bits -> K bits, head
 * dim), so the two kernels share a Metal source and its constants. */
#define PYFA_TQ_QUANT_PAGED_FC_SRC_DTYPE 0 /**< dtype code of src_k and src_v */
#define PYFA_TQ_QUANT_PAGED_FC_K_BITS 1    /**< == params.k_bits */
#define PYFA_TQ_QUANT_PAGED_FC_HEAD_DIM 2  /**< == params.head_dim */
#define PYFA_TQ_QUANT_PAGED_FC_V_BITS 3    /**< == params.v_bits */
#define PYFA_TQ_QUANT_PAGED_FC_COUNT 4
