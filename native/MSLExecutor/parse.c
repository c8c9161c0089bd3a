/*
 * Reads what a preprocessed Metal source declares, without understanding
 * C++ in general: a scanner over parse_tokens.c's tokens that knows
 * namespace scope, declarations ending in ';' and function bodies. It finds
 *   - kernels (`kernel void f(...)`, `[[kernel]] void f(...)`, template
 *     kernels with `template [[host_name("x")]] kernel void f<T>(...);`
 *     instantiations) and each argument's binding attribute;
 *   - function constants (`constant T name [[function_constant(i)]];`) and
 *     every is_function_constant_defined(name);
 *   - threadgroup variables declared in a kernel body (`threadgroup T a[N];`),
 *     which become references into the runtime's threadgroup static area.
 * and records the text edits that turn the source into a kernel unit
 * (library.c applies them per specialisation).
 *
 * Threadgroup layout: each kernel with such variables gets a struct
 * `mslx_tgl_<n>` inserted before it whose constexpr members are the
 * variables' offsets (each aligned to max(16, alignof(T))) and total size;
 * so array bounds may use namespace-scope constants, function constants and
 * template parameters, but not constants local to the kernel body.
 */
#include "parse.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *attribute;
    const char *field;
    int vector;
} builtins[] = {
    {"threadgroup_position_in_grid", "threadgroup_position_in_grid", 1},
    {"threadgroups_per_grid", "threadgroups_per_grid", 1},
    {"threads_per_threadgroup", "threads_per_threadgroup", 1},
    {"thread_position_in_threadgroup", "thread_position_in_threadgroup", 1},
    {"thread_position_in_grid", "thread_position_in_grid", 1},
    {"threads_per_grid", "threads_per_grid", 1},
    {"thread_index_in_threadgroup", "thread_index_in_threadgroup", 0},
    {"thread_index_in_simdgroup", "thread_index_in_simdgroup", 0},
    {"simdgroup_index_in_threadgroup", "simdgroup_index_in_threadgroup", 0},
    {"simdgroups_per_threadgroup", "simdgroups_per_threadgroup", 0},
    {"threads_per_simdgroup", "threads_per_simdgroup", 0},
    {"thread_execution_width", "threads_per_simdgroup", 0},
};

const char *mslx__builtin_field(int builtin, int *is_vector) {
    if (builtin < 0 || (size_t)builtin >= sizeof builtins / sizeof builtins[0]) return NULL;
    *is_vector = builtins[builtin].vector;
    return builtins[builtin].field;
}

static int find_constant(const parser *p, size_t name_tok) {
    for (size_t c = 0; c < p->out->constant_count; c++) {
        const char *name = p->out->constants[c].name;
        if (strlen(name) == p->toks[name_tok].length && !memcmp(name, p->text + p->toks[name_tok].start, strlen(name)))
            return (int)c;
    }
    return -1;
}

static int find_kernel(const parser *p, const char *name) {
    for (size_t k = 0; k < p->out->kernel_count; k++)
        if (!strcmp(p->out->kernels[k].name, name)) return (int)k;
    return -1;
}

static void free_args(mslx_arg *args, size_t count) {
    for (size_t i = 0; i < count; i++) {
        free(args[i].name);
        free(args[i].type);
    }
    free(args);
}

static void add_kernel(parser *p, char *name, char *callee, char *layout_size, mslx_arg *args, size_t arg_count) {
    mslx_parsed *o = p->out;
    if (!p->status && find_kernel(p, name) >= 0) mslx__parse_error(p, "kernel '%s' is defined twice", name);
    if (p->status || !name || !callee ||
        !mslx__parse_grow(p, (void **)&o->kernels, &p->kernel_capacity, o->kernel_count, sizeof(mslx_kernel))) {
        free(name), free(callee), free(layout_size), free_args(args, arg_count);
        return;
    }
    o->kernels[o->kernel_count++] = (mslx_kernel){name, callee, layout_size, args, arg_count};
}

static const struct {
    const char *spelling;
    uint32_t code;
} constant_types[] = {
    {"bool", MSLX_TYPE_BOOL},     {"int", MSLX_TYPE_INT},         {"int32_t", MSLX_TYPE_INT},
    {"uint", MSLX_TYPE_UINT},     {"uint32_t", MSLX_TYPE_UINT},   {"unsigned int", MSLX_TYPE_UINT},
    {"unsigned", MSLX_TYPE_UINT}, {"short", MSLX_TYPE_SHORT},     {"int16_t", MSLX_TYPE_SHORT},
    {"ushort", MSLX_TYPE_USHORT}, {"uint16_t", MSLX_TYPE_USHORT}, {"unsigned short", MSLX_TYPE_USHORT},
    {"float", MSLX_TYPE_FLOAT},   {"half", MSLX_TYPE_HALF},
};

/* `constant T name [[function_constant(i)]];` spanning tokens [first, last). */
static void parse_function_constant(parser *p, size_t first, size_t last, size_t attr) {
    size_t attr_end = mslx__skip_balanced(p, attr);
    size_t keyword = NONE;
    for (size_t i = first; i < attr; i++)
        if (is(p, i, "constant")) keyword = i;
    size_t name = attr - 1;
    if (keyword == NONE || !is_ident(p, name) || name <= keyword + 1 || attr_end != last) {
        char *text = mslx__span_text(p, first, last, NONE);
        mslx__parse_error(
            p, "unsupported function constant declaration '%s;' (expected: constant T name [[function_constant(i)]];)",
            text ? text : "");
        free(text);
        return;
    }
    /* The attribute holds exactly function_constant( index ). */
    size_t open = attr + 3, close = attr_end - 3;
    long index = is(p, attr + 2, "function_constant") && is(p, open, "(") && is(p, close, ")")
                     ? mslx__eval_index(p, open + 1, close)
                     : -1;
    char *cname = mslx__tok_text(p, name);
    char *type = mslx__span_text(p, keyword + 1, name, NONE);
    if (!cname || !type) {
        free(cname), free(type);
        return;
    }
    uint32_t code = 0;
    for (size_t t = 0; t < sizeof constant_types / sizeof constant_types[0]; t++)
        if (!strcmp(type, constant_types[t].spelling)) code = constant_types[t].code;
    if (index < 0)
        mslx__parse_error(p, "function constant '%s': [[function_constant(i)]] needs an integer constant index", cname);
    else if (!code)
        mslx__parse_error(
            p, "function constant '%s': type '%s' is not supported (bool, int, uint, short, ushort, float, half)",
            cname, type);
    else if (find_constant(p, name) >= 0)
        mslx__parse_error(p, "function constant '%s' is declared twice", cname);
    for (size_t c = 0; c < p->out->constant_count && !p->status; c++)
        if (p->out->constants[c].index == (uint32_t)index)
            mslx__parse_error(p, "function constants '%s' and '%s' share index %ld", p->out->constants[c].name, cname,
                              index);
    mslx_parsed *o = p->out;
    if (p->status ||
        !mslx__parse_grow(p, (void **)&o->constants, &p->constant_capacity, o->constant_count, sizeof *o->constants)) {
        free(cname), free(type);
        return;
    }
    o->constants[o->constant_count++] = (mslx_constant_decl){cname, type, code, (uint32_t)index};
    mslx__add_edit(p, p->toks[attr].start, tok_end(p, attr_end - 1), MSLX_EDIT_CONSTANT_VALUE,
                   (int)o->constant_count - 1, NULL);
}

/* ---- kernel arguments ---- */

static int is_type_keyword(const parser *p, size_t i) {
    static const char *const words[] = {"int",    "char", "short", "long", "unsigned", "signed",  "float",
                                        "double", "bool", "void",  "half", "const",    "volatile"};
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++)
        if (is(p, i, words[w])) return 1;
    return 0;
}

/* In type tokens [first, last): the '*' or '&' that makes it a pointer or a
 * reference (skipping trailing cv/restrict qualifiers), or NONE. */
static size_t declarator_op(const parser *p, size_t first, size_t last) {
    size_t i = last;
    while (i > first && (is(p, i - 1, "const") || is(p, i - 1, "volatile") || is(p, i - 1, "restrict") ||
                         is(p, i - 1, "__restrict")))
        i--;
    return i > first && (is(p, i - 1, "*") || is(p, i - 1, "&")) ? i - 1 : NONE;
}

/* The type a trampoline binds an argument through: a pointer type as
 * written, or for a reference `T &` the pointer type `T *`. */
static char *binding_type(parser *p, size_t first, size_t last, int *is_pointer, int *is_reference) {
    size_t op = declarator_op(p, first, last);
    *is_pointer = op != NONE && is(p, op, "*");
    *is_reference = op != NONE && is(p, op, "&");
    if (!*is_reference) return mslx__span_text(p, first, last, NONE);
    char *base = mslx__span_text(p, first, last, op);
    if (!base) return NULL;
    mslx_buf buf = {0};
    mslx__buf_printf(&buf, "%s *", base);
    free(base);
    if (buf.failed) mslx__parse_oom(p);
    return buf.data;
}

/* One argument of kernel `kernel`: tokens [first, last). */
static int parse_arg(parser *p, const char *kernel, size_t first, size_t last, mslx_arg *arg) {
    size_t attr = first;
    while (attr < last && !is_attribute(p, attr)) attr++;
    size_t name = attr > first + 1 && is_ident(p, attr - 1) ? attr - 1 : NONE;
    size_t type_end = name != NONE ? name : attr;
    arg->name = name != NONE ? mslx__tok_text(p, name) : mslx__span_text(p, first, attr, NONE);
    arg->condition = -1;
    arg->index = -1;
    if (!arg->name) return 0;
    if (attr == last)
        return mslx__parse_error(
            p,
            "kernel '%s', argument '%s': no binding attribute ([[buffer(i)]], [[threadgroup(i)]] or a "
            "built-in such as [[thread_position_in_grid]])",
            kernel, arg->name);
    for (size_t group = attr; group < last && is_attribute(p, group);) {
        size_t group_end = mslx__skip_balanced(p, group);
        size_t ends[8];
        size_t items = mslx__split_commas(p, group + 2, group_end - 2, ends, 8);
        for (size_t k = 0, start = group + 2; k < items; start = ends[k++] + 1) {
            char *what = mslx__tok_text(p, start);
            if (!what) return 0;
            size_t open = start + 1, close = ends[k] - 1;
            int has_args = is(p, open, "(") && is(p, close, ")");
            int kind = 0;
            if (!strcmp(what, "buffer") || !strcmp(what, "threadgroup")) {
                kind = what[0] == 'b' ? MSLX_ARG_BUFFER : MSLX_ARG_THREADGROUP;
                long index = has_args ? mslx__eval_index(p, open + 1, close) : -1;
                if (index < 0 || index >= (long)MSLX_MAX_BINDINGS)
                    mslx__parse_error(p,
                                      "kernel '%s', argument '%s': [[%s(i)]] needs an integer constant index below %u",
                                      kernel, arg->name, what, MSLX_MAX_BINDINGS);
                arg->index = (int)index;
            } else if (!strcmp(what, "function_constant")) {
                int c = has_args && close == open + 2 ? find_constant(p, open + 1) : -1;
                if (c < 0)
                    mslx__parse_error(
                        p,
                        "kernel '%s', argument '%s': [[function_constant(x)]] must name a declared function constant",
                        kernel, arg->name);
                else if (p->out->constants[c].type_code != MSLX_TYPE_BOOL)
                    mslx__parse_error(
                        p, "kernel '%s', argument '%s': [[function_constant(%s)]] needs a bool function constant",
                        kernel, arg->name, p->out->constants[c].name);
                arg->condition = c;
            } else {
                for (size_t b = 0; b < sizeof builtins / sizeof builtins[0]; b++)
                    if (!strcmp(what, builtins[b].attribute)) kind = MSLX_ARG_BUILTIN, arg->index = (int)b;
                if (!kind || ends[k] != start + 1)
                    mslx__parse_error(p, "kernel '%s', argument '%s': unsupported attribute [[%s]]", kernel, arg->name,
                                      what);
            }
            free(what);
            if (kind && arg->kind)
                mslx__parse_error(p, "kernel '%s', argument '%s': more than one binding attribute", kernel, arg->name);
            if (kind) arg->kind = kind;
        }
        mslx__blank(p, group, group_end);
        group = group_end;
    }
    if (p->status) return 0;
    if (!arg->kind)
        return mslx__parse_error(
            p, "kernel '%s', argument '%s': [[function_constant]] alone does not bind it; add [[buffer(i)]]", kernel,
            arg->name);
    int is_pointer;
    arg->type = binding_type(p, first, type_end, &is_pointer, &arg->is_reference);
    if (!arg->type) return 0;
    if (arg->kind == MSLX_ARG_BUFFER && !is_pointer && !arg->is_reference)
        return mslx__parse_error(
            p,
            "kernel '%s', argument '%s' [[buffer(%d)]]: type '%s' is a value; a buffer argument must be a "
            "pointer or a reference",
            kernel, arg->name, arg->index, arg->type);
    if (arg->kind == MSLX_ARG_THREADGROUP && !is_pointer)
        return mslx__parse_error(
            p, "kernel '%s', argument '%s' [[threadgroup(%d)]]: type '%s' must be a threadgroup pointer", kernel,
            arg->name, arg->index, arg->type);
    if (arg->kind == MSLX_ARG_BUILTIN && (is_pointer || arg->is_reference))
        return mslx__parse_error(p, "kernel '%s', argument '%s' [[%s]]: a built-in is passed by value, not as '%s'",
                                 kernel, arg->name, builtins[arg->index].attribute, arg->type);
    if (arg->condition >= 0 && arg->kind != MSLX_ARG_BUFFER)
        return mslx__parse_error(p,
                                 "kernel '%s', argument '%s': [[function_constant]] gates only [[buffer(i)]] arguments",
                                 kernel, arg->name);
    return 1;
}

/* The arguments between parentheses [open, close]. */
static int parse_args(parser *p, const char *kernel, size_t open, size_t close, mslx_arg **args, size_t *count) {
    size_t ends[MSLX_MAX_BINDINGS * 2 + 16];
    size_t max = sizeof ends / sizeof ends[0];
    size_t n = mslx__split_commas(p, open + 1, close, ends, max);
    if (n == max) return mslx__parse_error(p, "kernel '%s' has too many arguments", kernel);
    if (n == 1 && ends[0] == open + 2 && is(p, open + 1, "void")) n = 0;
    *args = calloc(n ? n : 1, sizeof **args);
    *count = n;
    if (!*args) return mslx__parse_oom(p);
    for (size_t a = 0, start = open + 1; a < n && !p->status; start = ends[a++] + 1)
        parse_arg(p, kernel, start, ends[a], &(*args)[a]);
    for (size_t a = 0; a < n && !p->status; a++)
        for (size_t b = 0; b < a; b++)
            if ((*args)[a].kind == (*args)[b].kind && (*args)[a].kind != MSLX_ARG_BUILTIN &&
                (*args)[a].index == (*args)[b].index)
                mslx__parse_error(p, "kernel '%s': arguments '%s' and '%s' both bind [[%s(%d)]]", kernel,
                                  (*args)[b].name, (*args)[a].name,
                                  (*args)[a].kind == MSLX_ARG_BUFFER ? "buffer" : "threadgroup", (*args)[a].index);
    return !p->status;
}

/* ---- threadgroup variables in a kernel body ---- */

/* `threadgroup T a[N], b;` at tokens [keyword, semicolon]: appends the
 * layout members to *layout and replaces the statement with references. */
static void rewrite_threadgroup_decl(parser *p, size_t keyword, size_t semicolon, const char *layout_ref,
                                     mslx_buf *layout, int *members) {
    size_t first_name = NONE;
    int angle = 0;
    for (size_t i = keyword + 1; i < semicolon; i++) {
        if (is(p, i, "<")) angle++;
        if (is(p, i, ">")) angle--;
        if (angle == 0 && i > keyword + 1 && is_ident(p, i) &&
            (is(p, i + 1, "[") || is(p, i + 1, ",") || i + 1 == semicolon)) {
            first_name = i;
            break;
        }
    }
    if (first_name == NONE) return;
    char *type = mslx__span_text(p, keyword + 1, first_name, NONE);
    mslx_buf code = {0};
    for (size_t i = first_name; i < semicolon && type;) {
        size_t dims = i + 1, dims_end = dims;
        while (is(p, dims_end, "[")) dims_end = mslx__skip_balanced(p, dims_end);
        char *name = mslx__tok_text(p, i);
        char *dim_text = mslx__span_text(p, dims, dims_end, NONE);
        if (!name || !dim_text) {
            free(name), free(dim_text);
            break;
        }
        int k = (*members)++;
        if (k == 0)
            mslx__buf_printf(layout, "static constexpr unsigned long o0 = 0; ");
        else
            mslx__buf_printf(layout,
                             "static constexpr unsigned long o%d = ::mslx_fe_tg_place(o%d + s%d, alignof(%s)); ", k,
                             k - 1, k - 1, type);
        mslx__buf_printf(layout, "static constexpr unsigned long s%d = sizeof(%s %s); ", k, type, dim_text);
        mslx__buf_printf(
            &code,
            "::mslx_fe_ref<threadgroup %s %s> %s = *(::mslx_fe_ptr<threadgroup %s %s>)::mslx_fe_tg_static(%s::o%d); ",
            type, dim_text, name, type, dim_text, layout_ref, k);
        free(name), free(dim_text);
        i = is(p, dims_end, ",") ? dims_end + 1 : semicolon;
    }
    if (code.failed || layout->failed)
        mslx__parse_oom(p);
    else if (code.data)
        mslx__add_edit(p, p->toks[keyword].start, tok_end(p, semicolon), MSLX_EDIT_TEXT, -1, code.data);
    mslx__buf_free(&code);
    free(type);
}

/* A statement `threadgroup T name...;` declares threadgroup storage; one
 * with '*', '&', '=' or '(' declares a pointer into it (left alone). */
static int is_threadgroup_storage(parser *p, size_t keyword, size_t *semicolon) {
    size_t i = keyword + 1;
    while (i < p->count && !is(p, i, ";")) {
        if (is(p, i, "[")) {
            i = mslx__skip_balanced(p, i);
            continue;
        }
        if (is(p, i, "*") || is(p, i, "&") || is(p, i, "=") || is(p, i, "(") || is(p, i, "{") || is(p, i, "}"))
            return 0;
        i++;
    }
    *semicolon = i;
    return i < p->count;
}

/* Rewrites the threadgroup variables of body [open, close); returns the
 * layout struct's members ("" when there are none). */
static char *rewrite_threadgroup_vars(parser *p, size_t open, size_t close, const char *layout_ref) {
    mslx_buf layout = {0};
    int members = 0;
    for (size_t i = open + 1; i < close && !p->status; i++) {
        size_t semicolon;
        if (!is(p, i, "threadgroup") || !(is(p, i - 1, "{") || is(p, i - 1, ";") || is(p, i - 1, "}")) ||
            !is_threadgroup_storage(p, i, &semicolon))
            continue;
        rewrite_threadgroup_decl(p, i, semicolon, layout_ref, &layout, &members);
        i = semicolon;
    }
    if (members)
        mslx__buf_printf(&layout, "static constexpr unsigned long size = o%d + s%d;", members - 1, members - 1);
    if (!layout.data) mslx__buf_puts(&layout, "");
    if (layout.failed) mslx__parse_oom(p);
    return layout.data;
}

/* The names of template parameters [open, close) ('<' ... '>'), as a
 * template argument list "<T, N, Ts...>". */
static char *template_arg_list(parser *p, size_t open, size_t close) {
    size_t ends[32];
    size_t n = mslx__split_commas(p, open + 1, close - 1, ends, 32);
    mslx_buf buf = {0};
    mslx__buf_puts(&buf, "<");
    for (size_t k = 0, start = open + 1; k < n; start = ends[k++] + 1) {
        size_t end = start;
        while (end < ends[k] && !is(p, end, "=")) end++;
        size_t name = end;
        while (name > start && !is_ident(p, name - 1)) name--;
        int pack = 0;
        for (size_t i = start; i < end; i++) pack |= is(p, i, "...");
        if (name == start)
            mslx__parse_error(p, "cannot read the template parameter list of a kernel template");
        else
            mslx__buf_printf(&buf, "%s%.*s%s", k ? ", " : "", (int)p->toks[name - 1].length,
                             p->text + p->toks[name - 1].start, pack ? "..." : "");
    }
    mslx__buf_puts(&buf, ">");
    if (buf.failed) mslx__parse_oom(p);
    return buf.data;
}

/* ---- declarations ---- */

/* A function definition [start, body_close): its head is [head, body_open). */
static void parse_function(parser *p, size_t start, size_t tmpl_open, size_t head, size_t body_open, size_t body_close,
                           const char *ns) {
    size_t marker = NONE, marker_end = NONE, param_open = NONE;
    for (size_t i = head; i < body_open && param_open == NONE;) {
        if (is(p, i, "vertex") || is(p, i, "fragment") || is(p, i, "mesh") || is(p, i, "object")) return;
        if (is(p, i, "kernel")) marker = i, marker_end = i + 1;
        if (is_attribute(p, i)) {
            size_t end = mslx__skip_balanced(p, i);
            if (end == i + 5 && is(p, i + 2, "kernel")) marker = i, marker_end = end;
            i = end;
            continue;
        }
        if (is(p, i, "(") && is_ident(p, i - 1) && !is(p, i - 1, "__attribute__") && !is(p, i - 1, "alignas") &&
            !is(p, i - 1, "decltype"))
            param_open = i;
        else if (is(p, i, "(")) {
            i = mslx__skip_balanced(p, i);
            continue;
        }
        i++;
    }
    if (marker == NONE || param_open == NONE) return;
    char *name = mslx__tok_text(p, param_open - 1);
    if (!name) return;
    int returns_void = 0;
    for (size_t i = marker_end; i < param_open - 1; i++) returns_void |= is(p, i, "void");
    if (!returns_void) {
        mslx__parse_error(p, "kernel '%s' must return void", name);
        free(name);
        return;
    }
    mslx__blank(p, marker, marker_end);
    size_t param_close = mslx__skip_balanced(p, param_open) - 1;
    mslx_arg *args = NULL;
    size_t arg_count = 0;
    if (!parse_args(p, name, param_open, param_close, &args, &arg_count)) {
        free(name);
        free_args(args, arg_count);
        return;
    }
    /* Threadgroup variables: layout struct mslx_tgl_<n> before the kernel. */
    char layout_name[32];
    snprintf(layout_name, sizeof layout_name, "mslx_tgl_%d", p->layouts);
    char *targs = tmpl_open != NONE ? template_arg_list(p, tmpl_open, head) : NULL;
    mslx_buf ref = {0};
    mslx__buf_printf(&ref, "%s%s", layout_name, targs ? targs : "");
    char *members = ref.data ? rewrite_threadgroup_vars(p, body_open, body_close, ref.data) : NULL;
    char *layout = NULL;
    if (members && *members) {
        p->layouts++;
        mslx_buf def = {0};
        if (tmpl_open != NONE) {
            char *params = mslx__span_text(p, tmpl_open, head, NONE);
            mslx__buf_printf(&def, "template %s ", params ? params : "<>");
            free(params);
        }
        mslx__buf_printf(&def, "struct %s { %s }; ", layout_name, members);
        if (def.failed)
            mslx__parse_oom(p);
        else
            mslx__add_edit(p, p->toks[start].start, p->toks[start].start, MSLX_EDIT_TEXT, -1, def.data);
        mslx__buf_free(&def);
        layout = mslx__strndup(layout_name, strlen(layout_name));
    }
    free(members), free(targs), mslx__buf_free(&ref);
    if (p->status) {
        free(name), free(layout), free_args(args, arg_count);
        return;
    }
    if (tmpl_open != NONE) {
        if (!mslx__parse_grow(p, (void **)&p->templates, &p->template_capacity, p->template_count,
                              sizeof *p->templates)) {
            free(name), free(layout), free_args(args, arg_count);
            return;
        }
        p->templates[p->template_count++] =
            (template_kernel){name, mslx__strndup(ns, strlen(ns)), layout, args, arg_count};
        return;
    }
    mslx_buf callee = {0}, size = {0};
    mslx__buf_printf(&callee, "%s::%s", ns, name);
    if (layout) mslx__buf_printf(&size, "%s::%s::size", ns, layout);
    free(layout);
    add_kernel(p, name, callee.data, size.data, args, arg_count);
}

/* `template [[host_name("x")]] kernel void f<A>(types);` at [first, last). */
static void parse_instantiation(parser *p, size_t first, size_t last) {
    size_t marker = NONE, host = NONE, param_open = NONE;
    for (size_t i = first + 1; i < last && param_open == NONE;) {
        if (is(p, i, "kernel")) marker = i;
        if (is_attribute(p, i)) {
            size_t end = mslx__skip_balanced(p, i);
            if (is(p, i + 2, "host_name") && is(p, i + 3, "(") && p->toks[i + 4].kind == TK_STRING) {
                host = i + 4;
                mslx__blank(p, i, end);
            } else if (end == i + 5 && is(p, i + 2, "kernel")) {
                marker = i;
                mslx__blank(p, i, end);
            }
            i = end;
            continue;
        }
        if (is(p, i, "(") && (is_ident(p, i - 1) || is(p, i - 1, ">")))
            param_open = i;
        else
            i++;
    }
    if (marker == NONE || param_open == NONE) return; /* not a kernel */
    if (is(p, marker, "kernel")) mslx__blank(p, marker, marker + 1);
    size_t lt = NONE;
    if (is(p, param_open - 1, ">")) {
        int depth = 0;
        for (size_t i = param_open - 1; i > first; i--) {
            if (is(p, i, ">")) depth++;
            if (is(p, i, "<") && --depth == 0) {
                lt = i;
                break;
            }
        }
    }
    if (lt == NONE || !is_ident(p, lt - 1)) {
        mslx__parse_error(
            p, "unsupported kernel instantiation: name its template arguments (template [[host_name(\"x\")]] kernel "
               "void f<T>(...);)");
        return;
    }
    char *tname = mslx__tok_text(p, lt - 1);
    if (!tname) return;
    template_kernel *t = NULL;
    for (size_t k = 0; k < p->template_count; k++)
        if (!strcmp(p->templates[k].name, tname)) t = &p->templates[k];
    if (!t || host == NONE) {
        mslx__parse_error(p,
                          !t ? "kernel instantiation of '%s': no kernel template of that name is defined before it"
                             : "kernel instantiation of '%s' has no [[host_name(\"name\")]]",
                          tname);
        free(tname);
        return;
    }
    char *host_name = mslx__strndup(p->text + p->toks[host].start + 1, p->toks[host].length - 2);
    if (!host_name) {
        free(tname);
        mslx__parse_oom(p);
        return;
    }
    for (const char *c = host_name; *c; c++)
        if (!isalnum((unsigned char)*c) && *c != '_')
            mslx__parse_error(p, "[[host_name(\"%s\")]]: a host name must be an identifier", host_name);
    if (!*host_name) mslx__parse_error(p, "[[host_name(\"\")]] is empty");
    size_t ends[MSLX_MAX_BINDINGS * 2 + 16];
    size_t param_close = mslx__skip_balanced(p, param_open) - 1;
    size_t n = mslx__split_commas(p, param_open + 1, param_close, ends, sizeof ends / sizeof ends[0]);
    if (n == 1 && ends[0] == param_open + 2 && is(p, param_open + 1, "void")) n = 0;
    if (n != t->arg_count)
        mslx__parse_error(p, "kernel '%s': its instantiation lists %zu argument types, its template has %zu arguments",
                          host_name, n, t->arg_count);
    mslx_arg *args = calloc(n ? n : 1, sizeof *args);
    if (!args) mslx__parse_oom(p);
    for (size_t a = 0, start = param_open + 1; a < n && args && !p->status; start = ends[a++] + 1) {
        size_t end = start;
        while (end < ends[a] && !is_attribute(p, end)) end++;
        if (end - start > 1 && is_ident(p, end - 1) && !is_type_keyword(p, end - 1) && !is(p, end - 2, "::")) end--;
        int is_pointer, is_reference;
        args[a] = t->args[a];
        args[a].name = mslx__strndup(t->args[a].name, strlen(t->args[a].name));
        args[a].type = binding_type(p, start, end, &is_pointer, &is_reference);
        if (is_reference != t->args[a].is_reference)
            mslx__parse_error(p,
                              "kernel '%s', argument '%s': the instantiation's type '%s' does not match the template's",
                              host_name, args[a].name, args[a].type ? args[a].type : "");
    }
    mslx_buf callee = {0}, size = {0};
    char *targs = mslx__span_text(p, lt, param_open, NONE);
    mslx__buf_printf(&callee, "%s::%s%s", t->ns, tname, targs ? targs : "");
    if (t->layout) mslx__buf_printf(&size, "%s::%s%s::size", t->ns, t->layout, targs ? targs : "");
    free(targs), free(tname);
    add_kernel(p, host_name, callee.data, size.data, args, args ? n : 0);
}

/* A declaration ending in ';' at namespace scope, tokens [first, last). */
static void parse_simple_declaration(parser *p, size_t first, size_t last) {
    if (is(p, first, "template") && !is(p, first + 1, "<")) {
        parse_instantiation(p, first, last);
        return;
    }
    for (size_t i = first; i < last;) {
        if (is_attribute(p, i)) {
            if (is(p, i + 2, "function_constant")) {
                parse_function_constant(p, first, last, i);
                return;
            }
            i = mslx__skip_balanced(p, i);
        } else if (is(p, i, "(") || is(p, i, "{")) {
            i = mslx__skip_balanced(p, i);
        } else {
            i++;
        }
    }
}

/* One declaration at namespace scope starting at `start`; returns the index after it. */
static size_t parse_declaration(parser *p, size_t start, const char *ns) {
    size_t i = start, tmpl_open = NONE;
    if (is(p, i, "template") && is(p, i + 1, "<")) {
        tmpl_open = i + 1;
        i = mslx__skip_angles(p, i + 1);
    }
    size_t head = i;
    int saw_paren = 0, saw_assign = 0, saw_class = 0;
    while (i < p->count && !p->status) {
        if (is(p, i, "(") || is(p, i, "[")) {
            saw_paren |= is(p, i, "(");
            i = mslx__skip_balanced(p, i);
            continue;
        }
        if (is(p, i, "=")) saw_assign = 1;
        if ((is(p, i, "class") || is(p, i, "struct") || is(p, i, "union") || is(p, i, "enum")) && !saw_paren)
            saw_class = 1;
        if (is(p, i, ";")) {
            parse_simple_declaration(p, start, i);
            return i + 1;
        }
        if (is(p, i, "}")) return i;
        if (is(p, i, "{")) {
            size_t end = mslx__skip_balanced(p, i);
            if (!saw_assign && !saw_class && saw_paren) {
                parse_function(p, start, tmpl_open, head, i, end - 1, ns);
                return end;
            }
            i = end;
            continue;
        }
        i++;
    }
    return i;
}

/* Declarations until the '}' closing this scope (or the end); returns its index. */
static size_t parse_scope(parser *p, size_t i, const char *ns) {
    while (i < p->count && !p->status) {
        if (is(p, i, "}")) return i;
        if (is(p, i, ";")) {
            i++;
            continue;
        }
        size_t k = is(p, i, "inline") ? i + 1 : i;
        if (is(p, k, "namespace")) {
            size_t open = k + 1;
            while (open < p->count && (is_ident(p, open) || is(p, open, "::"))) open++;
            if (is(p, open, "{")) {
                mslx_buf inner = {0};
                mslx__buf_puts(&inner, ns);
                for (size_t t = k + 1; t < open; t++)
                    if (is_ident(p, t))
                        mslx__buf_printf(&inner, "::%.*s", (int)p->toks[t].length, p->text + p->toks[t].start);
                if (inner.failed) {
                    mslx__parse_oom(p);
                    return p->count;
                }
                size_t close = parse_scope(p, open + 1, inner.data ? inner.data : "");
                mslx__buf_free(&inner);
                i = close + 1;
                continue;
            }
        }
        if (is(p, i, "extern") && i + 2 < p->count && p->toks[i + 1].kind == TK_STRING && is(p, i + 2, "{")) {
            i = parse_scope(p, i + 3, ns) + 1;
            continue;
        }
        i = parse_declaration(p, i, ns);
    }
    return i;
}

/* is_function_constant_defined(name) anywhere -> an edit to true/false. */
static void find_defined_queries(parser *p) {
    for (size_t i = 0; i + 3 < p->count && !p->status; i++) {
        if (!is(p, i, "is_function_constant_defined")) continue;
        int c = is(p, i + 1, "(") && is(p, i + 3, ")") ? find_constant(p, i + 2) : -1;
        if (c < 0) {
            char *text = mslx__span_text(p, i, i + 4 < p->count ? i + 4 : p->count, NONE);
            mslx__parse_error(p, "'%s': the argument must be a function constant declared before it", text ? text : "");
            free(text);
            return;
        }
        mslx__add_edit(p, p->toks[i].start, tok_end(p, i + 3), MSLX_EDIT_CONSTANT_DEFINED, c, NULL);
    }
}

static int compare_edits(const void *a, const void *b) {
    const mslx_edit *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

int mslx__parse(const char *text, size_t length, mslx_parsed *out, char *err, size_t err_len) {
    *out = (mslx_parsed){0};
    parser p = {.text = text, .length = length, .out = out, .err = err, .err_len = err_len};
    mslx__tokenize(&p);
    if (!p.status) {
        size_t end = parse_scope(&p, 0, "");
        if (end < p.count && !p.status) mslx__parse_error(&p, "unbalanced '}' in the Metal source");
    }
    find_defined_queries(&p);
    if (out->edit_count) qsort(out->edits, out->edit_count, sizeof *out->edits, compare_edits);
    for (size_t e = 1; e < out->edit_count && !p.status; e++)
        if (out->edits[e].start < out->edits[e - 1].end)
            mslx__parse_error(&p, "internal error: overlapping rewrites of the Metal source at offset %zu",
                              out->edits[e].start);
    for (size_t t = 0; t < p.template_count; t++) {
        free(p.templates[t].name), free(p.templates[t].ns), free(p.templates[t].layout);
        free_args(p.templates[t].args, p.templates[t].arg_count);
    }
    free(p.templates);
    free(p.toks);
    if (p.status) mslx__parsed_free(out);
    return p.status;
}

void mslx__parsed_free(mslx_parsed *parsed) {
    for (size_t k = 0; k < parsed->kernel_count; k++) {
        mslx_kernel *kernel = &parsed->kernels[k];
        free(kernel->name), free(kernel->callee), free(kernel->layout_size);
        free_args(kernel->args, kernel->arg_count);
    }
    for (size_t c = 0; c < parsed->constant_count; c++)
        free(parsed->constants[c].name), free(parsed->constants[c].type);
    for (size_t e = 0; e < parsed->edit_count; e++) free(parsed->edits[e].text);
    free(parsed->kernels), free(parsed->constants), free(parsed->edits);
    *parsed = (mslx_parsed){0};
}
