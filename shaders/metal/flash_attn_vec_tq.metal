// flash_attn_vec_tq on Metal: decode over TurboQuant codes in the rotated
// domain (contract: turboquant_params.h; semantics, grid, nwg and tmp as
// flash_attn_vec). flash_attn_vec.metal's structure and geometry: one
// SIMD-group per threadgroup, blocks of 32 positions with one position per
// lane for the scores, lanes owning float4 columns for the weighted sum of V,
// GQA heads in passes. Rows are dequantised in registers:
//   k~[i] = c_K[idx[i]] * (scale_K / sqrt(D)): the score is
//   dot(q_rot, c_K[idx]) * (scale_K * inv_sqrt_d), and a V row's softmax
//   weight takes scale_V * inv_sqrt_d before it multiplies c_V[idx].
// Both codebooks are copied into threadgroup memory after flash_attn_vec's
// layout (metal_layout.h, pyfa_metal_vec_tq_threadgroup_bytes).
#include <metal_stdlib>
#include "turboquant_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

constant int fc_k_bits [[function_constant(PYFA_TQ_VEC_FC_K_BITS)]];
constant int fc_v_bits [[function_constant(PYFA_TQ_VEC_FC_V_BITS)]];
constant int fc_head_dim [[function_constant(PYFA_TQ_VEC_FC_HEAD_DIM)]];
constant int fc_has_softcap [[function_constant(PYFA_TQ_VEC_FC_HAS_SOFTCAP)]];
constant int fc_direct_out [[function_constant(PYFA_TQ_VEC_FC_DIRECT_OUT)]];
constant int fc_has_lse [[function_constant(PYFA_TQ_VEC_FC_HAS_LSE)]];
constant int fc_paged [[function_constant(PYFA_TQ_VEC_FC_PAGED)]];
// Read with DIRECT_OUT 2 only, which Metal's plan never asks for (lastWorkgroupMerges).
constant int fc_out_dtype [[function_constant(PYFA_TQ_VEC_FC_OUT_DTYPE)]];

// q is the pre-rotated query inside tmp (its q_rot region); tmp is bound in
// every dispatch and only nwg > 1 writes it (the partials' region). out (the
// o_rot region of tmp) is f32 in the rotated domain; lse is bound in every
// dispatch and written only with fc_has_lse. With fc_paged codes and scales
// are paged pools (paged_kv_params.h), as in flash_attn_vec.metal.
kernel void flash_attn_vec_tq(
    constant pyfa_flash_attn_vec_tq_params &tp [[buffer(PYFA_VEC_ARG_PARAMS)]],
    device const float *q [[buffer(PYFA_VEC_ARG_Q)]],
    device const uchar *k [[buffer(PYFA_VEC_ARG_K)]],
    device const uchar *v [[buffer(PYFA_VEC_ARG_V)]],
    device const uint *kv_len [[buffer(PYFA_VEC_ARG_KV_LEN)]],
    device const uint *ring_start [[buffer(PYFA_VEC_ARG_RING_START)]],
    device float *tmp [[buffer(PYFA_VEC_ARG_TMP)]],
    device float *out [[buffer(PYFA_VEC_ARG_OUT)]],
    device float *lse [[buffer(PYFA_VEC_ARG_LSE)]],
    device const float *k_scales [[buffer(PYFA_TQ_VEC_ARG_K_SCALES)]],
    device const float *v_scales [[buffer(PYFA_TQ_VEC_ARG_V_SCALES)]],
    constant float *k_codebook [[buffer(PYFA_TQ_VEC_ARG_K_CODEBOOK)]],
    constant float *v_codebook [[buffer(PYFA_TQ_VEC_ARG_V_CODEBOOK)]],
    constant pyfa_kv_pages &pages [[buffer(PYFA_VEC_ARG_PAGES)]],
    device const int *block_table [[buffer(PYFA_VEC_ARG_BLOCK_TABLE)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    constant pyfa_flash_attn_vec_params &p = tp.attn;
    const uint iwg = tg.x, kvh = tg.y, b = tg.z;
    const uint G = p.num_heads / p.num_kv_heads, nrows = p.batch * p.num_heads;
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_tq_bits(fc_k_bits) || !pyfa_is_tq_bits(fc_v_bits)) {
        // Unreachable through the dispatchers: poison this workgroup's rows
        // (their partials, with a state that makes the reduce keep them).
        const uint D = p.head_dim, row0 = b * p.num_heads + kvh * G;
        for (uint g = 0; g < G; g++) {
            device float *dst = fc_direct_out ? out + ulong(row0 + g) * D : tmp + (ulong(row0 + g) * p.nwg + iwg) * D;
            for (uint i = lane; i < D; i += PYFA_METAL_VEC_THREADS) dst[i] = NAN;
            if (fc_direct_out && fc_has_lse && lane == 0) lse[row0 + g] = NAN;
            if (!fc_direct_out && lane == 0) {
                device float *sm = tmp + ulong(nrows) * p.nwg * D + (ulong(row0 + g) * p.nwg + iwg) * 2;
                sm[0] = 1.0f;
                sm[1] = 0.0f;
            }
        }
        return;
    }
    const uint D = uint(fc_head_dim), D4 = D / 4;
    const uint k_bits = uint(fc_k_bits), v_bits = uint(fc_v_bits);
    const uint NC = pyfa_metal_vec_cols_per_lane(D);
    const uint GP = pyfa_metal_vec_heads_per_pass(D, G);
    const uint cap = p.kv_capacity, nwg = p.nwg;
    const pyfa_vec_span span = pyfa_vec_workgroup_span(kv_len[b], fc_paged ? 0u : ring_start[b], cap, p.window,
                                                       nwg, iwg);
    const uint ring = span.ring, begin = span.begin, end = span.end;
    pyfa_pages pg = {};
    if (fc_paged) pg = pyfa_pages_of(pages, block_table, b, kvh, p.num_kv_heads);

    // Packed rows as 32-bit words (D * bits / 32 per row), scales per slot
    // (paged: per pool row, from the pools' starts).
    const ulong head_rows = fc_paged ? 0 : ulong(b * p.num_kv_heads + kvh) * cap;
    const uint k_row_words = D * k_bits / 32, v_row_words = D * v_bits / 32;
    device const uint *k_head = (device const uint *)k + head_rows * k_row_words;
    device const uint *v_head = (device const uint *)v + head_rows * v_row_words;
    device const float *k_scale = k_scales + head_rows;
    device const float *v_scale = v_scales + head_rows;

    threadgroup float *q_rows = shared;                         // [GP][D]
    threadgroup float *weights = shared + GP * D;               // [GP][PYFA_METAL_VEC_BLOCK]
    threadgroup float *k_cb = weights + GP * PYFA_METAL_VEC_BLOCK; // [2^k_bits]
    threadgroup float *v_cb = k_cb + (1u << k_bits);            // [2^v_bits]
    threadgroup const float4 *q_rows4 = (threadgroup const float4 *)q_rows;
    for (uint i = lane; i < (1u << k_bits); i += PYFA_METAL_VEC_THREADS) k_cb[i] = k_codebook[i];
    for (uint i = lane; i < (1u << v_bits); i += PYFA_METAL_VEC_THREADS) v_cb[i] = v_codebook[i];
    const float q_scale = fc_has_softcap ? 1.0f : p.scale;
    const float inv_sqrt_d = 1.0f / sqrt(float(D));

    for (uint g0 = 0; g0 < G; g0 += GP) {
        const uint gn = min(GP, G - g0);
        const uint row0 = b * p.num_heads + kvh * G + g0; // output row of head g0

        // The pass's query rows, scaled unless softcap scales the scores.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = lane; i < gn * D; i += PYFA_METAL_VEC_THREADS) q_rows[i] = q[ulong(row0) * D + i] * q_scale;
        threadgroup_barrier(mem_flags::mem_threadgroup);

        float m[PYFA_METAL_VEC_ACC4], s[PYFA_METAL_VEC_ACC4];
        float4 acc[PYFA_METAL_VEC_ACC4];
        for (uint g = 0; g < PYFA_METAL_VEC_ACC4; g++) {
            m[g] = PYFA_MASKED_SCORE;
            s[g] = 0.0f;
            acc[g] = float4(0.0f);
        }

        for (uint block = begin; block < end; block += PYFA_METAL_VEC_BLOCK) {
            // Scores of this lane's position for every head of the pass.
            const uint pos = block + lane;
            float score[PYFA_METAL_VEC_ACC4];
            for (uint g = 0; g < gn; g++) score[g] = PYFA_MASKED_SCORE;
            if (pos < end) {
                const uint slot = fc_paged ? pyfa_page_row(pg, pos) : (pos + ring >= cap ? pos + ring - cap : pos + ring);
                device const uint *k_row = k_head + ulong(slot) * k_row_words;
                for (uint g = 0; g < gn; g++) score[g] = 0.0f;
                for (uint c = 0; c < D4; c++) {
                    const float4 kc = pyfa_tq_centroids4(pyfa_tq_codes4(k_row, c, k_bits), k_bits, k_cb);
                    for (uint g = 0; g < gn; g++) score[g] += dot(q_rows4[g * D4 + c], kc);
                }
                const float f = k_scale[slot] * inv_sqrt_d;
                for (uint g = 0; g < gn; g++) score[g] *= f;
                if (fc_has_softcap) {
                    for (uint g = 0; g < gn; g++) score[g] = p.softcap * tanh(score[g] * p.scale / p.softcap);
                }
            }

            // Online softmax per head; every lane takes the same branches.
            for (uint g = 0; g < gn; g++) {
                const float m_new = max(m[g], simd_max(score[g]));
                float w = 0.0f;
                if (m_new > PYFA_MASKED_SCORE) {
                    const float alpha = exp(m[g] - m_new);
                    w = exp(score[g] - m_new);
                    s[g] = s[g] * alpha + simd_sum(w);
                    m[g] = m_new;
                    for (uint t = 0; t < NC; t++) acc[g * NC + t] *= alpha;
                }
                weights[g * PYFA_METAL_VEC_BLOCK + lane] = w;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            // acc += sum over the block's positions of (weight * scale_V / sqrt(D)) * c_V[idx].
            const uint nb = min(uint(PYFA_METAL_VEC_BLOCK), end - block);
            for (uint j = 0; j < nb; j++) {
                const uint pj = block + j;
                const uint slot = fc_paged ? pyfa_page_row(pg, pj) : (pj + ring >= cap ? pj + ring - cap : pj + ring);
                device const uint *v_row = v_head + ulong(slot) * v_row_words;
                const float f = v_scale[slot] * inv_sqrt_d;
                for (uint t = 0; t < NC; t++) {
                    const uint c = lane + t * PYFA_METAL_VEC_THREADS;
                    if (c < D4) {
                        const float4 vc = pyfa_tq_centroids4(pyfa_tq_codes4(v_row, c, v_bits), v_bits, v_cb);
                        for (uint g = 0; g < gn; g++) acc[g * NC + t] += (weights[g * PYFA_METAL_VEC_BLOCK + j] * f) * vc;
                    }
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }

        // Normalised rows (nwg == 1) or this workgroup's partial state.
        for (uint g = 0; g < gn; g++) {
            const uint row = row0 + g;
            if (fc_direct_out) {
                const float inv = s[g] > 0.0f ? 1.0f / s[g] : 0.0f;
                device float4 *o = (device float4 *)(out + ulong(row) * D);
                for (uint t = 0; t < NC; t++) {
                    const uint c = lane + t * PYFA_METAL_VEC_THREADS;
                    if (c < D4) o[c] = acc[g * NC + t] * inv;
                }
                if (fc_has_lse && lane == 0) lse[row] = s[g] > 0.0f ? m[g] + log(s[g]) : pyfa_neg_inf();
            } else {
                device float4 *o = (device float4 *)(tmp + (ulong(row) * nwg + iwg) * D);
                for (uint t = 0; t < NC; t++) {
                    const uint c = lane + t * PYFA_METAL_VEC_THREADS;
                    if (c < D4) o[c] = acc[g * NC + t];
                }
                if (lane == 0) {
                    device float *sm = tmp + ulong(nrows) * nwg * D + (ulong(row) * nwg + iwg) * 2;
                    sm[0] = s[g];
                    sm[1] = m[g];
                }
            }
        }
    }
}
