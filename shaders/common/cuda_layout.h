/*
 * Shared-memory sizes and variant choices of the CUDA decode kernels, as
 * functions of a specialisation's constants and the NVRTC knobs (-D PYFA_*).
 * The kernels (shaders/cuda) size their carve-ups with them and assert the
 * carve-up fits; the CUDA plan (Swift, through the PyfaShaderCommon module)
 * calls the same functions with the same knob values, so neither side
 * re-derives the other's layout.
 */
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define PYFA_LAYOUT_FN __host__ __device__ constexpr inline
#else
#if !defined(__METAL_VERSION__)
#include <stdint.h>
#endif
#define PYFA_LAYOUT_FN static inline
#endif

/* Warps per block of every CUDA decode kernel. */
#define PYFA_CUDA_DECODE_WARPS 4
/* Query heads one tensor-core pass serves: the n = 8 of m16n8k16. */
#define PYFA_CUDA_MMA_HEADS 8
/* Positions per tile of the TurboQuant tensor-core decode. */
#define PYFA_CUDA_TQ_MMA_TILE 64
/* Lane copies of its code-byte table (one per lane, so a warp's lookups hit
 * distinct banks whatever the codes), and the bytes of one entry (the copies
 * of the byte's two f16 codebook values). */
#define PYFA_CUDA_TQ_MMA_TABLE_COPIES 32
#define PYFA_CUDA_TQ_MMA_TABLE_ENTRY 128

PYFA_LAYOUT_FN int32_t pyfa_layout_max(int32_t a, int32_t b) { return a > b ? a : b; }

/* attn_vec.cu: warps one cache row spans (a lane loads 16 bytes of it). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_vec_warps_per_row(int32_t elem_size, int32_t D) {
    return (D / (16 / elem_size) + 31) / 32;
}

/* attn_vec.cu: query heads per pass (GT) for a cache of elem_size-byte
 * elements at head_dim D, given the accumulator budgets (floats per lane). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_vec_heads_per_pass(int32_t elem_size, int32_t D, int32_t budget,
                                                    int32_t budget_wide) {
    const int32_t per_lane = 16 / elem_size;
    const int32_t gt = (pyfa_cuda_vec_warps_per_row(elem_size, D) > 1 ? budget_wide : budget) / per_lane;
    return gt < 1 ? 1 : gt > 8 ? 8 : gt;
}

/* attn_vec.cu: dynamic shared bytes of one block: the double-buffered
 * partial scores [2][warps][rows*GT], then the larger of the cp.async ring
 * [stages][rows][K, V][warps][32 lanes] x 16 B and the merge area
 * ([row groups][GT][D] accumulators + [row groups][GT][2] (m, s)). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_vec_smem_bytes(int32_t elem_size, int32_t D, int32_t budget, int32_t budget_wide,
                                                int32_t rows_per_step, int32_t stages) {
    const int32_t gt = pyfa_cuda_vec_heads_per_pass(elem_size, D, budget, budget_wide);
    const int32_t row_groups = PYFA_CUDA_DECODE_WARPS / pyfa_cuda_vec_warps_per_row(elem_size, D);
    const int32_t ring_bytes = stages * rows_per_step * 2 * PYFA_CUDA_DECODE_WARPS * 32 * 16;
    const int32_t merge_bytes = row_groups * gt * (D + 2) * 4;
    return 2 * PYFA_CUDA_DECODE_WARPS * rows_per_step * gt * 4 + pyfa_layout_max(ring_bytes, merge_bytes);
}

/* attn_vec_mma.cuh: dynamic shared bytes of one block at head_dim D with
 * `stages` ring tiles and `split` warps sharing a position block's dims:
 * Qᵀ fragments, scores, (m, s) pairs, then the larger of the K + V ring and
 * the merge area (ring rows are whole 128-byte lines); up to D = 256 every
 * warp publishes its own state (the pairs and the merge area hold
 * PYFA_CUDA_DECODE_WARPS of them). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_vec_mma_smem_bytes(int32_t D, int32_t stages, int32_t split) {
    const int32_t tile = 16 * PYFA_CUDA_DECODE_WARPS / split; /* positions per tile */
    const int32_t states = D <= 256 ? PYFA_CUDA_DECODE_WARPS : 1;
    const int32_t row = (2 * D + 127) / 128 * 128;
    const int32_t fragments = D / 16 * 32 * 16, scores = split * tile * PYFA_CUDA_MMA_HEADS * 4;
    const int32_t ms = (states * PYFA_CUDA_MMA_HEADS * 2 * 4 + 127) / 128 * 128;
    const int32_t ring = stages * 2 * tile * row, merge = states * PYFA_CUDA_MMA_HEADS * D * 4;
    return fragments + scores + ms + pyfa_layout_max(ring, merge);
}

/* turboquant.cu: whether flash_attn_vec_tq runs the tensor-core kernel
 * (turboquant_mma.cuh): 4-bit K and V at a head dim whose bit is set in
 * `dims` (PYFA_TQ_VEC_MMA: 1 = D 64, 2 = 128, 4 = 256, 8 = 512; the plan
 * sets the head dims whose block fits the device's shared memory, 0 when
 * its knob turns the kernel off). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_tq_mma_dim_bit(int32_t D) {
    return D == 64 ? 1 : D == 128 ? 2 : D == 256 ? 4 : D == 512 ? 8 : 0;
}
PYFA_LAYOUT_FN int32_t pyfa_cuda_tq_uses_mma(int32_t k_bits, int32_t v_bits, int32_t D, int32_t dims) {
    return k_bits == 4 && v_bits == 4 && (dims & pyfa_cuda_tq_mma_dim_bit(D)) != 0;
}

/* flash_attn_vec_tq splits whose last workgroups merge (DIRECT_OUT 2): at most
 * this many workgroups per row, so the merge's scratch (2 floats per workgroup
 * and warp, 8 KB) fits the drained ring of every TurboQuant decode kernel. */
#define PYFA_CUDA_TQ_MERGE_MAX_NWG 256

/* turboquant.cu (vector kernel): dynamic shared bytes of one block: both
 * codebooks (256 floats each), the (m, s) pairs, then the larger of the
 * cp.async ring and the merge area. A row spans D/16 lanes, so a warp loads
 * 512/D rows at a time; `heads` query heads per pass. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_tq_vec_smem_bytes(int32_t D, int32_t k_bits, int32_t v_bits, int32_t rows_per_step,
                                                   int32_t stages, int32_t heads) {
    const int32_t rows_per_warp = 512 / D;
    const int32_t warp_bytes = rows_per_step * rows_per_warp * D * (k_bits + v_bits) / 8 + rows_per_step * 2 * rows_per_warp * 4;
    const int32_t ring = stages * PYFA_CUDA_DECODE_WARPS * warp_bytes;
    const int32_t merge = PYFA_CUDA_DECODE_WARPS * rows_per_warp * heads * D * 4;
    return (2 * 256 + PYFA_CUDA_DECODE_WARPS * rows_per_warp * heads * 2) * 4 + pyfa_layout_max(ring, merge);
}

/* turboquant_mma.cuh: the ring depth in tiles, `knob` when positive, else
 * by head dim (two at D = 256, measured faster than three on the H200), and
 * the dynamic shared bytes of one block: the code-byte
 * table (256 entries of PYFA_CUDA_TQ_MMA_TABLE_ENTRY bytes), Qᵀ fragments,
 * scores, (m, s) pairs, then the larger of the ring (code rows padded to
 * D/2 + 16 bytes, K and V scales) and the merge area; up to D = 256 every warp
 * publishes its own state (the pairs and the merge area hold
 * PYFA_CUDA_DECODE_WARPS of them). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_tq_mma_stages(int32_t D, int32_t knob) {
    return knob > 0 ? knob : (D == 256 ? 2 : 3);
}

PYFA_LAYOUT_FN int32_t pyfa_cuda_tq_mma_smem_bytes(int32_t D, int32_t knob) {
    const int32_t tile = PYFA_CUDA_TQ_MMA_TILE, row = D / 2 + 16; /* padded code row */
    const int32_t states = D <= 256 ? PYFA_CUDA_DECODE_WARPS : 1, stages = pyfa_cuda_tq_mma_stages(D, knob);
    const int32_t table = 256 * PYFA_CUDA_TQ_MMA_TABLE_ENTRY, fragments = D / 16 * 32 * 16;
    const int32_t scores = tile * PYFA_CUDA_MMA_HEADS * 4, ms = states * PYFA_CUDA_MMA_HEADS * 2 * 4;
    const int32_t ring = stages * (2 * tile * row + 2 * tile * 4), merge = states * PYFA_CUDA_MMA_HEADS * D * 4;
    return table + fragments + scores + ms + pyfa_layout_max(ring, merge);
}

/* attn_prefill_wgmma.cuh (sm_90a, f16 / bf16, D <= 256): query rows per block
 * (consumer warpgroups of 64 rows each), threads, the key tile and the
 * dynamic shared bytes (Q [BQ][D], then the K stages [BK][D] and the V stages
 * [BK][D], in 16 bits, unpadded core matrices).
 * attn_prefill_wgmma_split.cuh (D = PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM):
 * the two warpgroups share 64 query rows and split the head dim (each owns
 * 256 output columns and half of every Q Kᵀ dot product); its 64-key tile
 * streams in stages of 32 keys (four stages of 32 KiB beside Q's 64 KiB),
 * and the score halves meet in an exchange area ([2][64][32] f32). */
#define PYFA_CUDA_PREFILL_WGMMA_BLOCK_Q 128 /* two consumer warpgroups */
#define PYFA_CUDA_PREFILL_WGMMA_THREADS 256 /* their threads */
#define PYFA_CUDA_PREFILL_WGMMA_MAX_THREADS 512 /* the most a block launches: three consumers and the producer */
#define PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM 256
#define PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM 512
/* In rectangular mode with TMA stages (pyfa_cuda_prefill_wgmma_tma, D <= 256)
 * a further warpgroup, the producer, issues the K and V copies and waits for
 * the stages' release, so no consumer warpgroup waits for another outside
 * its turn. The block launches with 65536 / threads registers a thread (168
 * beside two consumer warpgroups, 128 beside three); the producer keeps
 * pyfa_cuda_prefill_wgmma_producer_regs of them and the consumers take the
 * rest (pyfa_cuda_prefill_wgmma_consumer_regs), as FlashAttention-3 splits
 * them: 24 / 240 and 32 / 160. */
#define PYFA_CUDA_PREFILL_WGMMA_PRODUCER_THREADS 128
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_producer_regs(int32_t consumers) { return consumers == 3 ? 32 : 24; }
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_consumer_regs(int32_t consumers) { return consumers == 3 ? 160 : 240; }
/* Whether flash_attn_prefill runs that path: kernels built for sm_90a, 16-bit
 * inputs (elem_size 2), D <= 256 or D = 512, and the knob
 * (PYFA_CUDA_PREFILL_WGMMA) not 0. At every head dim up to 256 it measured
 * faster than the mma.sync kernel (H200, bf16, 16/8 heads, D = 64, the
 * closest case: 288 against 217 TF causal and 299 against 226 non-causal at
 * 16K, 193 against 153 and 272 against 196 at 4K). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_uses_wgmma(int32_t sm90a, int32_t knob, int32_t elem_size, int32_t D) {
    return sm90a != 0 && knob != 0 && elem_size == 2 &&
           (D <= PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM || D == PYFA_CUDA_PREFILL_WGMMA_SPLIT_HEAD_DIM);
}
/* Stages of the K ring and of the V ring (V runs one tile behind K), so a
 * tile's copies are issued a whole tile of work ahead of its use. */
#define PYFA_CUDA_PREFILL_WGMMA_KV_STAGES 2
/* In rectangular mode the K and V stages of both paths arrive by TMA when the
 * CUDA backend encoded their tensor maps (inline arguments in these slots;
 * an absent map, argument 0, leaves the stages to cp.async copies). With S the
 * swizzle span (pyfa_cuda_prefill_wgmma_swizzle_bytes), a stage is laid out
 * [block of S / 2 elements][key][S bytes, 16-byte chunks swizzled] either way:
 * the TMA box {S / 2 elements, stage keys, 2 D / S, 1, 1} with S-byte
 * swizzling of the 5-d view {S / 2, kv_len, 2 D / S, num_kv_heads, batch} of
 * k or v (strides: the row, S bytes, the head, the batch). */
#define PYFA_CUDA_PREFILL_ARG_TMAP_K 13
#define PYFA_CUDA_PREFILL_ARG_TMAP_V 14
/* The query tile by TMA, in the kernels pyfa_cuda_prefill_wgmma_q_tma names:
 * the box {S / 2 elements, BQ rows, 2 D / S, 1, 1} with S-byte swizzling of
 * the 5-d view {S / 2, q_len, 2 D / S, num_heads, batch} of q (strides as
 * K's), one map a launch beside K's and V's; where it is absent (a view TMA
 * refuses, PYFA_CUDA_PREFILL_TMA=kv) the consumers copy Q: into the same
 * layout in the grid kernel's body that takes the stage maps, as core
 * matrices in the bodies without maps (attn_prefill_wgmma.cuh). */
#define PYFA_CUDA_PREFILL_ARG_TMAP_Q 18
/* Whether the warpgroup-MMA paths keep K and V stages in a swizzled layout
 * (and take them by TMA in rectangular mode): from D = 64 on (in the packed
 * modes, whose threads copy the stages, from D = 128: attn_prefill_wgmma.cuh).
 * At D 64 TMA measured 3-12% slower while thread 0 of a computing warpgroup
 * issued the copies (H200, bf16, 16/8 heads: 16K non-causal 330 against 320
 * TF with core matrices, also with the warpgroups taking turns, at two blocks
 * an SM and with 128-key tiles); with the producer warpgroup and 128-key tiles
 * it measured 10-15% faster than two blocks of 64-key tiles with the threads'
 * copies (16K non-causal 358-361 -> 412-413, causal 363 -> 406, 4K
 * non-causal 327-330 -> 371-372, causal 279-281 -> 309-310). From D = 80
 * the stages' TMA gained 12-32% (D 256 4K causal 272 -> 380, D 128 16K
 * 417 -> 485). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_tma(int32_t D) { return D >= 64; }
/* Whether the warpgroup-MMA kernel at D in KV mode kv_mode has the producer
 * warpgroup (rectangular mode, TMA stages, D <= 256), and its block's threads. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_producer(int32_t D, int32_t kv_mode) {
    return kv_mode == 0 /* PYFA_PREFILL_KV_RECT */ && pyfa_cuda_prefill_wgmma_tma(D) && D <= PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM;
}
/* Whether the kernel at D in KV mode kv_mode takes its query tile by TMA
 * (PYFA_CUDA_PREFILL_ARG_TMAP_Q): beside the producer, so that a block's
 * start does not wait for the consumers' copies of Q. The grid launch
 * (persistent == 0) at D 64 in causal calls only (causal != 0): there plain
 * calls took 7% less time with it (H200, bf16, 16/8 heads, 4K and 16K; a
 * causal block has half the key tiles on average, so its start weighs more),
 * non-causal ones 2-4% more. Persistent blocks (flash_attn_prefill_persistent)
 * take it in every call: their producer copies the next rank's query tile
 * under the rank before. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_q_tma(int32_t D, int32_t kv_mode, int32_t causal, int32_t persistent) {
    return pyfa_cuda_prefill_wgmma_producer(D, kv_mode) && (D != 64 || causal != 0 || persistent != 0);
}
/* Query rows a block: 64 a consumer warpgroup, two of them (128 rows) but
 * three (192) at D = 64 beside the producer, as FlashAttention-3 runs D 64 on
 * Hopper: the products of a 64-row warpgroup at D 64 take about as long as
 * its softmax, so two other warpgroups' products cover one's softmax where
 * one other's did not (H200, bf16, 16/8 heads, against two warpgroups in
 * 128 x 192 tiles: 16K non-causal 441-443 -> 475-486 TF, causal 425-426 ->
 * 454-461, 4K non-causal 380-382 -> 381-400, 4K causal level at 291-296).
 * At D 128 three warpgroups (192 x 64 tiles) measured 6-18% slower. The
 * split path (D = 512) holds 64 rows. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_block_q(int32_t D, int32_t kv_mode) {
    if (D > PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM) return 64;
    return pyfa_cuda_prefill_wgmma_producer(D, kv_mode) && D == 64 ? 192 : PYFA_CUDA_PREFILL_WGMMA_BLOCK_Q;
}
/* Consumer warpgroups of the D <= 256 kernel (the split path has two). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_consumers(int32_t D, int32_t kv_mode) {
    return D > PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM ? 2 : pyfa_cuda_prefill_wgmma_block_q(D, kv_mode) / 64;
}
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_block_threads(int32_t D, int32_t kv_mode) {
    return 128 * pyfa_cuda_prefill_wgmma_consumers(D, kv_mode) +
           (pyfa_cuda_prefill_wgmma_producer(D, kv_mode) ? PYFA_CUDA_PREFILL_WGMMA_PRODUCER_THREADS : 0);
}
/* Keys per tile in KV mode kv_mode. Beside the producer (rectangular mode)
 * D 192 takes 96 keys, against 64 elsewhere: the per-tile work (barriers,
 * waits, the rescale of o) spreads over more keys (H200, bf16, 16/8 heads:
 * 16K non-causal 632-655 -> 660-694 TF). D 64's 192-row tile there takes 128
 * (FlashAttention-3's tile): a score tile, P and o of 192 keys would not fit
 * the 160 registers of its consumers. Wider tiles measured slower at the
 * other head dims: D 96 192 keys (16K causal 558 -> 533-542 TF, 4K causal
 * 417-422 -> 358-360), D 128 176 and D 256 80 (FlashAttention-3's
 * non-causal tiles: 0-10% at 16K, up to 20% at 4K causal). Elsewhere 128 at
 * D 80 to 128; 64 beyond D 128 (shared memory) and at D 64 in the packed
 * modes, where the smaller tile takes the kernel from 240 registers a thread
 * to 116, so two blocks share an SM (H200, bf16, 16/8 heads, against 128 keys
 * with every thread's copies, one machine session: 16K 315 -> 354 TF
 * non-causal and 317 -> 349 causal, 4K non-causal 279 -> 308, 4K causal
 * level at 237-247 against 239-249). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_block_k(int32_t D, int32_t kv_mode) {
    if (pyfa_cuda_prefill_wgmma_producer(D, kv_mode) && (D == 64 || D == 192)) return D == 64 ? 128 : 96;
    return D > 128 ? 64 : D > 64 ? 128 : 64;
}
/* Keys of one ring stage: the key tile, or half of it on the split path. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_stage_keys(int32_t D, int32_t kv_mode) {
    return D > PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM ? pyfa_cuda_prefill_wgmma_block_k(D, kv_mode) / 2
                                                    : pyfa_cuda_prefill_wgmma_block_k(D, kv_mode);
}
/* The swizzle span of those stages: the widest of 128, 64 and 32 bytes that
 * divides a row (D 128, 192, 256, 512: 128; D 96: 64; D 80: 32). A stage is
 * [D / (span / 2) blocks][key][span bytes, 16-byte chunk c of key r at
 * c ^ ((r span / 128) % (span / 16))]: the layout TMA's swizzle of that span
 * writes, and wgmma's swizzled operand layout of the same span. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_swizzle_bytes(int32_t D) {
    return (D * 2) % 128 == 0 ? 128 : (D * 2) % 64 == 0 ? 64 : 32;
}
/* Query heads a cluster of the warpgroup-MMA kernel holds: 2, or 1 (none).
 * Beside the producer (rectangular mode) from D = 192 on, the blocks of one
 * query tile of two query heads that share a KV head run as a cluster of 2
 * along the grid's heads, where the query heads per KV head are even (the
 * dispatch's rule): the two are co-scheduled and read the same K and V tiles
 * at about the same time; each still copies its own. On H200s it measured
 * 1-12% faster at D 256 (16K), level to 7% faster at D 192, and mixed from
 * machine to machine at D 128 (+11% on one, -5 to -8% on another); sharing
 * the stages between the two by TMA multicast measured slower than this
 * everywhere (it couples the two blocks' pipelines). Figures:
 * docs/cuda/NOTES.md, "Two heads' blocks in a cluster". */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_cluster_heads(int32_t D, int32_t kv_mode) {
    return pyfa_cuda_prefill_wgmma_producer(D, kv_mode) && D >= 192 ? 2 : 1;
}
/* The launch-order rank of prefill block (x, y, z) of a (gx, gy, gz) grid
 * whose clusters hold cluster_y blocks along y (1: no cluster; 2: two heads,
 * gy even): its linear index without a cluster; in one, the cluster's linear
 * index times 2 plus the block's rank in it, so that the two blocks take
 * neighbouring ranks (tile_slot in attn_prefill.cu: the same query tile, an
 * even head and the next). */
PYFA_LAYOUT_FN uint64_t pyfa_cuda_prefill_block_rank(uint32_t x, uint32_t y, uint32_t z, uint32_t gx, uint32_t gy,
                                                     uint32_t cluster_y) {
    return cluster_y == 2 ? 2 * ((uint64_t)x + (uint64_t)gx * ((uint64_t)z * (gy / 2) + y / 2)) + (y & 1)
                          : (uint64_t)x + (uint64_t)gx * ((uint64_t)z * gy + y);
}
/* The prefill's rank order in sections of L2's size. Ranks run with the
 * query tile slowest (highest first, so that under causal masking the longest
 * tiles start first), then sequence, then head; read over every head at once,
 * the blocks in flight read the K and V of every KV head at once, and past
 * L2's size (50 MB on H100 and H200) those rows are fetched from DRAM again
 * (H200, bf16, 16/8 heads, D 128, 16K non-causal, Nsight Compute: 1.14 GB of
 * DRAM reads a call that holds 0.2 GB, where cuDNN's kernel moves about
 * that). Where the call's K and V exceed twice the section's bytes the order
 * takes the query heads (planes: a sequence's heads, then the next
 * sequence's) in sections whose K and V (kv_len keys of head_dim 16-bit values
 * each, a whole number of KV heads) fit them, as FlashAttention-3's scheduler
 * does, and runs each section in the order above.
 * Non-causal calls (causal == 0: without a window every block visits every
 * key tile) take sections of PYFA_CUDA_PREFILL_L2_SECTION_BYTES_UNIFORM (8 MiB,
 * one KV head of 16K keys at D 128) past 16 MiB. Against the causal calls' rule for every
 * call (H200, bf16, 16/8 heads, us a public call, three alternated runs a
 * side): D 128 16K 3,694-3,789 -> 3,514-3,598, B 4 D 128 8K 3,724-4,034 ->
 * 3,655-3,800; level at D 64 16K, D 128 8K, D 256 4K and 16K, and B 8 (32/8
 * heads) D 128 1K. Sections of 16 MiB measured as those of 8 at D 128 16K and
 * up to 6% slower at D 64 16K, up to 3% at B 4 D 128 8K. Causal calls take
 * PYFA_CUDA_PREFILL_L2_SECTION_BYTES (32 MiB) past 64 MiB: there the longest
 * tiles first balance the blocks only across a whole section, and sections
 * of 8 MiB made D 128 16K causal 40-60% slower (2,555-2,570 against
 * 1,602-1,825 us; 16 MiB 2,031-2,088). At 128 MB of K and V a first form of
 * the causal rule (sections from 32 MiB) took 3% less time at D 128 32K
 * causal (32/8 heads); at 64 MB (D 128 16K) it measured level to 5% slower,
 * so causal calls up to twice the section keep one section
 * (docs/cuda/NOTES.md, "The rank order in sections of L2's size"). */
#define PYFA_CUDA_PREFILL_L2_SECTION_BYTES (32u << 20)
#define PYFA_CUDA_PREFILL_L2_SECTION_BYTES_UNIFORM (8u << 20)
PYFA_LAYOUT_FN uint32_t pyfa_cuda_prefill_section_planes(uint32_t planes, uint32_t group, uint32_t kv_len,
                                                         uint32_t head_dim, uint32_t causal) {
    const uint64_t per_kv_head = (uint64_t)kv_len * head_dim * 4u; /* K and V rows */
    const uint32_t bytes = causal != 0 ? PYFA_CUDA_PREFILL_L2_SECTION_BYTES : PYFA_CUDA_PREFILL_L2_SECTION_BYTES_UNIFORM;
    const uint32_t g = group < 1 ? 1u : group;
    if (per_kv_head * (planes / g) <= 2ull * bytes) return planes;
    /* past here per_kv_head > 0: at least one KV head a section */
    const uint32_t kv_heads = per_kv_head >= bytes ? 1u : bytes / (uint32_t)per_kv_head;
    const uint64_t section = (uint64_t)kv_heads * g;
    return section >= planes ? planes : (uint32_t)section;
}
/* Rank `rank` of num_q_blocks * planes in that order, for sections of
 * `section` planes (pyfa_cuda_prefill_section_planes; the last may hold
 * fewer): its query tile << 32 | its plane. Sections are whole KV heads, so
 * where the query heads per KV head are even, ranks 2c and 2c + 1 take one
 * query tile, an even plane and the next (a cluster's two blocks). In 32-bit
 * arithmetic (64-bit divisions are calls that cost the kernels registers): a
 * launch has fewer than 2^32 blocks. In rectangular mode every block writes
 * output rows of its own (flash_attn_prefill's validation), and 2^32 blocks
 * would write at least 2^39 bytes; the packed modes, whose q_len is the
 * declared longest sequence, refuse grids of 2^32 tiles or more
 * (FlashAttnPrefillPacked.encode); persistent and key-split launches have at
 * most INT32_MAX ranks (their plans' rule). */
PYFA_LAYOUT_FN uint64_t pyfa_cuda_prefill_rank_slot(uint32_t rank, uint32_t num_q_blocks, uint32_t planes,
                                                    uint32_t section) {
    const uint32_t first = rank / (section * num_q_blocks) * section; /* the section's first plane */
    const uint32_t width = planes - first < section ? planes - first : section;
    const uint32_t j = rank - first * num_q_blocks;
    return (uint64_t)(num_q_blocks - 1 - j / width) << 32 | (first + j % width);
}
/* Key-split prefill (flash_attn_prefill_params.h, pyfa_prefill_split), for
 * the kernels that take it (pyfa_cuda_prefill_splits), which run one block an
 * SM (their setmaxnreg budgets take the register file). A grid of `blocks`
 * blocks of `key_tiles` key tiles each on `slots` SMs runs whole waves, then a
 * last wave that may leave SMs idle; a grid of fewer blocks than SMs (few
 * heads, or few query rows over many keys: speculative decoding's
 * verification, a chunk's tail) leaves most of them idle. Splitting each block
 * of the last wave over its keys in `parts` puts the idle SMs to work, at the
 * cost of each part's own start and end and of the merge. Modelled in key
 * tiles: whole waves, then rounds of parts, each costing its share of the
 * tiles plus 4 tiles' worth (measured on the H200 at D 64: ~7.5 us a part for
 * its start, its state's stores and the merge's loads), plus 2 for the last
 * merge. Returns the parts (2 to 16, at least 4 tiles each) that model
 * fastest where that is 5% or more below the whole blocks' time, else 0 (run
 * whole). At D 64 4K, 16 heads on 132 SMs (352 blocks of 32 tiles) that is 0:
 * split in 3 the last wave measured 1% faster. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_split_parts(uint64_t blocks, uint64_t slots, uint32_t key_tiles) {
    if (slots == 0 || blocks % slots == 0) return 0;
    const uint64_t waves = blocks / slots, rest = blocks % slots;
    const uint64_t whole = (waves + 1) * key_tiles;
    uint64_t best = whole;
    int32_t parts = 0;
    for (uint32_t s = 2; s <= 16 && key_tiles / s >= 4; s++) {
        const uint64_t rounds = (rest * s + slots - 1) / slots;
        const uint64_t t = waves * key_tiles + rounds * ((key_tiles + s - 1) / s + 4) + 2;
        if (t < best) {
            best = t;
            parts = (int32_t)s;
        }
    }
    return 20 * best <= 19 * whole ? parts : 0;
}
/* Whether the kernel at D in KV mode kv_mode takes a key split: the kernels
 * with the producer warpgroup up to D = 128. At D 256 the split's code alone,
 * not taken, made 4K non-causal calls 10-12% slower (H200: 419-424 against
 * 377-380 us; D 64 and 128 level), so the kernels from D 192 on carry none. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_splits(int32_t D, int32_t kv_mode) {
    return pyfa_cuda_prefill_wgmma_producer(D, kv_mode) && D <= 128;
}
/* Whether flash_attn_prefill_persistent (flash_attn_prefill_params.h,
 * pyfa_prefill_persist) serves the kernel at D in KV mode kv_mode: the kernels
 * that take a key split, one block an SM, whose shared memory holds a second
 * query tile, which TMA brings (pyfa_cuda_prefill_wgmma_q_tma, persistent).
 * In a grid of more than one wave each block's start (its Q tile, the first K
 * and V stages) and end (the last P V, the output's stores) leave the SM's
 * tensor cores idle once a block: about three key tiles' worth at D 128
 * (H200, stamped), 9% of a 4K non-causal block, more of a short causal one.
 * A persistent block copies the next rank's Q and first stages under the
 * last tiles of the one before. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_persists(int32_t D, int32_t kv_mode) {
    return pyfa_cuda_prefill_splits(D, kv_mode) && pyfa_cuda_prefill_wgmma_q_tma(D, kv_mode, 0, 1);
}
/* Floats of one part's state (attn_prefill_wgmma.cuh, merge_split_parts):
 * per consumer thread its output accumulators (D / 2 floats of 2 rows) and
 * (m, m, l, l). */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_split_state_floats(int32_t D, int32_t kv_mode) {
    return 4 * (D / 8 + 1) * 128 * pyfa_cuda_prefill_wgmma_consumers(D, kv_mode);
}
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_wgmma_smem_bytes(int32_t D, int32_t kv_mode) {
    const int32_t bq = pyfa_cuda_prefill_wgmma_block_q(D, kv_mode), keys = pyfa_cuda_prefill_wgmma_stage_keys(D, kv_mode);
    const int32_t exchange = D > PYFA_CUDA_PREFILL_WGMMA_MAX_HEAD_DIM ? 2 * bq * keys * 4 : 0;
    return (bq + 2 * PYFA_CUDA_PREFILL_WGMMA_KV_STAGES * keys) * D * 2 + exchange;
}
/* Whether a call of `ranks` blocks runs persistent blocks on `slots` SMs
 * (pyfa_cuda_prefill_persists says which kernels can; a plan asks for a key
 * split first): more than one wave of blocks at D 80 to 128. Measured on the
 * H200 (bf16, public calls, 16/8 heads, four alternated runs, two a side; us a
 * call, persistent against the grid launch): D 128 16K causal 1,644-1,782
 * against 1,880-1,976, 4K causal 115-124 against 134-144, 4K non-causal
 * 206-207 against 216-217, 8K and 16K non-causal level; D 96 and 80 at 4K
 * 3-13% less time, D 96 B 8, 32/8 heads, 1K causal too (166-168 against
 * 204), D 96 16K causal level. Other lengths at D 80 and 96, and lengths past 16K, are
 * taken by extension: a block's start and end, which the persistent blocks
 * overlap, only weigh less as its key tiles grow, and where they weigh least
 * (16K non-causal) the two launches were level. At D 64 (192-row tiles, whose
 * query tile the grid launch copies with the threads in non-causal calls)
 * they measured level at 4K and at 16K causal, up to 5% slower at 16K
 * non-causal and 6-9% faster at B 8 1K causal (188-189 against 200-206 us),
 * so D 64 keeps the grid launch. PYFA_CUDA_PREFILL_PERSIST=N forces the
 * persistent kernel wherever it serves. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_persistent_pays(int32_t D, uint64_t ranks, uint64_t slots) {
    return D >= 80 && D <= 128 && ranks > slots;
}
/* A persistent block's: a second query tile after the V stages. */
PYFA_LAYOUT_FN int32_t pyfa_cuda_prefill_persistent_smem_bytes(int32_t D, int32_t kv_mode) {
    return pyfa_cuda_prefill_wgmma_smem_bytes(D, kv_mode) + pyfa_cuda_prefill_wgmma_block_q(D, kv_mode) * D * 2;
}
