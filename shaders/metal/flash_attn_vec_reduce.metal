// flash_attn_vec_reduce on Metal: merges the nwg partial (o, S, M) states of
// each row (contract: pyfa_params.h). One threadgroup per row; lanes split
// the row's float4 columns and each walks the row's nwg states.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_head_dim [[function_constant(PYFA_REDUCE_FC_HEAD_DIM)]];

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
    const uint D = uint(fc_head_dim), D4 = D / 4, nwg = p.nwg, row = tg.x;
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
