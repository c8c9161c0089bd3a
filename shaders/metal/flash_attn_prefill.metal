// flash_attn_prefill on Metal: tiled flash attention over many query rows
// (contract: flash_attn_prefill_params.h; tile shapes and threadgroup memory:
// metal_layout.h). One threadgroup computes block_q query rows of one head:
//   - Q is staged once; each key tile is staged (in column chunks) first as K,
//     then as V, in the I/O dtype;
//   - S = Q Kᵀ and O += P V run on 8x8 SIMD-group matrices with f32
//     accumulators; the 8x8 tiles of S and O are dealt round-robin to the
//     SIMD-groups, O stays in registers for the whole key loop;
//   - the online softmax runs per query row on threads: block_q rows of
//     PYFA_METAL_PREFILL_THREADS / block_q consecutive lanes each (within one
//     SIMD-group, so row reductions are shuffles), in base 2 with f32
//     statistics. A key outside the row's causal / window range, or blocked
//     by the mask, scores PYFA_MASKED_SCORE; a row that has seen only such
//     keys keeps m = PYFA_MASKED_SCORE and l = 0, and ends as zeros with
//     lse = -inf.
// With blk, SKIP tiles are not visited and ZERO tiles skip the mask read:
// visiting a fully blocked tile rescales by exactly 1 and adds exactly 0, and
// a zero mask adds 0, so the result is bit-identical to the run without blk.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_dtype [[function_constant(PYFA_PREFILL_FC_DTYPE)]];
constant int fc_head_dim [[function_constant(PYFA_PREFILL_FC_HEAD_DIM)]];
constant int fc_block_q [[function_constant(PYFA_PREFILL_FC_BLOCK_Q)]];
constant int fc_block_k [[function_constant(PYFA_PREFILL_FC_BLOCK_K)]];
constant int fc_has_mask [[function_constant(PYFA_PREFILL_FC_HAS_MASK)]];
constant int fc_mask_kind [[function_constant(PYFA_PREFILL_FC_MASK_KIND)]];
constant int fc_causal [[function_constant(PYFA_PREFILL_FC_DO_CAUSAL)]];
constant int fc_has_window [[function_constant(PYFA_PREFILL_FC_HAS_WINDOW)]];
constant int fc_has_softcap [[function_constant(PYFA_PREFILL_FC_HAS_SOFTCAP)]];
constant int fc_has_blk [[function_constant(PYFA_PREFILL_FC_HAS_BLK)]];
constant int fc_has_lse [[function_constant(PYFA_PREFILL_FC_HAS_LSE)]];
constant int fc_out_dtype [[function_constant(PYFA_PREFILL_FC_OUT_DTYPE)]];
constant int fc_kv_mode [[function_constant(PYFA_PREFILL_FC_KV_MODE)]];

#define PYFA_LOG2E 1.44269504088896340736f
#define PYFA_LN2 0.69314718055994530942f
// Keys of one key tile a softmax thread holds: block_k / (threads / block_q),
// at most 32 / 4 over the tiles of metal_layout.h.
#define PYFA_PREFILL_KEYS_PER_THREAD 8

// dst[r][c] = src row r, columns [c0, c0 + cols), for r < rows; zeros for
// rows [rows, tile_rows) (a ragged tile), so no garbage reaches a product.
template <typename T>
inline void prefill_stage(threadgroup T *dst, device const T *src, long row_stride, uint rows, uint tile_rows,
                          uint c0, uint cols, uint tid) {
    for (uint e = tid; e < tile_rows * cols; e += PYFA_METAL_PREFILL_THREADS) {
        const uint r = e / cols, c = e - r * cols;
        dst[e] = r < rows ? src[long(r) * row_stride + c0 + c] : T(0.0f);
    }
}

// The packed modes' inputs (flash_attn_prefill_params.h, "Packed sequences").
struct prefill_packed_args {
    device const int *cu_seqlens_q;
    device const int *seq_k;       // cu_seqlens_k (varlen) or kv_len (paged)
    device const int *block_table; // paged
    pyfa_kv_pages pages;
    pyfa_prefill_packed packed;
};

// One sequence: its query rows (at most params.q_len), keys, the position of
// its row 0, its first packed q row and k row, and its block_table row.
struct prefill_sequence {
    uint q_len, kv_len;
    long q_offset, q_row0, k_row0;
    device const int *bt;
};

// x clamped to [lo, hi] (64-bit; written out rather than relying on the
// integer overloads of clamp / min for long).
inline long prefill_clamp(long x, long lo, long hi) { return x < lo ? lo : x > hi ? hi : x; }

inline prefill_sequence prefill_sequence_of(constant pyfa_flash_attn_prefill_params &p, prefill_packed_args pk, uint b) {
    prefill_sequence s = {p.q_len, p.kv_len, long(p.q_offset), 0, 0, pk.block_table};
    if (fc_kv_mode == PYFA_PREFILL_KV_RECT) return s;
    const long tq = long(pk.packed.total_q);
    const long q_begin = prefill_clamp(long(pk.cu_seqlens_q[b]), 0l, tq);
    const long q_end = prefill_clamp(long(pk.cu_seqlens_q[b + 1]), q_begin, tq);
    long kv_len;
    if (fc_kv_mode == PYFA_PREFILL_KV_VARLEN) {
        const long tk = long(pk.packed.total_k);
        const long k_begin = prefill_clamp(long(pk.seq_k[b]), 0l, tk);
        kv_len = prefill_clamp(long(pk.seq_k[b + 1]), k_begin, tk) - k_begin;
        s.k_row0 = k_begin;
    } else {
        kv_len = prefill_clamp(long(pk.seq_k[b]), 0l, long(pk.pages.pages_per_seq) * long(pk.pages.page_size));
        s.bt = pk.block_table + ulong(b) * pk.pages.pages_per_seq;
    }
    s.q_row0 = q_begin;
    s.q_len = uint(q_end - q_begin < long(p.q_len) ? q_end - q_begin : long(p.q_len));
    s.kv_len = uint(kv_len);
    s.q_offset = kv_len - (q_end - q_begin);
    return s;
}

// prefill_stage for keys [j0, j0 + rows) of a paged sequence (pool rows of D
// elements; a page outside the pool reads the last page).
template <typename T>
inline void prefill_stage_paged(threadgroup T *dst, device const T *pool, const pyfa_kv_pages g, device const int *bt,
                                uint num_kv_heads, uint kvh, long j0, uint D, uint rows, uint tile_rows, uint c0,
                                uint cols, uint tid) {
    for (uint e = tid; e < tile_rows * cols; e += PYFA_METAL_PREFILL_THREADS) {
        const uint r = e / cols, c = e - r * cols;
        T x = T(0.0f);
        if (r < rows) {
            const uint s = uint(j0) + r;
            int page = bt[s / g.page_size];
            if (page < 0 || uint(page) >= g.num_pages) page = int(g.num_pages) - 1;
            const uint row = PYFA_PAGE_ROW(g.layout, g.page_size, num_kv_heads, uint(page), s % g.page_size, kvh);
            x = pool[ulong(row) * D + c0 + c];
        }
        dst[e] = x;
    }
}

// The (query tile, head, sequence) of threadgroup `position` of a (query
// tiles, heads, batch) grid. Threadgroups start in about the order of their
// linear index; that index is read with the query tile slowest and highest
// first, so under causal masking the tiles with the most keys start first
// across every head and sequence and the shortest start last.
inline uint3 prefill_tile_slot(uint3 position, uint3 groups) {
    const ulong planes = ulong(groups.y) * groups.z;
    const ulong rank = position.x + ulong(groups.x) * (ulong(position.z) * groups.y + position.y);
    const uint plane = uint(rank % planes);
    return uint3(groups.x - 1 - uint(rank / planes), plane % groups.y, plane / groups.y);
}

// One query tile of one head, I/O element type T, output element type O (T
// or float). Constants come from the specialisation; `shared` is laid out as
// metal_layout.h states.
template <typename T, typename O>
void prefill_tile(constant pyfa_flash_attn_prefill_params &p, device const uchar *q, device const uchar *k,
                  device const uchar *v, device const uchar *mask, device const uchar *blk, device uchar *out,
                  device float *lse, prefill_packed_args pk, threadgroup float *shared, uint3 tg, uint tid, uint sg,
                  uint lane) {
    const uint NSG = PYFA_METAL_PREFILL_SIMDGROUPS, NT = PYFA_METAL_PREFILL_THREADS;
    const uint D = uint(fc_head_dim), es = pyfa_dtype_size(fc_dtype);
    const uint BQ = uint(fc_block_q), BK = uint(fc_block_k), KC = pyfa_metal_prefill_kv_cols(D, es);
    const uint KB = BK / 8, CB = D / 8;                 // key blocks of S, column blocks of O
    const uint n_score = (BQ / 8) * KB, n_out = (BQ / 8) * CB / NSG;
    const uint n_mine = (n_score + NSG - 1 - sg) / NSG; // score tiles sg, sg + NSG, ...
    const uint qtile = tg.x, h = tg.y, b = tg.z;
    const prefill_sequence seq = prefill_sequence_of(p, pk, b);
    const bool packed = fc_kv_mode != PYFA_PREFILL_KV_RECT, paged = fc_kv_mode == PYFA_PREFILL_KV_PAGED;
    const uint i0 = qtile * BQ;
    if (i0 >= seq.q_len) return; // a tile past a packed sequence's rows (uniform)
    const uint nq = min(BQ, seq.q_len - i0);
    const uint kvh = h / (p.num_heads / p.num_kv_heads);
    // Packed modes: row r of the sequence is packed row q_row0 + r (no batch stride).
    const long row0 = seq.q_row0 + long(i0);

    threadgroup T *q_s = (threadgroup T *)shared;                  // [BQ][D]
    threadgroup T *kv_s = q_s + BQ * D;                            // [BK][KC]
    threadgroup float *s_s = (threadgroup float *)(kv_s + BK * KC); // [BQ][BK]
    threadgroup float *alpha_s = s_s + BQ * BK;                    // [BQ]

    device const T *q_tile = (device const T *)q + ((packed ? 0l : long(b) * p.q_strides[0]) +
                                                    long(h) * p.q_strides[1] + row0 * p.q_strides[2]);
    device const T *k_head = (device const T *)k + ((packed ? seq.k_row0 * p.k_strides[2] : long(b) * p.k_strides[0]) +
                                                    long(kvh) * p.k_strides[1]);
    device const T *v_head = (device const T *)v + ((packed ? seq.k_row0 * p.v_strides[2] : long(b) * p.v_strides[0]) +
                                                    long(kvh) * p.v_strides[1]);
    prefill_stage(q_s, q_tile, p.q_strides[2], nq, BQ, 0, D, tid);

    // This thread's softmax row and its state.
    const uint TPR = NT / BQ, KPT = BK / TPR;
    const uint row = tid / TPR, sub = tid - row * TPR;
    const bool row_live = row < nq;
    const long pos = seq.q_offset + long(i0) + long(row);
    float m = PYFA_MASKED_SCORE, l = 0.0f;
    device const uchar *mask_row = mask;
    if (fc_has_mask) {
        const long off = long(b) * p.mask_strides[0] + long(h) * p.mask_strides[1] + long(i0 + row) * p.mask_strides[2];
        mask_row = mask + off * (fc_mask_kind == PYFA_MASK_BOOL ? 1 : long(es));
    }
    device const uchar *blk_row = blk;
    if (fc_has_mask && fc_has_blk) {
        const uint mask_heads = p.mask_strides[1] ? p.num_heads : 1;
        const ulong plane = ulong(p.mask_strides[0] ? b : 0) * mask_heads + (p.mask_strides[1] ? h : 0);
        blk_row = blk + (plane * p.num_q_blocks + qtile) * ulong(p.num_k_blocks);
    }

    // Keys any row of the tile can see.
    const long p_lo = seq.q_offset + long(i0), p_hi = p_lo + long(nq) - 1;
    long k_begin = 0, k_end = long(seq.kv_len);
    if (fc_causal && p_hi + 1 < k_end) k_end = p_hi + 1;
    if (fc_has_window && p_lo - long(p.window) + 1 > k_begin) k_begin = p_lo - long(p.window) + 1;

    simdgroup_float8x8 acc[PYFA_METAL_PREFILL_MAX_ACC];
    for (uint i = 0; i < n_out; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    const float qk_scale = p.scale * PYFA_LOG2E;

    for (long j0 = k_end > k_begin ? k_begin / BK * BK : k_end; j0 < k_end; j0 += BK) {
        const uint nk = min(BK, uint(long(seq.kv_len) - j0));
        const uint cls = fc_has_mask && fc_has_blk ? uint(blk_row[j0 / BK]) : uint(PYFA_BLK_MIXED);
        if (cls == PYFA_BLK_SKIP) continue; // uniform: every thread reads the same byte

        // S = Q Kᵀ over column chunks of K.
        simdgroup_float8x8 s_acc[PYFA_METAL_PREFILL_MAX_SCORE_TILES];
        for (uint i = 0; i < n_mine; i++) s_acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint c0 = 0; c0 < D; c0 += KC) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (paged)
                prefill_stage_paged(kv_s, (device const T *)k, pk.pages, seq.bt, p.num_kv_heads, kvh, j0, D, nk, BK, c0,
                                    KC, tid);
            else
                prefill_stage(kv_s, k_head + j0 * p.k_strides[2], p.k_strides[2], nk, BK, c0, KC, tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint i = 0; i < n_mine; i++) {
                const uint t = sg + NSG * i, stripe = t / KB, kb = t - stripe * KB;
                for (uint d = 0; d < KC; d += 8) {
                    simdgroup_matrix<T, 8, 8> qm, km;
                    simdgroup_load(qm, q_s, D, ulong2(c0 + d, stripe * 8));
                    simdgroup_load(km, kv_s, KC, ulong2(d, kb * 8), true);
                    simdgroup_multiply_accumulate(s_acc[i], qm, km, s_acc[i]);
                }
            }
        }
        for (uint i = 0; i < n_mine; i++) {
            const uint t = sg + NSG * i, stripe = t / KB, kb = t - stripe * KB;
            simdgroup_store(s_acc[i], s_s, BK, ulong2(kb * 8, stripe * 8));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // Online softmax of this thread's row: keys sub, sub + TPR, ...
        float sv[PYFA_PREFILL_KEYS_PER_THREAD];
        float mx = PYFA_MASKED_SCORE;
        for (uint u = 0; u < KPT; u++) {
            const uint j = sub + TPR * u;
            const long key = j0 + long(j);
            bool visible = row_live && j < nk && (!fc_causal || key <= pos) &&
                           (!fc_has_window || pos - key < long(p.window));
            float s = PYFA_MASKED_SCORE;
            if (visible) {
                float x = s_s[row * BK + j];
                x = fc_has_softcap ? p.softcap * tanh(x * p.scale / p.softcap) * PYFA_LOG2E : x * qk_scale;
                if (fc_has_mask && cls != PYFA_BLK_ZERO) {
                    if (fc_mask_kind == PYFA_MASK_BOOL) {
                        visible = mask_row[key] != 0;
                    } else {
                        const float bias = float(((device const T *)mask_row)[key]);
                        visible = !pyfa_is_neg_inf(bias);
                        x += bias * PYFA_LOG2E;
                    }
                }
                if (visible) s = x;
            }
            sv[u] = s;
            mx = max(mx, s);
        }
        for (uint w = 1; w < TPR; w <<= 1) mx = max(mx, simd_shuffle_xor(mx, ushort(w)));
        const float m_new = max(m, mx);
        const bool none = m_new == PYFA_MASKED_SCORE; // nothing visible to this row yet
        const float alpha = none ? 1.0f : exp2(m - m_new);
        float sum = 0.0f;
        for (uint u = 0; u < KPT; u++) {
            const float e = none ? 0.0f : exp2(sv[u] - m_new);
            s_s[row * BK + sub + TPR * u] = e;
            sum += e;
        }
        for (uint w = 1; w < TPR; w <<= 1) sum += simd_shuffle_xor(sum, ushort(w));
        l = l * alpha + sum;
        m = m_new;
        if (sub == 0) alpha_s[row] = alpha;

        // O = O * alpha + P V over column chunks of V; each O tile in its chunk.
        for (uint c0 = 0; c0 < D; c0 += KC) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
            if (paged)
                prefill_stage_paged(kv_s, (device const T *)v, pk.pages, seq.bt, p.num_kv_heads, kvh, j0, D, nk, BK, c0,
                                    KC, tid);
            else
                prefill_stage(kv_s, v_head + j0 * p.v_strides[2], p.v_strides[2], nk, BK, c0, KC, tid);
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint i = 0; i < n_out; i++) {
                const uint t = sg + NSG * i, stripe = t / CB, cb = t - stripe * CB;
                if (cb * 8 < c0 || cb * 8 >= c0 + KC) continue;
                const float a = alpha_s[stripe * 8 + pyfa_mat_row(lane)];
                acc[i].thread_elements()[0] *= a;
                acc[i].thread_elements()[1] *= a;
                for (uint kb = 0; kb < KB; kb++) {
                    simdgroup_float8x8 pm;
                    simdgroup_matrix<T, 8, 8> vm;
                    simdgroup_load(pm, s_s, BK, ulong2(kb * 8, stripe * 8));
                    simdgroup_load(vm, kv_s, KC, ulong2(cb * 8 - c0, kb * 8));
                    simdgroup_multiply_accumulate(acc[i], pm, vm, acc[i]);
                }
            }
        }
    }

    // 1/l per row (0 for a row that saw no key), the LSE, then O / l.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sub == 0) alpha_s[row] = l > 0.0f ? 1.0f / l : 0.0f;
    if (fc_has_lse && sub == 0 && row_live)
        lse[packed ? ulong(h) * pk.packed.total_q + ulong(row0) + row : (ulong(b) * p.num_heads + h) * p.q_len + i0 + row] =
            l > 0.0f ? (m + log2(l)) * PYFA_LN2 : pyfa_neg_inf();
    threadgroup_barrier(mem_flags::mem_threadgroup);
    device O *o_tile = (device O *)out + ((packed ? 0l : long(b) * p.out_strides[0]) + long(h) * p.out_strides[1] +
                                          row0 * p.out_strides[2]);
    const uint r_lane = pyfa_mat_row(lane), c_lane = pyfa_mat_col(lane);
    for (uint i = 0; i < n_out; i++) {
        const uint t = sg + NSG * i, stripe = t / CB, cb = t - stripe * CB;
        const uint r = stripe * 8 + r_lane;
        if (r < nq) {
            const float inv = alpha_s[r];
            device O *o = o_tile + long(r) * p.out_strides[2] + cb * 8 + c_lane;
            o[0] = O(acc[i].thread_elements()[0] * inv);
            o[1] = O(acc[i].thread_elements()[1] * inv);
        }
    }
}

// A specialisation outside the supported lists (never dispatched: the
// dispatcher validates and the plan picks the tile) fills its rows with NaN
// (an unknown out dtype written as the narrowest, never past the buffer).
inline void prefill_poison(constant pyfa_flash_attn_prefill_params &p, device uchar *out, device float *lse,
                           uint3 tg, uint tid) {
    if (fc_kv_mode != PYFA_PREFILL_KV_RECT) return; // packed rows: nothing to address without valid constants
    const uint i0 = tg.x * p.block_q, nq = min(p.block_q, p.q_len - i0);
    for (uint e = tid; e < nq * p.head_dim; e += PYFA_METAL_PREFILL_THREADS) {
        const uint r = e / p.head_dim, c = e - r * p.head_dim;
        const long at = long(tg.z) * p.out_strides[0] + long(tg.y) * p.out_strides[1] + long(i0 + r) * p.out_strides[2] + c;
        if (fc_out_dtype == PYFA_DTYPE_F32) ((device float *)out)[at] = NAN;
        else if (fc_out_dtype == PYFA_DTYPE_BF16) ((device ushort *)out)[at] = ushort(0x7fc0);
        else ((device half *)out)[at] = half(NAN);
    }
    if (fc_has_lse)
        for (uint r = tid; r < nq; r += PYFA_METAL_PREFILL_THREADS)
            lse[(ulong(tg.z) * p.num_heads + tg.y) * p.q_len + i0 + r] = NAN;
}

// mask, blk and lse are bound in every dispatch (the dispatcher binds a
// stand-in when one is absent); only the constants decide what is read.
kernel void flash_attn_prefill(
    constant pyfa_flash_attn_prefill_params &p [[buffer(PYFA_PREFILL_ARG_PARAMS)]],
    device const uchar *q [[buffer(PYFA_PREFILL_ARG_Q)]],
    device const uchar *k [[buffer(PYFA_PREFILL_ARG_K)]],
    device const uchar *v [[buffer(PYFA_PREFILL_ARG_V)]],
    device const uchar *mask [[buffer(PYFA_PREFILL_ARG_MASK)]],
    device const uchar *blk [[buffer(PYFA_PREFILL_ARG_BLK)]],
    device uchar *out [[buffer(PYFA_PREFILL_ARG_OUT)]],
    device float *lse [[buffer(PYFA_PREFILL_ARG_LSE)]],
    device const int *cu_seqlens_q [[buffer(PYFA_PREFILL_ARG_CU_SEQLENS_Q)]],
    device const int *seq_k [[buffer(PYFA_PREFILL_ARG_SEQ_K)]],
    device const int *block_table [[buffer(PYFA_PREFILL_ARG_BLOCK_TABLE)]],
    constant pyfa_kv_pages &pages [[buffer(PYFA_PREFILL_ARG_PAGES)]],
    constant pyfa_prefill_packed &packed [[buffer(PYFA_PREFILL_ARG_PACKED)]],
    threadgroup float *shared [[threadgroup(0)]],
    uint3 position [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    ushort tid [[thread_index_in_threadgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]])
{
    const uint3 tg = prefill_tile_slot(position, groups);
    const uint D = uint(fc_head_dim), es = pyfa_dtype_size(fc_dtype);
    if (!pyfa_is_attn_dtype(fc_dtype) || !pyfa_is_head_dim(fc_head_dim) ||
        (fc_out_dtype != fc_dtype && fc_out_dtype != PYFA_DTYPE_F32) || uint(fc_kv_mode) > PYFA_PREFILL_KV_PAGED ||
        uint(fc_block_q) != pyfa_metal_prefill_block_q(D, es) || uint(fc_block_k) != pyfa_metal_prefill_block_k(D, es)) {
        prefill_poison(p, out, lse, tg, tid);
        return;
    }
    const bool f32_out = fc_out_dtype == PYFA_DTYPE_F32;
    const prefill_packed_args pk = {cu_seqlens_q, seq_k, block_table, pages, packed};
    if (fc_dtype == PYFA_DTYPE_F16 && f32_out)
        prefill_tile<half, float>(p, q, k, v, mask, blk, out, lse, pk, shared, tg, tid, sg, lane);
    else if (fc_dtype == PYFA_DTYPE_F16)
        prefill_tile<half, half>(p, q, k, v, mask, blk, out, lse, pk, shared, tg, tid, sg, lane);
    else if (fc_dtype == PYFA_DTYPE_BF16 && f32_out)
        prefill_tile<bfloat, float>(p, q, k, v, mask, blk, out, lse, pk, shared, tg, tid, sg, lane);
    else if (fc_dtype == PYFA_DTYPE_BF16)
        prefill_tile<bfloat, bfloat>(p, q, k, v, mask, blk, out, lse, pk, shared, tg, tid, sg, lane);
    else
        prefill_tile<float, float>(p, q, k, v, mask, blk, out, lse, pk, shared, tg, tid, sg, lane);
}
