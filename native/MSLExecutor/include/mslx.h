/*
 * mslx: an executor that runs Metal Shading Language compute kernels on the
 * host CPU, so pyfa's Metal backend (Swift host code and .metal sources,
 * unchanged) runs and is tested on Linux. The Linux `Metal` Swift module is
 * its only client; nothing here is part of pyfa's public ABI.
 *
 * How a kernel runs:
 *   - mslx_library_create parses a source (after preprocessing it against the
 *     executor's own <metal_stdlib>): its kernels, their argument bindings
 *     ([[buffer(i)]], [[threadgroup(i)]], built-in positions) and its function
 *     constants ([[function_constant(i)]]).
 *   - mslx_function_create specialises one kernel: function constants become
 *     compile-time values, the toolchain's clang compiles the source as C++
 *     for OpenCL (MSL address spaces map onto OpenCL's), and the shared object
 *     is cached on disk by a hash of (source, constants, executor version).
 *   - mslx_dispatch runs a grid of threadgroups; each threadgroup's threads
 *     run as fibers on one OS thread and meet at threadgroup barriers and
 *     SIMD-group operations; threadgroups spread over a pool of OS threads.
 *
 * Every call returns MSLX_OK or an error status with a NUL-terminated message
 * in err (err_len bytes, may be 0). Nothing aborts the process.
 *
 * Thread safety: libraries and functions may be shared between threads;
 * mslx_dispatch may be called from several threads at once.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    MSLX_OK = 0,
    MSLX_ERR_INVALID = 1,     /* a bad argument to this API (unknown name, bad binding) */
    MSLX_ERR_COMPILE = 2,     /* the source did not parse or compile; message has clang's output */
    MSLX_ERR_EXECUTION = 3,   /* a kernel faulted or a checking-mode rule fired */
    MSLX_ERR_UNAVAILABLE = 4, /* no usable clang, cache directory or fiber support */
};

typedef struct mslx_library mslx_library;
typedef struct mslx_function mslx_function;

/* A header the source may #include "name" (besides <metal_stdlib>). */
typedef struct mslx_header {
    const char *name;
    const char *text;
    size_t length;
} mslx_header;

int mslx_library_create(const char *source, size_t length, const mslx_header *headers, size_t header_count,
                        mslx_library **out, char *err, size_t err_len);
void mslx_library_release(mslx_library *library);
/* Kernel names, in source order. The string lives as long as the library. */
size_t mslx_library_function_count(const mslx_library *library);
const char *mslx_library_function_name(const mslx_library *library, size_t i);

/* Function-constant value types (MTLDataType subset). */
enum {
    MSLX_TYPE_BOOL = 1,
    MSLX_TYPE_INT = 2,
    MSLX_TYPE_UINT = 3,
    MSLX_TYPE_SHORT = 4,
    MSLX_TYPE_USHORT = 5,
    MSLX_TYPE_FLOAT = 6,
    MSLX_TYPE_HALF = 7,
};

typedef struct mslx_constant_value {
    uint32_t index;    /* the [[function_constant(index)]] */
    uint32_t type;     /* MSLX_TYPE_*; must match the declaration's type */
    uint8_t bytes[8];  /* the value, in the type's natural encoding (bool: 1 byte) */
} mslx_constant_value;

/* Specialises and loads kernel `name`. Constants the source declares but
 * values omit are undefined (is_function_constant_defined(x) == false). */
int mslx_function_create(mslx_library *library, const char *name, const mslx_constant_value *values,
                         size_t value_count, mslx_function **out, char *err, size_t err_len);
void mslx_function_release(mslx_function *function);
const char *mslx_function_name(const mslx_function *function);
/* Threadgroup memory the kernel declares in its body (bytes). */
uint64_t mslx_function_static_threadgroup_memory(const mslx_function *function);

/* Limits the executor enforces, as a device would report them. */
#define MSLX_MAX_THREADS_PER_THREADGROUP 1024u
#define MSLX_MAX_THREADGROUP_MEMORY 32768u
#define MSLX_SIMD_WIDTH 32u
#define MSLX_MAX_BINDINGS 31u

enum { MSLX_BIND_NONE = 0, MSLX_BIND_BUFFER = 1, MSLX_BIND_BYTES = 2 };

/* What [[buffer(i)]] points at: a buffer's contents + offset (length readable
 * bytes from data), or inline bytes (setBytes). */
typedef struct mslx_binding {
    uint32_t kind;   /* MSLX_BIND_* */
    uint32_t reserved;
    const void *data;
    uint64_t length;
    const char *label; /* buffer's label for messages, may be NULL */
} mslx_binding;

typedef struct mslx_dispatch_desc {
    const mslx_function *function;
    mslx_binding buffers[MSLX_MAX_BINDINGS];                 /* by [[buffer(i)]] index */
    uint64_t threadgroup_memory_length[MSLX_MAX_BINDINGS];   /* by [[threadgroup(i)]] index */
    uint32_t threadgroups[3];                                /* grid, in threadgroups */
    uint32_t threads_per_threadgroup[3];
} mslx_dispatch_desc;

/* Runs the whole grid and returns when every threadgroup has finished. */
int mslx_dispatch(const mslx_dispatch_desc *desc, char *err, size_t err_len);

/* Execution modes. Initial values come from the environment:
 *   PYFA_MSL_CHECK=1            checking mode (see below)
 *   PYFA_MSL_LANE_ORDER=forward|reverse|random   order lanes run between meeting points
 *   PYFA_MSL_SEED=N             seed of the random lane order and of perturbation
 *   PYFA_MSL_PERTURB_ULPS=N     perturb results of math functions and SIMD-group
 *                               reductions by up to N ulps (Apple's fast math is
 *                               less exact than this executor)
 *   PYFA_MSL_THREADS=N          OS threads that run threadgroups (default: cores)
 * Checking mode reports, naming the kernel (and the buffer or lane): reads of
 * an inactive lane's value, divergent threadgroup barriers (a barrier some
 * live lanes never reach), SIMD-group matrix ops under a partial mask,
 * threadgroup memory beyond the dispatch's length or the 32 KiB limit,
 * buffer reads or writes past a buffer's end (guard pages behind buffers made
 * by mslx_alloc), and it fills threadgroup memory with NaN bytes before each
 * threadgroup so reads of unwritten memory show up as NaN. */
enum { MSLX_LANES_FORWARD = 0, MSLX_LANES_REVERSE = 1, MSLX_LANES_RANDOM = 2 };

typedef struct mslx_options {
    int32_t check;
    int32_t lane_order;
    uint64_t seed;
    int32_t perturb_ulps;
    int32_t threads;
} mslx_options;

void mslx_get_options(mslx_options *options);
void mslx_set_options(const mslx_options *options);

/* Memory for buffers: page-aligned host memory; in checking mode the end of
 * the usable range (rounded up to 16 bytes) touches an inaccessible guard
 * page, so an access past it faults and is reported. Returns NULL on failure. */
void *mslx_alloc(size_t length);
void mslx_free(void *pointer, size_t length);

/* A line describing the executor (clang path and version, modes), for
 * Device.info. */
const char *mslx_describe(void);

#ifdef __cplusplus
}
#endif
