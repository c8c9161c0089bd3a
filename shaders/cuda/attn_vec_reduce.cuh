/*
 * The merge of flash_attn_vec_reduce (contract in pyfa_params.h), shared by
 * the dense reduce kernel (attn_vec.cu) and the fused TurboQuant reduce + undo
 * (turboquant.cu). Both call attn_vec_reduce_row, whose result bits do not
 * depend on the block size: M is a max (exact in any order), each weight is
 * computed by one thread, the total is summed by every thread in w order, and
 * each output element by one thread with a fixed accumulator pattern; every
 * multiply-add is written out (fmaf). So fused and unfused tails agree bit
 * for bit whatever threads the plan gives each kernel.
 */
#pragma once
#include "pyfa_cuda.cuh"

#define PYFA_REDUCE_MAX_NWG 1024 /* FlashAttnVec.maxWorkgroups */

/* Synchronises this thread's group of GROUP threads: 0 = the block, 32 = the
 * warp, else the 32-aligned warps on named barrier 1 + threadIdx.x / GROUP. */
template <int GROUP>
__device__ __forceinline__ void attn_vec_group_sync() {
    if constexpr (GROUP == 32) __syncwarp();
    else if constexpr (GROUP == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"r"(1 + threadIdx.x / GROUP), "n"(GROUP) : "memory");
}

/* Merges one row: sm = its (S, M) pairs, part = its nwg partial outputs
 * [nwg, D]; writes element e through store(e, value) and returns the row's
 * lse (every thread gets it). scratch: shared float[2 * nwg]. A row whose
 * workgroups saw no key gives zeros and lse -inf. Every thread of the block
 * (GROUP > 0: of its group of GROUP threads, a warp or warps 32-aligned, which
 * synchronise on named barrier 1 + threadIdx.x / GROUP) must call it. The
 * pairs are read once, one per thread, into shared memory: the scans over them
 * then wait on shared loads, not on nwg global loads in a row. */
template <int GROUP = 0, class Store>
__device__ __forceinline__ float attn_vec_reduce_row(const float *sm, const float *part, uint32_t nwg, uint32_t D,
                                                     float *scratch, Store store) {
    static_assert(GROUP % 32 == 0, "groups of whole warps");
    const uint32_t rank = GROUP ? threadIdx.x % GROUP : threadIdx.x, size = GROUP ? GROUP : blockDim.x;
    float *s_total = scratch, *weight = scratch + nwg; /* S of each workgroup, then its weight */
    for (uint32_t w = rank; w < nwg; w += size) {
        /* .cg loads (L2): other workgroups of the same launch may have written them (attn_vec_merge_last) */
        const float S = __ldcg(sm + 2 * w), m = __ldcg(sm + 2 * w + 1);
        s_total[w] = S;
        weight[w] = S > 0.0f ? m : -INFINITY; /* the M candidates, until the weights replace them */
    }
    attn_vec_group_sync<GROUP>();
    float M = -INFINITY;
    for (uint32_t w = 0; w < nwg; w++) M = fmaxf(M, weight[w]);
    attn_vec_group_sync<GROUP>(); /* every thread has M before the weights overwrite the candidates */
    for (uint32_t w = rank; w < nwg; w += size)
        weight[w] = (s_total[w] > 0.0f && M != -INFINITY) ? __expf(__ldcg(sm + 2 * w + 1) - M) : 0.0f;
    attn_vec_group_sync<GROUP>();
    float total = 0.0f;
    for (uint32_t w = 0; w < nwg; w++) total = fmaf(s_total[w], weight[w], total);
    const float inv = total > 0.0f ? __frcp_rn(total) : 0.0f;
    for (uint32_t e = rank; e < D; e += size) {
        /* Accumulator i takes the partials w = i (mod 8); the loop is unrolled so
         * 32 independent loads are in flight per thread (it is latency-bound). */
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        uint32_t w = 0;
#pragma unroll 4
        for (; w + 8 <= nwg; w += 8) {
            float x[8];
#pragma unroll
            for (int i = 0; i < 8; i++) x[i] = __ldcg(part + (size_t)(w + i) * D + e);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = fmaf(weight[w + i], x[i], acc[i]);
        }
        for (; w < nwg; w++) acc[0] = fmaf(weight[w], __ldcg(part + (size_t)w * D + e), acc[0]);
        store(e, __fmul_rn(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])), inv));
    }
    return total > 0.0f ? M + logf(total) : -INFINITY;
}

/* attn_vec_merge_last's merge of rows [row0, row0 + gn), a group of GROUP
 * threads a row (0: the whole block), each group's scratch 2 nwg floats. */
template <int GROUP, int D>
__device__ __forceinline__ void attn_vec_merge_rows(const pyfa_cuda_args &a, uint32_t gn, size_t row0, uint32_t nrows,
                                                    uint32_t nwg, int out_dtype, bool has_lse, float *scratch_base) {
    const float *tmp = pyfa_ptr<const float>(a, PYFA_VEC_ARG_TMP);
    const uint32_t n = nwg < PYFA_REDUCE_MAX_NWG ? nwg : PYFA_REDUCE_MAX_NWG;
    const uint32_t group = GROUP ? threadIdx.x / GROUP : 0, groups = GROUP ? blockDim.x / GROUP : 1;
    float *scratch = scratch_base + group * 2 * n;
    void *out = pyfa_ptr<void>(a, PYFA_VEC_ARG_OUT);
    for (uint32_t g = group; g < gn; g += groups) {
        const size_t row = row0 + g;
        const float *sm = tmp + (size_t)nrows * nwg * D + row * nwg * 2;
        const float *part = tmp + row * nwg * D;
        const float lse = attn_vec_reduce_row<GROUP>(sm, part, n, D, scratch, [&](uint32_t e, float x) {
            pyfa_store_as(out, row * D + e, x, out_dtype);
        });
        if (has_lse && (GROUP ? threadIdx.x % GROUP : threadIdx.x) == 0) pyfa_ptr<float>(a, PYFA_VEC_ARG_LSE)[row] = lse;
        attn_vec_group_sync<GROUP>(); /* this group's scratch serves its next row */
    }
}

/* After a workgroup wrote its partial states of rows [row0, row0 + gn): it
 * takes a ticket of row0, and the workgroup that takes the last (nwg - 1)
 * merges those rows with attn_vec_reduce_row (so out and lse get the bits
 * flash_attn_vec_reduce writes: they do not depend on how many threads merge
 * a row), and takes the nwg tickets back for the next dispatch (every other
 * workgroup of the rows has taken its ticket). A row is merged by a warp, or,
 * with fewer rows than warps, by two warps or the whole block: the merge is a
 * chain of loads over the partials, and more threads shorten it.
 * Each merging group's scratch (2 nwg floats, at most one group a warp) lies
 * at `scratch_area` in shared memory, by default the start of dynamic shared
 * memory, free by now (the plan checks that blockDim / 32 of them fit). Every thread of the block calls it; tmp,
 * out and lse as flash_attn_vec's. Returns whether this workgroup merged
 * (alike in every thread). */
template <int D>
__device__ __noinline__ bool attn_vec_merge_last(const pyfa_cuda_args &a, uint32_t gn, size_t row0, uint32_t nrows,
                                                 uint32_t nwg, int out_dtype, bool has_lse, float *scratch_area) {
    extern __shared__ __align__(16) float attn_vec_merge_scratch[];
    __shared__ uint32_t s_last;
    __threadfence(); /* this thread's partials, visible to the device before the ticket */
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t *ticket = pyfa_ptr<uint32_t>(a, PYFA_VEC_ARG_TICKETS) + row0;
        s_last = atomicAdd(ticket, 1u) == nwg - 1;
        /* Taken back, not stored as 0: should dispatches sharing the tickets ever overlap (a
         * plan run on two streams at once, against its contract), the count still returns to 0
         * once they are done, so later dispatches merge right. */
        if (s_last) atomicSub(ticket, nwg);
    }
    __syncthreads();
    if (!s_last) return false; /* uniform */
    __threadfence(); /* the other workgroups' partials, seen after their tickets */
    float *scratch = scratch_area ? scratch_area : attn_vec_merge_scratch;
    const uint32_t warps = blockDim.x >> 5;
    if (gn == 1)
        attn_vec_merge_rows<0, D>(a, gn, row0, nrows, nwg, out_dtype, has_lse, scratch);
    else if (2 * gn <= warps)
        attn_vec_merge_rows<64, D>(a, gn, row0, nrows, nwg, out_dtype, has_lse, scratch);
    else
        attn_vec_merge_rows<32, D>(a, gn, row0, nrows, nwg, out_dtype, has_lse, scratch);
    return true;
}

/* The end of one decode workgroup (flash_attn_vec and flash_attn_vec_tq):
 * merges the STATES partial softmax states each of its gn query heads left
 * in shared memory — s_ms[(state * GT + g) * 2 + {0, 1}] = (m in the log2
 * domain, s), s_acc[(state * GT + g) * D + e] = the unnormalised output — and
 * writes head g0 + g either normalised to out in dtype out_dtype, and its lse
 * when has_lse (direct: nwg == 1), or as this workgroup's partial (o, S, M)
 * in tmp (contract in pyfa_params.h), then, with tickets bound, takes part in
 * attn_vec_merge_last (its scratch at merge_scratch when given) and returns
 * whether this workgroup merged. Every thread of the block takes part. */
template <int STATES, int GT, int D>
__device__ __forceinline__ bool attn_vec_write_states(const pyfa_cuda_args &a, const float *s_ms, const float *s_acc,
                                                      uint32_t gn, size_t row0, uint32_t nrows, uint32_t nwg,
                                                      uint32_t iwg, bool direct, int out_dtype, bool has_lse,
                                                      float *merge_scratch = nullptr) {
    for (uint32_t i = threadIdx.x; i < gn * D; i += blockDim.x) {
        const uint32_t g = i / D, e = i % D;
        float M = -INFINITY;
#pragma unroll 8
        for (int st = 0; st < STATES; st++) M = fmaxf(M, s_ms[(st * GT + g) * 2]);
        float o = 0.0f, total = 0.0f;
        if (M != -INFINITY) {
#pragma unroll 8
            for (int st = 0; st < STATES; st++) {
                const float f = exp2f(s_ms[(st * GT + g) * 2] - M);
                total += s_ms[(st * GT + g) * 2 + 1] * f;
                o += s_acc[(st * GT + g) * D + e] * f;
            }
        }
        const size_t row = row0 + g;
        if (direct) {
            pyfa_store_as(pyfa_ptr<void>(a, PYFA_VEC_ARG_OUT), row * D + e, total > 0.0f ? o / total : 0.0f, out_dtype);
            if (has_lse && e == 0)
                pyfa_ptr<float>(a, PYFA_VEC_ARG_LSE)[row] = total > 0.0f ? (M + log2f(total)) * PYFA_LN2 : -INFINITY;
        } else {
            float *tmp = pyfa_ptr<float>(a, PYFA_VEC_ARG_TMP);
            tmp[(row * nwg + iwg) * D + e] = o;
            if (e == 0) {
                float *sm = tmp + (size_t)nrows * nwg * D + (row * nwg + iwg) * 2;
                sm[0] = total;
                sm[1] = M == -INFINITY ? -INFINITY : M * PYFA_LN2;
            }
        }
    }
    /* Split with the tickets bound (DIRECT_OUT 2): the last workgroup merges. */
    if (!direct && a.arg[PYFA_VEC_ARG_TICKETS] != 0)
        return attn_vec_merge_last<D>(a, gn, row0, nrows, nwg, out_dtype, has_lse, merge_scratch);
    return false;
}

/* The logical positions [begin, end) workgroup iwg of sequence b covers, and
 * the sequence's ring_start, for flash_attn_vec and flash_attn_vec_tq (whose
 * kv_len / ring_start slots share the decode's numbers). Lengths may be
 * device-resident and unchecked, so they are clamped into range. */
struct attn_vec_span {
    uint32_t ring, begin, end;
};

__device__ __forceinline__ attn_vec_span attn_vec_workgroup_span(const pyfa_cuda_args &a, uint32_t b, uint32_t cap,
                                                                 uint32_t window, uint32_t nwg, uint32_t iwg,
                                                                 bool paged = false) {
    uint32_t kv_len = pyfa_values<uint32_t>(a, PYFA_VEC_ARG_KV_LEN)[b];
    /* A paged sequence is not a ring: its ring_start slot is not read. */
    uint32_t ring = paged ? 0u : pyfa_values<uint32_t>(a, PYFA_VEC_ARG_RING_START)[b];
    kv_len = (int32_t)kv_len < 0 ? 0 : (kv_len > cap ? cap : kv_len);
    ring = ring < cap ? ring : 0;
    const uint32_t lo = (window && kv_len > window) ? kv_len - window : 0;
    const uint64_t n = kv_len - lo, chunk = (n + nwg - 1) / nwg;
    const uint64_t c0 = (uint64_t)iwg * chunk, c1 = c0 + chunk;
    return {ring, lo + (uint32_t)(c0 < n ? c0 : n), lo + (uint32_t)(c1 < n ? c1 : n)};
}

/* Paged pools (paged_kv_params.h) for one (sequence, KV head) of a decode
 * workgroup with the PAGED constant: row(s) is the pool row of position s
 * (s < pages_per_seq * page_size, which the kv_len clamp guarantees), with
 * a block_table entry outside 0..num_pages-1 read as page num_pages - 1.
 * Both layouts' PYFA_PAGE_ROW is page * page_size * num_kv_heads + t *
 * t_stride + head_row (NHD: t_stride = num_kv_heads, head_row = kvh; HND:
 * 1 and kvh * page_size), so a row costs a clamp and two multiply-adds.
 * page_size is a power of two: shifts and masks. 32-bit rows are exact (the
 * dispatchers check num_pages * page_size * num_kv_heads fits); callers
 * widen a row to 64 bits before multiplying it by a row's bytes. */
struct attn_vec_pages {
    const int32_t *table; /* this sequence's block_table row (device memory or launch bytes) */
    uint32_t shift, mask, last_page, page_rows, t_stride, head_row;

    /* The block_table entry of position s, as stored (unclamped). */
    __device__ __forceinline__ uint32_t entry(uint32_t s) const { return (uint32_t)table[s >> shift]; }
    /* The pool row of position s given its entry. */
    __device__ __forceinline__ uint32_t row_at(uint32_t entry, uint32_t s) const {
        return min(entry, last_page) * page_rows + (s & mask) * t_stride + head_row;
    }
    __device__ __forceinline__ uint32_t row(uint32_t s) const { return row_at(entry(s), s); }
};

__device__ __forceinline__ attn_vec_pages attn_vec_pages_of(const pyfa_cuda_args &a, uint32_t b, uint32_t kvh,
                                                            uint32_t num_kv_heads) {
    const pyfa_kv_pages &kp = pyfa_param<pyfa_kv_pages>(a, PYFA_VEC_ARG_PAGES);
    const bool nhd = kp.layout == PYFA_PAGES_NHD;
    attn_vec_pages pg;
    pg.table = pyfa_values<int32_t>(a, PYFA_VEC_ARG_BLOCK_TABLE) + (size_t)b * kp.pages_per_seq;
    pg.shift = (uint32_t)(__ffs((int)kp.page_size) - 1);
    pg.mask = kp.page_size - 1;
    pg.last_page = kp.num_pages - 1;
    pg.page_rows = kp.page_size * num_kv_heads;
    pg.t_stride = nhd ? num_kv_heads : 1u;
    pg.head_row = nhd ? kvh : kvh * kp.page_size;
    return pg;
}
