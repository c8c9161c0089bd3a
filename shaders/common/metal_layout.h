/*
 * Geometry of the Metal kernels, as functions of head_dim, the GQA group and
 * the element size: the kernels (shaders/metal) size their loops and threadgroup memory
 * with them, the Metal plan (Swift, through the PyfaShaderCommon module)
 * sizes its dispatches with the same functions, so neither side re-derives
 * the other's layout.
 *
 * flash_attn_vec on Metal: one SIMD-group (32 lanes) per threadgroup. Scores
 * take one cache position per lane (a block of 32 positions); the output
 * accumulators split the row into float4 columns, lane l owning columns
 * l, l + 32, ... Query heads of a GQA group run in passes of
 * pyfa_metal_vec_heads_per_pass heads, so a lane holds at most
 * PYFA_METAL_VEC_ACC4 float4 accumulators at any head_dim.
 */
#pragma once

#if defined(__METAL_VERSION__)
#define PYFA_METAL_FN constexpr inline
#else
#include <stdint.h>
#define PYFA_METAL_FN static inline
#endif

/* Threads of every Metal decode threadgroup: one SIMD-group. */
#define PYFA_METAL_VEC_THREADS 32
/* Cache positions per block: one per lane. */
#define PYFA_METAL_VEC_BLOCK 32
/* float4 accumulators a lane holds (32 floats). */
#define PYFA_METAL_VEC_ACC4 8
/* Threads of the reduce kernel (lanes split a row's float4 columns). */
#define PYFA_METAL_REDUCE_THREADS 32
/* Threads of kv_append: one SIMD-group per cache row, lanes striding its elements. */
#define PYFA_METAL_KV_APPEND_THREADS 32

/* float4 columns of a head_dim-wide row one lane owns. */
PYFA_METAL_FN uint32_t pyfa_metal_vec_cols_per_lane(uint32_t head_dim) {
    return (head_dim / 4 + PYFA_METAL_VEC_THREADS - 1) / PYFA_METAL_VEC_THREADS;
}

/* Query heads one pass over the cache serves (1 ..= group). */
PYFA_METAL_FN uint32_t pyfa_metal_vec_heads_per_pass(uint32_t head_dim, uint32_t group) {
    const uint32_t most = PYFA_METAL_VEC_ACC4 / pyfa_metal_vec_cols_per_lane(head_dim);
    const uint32_t heads = group < most ? group : most;
    return heads < 1 ? 1 : heads;
}

/* Threadgroup bytes of flash_attn_vec: the pass's query rows [heads][head_dim]
 * then its softmax weights [heads][PYFA_METAL_VEC_BLOCK], both f32. */
PYFA_METAL_FN uint32_t pyfa_metal_vec_threadgroup_bytes(uint32_t head_dim, uint32_t group) {
    return pyfa_metal_vec_heads_per_pass(head_dim, group) * (head_dim + PYFA_METAL_VEC_BLOCK) * 4;
}

/* ---------------------------------------------------------------------------
 * flash_attn_prefill on Metal: PYFA_METAL_PREFILL_SIMDGROUPS SIMD-groups per
 * threadgroup, one (query tile, head, sequence) each. Products run on 8x8
 * SIMD-group matrices: S = Q Kᵀ ([block_q][block_k]) and O += P V
 * ([block_q][head_dim]). The 8x8 tiles of S and of O are dealt round-robin to
 * the SIMD-groups (tile t to SIMD-group t % SIMDGROUPS); O stays in registers.
 * Threadgroup memory, in this order:
 *   Q      [block_q][head_dim]  I/O dtype (copied as is, scaled in f32 later)
 *   K or V [block_k][kv_cols]   I/O dtype: a column chunk of the key tile
 *   S / P  [block_q][block_k]   f32 (scores, then softmax weights)
 *   alpha  [block_q]            f32 (rescale of this key tile, at the end 1/l)
 * kv_cols < head_dim means K and V are staged in head_dim / kv_cols column
 * chunks, which is how the widest rows fit in 32 KiB.
 *
 * Tiles by head_dim and I/O element size (2: f16 / bf16, 4: f32):
 *            block_q  block_k  kv_cols      bytes (<= 32 KiB)
 *   2, <=192     32       32        D      <= 28800
 *   2, 256       32       16        D         26752
 *   2, 512       16       16      256         25664
 *   4, <=96      32       32        D      <= 28800
 *   4, 128       32       16        D         26752
 *   4, 192       16       16        D         25664
 *   4, 256       16       16      128         25664
 *   4, 512        8       16      128         25120
 * so a SIMD-group holds at most PYFA_METAL_PREFILL_MAX_ACC output tiles
 * (64 f32 per lane) and PYFA_METAL_PREFILL_MAX_SCORE_TILES score tiles.
 * The blk pre-pass and merge_attention_states run one SIMD-group per
 * threadgroup and no threadgroup memory.
 * ------------------------------------------------------------------------- */
#define PYFA_METAL_PREFILL_SIMDGROUPS 4
#define PYFA_METAL_PREFILL_THREADS 128 /* 32 lanes x PYFA_METAL_PREFILL_SIMDGROUPS */
#define PYFA_METAL_PREFILL_MAX_ACC 32
#define PYFA_METAL_PREFILL_MAX_SCORE_TILES 4
#define PYFA_METAL_PREFILL_AUX_THREADS 32

PYFA_METAL_FN uint32_t pyfa_metal_prefill_block_q(uint32_t head_dim, uint32_t elem_bytes) {
    if (elem_bytes == 2) return head_dim <= 256 ? 32 : 16;
    return head_dim <= 128 ? 32 : head_dim <= 256 ? 16 : 8;
}

PYFA_METAL_FN uint32_t pyfa_metal_prefill_block_k(uint32_t head_dim, uint32_t elem_bytes) {
    if (elem_bytes == 2) return head_dim <= 192 ? 32 : 16;
    return head_dim <= 96 ? 32 : 16;
}

/* Columns of one staged K or V chunk (divides head_dim). */
PYFA_METAL_FN uint32_t pyfa_metal_prefill_kv_cols(uint32_t head_dim, uint32_t elem_bytes) {
    if (elem_bytes == 2) return head_dim <= 256 ? head_dim : 256;
    return head_dim <= 192 ? head_dim : 128;
}

/* Threadgroup bytes of flash_attn_prefill (layout above). */
PYFA_METAL_FN uint32_t pyfa_metal_prefill_threadgroup_bytes(uint32_t head_dim, uint32_t elem_bytes) {
    const uint32_t bq = pyfa_metal_prefill_block_q(head_dim, elem_bytes);
    const uint32_t bk = pyfa_metal_prefill_block_k(head_dim, elem_bytes);
    return (bq * head_dim + bk * pyfa_metal_prefill_kv_cols(head_dim, elem_bytes)) * elem_bytes + bq * bk * 4 + bq * 4;
}

/*
 * TurboQuant on Metal (turboquant_params.h). The row kernels
 * (hadamard_quantize_kv, tq_dequantize_kv, the fwht family) and the fused
 * reduce + undo run one SIMD-group per row, which holds the row in
 * threadgroup memory for the FWHT's stages; flash_attn_vec_tq is the dense
 * decode's geometry plus both codebooks in threadgroup memory.
 */
#define PYFA_METAL_TQ_ROW_THREADS 32
/* Levels of the widest TurboQuant code (8 bits). */
#define PYFA_METAL_TQ_MAX_LEVELS 256

/* Threadgroup bytes of a row kernel: the row being transformed, then (the
 * encoder) its centroids c[idx], both f32 [head_dim]. */
PYFA_METAL_FN uint32_t pyfa_metal_tq_rows_threadgroup_bytes(uint32_t head_dim) {
    return 2 * head_dim * 4;
}

/* Threadgroup bytes of flash_attn_vec_reduce_tq_hb_undo: one f32 row. */
PYFA_METAL_FN uint32_t pyfa_metal_tq_reduce_undo_threadgroup_bytes(uint32_t head_dim) {
    return head_dim * 4;
}

/* Threadgroup bytes of flash_attn_vec_tq: flash_attn_vec's layout, then the
 * K codebook (f32 [2^k_bits]) and the V codebook (f32 [2^v_bits]). */
PYFA_METAL_FN uint32_t pyfa_metal_vec_tq_threadgroup_bytes(uint32_t head_dim, uint32_t group, uint32_t k_bits,
                                                          uint32_t v_bits) {
    return pyfa_metal_vec_threadgroup_bytes(head_dim, group) + ((1u << k_bits) + (1u << v_bits)) * 4;
}
