/*
 * The per-element arithmetic of flash_attn_vec_reduce (contract in
 * pyfa_params.h), shared by the dense reduce kernel (attn_vec.cu) and the
 * fused TurboQuant reduce + undo (turboquant.cu): both call these functions,
 * and every multiply-add is written out (fmaf), so the two kernels produce
 * the same bits for the same tmp.
 */
#pragma once
#include "pyfa_cuda.cuh"

/* The largest M over the workgroups of a row that saw a key (S > 0);
 * -INFINITY when none did. sm: the row's (S, M) pairs. */
__device__ __forceinline__ float attn_vec_reduce_max(const float *sm, uint32_t nwg) {
    float M = -INFINITY;
    for (uint32_t w = 0; w < nwg; w++)
        if (sm[2 * w] > 0.0f) M = fmaxf(M, sm[2 * w + 1]);
    return M;
}

/* Output element e of a row: the partials part[w * head_dim + e] merged with
 * the weights exp(M_w - M) / sum_w S_w exp(M_w - M); 0 for a row with no key. */
__device__ __forceinline__ float attn_vec_reduce_element(const float *sm, const float *part, uint32_t nwg,
                                                         uint32_t head_dim, float M, uint32_t e) {
    float acc = 0.0f, total = 0.0f;
    if (M != -INFINITY) {
#pragma unroll 8 /* several partials' loads in flight: the loop is latency-bound */
        for (uint32_t w = 0; w < nwg; w++) {
            if (!(sm[2 * w] > 0.0f)) continue;
            const float f = __expf(sm[2 * w + 1] - M);
            total = fmaf(sm[2 * w], f, total);
            acc = fmaf(f, part[(size_t)w * head_dim + e], acc);
        }
    }
    return total > 0.0f ? __fdiv_rn(acc, total) : 0.0f;
}
