/*
 * What the executor's two halves need from each other (not part of mslx.h):
 * the front end (library.c: parse, specialise, compile, cache, load) and the
 * runtime (runtime.c, fiber.c: dispatch, fibers, modes, memory).
 */
#pragma once
#include "include/mslx.h"
#include "mslx_abi.h"

/* Front end -> runtime: the loaded entry point of a specialised kernel
 * (mslx_entry_<kernel> of its module). */
typedef void (*mslx_entry_fn)(const mslx_lane_ctx *ctx);
mslx_entry_fn mslx__function_entry(const mslx_function *function);
/* Bit i set: the kernel takes [[buffer(i)]] (resp. [[threadgroup(i)]]); the
 * runtime refuses a dispatch that leaves one of them unbound. */
uint32_t mslx__function_buffer_mask(const mslx_function *function);
uint32_t mslx__function_threadgroup_mask(const mslx_function *function);
/* "clang <version> (<path>)" of the compiler the front end uses, or a reason
 * it has none; for mslx_describe. */
const char *mslx__compiler_description(void);

/* Runtime -> front end: the table every loaded module's mslx_module_init
 * receives. */
const mslx_runtime *mslx__runtime(void);

/* The clang options a kernel unit is compiled with (besides -I for the
 * executor's headers, -D for function constants, -o and the input). The
 * runtime's <metal_stdlib> (stdlib/metal_stdlib) is written for exactly
 * these; change them together. -cl-no-stdinc: no opencl-c-base.h and no
 * implicit OpenCL builtin functions (they would call unresolved mangled
 * symbols such as _Z3expf and make `exp` ambiguous); <metal_stdlib> declares
 * every type and function a kernel uses, and enables cl_khr_fp16 itself. */
#define MSLX_KERNEL_CFLAGS \
    "-x", "clcpp", "-cl-std=clc++2021", "-O2", "-fPIC", "-ffp-contract=off", \
    "-cl-no-stdinc", "-D__METAL_VERSION__=310", "-D__HAVE_MSLX__=1", \
    "-Wno-unused-value", "-Wno-ignored-attributes", "-Wno-unknown-attributes"
