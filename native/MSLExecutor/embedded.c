/* The headers every kernel unit is compiled against, embedded at build time
 * (C23 #embed) so the library needs no files beside it at run time: the
 * runtime's <metal_stdlib> and the runtime/module ABI. */
#include "frontend.h"

#pragma clang diagnostic ignored "-Wc23-extensions"

static const char metal_stdlib_text[] = {
#embed "stdlib/metal_stdlib"
    , 0};

static const char abi_text[] = {
#embed "mslx_abi.h"
    , 0};

static const mslx_embedded_file headers[] = {
    {"metal_stdlib", metal_stdlib_text, sizeof metal_stdlib_text - 1},
    {"mslx_abi.h", abi_text, sizeof abi_text - 1},
};

const mslx_embedded_file *mslx__embedded_headers(size_t *count) {
    *count = sizeof headers / sizeof headers[0];
    return headers;
}
