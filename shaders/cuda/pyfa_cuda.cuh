/*
 * Prelude of every pyfa CUDA kernel, compiled by NVRTC without CUDA headers:
 * fixed-width integer types, the shared parameter headers, argument access
 * and 16-bit float conversions done with PTX / bit operations.
 */
#pragma once

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;

#include "pyfa_params.h"
#include "cuda_layout.h"
#include "pyfa_cuda_args.h"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

/* The constants every entry body switches over, at compile time: each body
 * static_asserts that its template arguments are ones it is built for, so a
 * specialisation outside them fails to compile (the NVRTC log becomes
 * PyfaError.compile when the pipeline is made, before any launch) instead of
 * taking a template branch meant for another value and leaving its output
 * wrong or unwritten. The dispatchers' validation keeps them unreachable. */
#define PYFA_IS_ONE_OF(v) || x == (v)
__host__ __device__ constexpr bool pyfa_is_float_dtype(int x) { return false PYFA_FOR_EACH_ATTN_DTYPE(PYFA_IS_ONE_OF); }
__host__ __device__ constexpr bool pyfa_is_head_dim(int x) { return false PYFA_FOR_EACH_HEAD_DIM(PYFA_IS_ONE_OF); }
__host__ __device__ constexpr bool pyfa_is_tq_head_dim(int x) { return false PYFA_FOR_EACH_TQ_HEAD_DIM(PYFA_IS_ONE_OF); }
__host__ __device__ constexpr bool pyfa_is_tq_bits(int x) { return false PYFA_FOR_EACH_TQ_BITS(PYFA_IS_ONE_OF); }
#undef PYFA_IS_ONE_OF

#define PYFA_LOG2E 1.4426950408889634f
#define PYFA_LN2 0.6931471805599453f

/* An inline argument (parameter struct) of slot `slot`. */
template <class T>
__device__ __forceinline__ const T &pyfa_param(const pyfa_cuda_args &a, int slot) {
    return *reinterpret_cast<const T *>(a.inline_bytes + (a.arg[slot] & ~PYFA_CUDA_INLINE_TAG));
}

/* Read-only values of slot `slot` that a dispatch passes either as a buffer
 * (device memory, e.g. kv_len kept on the GPU) or inline with the launch
 * (host values): the pointer is into parameter space for the latter. */
template <class T>
__device__ __forceinline__ const T *pyfa_values(const pyfa_cuda_args &a, int slot) {
    const uint64_t v = a.arg[slot];
    return (v & PYFA_CUDA_INLINE_TAG) ? reinterpret_cast<const T *>(a.inline_bytes + (v & ~PYFA_CUDA_INLINE_TAG))
                                      : reinterpret_cast<const T *>(v);
}

/* The device address of buffer slot `slot`. */
template <class T>
__device__ __forceinline__ T *pyfa_ptr(const pyfa_cuda_args &a, int slot) {
    return reinterpret_cast<T *>(a.arg[slot]);
}

/* Appends that advance a cache's device state themselves (kv_append and
 * hadamard_quantize_kv given tickets): every workgroup reads the state at
 * `state_slot` and advances it as kv_advance would (params at
 * `advance_slot`), so all write at the advanced write_pos; then, once every
 * thread of the workgroup has read it, pyfa_store_advanced_last has the
 * last workgroup of the grid to take a ticket store the advanced state.
 * Every thread of every workgroup calls it (it holds a barrier), a dropped
 * append's too, so the tickets return to zero. */
__device__ __forceinline__ pyfa_kv_state pyfa_read_advanced(const pyfa_cuda_args &a, int state_slot,
                                                           int advance_slot) {
    const int32_t *s = pyfa_ptr<const int32_t>(a, state_slot); /* 4-byte aligned */
    return pyfa_kv_advanced(pyfa_kv_state{__ldcg(s), __ldcg(s + 1), __ldcg(s + 2), __ldcg(s + 3)},
                            pyfa_param<pyfa_kv_advance_params>(a, advance_slot));
}

/* The slot of an append's first row: with `advances` (tickets given) the
 * advanced state's write_pos, `next` taking the advanced state; else the
 * value at `position_slot` (launch bytes or a state's write_pos). */
__device__ __forceinline__ int32_t pyfa_append_position(const pyfa_cuda_args &a, int position_slot, int advance_slot,
                                                       bool advances, pyfa_kv_state &next) {
    if (advances) {
        next = pyfa_read_advanced(a, position_slot, advance_slot);
        return next.write_pos;
    }
    return pyfa_values<int32_t>(a, position_slot)[0];
}

__device__ __forceinline__ void pyfa_store_advanced_last(const pyfa_cuda_args &a, int state_slot, int tickets_slot,
                                                         const pyfa_kv_state &next) {
    __syncthreads(); /* every thread of the workgroup has read the state */
    if (threadIdx.x == 0) {
        const uint32_t blocks = gridDim.x * gridDim.y * gridDim.z;
        uint32_t *ticket = pyfa_ptr<uint32_t>(a, tickets_slot);
        if (atomicAdd(ticket, 1u) == blocks - 1) {
            *pyfa_ptr<pyfa_kv_state>(a, state_slot) = next;
            atomicSub(ticket, blocks); /* taken back for the next dispatch */
        }
    }
}

__device__ __forceinline__ float pyfa_f16_to_f32(uint32_t bits16) {
    float f;
    unsigned short h = (unsigned short)bits16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

/* Two packed 16-bit floats of dtype DT (f16 or bf16) as f32, low half first. */
template <int DT>
__device__ __forceinline__ void pyfa_unpack2(uint32_t w, float &lo, float &hi) {
    if constexpr (DT == PYFA_DTYPE_BF16) {
        lo = __uint_as_float(w << 16);
        hi = __uint_as_float(w & 0xffff0000u);
    } else {
        lo = pyfa_f16_to_f32(w & 0xffffu);
        hi = pyfa_f16_to_f32(w >> 16);
    }
}

/* Elements of dtype DT in one 16-byte load. */
template <int DT>
struct pyfa_vec16 {
    static constexpr int elems = DT == PYFA_DTYPE_F32 ? 4 : 8;
};

/* A 16-byte chunk of dtype DT as f32 values. */
template <int DT>
__device__ __forceinline__ void pyfa_chunk_to_f32(const uint4 w, float *x) {
    if constexpr (DT == PYFA_DTYPE_F32) {
        x[0] = __uint_as_float(w.x);
        x[1] = __uint_as_float(w.y);
        x[2] = __uint_as_float(w.z);
        x[3] = __uint_as_float(w.w);
    } else {
        pyfa_unpack2<DT>(w.x, x[0], x[1]);
        pyfa_unpack2<DT>(w.y, x[2], x[3]);
        pyfa_unpack2<DT>(w.z, x[4], x[5]);
        pyfa_unpack2<DT>(w.w, x[6], x[7]);
    }
}

/* One element i of a row of dtype DT as f32. */
template <int DT>
__device__ __forceinline__ float pyfa_load_f32(const void *row, uint32_t i) {
    if constexpr (DT == PYFA_DTYPE_F32) {
        return reinterpret_cast<const float *>(row)[i];
    } else if constexpr (DT == PYFA_DTYPE_BF16) {
        return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(row)[i] << 16);
    } else {
        return pyfa_f16_to_f32(reinterpret_cast<const uint16_t *>(row)[i]);
    }
}

/* Streaming 16-byte load that does not pollute L1 (each K/V byte is read once). */
__device__ __forceinline__ uint4 pyfa_ld_stream16(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ float pyfa_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* 16-byte asynchronous global -> shared copy (sm_80+), bypassing registers
 * and L1; bytes == 0 writes zeros without reading. */
__device__ __forceinline__ void pyfa_cp_async16(void *smem_dst, const void *src, uint32_t bytes) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
/* The same through L1 (.ca). */
__device__ __forceinline__ void pyfa_cp_async16_ca(void *smem_dst, const void *src, uint32_t bytes) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void pyfa_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void pyfa_cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ uint4 pyfa_lds16(const void *p) { return *reinterpret_cast<const uint4 *>(p); }

/* f32 -> dtype DT bits (round to nearest even); f32 returns its own bits. */
template <int DT>
__device__ __forceinline__ uint32_t pyfa_f32_to_bits(float x) {
    if constexpr (DT == PYFA_DTYPE_F32) {
        return __float_as_uint(x);
    } else {
        unsigned short h;
        if constexpr (DT == PYFA_DTYPE_BF16) {
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        } else {
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        }
        return h;
    }
}

/* Two f32 as packed 16-bit floats of dtype DT (f16 or bf16), lo in the low half. */
template <int DT>
__device__ __forceinline__ uint32_t pyfa_pack2(float lo, float hi) {
    uint32_t r;
    if constexpr (DT == PYFA_DTYPE_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

/* Stores x as element i of a row of dtype DT. */
template <int DT>
__device__ __forceinline__ void pyfa_store_f32(void *row, uint32_t i, float x) {
    if constexpr (DT == PYFA_DTYPE_F32) {
        reinterpret_cast<float *>(row)[i] = x;
    } else {
        reinterpret_cast<uint16_t *>(row)[i] = (uint16_t)pyfa_f32_to_bits<DT>(x);
    }
}

/* pyfa_store_f32 with the dtype (f32, f16 or bf16) a value: a compile-time
 * constant where the caller is inlined into an entry point. */
__device__ __forceinline__ void pyfa_store_as(void *row, size_t i, float x, int dtype) {
    if (dtype == PYFA_DTYPE_F16) {
        reinterpret_cast<uint16_t *>(row)[i] = (uint16_t)pyfa_f32_to_bits<PYFA_DTYPE_F16>(x);
    } else if (dtype == PYFA_DTYPE_BF16) {
        reinterpret_cast<uint16_t *>(row)[i] = (uint16_t)pyfa_f32_to_bits<PYFA_DTYPE_BF16>(x);
    } else {
        reinterpret_cast<float *>(row)[i] = x;
    }
}
