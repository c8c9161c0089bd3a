/*
 * Tensor memory access (TMA, sm_90) and the shared-memory barriers it
 * completes: a copy of a tensor-map box into shared memory is one instruction
 * of one thread, written by the copy engine without the load/store pipe, and
 * its arrival is awaited on an mbarrier whose phase flips once the expected
 * bytes have landed.
 *
 *   pyfa_mbar_init(bar, 1)           one arrival a phase (the expecting thread's)
 *   pyfa_mbar_expect_tx(bar, bytes)  that arrival, announcing the bytes to come
 *   pyfa_tma_load_5d(dst, map, bar, c0 .. c4)
 *                                    the box at coordinates c of the map (a
 *                                    CUtensorMap in parameter or global memory)
 *   pyfa_mbar_wait(bar, parity)      until the phase of that parity completed
 *   pyfa_mbar_arrive(bar)            one plain arrival (a consumer releasing a stage)
 *
 * A barrier's n-th phase (from 0) completes with parity n & 1. Data a TMA
 * copy wrote is visible to the threads that waited for its phase, and to the
 * tensor cores (both are the async proxy) without a proxy fence.
 */
#pragma once
#include "pyfa_cuda.cuh"

__device__ __forceinline__ void pyfa_mbar_init(uint64_t *bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(arrivals)
                 : "memory");
}
/* Makes initialised barriers visible to the copy engine (before a barrier of the block). */
__device__ __forceinline__ void pyfa_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void pyfa_mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void pyfa_mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
}
__device__ __forceinline__ void pyfa_mbar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile("{\n.reg .pred done;\nPYFA_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra PYFA_MBAR_WAIT;\n}\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void pyfa_tma_load_5d(void *dst, const void *map, uint64_t *bar, int c0, int c1, int c2, int c3,
                                                 int c4) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, "
                 "%5, %6, %7}], [%2];" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(map), "r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
                 : "memory");
}

/* Named barriers 1..15 (0 is __syncthreads'): `threads` arrivals, a multiple
 * of 32, complete one; sync waits for it, arrive does not. */
__device__ __forceinline__ void pyfa_bar_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void pyfa_bar_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Moves a warpgroup's registers a thread to n (every warp of the warpgroup
 * executes it; sm_90a): dec returns registers to the block's pool, inc waits
 * until the pool holds them. The block's threads launch with the entry's
 * register count; the counts a block takes after the moves must fit what it
 * launched with. */
template <int N>
__device__ __forceinline__ void pyfa_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void pyfa_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
