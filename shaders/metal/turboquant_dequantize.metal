// tq_dequantize_kv on Metal: cache slots back to f32 rows in the original
// domain, x~ = s . FWHT(c[idx]) * (scale / D) (contract: turboquant_params.h).
// One SIMD-group per row. Built with fast math off like the encoder
// (kernel_list.h), so a row decodes to the CPU's floats: the same FWHT
// additions in the same order, then one correctly rounded / and two products.
#include <metal_stdlib>
#include "turboquant_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

#pragma clang fp contract(off)

constant int fc_bits [[function_constant(PYFA_TQ_DEQUANT_FC_BITS)]];
constant int fc_head_dim [[function_constant(PYFA_TQ_DEQUANT_FC_HEAD_DIM)]];

kernel void tq_dequantize_kv(
    constant pyfa_tq_dequantize_params &p [[buffer(PYFA_TQ_DEQUANT_ARG_PARAMS)]],
    device const uchar *codes [[buffer(PYFA_TQ_DEQUANT_ARG_CODES)]],
    device const float *scales [[buffer(PYFA_TQ_DEQUANT_ARG_SCALES)]],
    constant float *codebook [[buffer(PYFA_TQ_DEQUANT_ARG_CODEBOOK)]],
    device float *out [[buffer(PYFA_TQ_DEQUANT_ARG_OUT)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint T = PYFA_METAL_TQ_ROW_THREADS;
    const uint token = tg.x, head = tg.y;
    device float *dst = out + (ulong(token) * p.num_kv_heads + head) * p.head_dim;
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_tq_bits(fc_bits)) {
        // Unreachable through the dispatchers: poison the row.
        for (uint i = lane; i < p.head_dim; i += T) dst[i] = NAN;
        return;
    }
    const uint D = uint(fc_head_dim), bits = uint(fc_bits), mask = (1u << bits) - 1;
    uint slot = p.first_slot + token;
    if (slot >= p.kv_capacity) slot -= p.kv_capacity;
    const ulong r = (ulong(p.sequence) * p.num_kv_heads + head) * p.kv_capacity + slot;
    device const uint *row = (device const uint *)(codes + r * (D * bits / 8));
    threadgroup float *u = shared; // [D]

    for (uint c = lane; c < D / 4; c += T) {
        const uint quad = pyfa_tq_codes4(row, c, bits);
        for (uint k = 0; k < 4; k++) u[4 * c + k] = codebook[(quad >> (k * bits)) & mask];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    pyfa_tq_fwht(u, D, lane, T);
    const float f = scales[r] / float(D);
    for (uint i = lane; i < D; i += T) {
        const float y = u[i] * f;
        dst[i] = y * pyfa_tq_sign(p.seed_lo, p.seed_hi, p.stream, i);
    }
}
