// flash_attn_vec_reduce on Metal: merges the nwg partial (o, S, M) states of
// each row (contract: pyfa_params.h). One threadgroup per row; lanes split
// the row's float4 columns and each walks the row's nwg states.
//
// flash_attn_vec_reduce_tq_hb_undo (turboquant_params.h) is the reduce, then
// fwht_sign_undo's row transform, in one dispatch. Its output is bit for bit
// reduce followed by undo because it runs the same functions on the same
// values: pyfa_vec_reduce_col below (this kernel's body) writes the f32 row
// to threadgroup memory, a barrier, then pyfa_tq_transform_u (fwht_sign_undo's
// body after its load) rotates it and stores it in out's dtype. Lanes read
// other lanes' elements there, so the values pass through memory as f32 in
// both paths (the unfused reduce stores f32 rows that the undo loads) and no
// contraction or reordering can span the two steps; both libraries build with
// the same (default) options.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
#include "pyfa_metal_tq.h"
using namespace metal;

constant int fc_head_dim [[function_constant(PYFA_REDUCE_FC_HEAD_DIM)]];
constant int fc_out_dtype [[function_constant(PYFA_REDUCE_FC_OUT_DTYPE)]];
constant int fc_has_lse [[function_constant(PYFA_REDUCE_FC_HAS_LSE)]];

// What merges a row's nwg (S, M) states: the largest M among the states that
// saw a key (S > 0), their total weight sum S exp(M - m), and whether any did.
struct pyfa_reduce_stats {
    float m, total;
    bool seen;
};

inline pyfa_reduce_stats pyfa_vec_reduce_stats(device const float *sm, uint nwg) {
    pyfa_reduce_stats r;
    r.m = PYFA_MASKED_SCORE;
    r.total = 0.0f;
    r.seen = false;
    for (uint w = 0; w < nwg; w++) {
        if (sm[2 * w] > 0.0f) {
            r.m = r.seen ? max(r.m, sm[2 * w + 1]) : sm[2 * w + 1];
            r.seen = true;
        }
    }
    for (uint w = 0; r.seen && w < nwg; w++)
        if (sm[2 * w] > 0.0f) r.total += sm[2 * w] * exp(sm[2 * w + 1] - r.m);
    return r;
}

// The row's lse: -inf when no workgroup saw a key.
inline float pyfa_vec_reduce_lse(pyfa_reduce_stats st) { return st.seen ? st.m + log(st.total) : pyfa_neg_inf(); }

// float4 column c of the merged row from its partials part [nwg][D4]; a row
// no workgroup saw a key for is zeros.
inline float4 pyfa_vec_reduce_col(device const float *sm, device const float4 *part, uint nwg, uint D4,
                                  pyfa_reduce_stats st, uint c) {
    float4 acc = float4(0.0f);
    if (!st.seen) return acc;
    for (uint w = 0; w < nwg; w++) {
        if (!(sm[2 * w] > 0.0f)) continue;
        acc += exp(sm[2 * w + 1] - st.m) * part[w * D4 + c];
    }
    return acc / st.total;
}

// Unreachable through the dispatchers (a specialisation outside the built
// lists): poison the row, an unknown out dtype written as the narrowest.
inline void pyfa_reduce_poison(device uchar *out, device float *lse, uint row, uint D, uint lane) {
    const int odt = pyfa_is_attn_dtype(fc_out_dtype) ? fc_out_dtype : PYFA_DTYPE_F16;
    for (uint i = lane; i < D; i += PYFA_METAL_REDUCE_THREADS)
        pyfa_store1(out + ulong(row) * D * pyfa_dtype_size(odt), i, NAN, odt);
    if (fc_has_lse && lane == 0) lse[row] = NAN;
}

// Lanes take float4 columns of row tg.x and store them in out's dtype.
kernel void flash_attn_vec_reduce(
    constant pyfa_attn_reduce_params &p [[buffer(PYFA_REDUCE_ARG_PARAMS)]],
    device const float *tmp [[buffer(PYFA_REDUCE_ARG_TMP)]],
    device uchar *out [[buffer(PYFA_REDUCE_ARG_OUT)]],
    device float *lse [[buffer(PYFA_REDUCE_ARG_LSE)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint row = tg.x;
    if (!pyfa_is_head_dim(fc_head_dim) || !pyfa_is_attn_dtype(fc_out_dtype)) {
        pyfa_reduce_poison(out, lse, row, p.head_dim, lane);
        return;
    }
    const uint D = uint(fc_head_dim), D4 = D / 4, nwg = p.nwg;
    device const float *sm = tmp + ulong(p.nrows) * nwg * D + ulong(row) * nwg * 2;
    device const float4 *part = (device const float4 *)(tmp + ulong(row) * nwg * D);
    const pyfa_reduce_stats st = pyfa_vec_reduce_stats(sm, nwg);
    device uchar *o = out + ulong(row) * D * pyfa_dtype_size(fc_out_dtype);
    for (uint c = lane; c < D4; c += PYFA_METAL_REDUCE_THREADS)
        pyfa_store4(o, c, pyfa_vec_reduce_col(sm, part, nwg, D4, st, c), fc_out_dtype);
    if (fc_has_lse && lane == 0) lse[row] = pyfa_vec_reduce_lse(st);
}

kernel void flash_attn_vec_reduce_tq_hb_undo(
    constant pyfa_tq_reduce_undo_params &p [[buffer(PYFA_REDUCE_ARG_PARAMS)]],
    device const float *tmp [[buffer(PYFA_REDUCE_ARG_TMP)]],
    device uchar *out [[buffer(PYFA_REDUCE_ARG_OUT)]],
    device float *lse [[buffer(PYFA_REDUCE_ARG_LSE)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_threadgroup]])
{
    const uint row = tg.x;
    if (!pyfa_is_tq_head_dim(fc_head_dim) || !pyfa_is_attn_dtype(fc_out_dtype)) {
        pyfa_reduce_poison(out, lse, row, p.reduce.head_dim, lane);
        return;
    }
    const uint D = uint(fc_head_dim), D4 = D / 4, nwg = p.reduce.nwg;
    device const float *sm = tmp + ulong(p.reduce.nrows) * nwg * D + ulong(row) * nwg * 2;
    device const float4 *part = (device const float4 *)(tmp + ulong(row) * nwg * D);
    const pyfa_reduce_stats st = pyfa_vec_reduce_stats(sm, nwg);
    threadgroup float4 *u4 = (threadgroup float4 *)shared;
    for (uint c = lane; c < D4; c += PYFA_METAL_REDUCE_THREADS) u4[c] = pyfa_vec_reduce_col(sm, part, nwg, D4, st, c);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    pyfa_tq_transform_u(shared, out + ulong(row) * D * pyfa_dtype_size(fc_out_dtype), fc_out_dtype, D,
                        PYFA_TQ_FWHT_SIGN_UNDO, p.seed_lo, p.seed_hi, p.stream, lane, PYFA_METAL_REDUCE_THREADS);
    if (fc_has_lse && lane == 0) lse[row] = pyfa_vec_reduce_lse(st);
}
