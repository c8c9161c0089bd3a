/*
 * Libraries and functions (the front-end half of mslx.h).
 *
 * A library is its source after preprocessing (compile.c) plus what parse.c
 * found in it. A specialisation is the library compiled with one set of
 * function-constant values: one kernel unit (the source with its constants
 * replaced by values, its threadgroup variables rewritten, and one
 * trampoline per kernel) and so one module serving every kernel of the
 * library. A library keeps its specialisations, keyed by the values, so
 * creating the same function again, or another kernel with the same values,
 * loads nothing new.
 */
#include "frontend.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A loaded module: the entry point and static threadgroup bytes of each of
 * the library's kernels. Shared by a specialisation and its functions. */
typedef struct mslx_module {
    atomic_int references;
    void *handle;
    mslx_entry_fn *entries;
    uint64_t *static_sizes;
} mslx_module;

/* One function constant's value in a specialisation (zeroed unused bytes,
 * so settings compare with memcmp). */
typedef struct constant_setting {
    uint32_t defined;
    uint32_t reserved;
    uint8_t bytes[8];
} constant_setting;

typedef struct specialisation {
    struct specialisation *next;
    constant_setting *settings; /* one per declared constant */
    int compiling;              /* a thread is building it; others wait on `built` */
    int status;
    char *message; /* when status is an error */
    mslx_module *module;
} specialisation;

struct mslx_library {
    char *text; /* normalised preprocessed source */
    size_t length;
    mslx_parsed parsed;
    pthread_mutex_t lock;
    pthread_cond_t built;
    specialisation *specialisations;
};

struct mslx_function {
    mslx_module *module;
    size_t kernel;
    char *name;
    uint32_t buffer_mask, threadgroup_mask;
};

/* Longest message kept for a failed specialisation. */
#define MESSAGE_CAPACITY 16384

/* Declarations the kernel unit's generated code uses. The lane context is
 * declared before <metal_stdlib>, whose address-space macros (threadgroup)
 * would otherwise rename its field. Generated code never writes a type name
 * followed by '(': <metal_stdlib> makes `float4(...)` etc. function-like
 * macros, hence the alias templates for references and pointers to arrays. */
static const char prelude[] =
    "# 1 \"<mslx prelude>\"\n"
    "#include \"mslx_abi.h\"\n"
    "static inline void *const *mslx_fe_threadgroup_args(const mslx_lane_ctx *ctx) { return ctx->threadgroup; }\n"
    "#include <metal_stdlib>\n"
    "template <typename T> using mslx_fe_ref = T &;\n"
    "template <typename T> using mslx_fe_ptr = T *;\n"
    "extern \"C\" threadgroup void *mslx_fe_tg_static(unsigned long offset) __asm__(\"mslx_rt_threadgroup_static\");\n"
    "constexpr unsigned long mslx_fe_tg_place(unsigned long at, unsigned long align) {\n"
    "    return (at + (align < 16 ? 16 : align) - 1) / (align < 16 ? 16 : align) * (align < 16 ? 16 : align);\n"
    "}\n";

static const char *const type_names[] = {"?", "bool", "int", "uint", "short", "ushort", "float", "half"};
static const size_t type_sizes[] = {0, 1, 4, 4, 2, 2, 4, 2};

static const char *type_name(uint32_t type) {
    return type < sizeof type_names / sizeof type_names[0] ? type_names[type] : "?";
}

/* ---- modules ---- */

static void module_release(mslx_module *module) {
    if (!module || atomic_fetch_sub(&module->references, 1) != 1) return;
    if (module->handle) dlclose(module->handle);
    free(module->entries);
    free(module->static_sizes);
    free(module);
}

static int module_create(const mslx_parsed *parsed, void *handle, mslx_module **out, char *err, size_t err_len) {
    mslx_module *module = calloc(1, sizeof *module);
    size_t n = parsed->kernel_count ? parsed->kernel_count : 1;
    if (module) {
        module->entries = calloc(n, sizeof *module->entries);
        module->static_sizes = calloc(n, sizeof *module->static_sizes);
    }
    if (!module || !module->entries || !module->static_sizes) {
        if (module) free(module->entries), free(module->static_sizes);
        free(module);
        dlclose(handle);
        return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "out of memory loading a kernel module");
    }
    atomic_init(&module->references, 1);
    module->handle = handle;
    for (size_t k = 0; k < parsed->kernel_count; k++) {
        char symbol[512];
        snprintf(symbol, sizeof symbol, "mslx_entry_%s", parsed->kernels[k].name);
        *(void **)&module->entries[k] = dlsym(handle, symbol);
        snprintf(symbol, sizeof symbol, "mslx_tgsize_%s", parsed->kernels[k].name);
        const unsigned long *size = dlsym(handle, symbol);
        if (!module->entries[k] || !size) {
            module_release(module);
            return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "compiled module lacks %s", symbol);
        }
        module->static_sizes[k] = *size;
    }
    *out = module;
    return MSLX_OK;
}

/* ---- function-constant values ---- */

static int resolve_constants(const mslx_library *library, const mslx_constant_value *values, size_t count,
                             constant_setting *settings, char *err, size_t err_len) {
    const mslx_parsed *parsed = &library->parsed;
    for (size_t v = 0; v < count; v++) {
        size_t c = 0;
        while (c < parsed->constant_count && parsed->constants[c].index != values[v].index) c++;
        if (c == parsed->constant_count) continue; /* a constant this source does not declare: unused */
        const mslx_constant_decl *decl = &parsed->constants[c];
        if (settings[c].defined)
            return mslx__fail(MSLX_ERR_INVALID, err, err_len, "function constant '%s' (index %u) is given twice",
                              decl->name, decl->index);
        if (values[v].type != decl->type_code)
            return mslx__fail(MSLX_ERR_INVALID, err, err_len,
                              "function constant '%s' (index %u) is declared %s but its value has type %s (%u)",
                              decl->name, decl->index, decl->type, type_name(values[v].type), values[v].type);
        settings[c].defined = 1;
        memcpy(settings[c].bytes, values[v].bytes, type_sizes[decl->type_code]);
        if (decl->type_code == MSLX_TYPE_BOOL) settings[c].bytes[0] = settings[c].bytes[0] != 0;
    }
    return MSLX_OK;
}

static uint32_t half_bits_to_float_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 31u, mantissa = h & 1023u;
    if (exponent == 31) return sign | 0x7f800000u | mantissa << 13;
    if (exponent) return sign | (exponent + 112) << 23 | mantissa << 13;
    if (!mantissa) return sign;
    exponent = 113;
    while (!(mantissa & 1024u)) mantissa <<= 1, exponent--;
    return sign | exponent << 23 | (mantissa & 1023u) << 13;
}

static void format_float(mslx_buf *out, float value) {
    if (isnan(value))
        mslx__buf_puts(out, "__builtin_nanf(\"\")");
    else if (isinf(value))
        mslx__buf_puts(out, value < 0 ? "(-__builtin_inff())" : "__builtin_inff()");
    else
        mslx__buf_printf(out, "%af", (double)value); /* hexadecimal: exact */
}

/* " = <value>" for a function constant's declaration. */
static void format_constant(mslx_buf *out, const mslx_constant_decl *decl, const constant_setting *setting) {
    if (!setting->defined) {
        mslx__buf_printf(out, " = %s()", decl->type);
        return;
    }
    const uint8_t *b = setting->bytes;
    int32_t i32;
    uint32_t u32;
    int16_t i16;
    uint16_t u16;
    float f;
    mslx__buf_puts(out, " = ");
    switch (decl->type_code) {
    case MSLX_TYPE_BOOL: mslx__buf_puts(out, b[0] ? "true" : "false"); break;
    case MSLX_TYPE_INT:
        memcpy(&i32, b, 4);
        if (i32 == INT32_MIN)
            mslx__buf_puts(out, "(-2147483647 - 1)");
        else
            mslx__buf_printf(out, "%d", (int)i32);
        break;
    case MSLX_TYPE_UINT: memcpy(&u32, b, 4), mslx__buf_printf(out, "%uu", (unsigned)u32); break;
    case MSLX_TYPE_SHORT: memcpy(&i16, b, 2), mslx__buf_printf(out, "%d", (int)i16); break;
    case MSLX_TYPE_USHORT: memcpy(&u16, b, 2), mslx__buf_printf(out, "%u", (unsigned)u16); break;
    case MSLX_TYPE_FLOAT: memcpy(&f, b, 4), format_float(out, f); break;
    case MSLX_TYPE_HALF:
        memcpy(&u16, b, 2);
        u32 = half_bits_to_float_bits(u16);
        memcpy(&f, &u32, 4);
        format_float(out, f);
        break;
    }
}

/* "kernel 'k' (constants: a = 1, b undefined)", for messages. */
static void describe_specialisation(mslx_buf *out, const mslx_library *library, const char *kernel,
                                    const constant_setting *settings) {
    mslx__buf_printf(out, "kernel '%s'", kernel);
    const mslx_parsed *parsed = &library->parsed;
    for (size_t c = 0; c < parsed->constant_count; c++) {
        mslx__buf_puts(out, c ? ", " : " (function constants: ");
        mslx__buf_puts(out, parsed->constants[c].name);
        if (settings[c].defined)
            format_constant(out, &parsed->constants[c], &settings[c]);
        else
            mslx__buf_puts(out, " undefined");
    }
    if (parsed->constant_count) mslx__buf_puts(out, ")");
}

/* ---- the kernel unit ---- */

static int argument_present(const mslx_arg *arg, const constant_setting *settings) {
    return arg->condition < 0 || (settings[arg->condition].defined && settings[arg->condition].bytes[0]);
}

static void write_argument(mslx_buf *out, const mslx_arg *arg, const constant_setting *settings) {
    int vector = 0;
    const char *field;
    switch (arg->kind) {
    case MSLX_ARG_BUFFER:
        if (!argument_present(arg, settings))
            mslx__buf_printf(out, "%s(%s)0", arg->is_reference ? "*" : "", arg->type);
        else
            mslx__buf_printf(out, "%s(%s)(unsigned long)ctx->buffers[%d]", arg->is_reference ? "*" : "", arg->type,
                             arg->index);
        break;
    case MSLX_ARG_THREADGROUP:
        mslx__buf_printf(out, "(%s)(unsigned long)::mslx_fe_threadgroup_args(ctx)[%d]", arg->type, arg->index);
        break;
    default:
        field = mslx__builtin_field(arg->index, &vector);
        if (vector)
            mslx__buf_printf(out, "mslx_position<%s>(ctx->%s)", arg->type, field);
        else
            mslx__buf_printf(out, "(%s)ctx->%s", arg->type, field);
    }
}

static void write_entry_points(mslx_buf *out, const mslx_parsed *parsed, const constant_setting *settings) {
    mslx__buf_puts(out, "\n# 1 \"<mslx entry points>\"\n");
    for (size_t k = 0; k < parsed->kernel_count; k++) {
        const mslx_kernel *kernel = &parsed->kernels[k];
        mslx__buf_printf(out,
                         "extern \"C\" __attribute__((visibility(\"default\"))) void mslx_entry_%s(const mslx_lane_ctx "
                         "*ctx) {\n    %s(",
                         kernel->name, kernel->callee);
        for (size_t a = 0; a < kernel->arg_count; a++) {
            mslx__buf_puts(out, "\n        ");
            write_argument(out, &kernel->args[a], settings);
            mslx__buf_printf(out, "%s /* kernel '%s', argument '%s' */", a + 1 < kernel->arg_count ? "," : "",
                             kernel->name, kernel->args[a].name);
        }
        mslx__buf_printf(out,
                         ");\n}\nextern \"C\" __attribute__((visibility(\"default\"))) const unsigned long "
                         "mslx_tgsize_%s = %s;\n",
                         kernel->name, kernel->layout_size ? kernel->layout_size : "0");
    }
}

static void write_unit(mslx_buf *out, const mslx_library *library, const constant_setting *settings) {
    const mslx_parsed *parsed = &library->parsed;
    mslx__buf_puts(out, prelude);
    size_t at = 0;
    for (size_t e = 0; e < parsed->edit_count; e++) {
        const mslx_edit *edit = &parsed->edits[e];
        mslx__buf_append(out, library->text + at, edit->start - at);
        if (edit->kind == MSLX_EDIT_TEXT)
            mslx__buf_puts(out, edit->text);
        else if (edit->kind == MSLX_EDIT_CONSTANT_VALUE)
            format_constant(out, &parsed->constants[edit->constant], &settings[edit->constant]);
        else
            mslx__buf_puts(out, settings[edit->constant].defined ? "true" : "false");
        at = edit->end;
    }
    mslx__buf_append(out, library->text + at, library->length - at);
    write_entry_points(out, parsed, settings);
}

/* ---- specialisations ---- */

static void specialisation_free(specialisation *s) {
    module_release(s->module);
    free(s->settings);
    free(s->message);
    free(s);
}

/* Builds and loads the specialisation (called without the library's lock). */
static int build(mslx_library *library, const char *kernel, const constant_setting *settings, mslx_module **module,
                 char *message) {
    mslx_buf unit = {0}, what = {0};
    write_unit(&unit, library, settings);
    describe_specialisation(&what, library, kernel, settings);
    if (unit.failed || what.failed) {
        mslx__buf_free(&unit), mslx__buf_free(&what);
        return mslx__fail(MSLX_ERR_UNAVAILABLE, message, MESSAGE_CAPACITY, "out of memory writing a kernel unit");
    }
    void *handle = NULL;
    int status = mslx__load_module(unit.data, unit.length, what.data, &handle, message, MESSAGE_CAPACITY);
    if (!status) status = module_create(&library->parsed, handle, module, message, MESSAGE_CAPACITY);
    mslx__buf_free(&unit), mslx__buf_free(&what);
    return status;
}

/* The module for `settings`, built by this thread or by another one
 * already at it. Compile errors are remembered; other failures are retried. */
static int acquire(mslx_library *library, const char *kernel, constant_setting *settings, mslx_module **module,
                   char *err, size_t err_len) {
    size_t settings_size = library->parsed.constant_count * sizeof *settings;
    pthread_mutex_lock(&library->lock);
    specialisation *s;
    for (;;) {
        for (s = library->specialisations; s; s = s->next)
            if (!memcmp(s->settings, settings, settings_size)) break;
        if (!s) {
            s = calloc(1, sizeof *s);
            if (!s) {
                pthread_mutex_unlock(&library->lock);
                free(settings);
                return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "out of memory");
            }
            s->settings = settings;
            s->next = library->specialisations;
            library->specialisations = s;
            break;
        }
        if (s->compiling) {
            pthread_cond_wait(&library->built, &library->lock);
            continue;
        }
        free(settings);
        if (s->status == MSLX_OK || s->status == MSLX_ERR_COMPILE) {
            int status = s->status;
            if (status) {
                mslx__fail(status, err, err_len, "%s", s->message ? s->message : "compile error");
            } else {
                atomic_fetch_add(&s->module->references, 1);
                *module = s->module;
            }
            pthread_mutex_unlock(&library->lock);
            return status;
        }
        free(s->message);
        s->message = NULL;
        break;
    }
    s->compiling = 1;
    pthread_mutex_unlock(&library->lock);

    char *message = malloc(MESSAGE_CAPACITY);
    mslx_module *built = NULL;
    int status = message ? build(library, kernel, s->settings, &built, message) : MSLX_ERR_UNAVAILABLE;
    if (status) mslx__fail(status, err, err_len, "%s", message ? message : "out of memory");

    pthread_mutex_lock(&library->lock);
    s->compiling = 0;
    s->status = status;
    s->module = built;
    s->message = status && message ? mslx__strndup(message, strlen(message)) : NULL;
    if (!status) {
        atomic_fetch_add(&built->references, 1);
        *module = built;
    }
    pthread_cond_broadcast(&library->built);
    pthread_mutex_unlock(&library->lock);
    free(message);
    return status;
}

/* ---- public API ---- */

int mslx_library_create(const char *source, size_t length, const mslx_header *headers, size_t header_count,
                        mslx_library **out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!out || (!source && length) || (header_count && !headers))
        return mslx__fail(MSLX_ERR_INVALID, err, err_len,
                          "mslx_library_create: missing source, headers or result pointer");
    *out = NULL;
    mslx_library *library = calloc(1, sizeof *library);
    if (!library) return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "out of memory");
    mslx_buf text = {0};
    int status = mslx__preprocess(source ? source : "", length, headers, header_count, &text, err, err_len);
    if (!status) status = mslx__parse(text.data, text.length, &library->parsed, err, err_len);
    if (status) {
        mslx__buf_free(&text);
        free(library);
        return status;
    }
    library->text = text.data;
    library->length = text.length;
    pthread_mutex_init(&library->lock, NULL);
    pthread_cond_init(&library->built, NULL);
    *out = library;
    return MSLX_OK;
}

void mslx_library_release(mslx_library *library) {
    if (!library) return;
    for (specialisation *s = library->specialisations, *next; s; s = next) {
        next = s->next;
        specialisation_free(s);
    }
    mslx__parsed_free(&library->parsed);
    free(library->text);
    pthread_mutex_destroy(&library->lock);
    pthread_cond_destroy(&library->built);
    free(library);
}

size_t mslx_library_function_count(const mslx_library *library) { return library ? library->parsed.kernel_count : 0; }

const char *mslx_library_function_name(const mslx_library *library, size_t i) {
    return library && i < library->parsed.kernel_count ? library->parsed.kernels[i].name : NULL;
}

int mslx_function_create(mslx_library *library, const char *name, const mslx_constant_value *values, size_t value_count,
                         mslx_function **out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!library || !name || !out || (value_count && !values))
        return mslx__fail(MSLX_ERR_INVALID, err, err_len,
                          "mslx_function_create: missing library, name, values or result pointer");
    *out = NULL;
    const mslx_parsed *parsed = &library->parsed;
    size_t k = 0;
    while (k < parsed->kernel_count && strcmp(parsed->kernels[k].name, name)) k++;
    if (k == parsed->kernel_count) {
        mslx_buf names = {0};
        for (size_t i = 0; i < parsed->kernel_count; i++)
            mslx__buf_printf(&names, "%s'%s'", i ? ", " : "", parsed->kernels[i].name);
        int status = mslx__fail(MSLX_ERR_INVALID, err, err_len, "no kernel '%s' in this library (its kernels: %s)",
                                name, names.data ? names.data : "none");
        mslx__buf_free(&names);
        return status;
    }
    constant_setting *settings = calloc(parsed->constant_count ? parsed->constant_count : 1, sizeof *settings);
    mslx_function *function = calloc(1, sizeof *function);
    char *name_copy = mslx__strndup(name, strlen(name));
    int status =
        settings && function && name_copy ? MSLX_OK : mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "out of memory");
    if (!status) status = resolve_constants(library, values, value_count, settings, err, err_len);
    if (!status) {
        const mslx_kernel *kernel = &parsed->kernels[k];
        for (size_t a = 0; a < kernel->arg_count; a++) {
            const mslx_arg *arg = &kernel->args[a];
            if (arg->kind == MSLX_ARG_BUFFER && argument_present(arg, settings))
                function->buffer_mask |= 1u << arg->index;
            if (arg->kind == MSLX_ARG_THREADGROUP) function->threadgroup_mask |= 1u << arg->index;
        }
        status = acquire(library, name, settings, &function->module, err, err_len); /* takes settings */
        settings = NULL;
    }
    if (status) {
        free(settings), free(function), free(name_copy);
        return status;
    }
    function->kernel = k;
    function->name = name_copy;
    *out = function;
    return MSLX_OK;
}

void mslx_function_release(mslx_function *function) {
    if (!function) return;
    module_release(function->module);
    free(function->name);
    free(function);
}

const char *mslx_function_name(const mslx_function *function) { return function ? function->name : NULL; }

uint64_t mslx_function_static_threadgroup_memory(const mslx_function *function) {
    return function ? function->module->static_sizes[function->kernel] : 0;
}

mslx_entry_fn mslx__function_entry(const mslx_function *function) {
    return function ? function->module->entries[function->kernel] : NULL;
}

uint32_t mslx__function_buffer_mask(const mslx_function *function) { return function ? function->buffer_mask : 0; }

uint32_t mslx__function_threadgroup_mask(const mslx_function *function) {
    return function ? function->threadgroup_mask : 0;
}
