/*
 * The CPU backend's kernel interface. A CPU kernel is a C function called
 * once per threadgroup of the dispatch grid; threadgroups are spread over a
 * pool of threads. It reads the same parameter structs and buffers as the GPU
 * kernels of the same name.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#define PYFA_CPU_MAX_ARGS 16
#define PYFA_CPU_MAX_CONSTANTS 16

typedef struct pyfa_cpu_dispatch {
    void *args[PYFA_CPU_MAX_ARGS];         /* slot i: buffer contents + offset, or inline bytes */
    uint64_t arg_bytes[PYFA_CPU_MAX_ARGS]; /* bytes readable from args[i] */
    int32_t constants[PYFA_CPU_MAX_CONSTANTS]; /* function-constant values by index */
    uint32_t grid[3];                      /* threadgroups per dimension */
    uint32_t threads[3];                   /* threads per threadgroup (GPU geometry; informative) */
    uint64_t threadgroup_memory;           /* scratch bytes each threadgroup gets, 64-byte aligned */
    /* Set by a kernel through pyfa_cpu_fail (first report wins, any thread);
     * the caller zeroes it before the run and reads it after. */
    int32_t failed;
    char failure[124];
} pyfa_cpu_dispatch;

/* Reports that a threadgroup of `d` could not run (a function constant its
 * build does not handle): the first report's message is kept in d->failure
 * and d->failed becomes 1. The kernel then returns without writing; the
 * dispatch is an error for the caller, never a silent partial output. Never
 * aborts. printf-style message. */
void pyfa_cpu_fail(const pyfa_cpu_dispatch *d, const char *format, ...) __attribute__((format(printf, 2, 3)));

/* Runs one threadgroup (x, y, z). `scratch` holds threadgroup_memory bytes. */
typedef void (*pyfa_cpu_kernel)(const pyfa_cpu_dispatch *d, uint32_t x, uint32_t y, uint32_t z,
                                void *scratch);

/* The kernel registered under `name`, or NULL. */
pyfa_cpu_kernel pyfa_cpu_find_kernel(const char *name);

/* Runs every threadgroup of d->grid and returns when all are done. Thread-safe:
 * concurrent callers take turns on the pool. Returns 0, or -1 if scratch
 * memory could not be allocated (nothing ran). */
int pyfa_cpu_run(const pyfa_cpu_dispatch *d, pyfa_cpu_kernel kernel);

/* Runs the threadgroups of `count` dispatches together, interleaved over the
 * pool (dispatch order is not an ordering: groups of later dispatches run
 * before, between and alongside those of earlier ones). For stress-testing
 * the barriers ops record; same return values as pyfa_cpu_run. */
int pyfa_cpu_run_many(const pyfa_cpu_dispatch *const *d, const pyfa_cpu_kernel *kernels, uint32_t count);

/* Threads the pool uses (PYFA_NUM_THREADS overrides the core count). */
uint32_t pyfa_cpu_thread_count(void);

/* "avx2" when the AVX2+FMA+F16C kernels are in use, else "generic". */
const char *pyfa_cpu_isa(void);

/* Scratch bytes one flash_attn_vec threadgroup needs for `group` query heads
 * per KV head at head_dim `head_dim` (num_heads for one that walks every KV
 * head, PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS). */
uint64_t pyfa_cpu_vec_scratch_bytes(uint32_t group, uint32_t head_dim);

/* A CPU-only value of flash_attn_vec's PYFA_VEC_FC_VARIANT, clear of the
 * shared PYFA_VEC_VARIANT_* values: with PAGED the threadgroups with KV head
 * 0 walk every KV head of their (sequence, split), the others return at
 * once (attn_vec_body.h says why); the threadgroup scratch must then hold
 * num_heads states (pyfa_cpu_vec_scratch_bytes(num_heads, D)). Without
 * PAGED it runs as PYFA_VEC_VARIANT_PORTABLE (the CPU plan never picks it
 * there). */
#define PYFA_CPU_VEC_VARIANT_ALL_KV_HEADS 256

/* The CPU plan keeps per-head threadgroups where num_heads states would need
 * more scratch than this (H * D > 128K floats, e.g. 256 heads at D = 512):
 * then the state alone no longer fits the core's L2 beside the rows it reads. */
#define PYFA_CPU_VEC_ALL_KV_HEADS_MAX_SCRATCH (1u << 20)

/* Scratch bytes one flash_attn_prefill threadgroup needs at head_dim. */
uint64_t pyfa_cpu_prefill_scratch_bytes(uint32_t head_dim);

/* The (block_q, block_k) tile the CPU prefill kernel is built for. */
void pyfa_cpu_prefill_tile(uint32_t *block_q, uint32_t *block_k);
