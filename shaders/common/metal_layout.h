/*
 * Geometry of the Metal decode kernels, as functions of head_dim and the GQA
 * group: the kernels (shaders/metal) size their loops and threadgroup memory
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
