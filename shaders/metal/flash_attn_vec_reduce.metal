// flash_attn_vec_reduce on Metal: merges the nwg partial (o, S, M) states of
// each row (contract: pyfa_params.h). One threadgroup per row; lanes split
// the row's float4 columns and each walks the row's nwg states.
//
// flash_attn_vec_reduce_tq_hb_undo (turboquant_params.h) is the reduce, then
// fwht_sign_undo's row transform, in one dispatch. Its output is bit for bit
// reduce followed by undo because it runs the same two functions on the same
// values: pyfa_vec_reduce_row below (this kernel's body) writes the row to
// out, a device barrier, then pyfa_tq_transform_row (fwht_sign_undo's body)
// reads it back from out. Lanes read other lanes' elements there, so the
// values pass through memory as f32 in both paths and no contraction or
// reordering can span the two steps; both libraries build with the same
// (default) options.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

constant int fc_head_dim [[function_constant(PYFA_REDUCE_FC_HEAD_DIM)]];

// Row `row` of out from its nwg states in tmp; lanes take float4 columns.
inline void pyfa_vec_reduce_row(constant pyfa_attn_reduce_params &p, device const float *tmp, device float *out,
                                uint row, uint lane, uint D) {
    const uint D4 = D / 4, nwg = p.nwg;
    device const float *sm = tmp + ulong(p.nrows) * nwg * D + ulong(row) * nwg * 2;
    device const float4 *part = (device const float4 *)(tmp + ulong(row) * nwg * D);
    device float4 *o = (device float4 *)(out + ulong(row) * D);

    // Largest M among the states that saw a key (S > 0).
    float m = PYFA_MASKED_SCORE;
    bool seen = false;
    for (uint w = 0; w < nwg; w++) {
        if (sm[2 * w] > 0.0f) {
            m = seen ? max(m, sm[2 * w + 1]) : sm[2 * w + 1];
            seen = true;
        }
    }
    for (uint c = lane; c < D4; c += PYFA_METAL_REDUCE_THREADS) {
        float4 acc = float4(0.0f);
        float total = 0.0f;
        if (seen) {
            for (uint w = 0; w < nwg; w++) {
                if (!(sm[2 * w] > 0.0f)) continue;
                const float f = exp(sm[2 * w + 1] - m);
                total += sm[2 * w] * f;
                acc += f * part[w * D4 + c];
            }
            acc /= total;
        }
        o[c] = acc; // a row no workgroup saw a key for stays zero
    }
}

kernel void flash_attn_vec_reduce(
    constant pyfa_attn_reduce_params &p [[buffer(PYFA_REDUCE_ARG_PARAMS)]],
    device const float *tmp [[buffer(PYFA_REDUCE_ARG_TMP)]],
    device float *out [[buffer(PYFA_REDUCE_ARG_OUT)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    if (!pyfa_is_head_dim(fc_head_dim)) { // unreachable through the dispatchers: poison the row
        for (uint i = lane; i < p.head_dim; i += PYFA_METAL_REDUCE_THREADS) out[ulong(tg.x) * p.head_dim + i] = NAN;
        return;
    }
    pyfa_vec_reduce_row(p, tmp, out, tg.x, lane, uint(fc_head_dim));
}

kernel void flash_attn_vec_reduce_tq_hb_undo(
    constant pyfa_tq_reduce_undo_params &p [[buffer(PYFA_REDUCE_ARG_PARAMS)]],
    device const float *tmp [[buffer(PYFA_REDUCE_ARG_TMP)]],
    device float *out [[buffer(PYFA_REDUCE_ARG_OUT)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint row = tg.x;
    if (!pyfa_is_tq_head_dim(fc_head_dim)) { // unreachable through the dispatchers: poison the row
        for (uint i = lane; i < p.reduce.head_dim; i += PYFA_METAL_REDUCE_THREADS)
            out[ulong(row) * p.reduce.head_dim + i] = NAN;
        return;
    }
    const uint D = uint(fc_head_dim);
    pyfa_vec_reduce_row(p.reduce, tmp, out, row, lane, D);
    threadgroup_barrier(mem_flags::mem_device);
    device float *o = out + ulong(row) * D;
    pyfa_tq_transform_row((device const uchar *)o, PYFA_DTYPE_F32, o, shared, D, PYFA_TQ_FWHT_SIGN_UNDO, p.seed_lo,
                          p.seed_hi, p.stream, lane, PYFA_METAL_REDUCE_THREADS);
}
