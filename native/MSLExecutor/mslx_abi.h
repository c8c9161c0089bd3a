/*
 * The interface between the executor's runtime (runtime.c and fiber.c, linked into
 * libpyfa) and a compiled kernel module (the shared object the front end
 * builds from one specialised .metal source). Plain C, no includes: the front
 * end passes this file to clang with the module's sources, the runtime
 * includes it directly.
 *
 * A kernel module is two translation units linked into one shared object:
 *   - the kernel unit: the .metal source, compiled as C++ for OpenCL
 *     (-x clcpp -cl-std=clc++2021) against the executor's <metal_stdlib>,
 *     followed by one generated trampoline per kernel:
 *         extern "C" void mslx_entry_<kernel>(const mslx_lane_ctx *ctx);
 *     which binds each [[buffer(i)]], [[threadgroup(i)]] and built-in
 *     argument from ctx and calls the kernel;
 *   - the glue unit (plain C, generated): holds the runtime table and
 *     defines every mslx_rt_* function below as a call through it, so the
 *     kernel unit calls ordinary extern "C" functions (OpenCL C++ has no
 *     function pointers) and the module needs no symbol from libpyfa.
 * After dlopen the runtime calls the module's
 *     void mslx_module_init(const mslx_runtime *rt);
 * once, before any entry runs.
 *
 * All mslx_rt_* functions act on the lane (thread) that calls them; the
 * runtime knows which lane that is. Pointers cross as plain addresses: the
 * kernel unit declares its mslx_rt_* prototypes with the OpenCL address
 * spaces its arguments have (a string literal is __constant there).
 */
#ifndef MSLX_ABI_H
#define MSLX_ABI_H

#define MSLX_ABI_VERSION 2u
#define MSLX_LANES_PER_SIMDGROUP 32u

/* What one lane sees: its bindings and built-in positions. The trampoline
 * reads, never writes. Vectors are (x, y, z). */
typedef struct mslx_lane_ctx {
    void *buffers[31];               /* [[buffer(i)]]: contents + offset, or inline bytes */
    unsigned long buffer_lengths[31];/* readable bytes from buffers[i] */
    void *threadgroup[31];           /* [[threadgroup(i)]]: this threadgroup's block */
    unsigned int threadgroup_position_in_grid[3];
    unsigned int threadgroups_per_grid[3];
    unsigned int threads_per_threadgroup[3];
    unsigned int thread_position_in_threadgroup[3];
    unsigned int thread_position_in_grid[3];
    unsigned int threads_per_grid[3];
    unsigned int thread_index_in_threadgroup;
    unsigned int thread_index_in_simdgroup;
    unsigned int simdgroup_index_in_threadgroup;
    unsigned int simdgroups_per_threadgroup;
    unsigned int threads_per_simdgroup;
    unsigned int reserved;
} mslx_lane_ctx;

/* Flags of threadgroup_barrier / simdgroup_barrier (MSL mem_flags values). */
#define MSLX_MEM_NONE 0u
#define MSLX_MEM_DEVICE 1u
#define MSLX_MEM_THREADGROUP 2u
#define MSLX_MEM_TEXTURE 4u

/* The runtime's services, in the order of this table. Not declared in the
 * kernel unit (C++ for OpenCL has no function pointers); it needs only the
 * lane context above. */
#ifndef __OPENCL_CPP_VERSION__
typedef struct mslx_runtime {
    unsigned int abi_version; /* MSLX_ABI_VERSION */
    unsigned int reserved;

    /* Every active lane (not yet returned) of the caller's SIMD-group meets
     * here; each passes `size` bytes (<= 64) at `value`. On return all[i *
     * size ...] holds lane i's bytes (zeros for a lane that did not take
     * part) and *active has bit i set for each lane that took part. `op`
     * names the SIMD-group function for diagnostics ("simd_sum"). Lanes that
     * arrive at different meeting points (another op, a barrier) are a
     * divergence: reported in checking mode, as the MSL spec leaves it
     * undefined. */
    void (*simd_exchange)(const char *op, const void *value, unsigned int size, void *all, unsigned int *active);

    /* threadgroup_barrier(flags): every live lane of the threadgroup meets
     * here. A lane that returned while others wait at a barrier is reported
     * in checking mode. */
    void (*threadgroup_barrier)(unsigned int flags);
    /* simdgroup_barrier(flags): every live lane of the SIMD-group meets here. */
    void (*simdgroup_barrier)(unsigned int flags);

    /* A checking-mode rule fired (or the kernel hit something the executor
     * cannot run): the dispatch fails with this message (the runtime adds the
     * kernel's name and the lane); the lane does not return. */
    void (*fail)(const char *message);

    /* Modes, as mslx_get_options reports them. */
    int (*check_enabled)(void);
    int (*perturb_ulps)(void);
    /* A pseudo-random 64-bit value from the lane's own stream (seeded by
     * PYFA_MSL_SEED and the lane's position, so a run repeats). */
    unsigned long (*random_u64)(void);

    /* Threadgroup variables declared in a kernel's body: the block at
     * `offset` (bytes) of the threadgroup's static area, which holds
     * mslx_function_static_threadgroup_memory() bytes. */
    void *(*threadgroup_static)(unsigned long offset);

    /* The calling lane's index in its SIMD-group (thread_index_in_simdgroup),
     * for SIMD-group functions that need it (shuffles, prefix sums, matrix
     * fragments) without the kernel passing it in. */
    unsigned int (*simd_lane)(void);
} mslx_runtime;
#endif

#endif
