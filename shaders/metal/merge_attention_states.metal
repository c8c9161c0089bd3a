// merge_attention_states on Metal: out = (w_a o_a + w_b o_b) / (w_a + w_b)
// with w_x = exp(lse_x - max(lse_a, lse_b)) (contract:
// flash_attn_prefill_params.h). One SIMD-group per row; lanes split the
// row's columns. A side whose lse is -inf (bit pattern: fast math may fold
// comparisons with infinities) has weight 0; both: zeros and lse -inf. A
// side whose lse is +inf dominates: weight 1 for each +inf side, 0 for the
// other, lse +inf.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_dtype [[function_constant(PYFA_MERGE_FC_DTYPE)]];
constant int fc_has_lse [[function_constant(PYFA_MERGE_FC_HAS_LSE)]];
constant int fc_out_dtype [[function_constant(PYFA_MERGE_FC_OUT_DTYPE)]];

// Inputs of element type T, out of O (T or float).
template <typename T, typename O>
void merge_row(constant pyfa_merge_attn_params &p, device const uchar *o_a, device const float *lse_a,
               device const uchar *o_b, device const float *lse_b, device uchar *out, device float *lse_out,
               uint3 tg, uint lane) {
    const ulong idx = (ulong(tg.z) * p.num_heads + tg.y) * p.seq_len + tg.x;
    const long off = long(tg.z) * p.o_strides[0] + long(tg.y) * p.o_strides[1] + long(tg.x) * p.o_strides[2];
    device const T *a = (device const T *)o_a + off;
    device const T *b = (device const T *)o_b + off;
    device O *o = (device O *)out + off;
    const float la = lse_a[idx], lb = lse_b[idx];
    const bool none_a = pyfa_is_neg_inf(la), none_b = pyfa_is_neg_inf(lb);
    const bool top_a = as_type<uint>(la) == 0x7f800000u, top_b = as_type<uint>(lb) == 0x7f800000u;
    const bool top = top_a || top_b;
    const float mx = none_a ? lb : none_b ? la : max(la, lb);
    const float wa = top ? (top_a ? 1.0f : 0.0f) : none_a ? 0.0f : exp(la - mx);
    const float wb = top ? (top_b ? 1.0f : 0.0f) : none_b ? 0.0f : exp(lb - mx);
    const float total = wa + wb;
    const bool none = none_a && none_b;
    const float fa = none ? 0.0f : wa / total, fb = none ? 0.0f : wb / total;
    for (uint d = lane; d < p.head_dim; d += PYFA_METAL_PREFILL_AUX_THREADS)
        o[d] = none ? O(0.0f) : O(fa * float(a[d]) + fb * float(b[d]));
    // One side alone passes its lse through unchanged (no exp/log round trip).
    if (fc_has_lse && lane == 0)
        lse_out[idx] = none ? pyfa_neg_inf() : top ? as_type<float>(0x7f800000u) : none_a ? lb : none_b ? la
                                                                                   : mx + log(total);
}

// lse_out is bound in every dispatch (the dispatcher binds a stand-in when
// the caller wants none); only fc_has_lse writes it.
kernel void merge_attention_states(
    constant pyfa_merge_attn_params &p [[buffer(PYFA_MERGE_ARG_PARAMS)]],
    device const uchar *o_a [[buffer(PYFA_MERGE_ARG_O_A)]],
    device const float *lse_a [[buffer(PYFA_MERGE_ARG_LSE_A)]],
    device const uchar *o_b [[buffer(PYFA_MERGE_ARG_O_B)]],
    device const float *lse_b [[buffer(PYFA_MERGE_ARG_LSE_B)]],
    device uchar *out [[buffer(PYFA_MERGE_ARG_OUT)]],
    device float *lse_out [[buffer(PYFA_MERGE_ARG_LSE_OUT)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    const bool f32_out = fc_out_dtype == PYFA_DTYPE_F32, same = fc_out_dtype == fc_dtype;
    if (fc_dtype == PYFA_DTYPE_F16 && (same || f32_out)) {
        if (f32_out) merge_row<half, float>(p, o_a, lse_a, o_b, lse_b, out, lse_out, tg, lane);
        else merge_row<half, half>(p, o_a, lse_a, o_b, lse_b, out, lse_out, tg, lane);
    } else if (fc_dtype == PYFA_DTYPE_BF16 && (same || f32_out)) {
        if (f32_out) merge_row<bfloat, float>(p, o_a, lse_a, o_b, lse_b, out, lse_out, tg, lane);
        else merge_row<bfloat, bfloat>(p, o_a, lse_a, o_b, lse_b, out, lse_out, tg, lane);
    } else if (fc_dtype == PYFA_DTYPE_F32 && same) {
        merge_row<float, float>(p, o_a, lse_a, o_b, lse_b, out, lse_out, tg, lane);
    } else if (fc_has_lse && lane == 0) { // unreachable through the dispatcher: poison the row's lse
        lse_out[(ulong(tg.z) * p.num_heads + tg.y) * p.seq_len + tg.x] = NAN;
    }
}
