/* Kernel sources embedded at build time (C23 #embed): the library carries
 * its CUDA code, so nothing is copied or looked up at run time. */
#include "pyfa_cuda_driver.h"

#include <string.h>

#pragma clang diagnostic ignored "-Wc23-extensions"

static const char src_params[] = {
#embed "../../shaders/common/pyfa_params.h"
, 0};
/* Every header pyfa_params.h includes (one family header per op family). */
static const char src_prefill_params[] = {
#embed "../../shaders/common/flash_attn_prefill_params.h"
, 0};
static const char src_turboquant_params[] = {
#embed "../../shaders/common/turboquant_params.h"
, 0};
static const char src_paged_kv_params[] = {
#embed "../../shaders/common/paged_kv_params.h"
, 0};
static const char src_cuda_layout[] = {
#embed "../../shaders/common/cuda_layout.h"
, 0};
static const char src_args[] = {
#embed "../../shaders/cuda/pyfa_cuda_args.h"
, 0};
static const char src_prelude[] = {
#embed "../../shaders/cuda/pyfa_cuda.cuh"
, 0};
static const char src_attn_vec[] = {
#embed "../../shaders/cuda/attn_vec.cu"
, 0};
static const char src_kv_append[] = {
#embed "../../shaders/cuda/kv_append.cu"
, 0};
static const char src_attn_prefill[] = {
#embed "../../shaders/cuda/attn_prefill.cu"
, 0};
static const char src_attn_vec_reduce[] = {
#embed "../../shaders/cuda/attn_vec_reduce.cuh"
, 0};
static const char src_vec_mma_tile[] = {
#embed "../../shaders/cuda/vec_mma_tile.cuh"
, 0};
static const char src_attn_vec_mma[] = {
#embed "../../shaders/cuda/attn_vec_mma.cuh"
, 0};
static const char src_mma[] = {
#embed "../../shaders/cuda/pyfa_mma.cuh"
, 0};
static const char src_wgmma[] = {
#embed "../../shaders/cuda/pyfa_wgmma.cuh"
, 0};
static const char src_attn_prefill_wgmma[] = {
#embed "../../shaders/cuda/attn_prefill_wgmma.cuh"
, 0};
static const char src_tma[] = {
#embed "../../shaders/cuda/pyfa_tma.cuh"
, 0};
static const char src_attn_prefill_wgmma_split[] = {
#embed "../../shaders/cuda/attn_prefill_wgmma_split.cuh"
, 0};
static const char src_turboquant_mma[] = {
#embed "../../shaders/cuda/turboquant_mma.cuh"
, 0};
static const char src_turboquant[] = {
#embed "../../shaders/cuda/turboquant.cu"
, 0};

static const struct {
    const char *name;
    const char *text;
    size_t length;
} files[] = {
    {"pyfa_params.h", src_params, sizeof src_params - 1},
    {"flash_attn_prefill_params.h", src_prefill_params, sizeof src_prefill_params - 1},
    {"turboquant_params.h", src_turboquant_params, sizeof src_turboquant_params - 1},
    {"paged_kv_params.h", src_paged_kv_params, sizeof src_paged_kv_params - 1},
    {"cuda_layout.h", src_cuda_layout, sizeof src_cuda_layout - 1},
    {"pyfa_cuda_args.h", src_args, sizeof src_args - 1},
    {"pyfa_cuda.cuh", src_prelude, sizeof src_prelude - 1},
    {"attn_vec.cu", src_attn_vec, sizeof src_attn_vec - 1},
    {"kv_append.cu", src_kv_append, sizeof src_kv_append - 1},
    {"attn_prefill.cu", src_attn_prefill, sizeof src_attn_prefill - 1},
    {"attn_vec_reduce.cuh", src_attn_vec_reduce, sizeof src_attn_vec_reduce - 1},
    {"vec_mma_tile.cuh", src_vec_mma_tile, sizeof src_vec_mma_tile - 1},
    {"attn_vec_mma.cuh", src_attn_vec_mma, sizeof src_attn_vec_mma - 1},
    {"pyfa_mma.cuh", src_mma, sizeof src_mma - 1},
    {"pyfa_wgmma.cuh", src_wgmma, sizeof src_wgmma - 1},
    {"attn_prefill_wgmma.cuh", src_attn_prefill_wgmma, sizeof src_attn_prefill_wgmma - 1},
    {"pyfa_tma.cuh", src_tma, sizeof src_tma - 1},
    {"attn_prefill_wgmma_split.cuh", src_attn_prefill_wgmma_split, sizeof src_attn_prefill_wgmma_split - 1},
    {"turboquant_mma.cuh", src_turboquant_mma, sizeof src_turboquant_mma - 1},
    {"turboquant.cu", src_turboquant, sizeof src_turboquant - 1},
};

const char *pyfa_cuda_source(const char *file, size_t *length) {
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        if (strcmp(files[i].name, file) == 0) {
            if (length) *length = files[i].length;
            return files[i].text;
        }
    }
    return NULL;
}

const char *pyfa_cuda_source_name(size_t i) { return i < sizeof files / sizeof files[0] ? files[i].name : NULL; }

#include "../../shaders/common/cuda_layout.h" /* block sizes kernel_list.h names */

static const struct {
    const char *name;
    const char *file;
    uint32_t max_threads;
} kernels[] = {
#define PYFA_CUDA_KERNEL(name, file, threads) {#name, file, threads},
#include "../../shaders/cuda/kernel_list.h"
#undef PYFA_CUDA_KERNEL
};

const char *pyfa_cuda_kernel_file(const char *name, uint32_t *max_threads) {
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        if (strcmp(kernels[i].name, name) == 0) {
            if (max_threads) *max_threads = kernels[i].max_threads;
            return kernels[i].file;
        }
    }
    return NULL;
}

const char *pyfa_cuda_kernel_name(size_t i) { return i < sizeof kernels / sizeof kernels[0] ? kernels[i].name : NULL; }
