/* Metal kernel sources embedded at build time (C23 #embed): the library
 * carries its kernels, so nothing is copied or looked up at run time. */
#include "pyfa_metal_sources.h"

#include <string.h>

#pragma clang diagnostic ignored "-Wc23-extensions"

static const char src_params[] = {
#embed "../../shaders/common/pyfa_params.h"
, 0};
static const char src_prefill_params[] = {
#embed "../../shaders/common/flash_attn_prefill_params.h"
, 0};
static const char src_turboquant_params[] = {
#embed "../../shaders/common/turboquant_params.h"
, 0};
static const char src_paged_kv_params[] = {
#embed "../../shaders/common/paged_kv_params.h"
, 0};
static const char src_metal_layout[] = {
#embed "../../shaders/common/metal_layout.h"
, 0};
static const char src_pyfa_metal[] = {
#embed "../../shaders/metal/pyfa_metal.h"
, 0};
static const char src_flash_attn_vec[] = {
#embed "../../shaders/metal/flash_attn_vec.metal"
, 0};
static const char src_flash_attn_vec_reduce[] = {
#embed "../../shaders/metal/flash_attn_vec_reduce.metal"
, 0};
static const char src_kv_append[] = {
#embed "../../shaders/metal/kv_append.metal"
, 0};
static const char src_flash_attn_prefill[] = {
#embed "../../shaders/metal/flash_attn_prefill.metal"
, 0};
static const char src_flash_attn_prefill_blk[] = {
#embed "../../shaders/metal/flash_attn_prefill_blk.metal"
, 0};
static const char src_merge_attention_states[] = {
#embed "../../shaders/metal/merge_attention_states.metal"
, 0};
static const char src_pyfa_metal_tq[] = {
#embed "../../shaders/metal/pyfa_metal_tq.h"
, 0};
static const char src_flash_attn_vec_tq[] = {
#embed "../../shaders/metal/flash_attn_vec_tq.metal"
, 0};
static const char src_turboquant_quantize[] = {
#embed "../../shaders/metal/turboquant_quantize.metal"
, 0};
static const char src_turboquant_dequantize[] = {
#embed "../../shaders/metal/turboquant_dequantize.metal"
, 0};
static const char src_turboquant_fwht[] = {
#embed "../../shaders/metal/turboquant_fwht.metal"
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
    {"metal_layout.h", src_metal_layout, sizeof src_metal_layout - 1},
    {"pyfa_metal.h", src_pyfa_metal, sizeof src_pyfa_metal - 1},
    {"flash_attn_vec.metal", src_flash_attn_vec, sizeof src_flash_attn_vec - 1},
    {"flash_attn_vec_reduce.metal", src_flash_attn_vec_reduce, sizeof src_flash_attn_vec_reduce - 1},
    {"kv_append.metal", src_kv_append, sizeof src_kv_append - 1},
    {"flash_attn_prefill.metal", src_flash_attn_prefill, sizeof src_flash_attn_prefill - 1},
    {"flash_attn_prefill_blk.metal", src_flash_attn_prefill_blk, sizeof src_flash_attn_prefill_blk - 1},
    {"merge_attention_states.metal", src_merge_attention_states, sizeof src_merge_attention_states - 1},
    {"pyfa_metal_tq.h", src_pyfa_metal_tq, sizeof src_pyfa_metal_tq - 1},
    {"flash_attn_vec_tq.metal", src_flash_attn_vec_tq, sizeof src_flash_attn_vec_tq - 1},
    {"turboquant_quantize.metal", src_turboquant_quantize, sizeof src_turboquant_quantize - 1},
    {"turboquant_dequantize.metal", src_turboquant_dequantize, sizeof src_turboquant_dequantize - 1},
    {"turboquant_fwht.metal", src_turboquant_fwht, sizeof src_turboquant_fwht - 1},
};

const char *pyfa_metal_source(const char *file, size_t *length) {
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        if (strcmp(files[i].name, file) == 0) {
            if (length) *length = files[i].length;
            return files[i].text;
        }
    }
    return NULL;
}

static const struct {
    const char *name;
    const char *file;
} kernels[] = {
#define PYFA_METAL_KERNEL(name, file) {#name, file},
#define PYFA_METAL_SAFE_MATH_FILE(file)
#include "../../shaders/metal/kernel_list.h"
#undef PYFA_METAL_SAFE_MATH_FILE
#undef PYFA_METAL_KERNEL
};

static const char *const safe_math_files[] = {
#define PYFA_METAL_KERNEL(name, file)
#define PYFA_METAL_SAFE_MATH_FILE(file) file,
#include "../../shaders/metal/kernel_list.h"
#undef PYFA_METAL_SAFE_MATH_FILE
#undef PYFA_METAL_KERNEL
};

int pyfa_metal_file_safe_math(const char *file) {
    for (size_t i = 0; i < sizeof safe_math_files / sizeof safe_math_files[0]; i++) {
        if (strcmp(safe_math_files[i], file) == 0) return 1;
    }
    return 0;
}

const char *pyfa_metal_kernel_file(const char *name) {
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        if (strcmp(kernels[i].name, name) == 0) return kernels[i].file;
    }
    return NULL;
}

const char *pyfa_metal_kernel_name(size_t i) { return i < sizeof kernels / sizeof kernels[0] ? kernels[i].name : NULL; }
