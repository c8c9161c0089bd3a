// fwht, fwht_sign_premult and fwht_sign_undo on Metal (contract:
// turboquant_params.h): one SIMD-group per row, through
// pyfa_tq_transform_row, whose pyfa_tq_transform_u
// flash_attn_vec_reduce_tq_hb_undo (flash_attn_vec_reduce.metal) runs for its
// undo too.
#include <metal_stdlib>
#include "turboquant_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

constant int fc_src_dtype [[function_constant(PYFA_TQ_FWHT_FC_SRC_DTYPE)]];
constant int fc_head_dim [[function_constant(PYFA_TQ_FWHT_FC_HEAD_DIM)]];
constant int fc_dst_dtype [[function_constant(PYFA_TQ_FWHT_FC_DST_DTYPE)]];

// Row tg.x of src -> dst. dst may be src (in place, one dtype).
inline void pyfa_tq_fwht_kernel(constant pyfa_tq_fwht_params &p, device const uchar *src, device uchar *dst,
                                threadgroup float *u, uint row, uint lane, uint transform) {
    const uint T = PYFA_METAL_TQ_ROW_THREADS;
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_attn_dtype(fc_src_dtype) || !pyfa_is_attn_dtype(fc_dst_dtype)) {
        // Unreachable through the dispatchers: poison the row (an unknown
        // dst dtype written as the narrowest, never past the buffer).
        const int ddt = pyfa_is_attn_dtype(fc_dst_dtype) ? fc_dst_dtype : PYFA_DTYPE_F16;
        device uchar *d = dst + ulong(row) * p.head_dim * pyfa_dtype_size(ddt);
        for (uint i = lane; i < p.head_dim; i += T) pyfa_store1(d, i, NAN, ddt);
        return;
    }
    const uint D = uint(fc_head_dim);
    pyfa_tq_transform_row(src + ulong(row) * D * pyfa_dtype_size(fc_src_dtype), fc_src_dtype,
                          dst + ulong(row) * D * pyfa_dtype_size(fc_dst_dtype), fc_dst_dtype, u, D, transform,
                          p.seed_lo, p.seed_hi, p.stream, lane, T);
}

#define PYFA_TQ_FWHT_KERNEL(name, transform)                                                                  \
    kernel void name(constant pyfa_tq_fwht_params &p [[buffer(PYFA_TQ_FWHT_ARG_PARAMS)]],                     \
                     device const uchar *src [[buffer(PYFA_TQ_FWHT_ARG_SRC)]],                                  \
                     device uchar *dst [[buffer(PYFA_TQ_FWHT_ARG_DST)]],                                        \
                     threadgroup float *shared [[threadgroup(0)]],                                              \
                     uint3 tg [[threadgroup_position_in_grid]],                                                 \
                     ushort lane [[thread_index_in_threadgroup]]) {                                             \
        pyfa_tq_fwht_kernel(p, src, dst, shared, tg.x, lane, transform);                                       \
    }

PYFA_TQ_FWHT_KERNEL(fwht, PYFA_TQ_FWHT_PLAIN)
PYFA_TQ_FWHT_KERNEL(fwht_sign_premult, PYFA_TQ_FWHT_SIGN_PREMULT)
PYFA_TQ_FWHT_KERNEL(fwht_sign_undo, PYFA_TQ_FWHT_SIGN_UNDO)
