/*
 * Tensor-core building blocks shared by the mma kernels (prefill, the
 * tensor-core decodes): ldmatrix loads, the m16n8k16 product with f32
 * accumulators, and the hi + lo split that keeps an f32 operand exact to
 * about 2^-22 (f16) / 2^-16 (bf16) through two 16-bit products.
 */
#pragma once
#include "pyfa_cuda.cuh"

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

/* c += a b for one m16n8k16 tile, 16-bit inputs of dtype DT, f32 accumulators. */
template <int DT>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (DT == PYFA_DTYPE_BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/* (x0, x1) as packed 16-bit pairs of dtype DT: hi = rn(x), lo = rn(x - hi). */
template <int DT>
__device__ __forceinline__ void pyfa_split2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    hi = pyfa_pack2<DT>(x0, x1);
    float h0, h1;
    pyfa_unpack2<DT>(hi, h0, h1);
    lo = pyfa_pack2<DT>(x0 - h0, x1 - h1);
}
