// flash_attn_prefill_blk on Metal: classifies the (query tile, key tile)
// blocks of a mask for flash_attn_prefill (contract and byte values:
// flash_attn_prefill_params.h). One SIMD-group per threadgroup writes byte x
// of mask plane (z, y), query tile x / num_k_blocks and key tile
// x % num_k_blocks: its lanes walk the tile's entries (a row's keys across
// lanes, so reads are contiguous) and two votes decide the byte. Additive
// entries are compared by bit pattern: SKIP needs exactly -inf, ZERO exactly
// +-0.
#include <metal_stdlib>
#include "pyfa_params.h"
#include "metal_layout.h"
#include "pyfa_metal.h"
using namespace metal;

constant int fc_dtype [[function_constant(PYFA_BLK_FC_DTYPE)]];
constant int fc_block_q [[function_constant(PYFA_BLK_FC_BLOCK_Q)]];
constant int fc_block_k [[function_constant(PYFA_BLK_FC_BLOCK_K)]];
constant int fc_mask_kind [[function_constant(PYFA_BLK_FC_MASK_KIND)]];

kernel void flash_attn_prefill_blk(
    constant pyfa_flash_attn_prefill_params &p [[buffer(PYFA_PREFILL_ARG_PARAMS)]],
    device const uchar *mask [[buffer(PYFA_PREFILL_ARG_MASK)]],
    device uchar *blk [[buffer(PYFA_PREFILL_ARG_BLK)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    const uint BQ = uint(fc_block_q), BK = uint(fc_block_k);
    const uint mask_heads = p.mask_strides[1] ? p.num_heads : 1;
    device uchar *dst = blk + (ulong(tg.z) * mask_heads + tg.y) * p.num_q_blocks * ulong(p.num_k_blocks) + tg.x;
    const bool is_bool = fc_mask_kind == PYFA_MASK_BOOL;
    if (BQ == 0 || BK == 0 || (!is_bool && !pyfa_is_attn_dtype(fc_dtype))) {
        // Unreachable through the dispatcher: mark the tile MIXED, which
        // makes the prefill read its mask (never a wrong skip).
        if (lane == 0) *dst = PYFA_BLK_MIXED;
        return;
    }
    const uint es = is_bool ? 1 : pyfa_dtype_size(fc_dtype);
    const uint qt = tg.x / p.num_k_blocks, kt = tg.x % p.num_k_blocks;
    const uint i0 = qt * BQ, nq = min(BQ, p.q_len - i0);
    const uint j0 = kt * BK, nk = min(BK, p.kv_len - j0);
    device const uchar *base = mask + (long(tg.z) * p.mask_strides[0] + long(tg.y) * p.mask_strides[1] +
                                       long(i0) * p.mask_strides[2]) * long(es);
    // Bit patterns of an additive -inf, and the mask of everything but the sign.
    const uint neg_inf = es == 4 ? 0xff800000u : fc_dtype == PYFA_DTYPE_F16 ? 0xfc00u : 0xff80u;
    const uint magnitude = es == 4 ? 0x7fffffffu : 0x7fffu;

    bool open = false, active = false; // some entry attends / some entry is not a no-op
    for (uint i = 0; i < nq; i++) {
        device const uchar *row = base + (long(i) * p.mask_strides[2] + j0) * long(es);
        for (uint j = lane; j < nk; j += PYFA_METAL_PREFILL_AUX_THREADS) {
            if (is_bool) {
                const bool attend = row[j] != 0;
                open = open || attend;
                active = active || !attend;
            } else {
                const uint bits = es == 4 ? ((device const uint *)row)[j] : uint(((device const ushort *)row)[j]);
                open = open || bits != neg_inf;
                active = active || (bits & magnitude) != 0;
            }
        }
        if (simd_any(open) && simd_any(active)) break; // MIXED already: the rest cannot change it
    }
    open = simd_any(open);
    active = simd_any(active);
    if (lane == 0) *dst = !open ? PYFA_BLK_SKIP : !active ? PYFA_BLK_ZERO : PYFA_BLK_MIXED;
}
