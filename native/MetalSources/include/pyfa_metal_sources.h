/*
 * The Metal kernel sources embedded in libpyfa (C23 #embed at build time):
 * the .metal files of shaders/metal, the headers they include from shaders/metal and
 * shaders/common, and the kernel list (shaders/metal/kernel_list.h).
 */
#pragma once
#include <stddef.h>

/* The text of an embedded file by its name ("flash_attn_vec.metal",
 * "pyfa_params.h"), or NULL; *length gets its size. */
const char *pyfa_metal_source(const char *file, size_t *length);
/* The source file that defines kernel `name`, or NULL if Metal has none. */
const char *pyfa_metal_kernel_file(const char *name);
/* 1 if `file` is built with fast math off (PYFA_METAL_SAFE_MATH_FILE), else 0. */
int pyfa_metal_file_safe_math(const char *file);
/* The i-th kernel name of the list, or NULL past its end. */
const char *pyfa_metal_kernel_name(size_t i);
