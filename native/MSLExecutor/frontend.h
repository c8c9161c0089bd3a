/*
 * Internals of the executor's front end: what the public library/function
 * calls (library.c) are built from: parsing the Metal source (parse.c,
 * parse_tokens.c), clang and the module cache (compile.c), plumbing
 * (toolchain.c) and the embedded headers (embedded.c). Nothing here is seen
 * by the runtime; mslx_internal.h is that contract.
 */
#pragma once
#include "mslx_internal.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* ---- embedded.c: the headers every kernel unit is compiled against ---- */

typedef struct mslx_embedded_file {
    const char *name; /* as the kernel unit #includes it */
    const char *text;
    size_t length;
} mslx_embedded_file;

/* metal_stdlib and mslx_abi.h. */
const mslx_embedded_file *mslx__embedded_headers(size_t *count);

/* ---- toolchain.c: strings, files, processes, hashing, clang, cache ---- */

/* A growable NUL-terminated byte string; zero-initialised is empty. A failed
 * allocation sets `failed` and leaves the contents as they were. */
typedef struct mslx_buf {
    char *data;
    size_t length, capacity;
    int failed;
} mslx_buf;

void mslx__buf_append(mslx_buf *buf, const char *bytes, size_t length);
void mslx__buf_puts(mslx_buf *buf, const char *text);
void mslx__buf_printf(mslx_buf *buf, const char *format, ...) __attribute__((format(printf, 2, 3)));
void mslx__buf_free(mslx_buf *buf);

/* Writes a message into err (always NUL-terminated when err_len > 0) and
 * returns status, so callers can `return mslx__fail(...)`. */
int mslx__fail(int status, char *err, size_t err_len, const char *format, ...) __attribute__((format(printf, 4, 5)));

char *mslx__strndup(const char *text, size_t length);

/* 0 on success, else an errno value. write_file replaces the file's contents
 * (not atomically; callers rename a temporary into place where that matters). */
int mslx__write_file(const char *path, const void *data, size_t length);
int mslx__read_file(const char *path, mslx_buf *out);
/* mkdir -p; 0 or an errno value. */
int mslx__make_dirs(const char *path);
/* 1 if path belongs to this user and only this user can write it. */
int mslx__owned_privately(const char *path);
/* A fresh private directory under $TMPDIR (or /tmp); path gets the name. */
int mslx__make_work_dir(char *path, size_t path_len, char *err, size_t err_len);
/* Removes a directory tree this process created (never follows links). */
void mslx__remove_tree(const char *path);

/* Runs argv[0] (an absolute path) with stdin from /dev/null, stdout into
 * stdout_path (or /dev/null when NULL) and stderr collected in *stderr_text.
 * Returns 0 when the process ran (its exit status in *exit_status), else an
 * errno value (the program could not be started). */
int mslx__run(const char *const *argv, const char *stdout_path, const char *scratch_dir, mslx_buf *stderr_text,
              int *exit_status);

/* SHA-256 (FIPS 180-4), for cache keys. */
typedef struct mslx_sha256 {
    uint32_t state[8];
    uint64_t length;
    uint8_t block[64];
    size_t used;
} mslx_sha256;
void mslx__sha256_init(mslx_sha256 *ctx);
void mslx__sha256_update(mslx_sha256 *ctx, const void *data, size_t length);
/* Feeds a field as (64-bit length, bytes) so field boundaries are part of the hash. */
void mslx__sha256_field(mslx_sha256 *ctx, const void *data, size_t length);
void mslx__sha256_final(mslx_sha256 *ctx, uint8_t digest[32]);
void mslx__hex(const uint8_t *bytes, size_t count, char *out); /* out: 2*count+1 chars */

/* The clang every compile uses: absolute path and the first line of its
 * --version output. Resolved once per process. */
int mslx__clang(const char **path, const char **version, char *err, size_t err_len);
/* The directory compiled modules are cached in, created on first use. */
int mslx__cache_dir(const char **dir, char *err, size_t err_len);
/* A directory holding the embedded headers (metal_stdlib, mslx_abi.h), for
 * -I; inside the cache directory, named by the headers' hash. */
int mslx__include_dir(const char **dir, char *err, size_t err_len);

/* ---- parse.c: what a preprocessed source declares ---- */

/* The mslx_lane_ctx field a built-in argument (mslx_arg.index) reads, and
 * whether it is a 3-vector (bound through mslx_position<T>). */
const char *mslx__builtin_field(int builtin, int *is_vector);

enum { MSLX_ARG_BUFFER = 1, MSLX_ARG_THREADGROUP = 2, MSLX_ARG_BUILTIN = 3 };

typedef struct mslx_arg {
    char *name; /* the parameter's name, for messages */
    char *type; /* the type the trampoline binds to (reference: without the '&') */
    int kind;   /* MSLX_ARG_* */
    int is_reference;
    int index;     /* [[buffer(i)]] / [[threadgroup(i)]] index, or the built-in */
    int condition; /* [[function_constant(c)]] gate: index into constants, or -1 */
} mslx_arg;

typedef struct mslx_kernel {
    char *name;        /* host name: the kernel's, or the instantiation's [[host_name]] */
    char *callee;      /* qualified expression the trampoline calls */
    char *layout_size; /* expression for its threadgroup static bytes, or NULL */
    mslx_arg *args;
    size_t arg_count;
} mslx_kernel;

typedef struct mslx_constant_decl {
    char *name;
    char *type;         /* declared type text */
    uint32_t type_code; /* MSLX_TYPE_* */
    uint32_t index;     /* [[function_constant(index)]] */
} mslx_constant_decl;

/* A replacement of text[start, end) made when a specialisation's unit is
 * written. CONSTANT_VALUE: " = <value>" in place of the
 * [[function_constant(i)]] attribute of constants[constant];
 * CONSTANT_DEFINED: true/false in place of is_function_constant_defined(x);
 * TEXT: the fixed `text` (blanks, threadgroup rewrites, insertions). */
enum { MSLX_EDIT_TEXT = 0, MSLX_EDIT_CONSTANT_VALUE = 1, MSLX_EDIT_CONSTANT_DEFINED = 2 };
typedef struct mslx_edit {
    size_t start, end;
    int kind;
    int constant;
    char *text;
} mslx_edit;

typedef struct mslx_parsed {
    mslx_kernel *kernels;
    size_t kernel_count;
    mslx_constant_decl *constants;
    size_t constant_count;
    mslx_edit *edits; /* sorted by start, non-overlapping */
    size_t edit_count;
} mslx_parsed;

/* Parses a normalised preprocessed source (text[length] == 0). On failure
 * returns MSLX_ERR_COMPILE with a message naming the kernel/argument/rule. */
int mslx__parse(const char *text, size_t length, mslx_parsed *out, char *err, size_t err_len);
void mslx__parsed_free(mslx_parsed *parsed);

/* ---- compile.c: clang -E, and kernel units to loaded modules ---- */

/* Preprocesses a source (with its headers) against empty stand-ins for the
 * Metal headers, so user macros are expanded and MSL keywords are kept.
 * *text gets the user's code with line markers naming "source.metal" and
 * the headers; each Metal include is left out (a kernel unit includes the
 * executor's <metal_stdlib> first). */
int mslx__preprocess(const char *source, size_t length, const mslx_header *headers, size_t header_count, mslx_buf *text,
                     char *err, size_t err_len);

/* Compiles a kernel unit (C++ for OpenCL) with the glue unit into a shared
 * object, or finds it in the disk cache, then dlopens it and calls its
 * mslx_module_init. `what` names the specialisation in messages. */
int mslx__load_module(const char *unit, size_t unit_length, const char *what, void **handle, char *err, size_t err_len);
