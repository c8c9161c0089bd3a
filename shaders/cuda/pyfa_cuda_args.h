/*
 * The one kernel parameter every CUDA kernel of pyfa takes: the encoder's
 * argument slots (CUDA's answer to the CPU backend's pyfa_cpu_dispatch).
 * arg[slot] is a device address for a buffer argument, or for an inline
 * argument (a parameter struct, or small per-call values such as kv_len sent
 * with the launch) the byte offset of its copy in inline_bytes, tagged with
 * PYFA_CUDA_INLINE_TAG. Kernels receive it as a __grid_constant__ parameter,
 * so inline bytes are read straight from parameter space, also through a
 * pointer (pyfa_values in pyfa_cuda.cuh).
 */
#pragma once

#if !defined(__CUDACC_RTC__)
#include <stdint.h>
#endif

#define PYFA_CUDA_MAX_ARGS 24
/* Inline bytes of one dispatch: room for the largest set, TurboQuant decode's
 * params and two 8-bit codebooks (2 x 1 KB); the whole struct stays well under
 * the 4 KB kernel-parameter limit. */
#define PYFA_CUDA_INLINE_BYTES 2304

/* Marks an inline offset in arg[slot]: no device address has bit 63 set. */
#define PYFA_CUDA_INLINE_TAG (1ull << 63)

/* On the device the block is 64-byte aligned in parameter space, so a TMA
 * tensor map placed in inline_bytes at a multiple of 64 is usable in place.
 * The host struct keeps its natural alignment and the same layout: arg[]
 * and the whole block are multiples of 64 bytes (checked below). */
#if defined(__CUDACC__)
#define PYFA_CUDA_ARGS_ALIGN __align__(64)
#else
#define PYFA_CUDA_ARGS_ALIGN
#endif
#if defined(__cplusplus)
static_assert(8 * PYFA_CUDA_MAX_ARGS % 64 == 0 && (8 * PYFA_CUDA_MAX_ARGS + PYFA_CUDA_INLINE_BYTES) % 64 == 0,
              "pyfa_cuda_args: the same layout with and without 64-byte alignment");
#else
_Static_assert(8 * PYFA_CUDA_MAX_ARGS % 64 == 0 && (8 * PYFA_CUDA_MAX_ARGS + PYFA_CUDA_INLINE_BYTES) % 64 == 0,
               "pyfa_cuda_args: the same layout with and without 64-byte alignment");
#endif

typedef struct PYFA_CUDA_ARGS_ALIGN pyfa_cuda_args {
    uint64_t arg[PYFA_CUDA_MAX_ARGS];
    uint8_t inline_bytes[PYFA_CUDA_INLINE_BYTES];
} pyfa_cuda_args;
