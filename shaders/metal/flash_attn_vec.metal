// flash_attn_vec on Metal: decode attention over a KV cache, split over nwg
// workgroups per sequence (contract: pyfa_params.h). Geometry from
// metal_layout.h: one SIMD-group per threadgroup; a block of 32 cache
// positions per step, one position per lane for the scores; lanes split the
// row's float4 columns for the weighted sum of V. A GQA group's query heads
// run in passes of pyfa_metal_vec_heads_per_pass heads, each pass one walk
// over this workgroup's positions.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_q_dtype [[function_constant(PYFA_VEC_FC_Q_DTYPE)]];
constant int fc_kv_dtype [[function_constant(PYFA_VEC_FC_KV_DTYPE)]];
constant int fc_head_dim [[function_constant(PYFA_VEC_FC_HEAD_DIM)]];
constant int fc_has_softcap [[function_constant(PYFA_VEC_FC_HAS_SOFTCAP)]];
constant int fc_direct_out [[function_constant(PYFA_VEC_FC_DIRECT_OUT)]];
constant int fc_out_dtype [[function_constant(PYFA_VEC_FC_OUT_DTYPE)]];
constant int fc_has_lse [[function_constant(PYFA_VEC_FC_HAS_LSE)]];
constant int fc_paged [[function_constant(PYFA_VEC_FC_PAGED)]];

// tmp and lse are bound in every dispatch (the dispatcher binds out in their
// place when nwg == 1 / no lse is wanted); only nwg > 1 writes tmp, only
// fc_has_lse writes lse. out is of fc_out_dtype. With fc_paged k and v are
// paged pools addressed through pages and block_table (paged_kv_params.h)
// and ring_start is not read; without it those two slots are not read.
kernel void flash_attn_vec(
    constant pyfa_flash_attn_vec_params &p [[buffer(PYFA_VEC_ARG_PARAMS)]],
    device const uchar *q [[buffer(PYFA_VEC_ARG_Q)]],
    device const uchar *k [[buffer(PYFA_VEC_ARG_K)]],
    device const uchar *v [[buffer(PYFA_VEC_ARG_V)]],
    device const uint *kv_len [[buffer(PYFA_VEC_ARG_KV_LEN)]],
    device const uint *ring_start [[buffer(PYFA_VEC_ARG_RING_START)]],
    device float *tmp [[buffer(PYFA_VEC_ARG_TMP)]],
    device uchar *out [[buffer(PYFA_VEC_ARG_OUT)]],
    device float *lse [[buffer(PYFA_VEC_ARG_LSE)]],
    constant pyfa_kv_pages &pages [[buffer(PYFA_VEC_ARG_PAGES)]],
    device const int *block_table [[buffer(PYFA_VEC_ARG_BLOCK_TABLE)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    const uint iwg = tg.x, kvh = tg.y, b = tg.z;
    if (!pyfa_is_head_dim(fc_head_dim) || !pyfa_is_attn_dtype(fc_kv_dtype) || !pyfa_is_attn_dtype(fc_q_dtype) ||
        !pyfa_is_attn_dtype(fc_out_dtype)) {
        // Unreachable through the dispatchers: poison this workgroup's rows
        // (their partials, with a state that makes the reduce keep them),
        // laid out by params.head_dim, which sized the buffers. An unknown
        // out dtype is written as the narrowest, never past the buffer.
        const uint D = p.head_dim, G = p.num_heads / p.num_kv_heads;
        const uint row0 = b * p.num_heads + kvh * G, nrows = p.batch * p.num_heads;
        const int odt = pyfa_is_attn_dtype(fc_out_dtype) ? fc_out_dtype : PYFA_DTYPE_F16;
        for (uint g = 0; g < G; g++) {
            for (uint i = lane; i < D; i += PYFA_METAL_VEC_THREADS) {
                if (fc_direct_out) pyfa_store1(out + ulong(row0 + g) * D * pyfa_dtype_size(odt), i, NAN, odt);
                else tmp[(ulong(row0 + g) * p.nwg + iwg) * D + i] = NAN;
            }
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
    const uint NC = pyfa_metal_vec_cols_per_lane(D);
    const uint G = p.num_heads / p.num_kv_heads;
    const uint GP = pyfa_metal_vec_heads_per_pass(D, G);
    const uint cap = p.kv_capacity, nwg = p.nwg;
    const pyfa_vec_span span = pyfa_vec_workgroup_span(kv_len[b], fc_paged ? 0u : ring_start[b], cap, p.window,
                                                       nwg, iwg);
    const uint ring = span.ring, begin = span.begin, end = span.end;
    pyfa_pages pg = {};
    if (fc_paged) pg = pyfa_pages_of(pages, block_table, b, kvh, p.num_kv_heads);

    const uint kv_row_bytes = D * pyfa_dtype_size(fc_kv_dtype);
    const uint q_row_bytes = D * pyfa_dtype_size(fc_q_dtype);
    // Paged: slots are pool rows from the pool's start.
    const ulong head_rows = fc_paged ? 0 : ulong(b * p.num_kv_heads + kvh) * cap;
    device const uchar *k_head = k + head_rows * kv_row_bytes;
    device const uchar *v_head = v + head_rows * kv_row_bytes;
    threadgroup float *q_rows = shared;                 // [GP][D]
    threadgroup float *weights = shared + GP * D;       // [GP][PYFA_METAL_VEC_BLOCK]
    threadgroup const float4 *q_rows4 = (threadgroup const float4 *)q_rows;
    const float q_scale = fc_has_softcap ? 1.0f : p.scale;

    for (uint g0 = 0; g0 < G; g0 += GP) {
        const uint gn = min(GP, G - g0);
        const uint row0 = b * p.num_heads + kvh * G + g0; // output row of head g0

        // The pass's query rows, scaled unless softcap scales the scores.
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = lane; i < gn * D; i += PYFA_METAL_VEC_THREADS) {
            const uint g = i / D, d = i - g * D;
            q_rows[i] = pyfa_load1(q + ulong(row0 + g) * q_row_bytes, d, fc_q_dtype) * q_scale;
        }
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
                const uint slot = fc_paged ? pyfa_page_row(pg, pos) : pyfa_ring_slot(pos, ring, cap);
                device const uchar *k_row = k_head + ulong(slot) * kv_row_bytes;
                for (uint g = 0; g < gn; g++) score[g] = 0.0f;
                for (uint c = 0; c < D4; c++) {
                    const float4 kc = pyfa_load4(k_row, c, fc_kv_dtype);
                    for (uint g = 0; g < gn; g++) score[g] += dot(q_rows4[g * D4 + c], kc);
                }
                // precise::tanh: the fast-math tanh is NaN for arguments past ~44.
                if (fc_has_softcap) {
                    for (uint g = 0; g < gn; g++) score[g] = p.softcap * precise::tanh(score[g] * p.scale / p.softcap);
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

            // acc += sum over the block's positions of weight * V row.
            const uint nb = min(uint(PYFA_METAL_VEC_BLOCK), end - block);
            for (uint j = 0; j < nb; j++) {
                const uint pj = block + j;
                const uint slot = fc_paged ? pyfa_page_row(pg, pj) : pyfa_ring_slot(pj, ring, cap);
                device const uchar *v_row = v_head + ulong(slot) * kv_row_bytes;
                for (uint t = 0; t < NC; t++) {
                    const uint c = lane + t * PYFA_METAL_VEC_THREADS;
                    if (c < D4) {
                        const float4 vc = pyfa_load4(v_row, c, fc_kv_dtype);
                        for (uint g = 0; g < gn; g++) acc[g * NC + t] += weights[g * PYFA_METAL_VEC_BLOCK + j] * vc;
                    }
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }

        // Normalised rows (nwg == 1) or this workgroup's partial state.
        const uint nrows = p.batch * p.num_heads;
        for (uint g = 0; g < gn; g++) {
            const uint row = row0 + g;
            if (fc_direct_out) {
                const float inv = s[g] > 0.0f ? 1.0f / s[g] : 0.0f;
                device uchar *o = out + ulong(row) * D * pyfa_dtype_size(fc_out_dtype);
                for (uint t = 0; t < NC; t++) {
                    const uint c = lane + t * PYFA_METAL_VEC_THREADS;
                    if (c < D4) pyfa_store4(o, c, acc[g * NC + t] * inv, fc_out_dtype);
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
