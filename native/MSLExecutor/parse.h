/*
 * The Metal-source scanner's shared pieces (parse.c: declarations;
 * parse_tokens.c: tokens, brackets, constant expressions, edits).
 */
#pragma once
#include "frontend.h"

#include <string.h>

enum { TK_IDENT, TK_NUMBER, TK_STRING, TK_CHAR, TK_PUNCT };

typedef struct token {
    int kind;
    size_t start, length;
} token;

/* A template kernel, waiting for its explicit instantiations. */
typedef struct template_kernel {
    char *name;
    char *ns;     /* "::a::b" or "" */
    char *layout; /* "mslx_tgl_<n>" or NULL */
    mslx_arg *args;
    size_t arg_count;
} template_kernel;

typedef struct parser {
    const char *text;
    size_t length;
    token *toks;
    size_t count;
    mslx_parsed *out;
    size_t edit_capacity, kernel_capacity, constant_capacity, template_capacity;
    template_kernel *templates;
    size_t template_count;
    int layouts;
    int status;
    char *err;
    size_t err_len;
} parser;

#define NONE ((size_t)-1)

/* Token tests; an index past the end matches nothing. */
static inline int is(const parser *p, size_t i, const char *text) {
    return i < p->count && p->toks[i].length == strlen(text) &&
           !memcmp(p->text + p->toks[i].start, text, p->toks[i].length);
}
static inline int is_ident(const parser *p, size_t i) { return i < p->count && p->toks[i].kind == TK_IDENT; }
static inline int is_attribute(const parser *p, size_t i) { return is(p, i, "[") && is(p, i + 1, "["); }
static inline size_t tok_end(const parser *p, size_t i) { return p->toks[i].start + p->toks[i].length; }

/* Records the first error (MSLX_ERR_COMPILE) in p; returns 0. */
int mslx__parse_error(parser *p, const char *format, ...) __attribute__((format(printf, 2, 3)));
/* Records an allocation failure (MSLX_ERR_UNAVAILABLE); returns 0. */
int mslx__parse_oom(parser *p);
/* Grows *array (of `size`-byte elements) to hold one more than `count`; 0 on failure. */
int mslx__parse_grow(parser *p, void **array, size_t *capacity, size_t count, size_t size);

/* Fills p->toks from p->text; lines starting with '#' (line markers,
 * #pragma) are skipped. */
void mslx__tokenize(parser *p);
/* Source text of tokens [first, last), line breaks as spaces, token `skip`
 * (or NONE) left out; NULL when out of memory. */
char *mslx__span_text(parser *p, size_t first, size_t last, size_t skip);
char *mslx__tok_text(parser *p, size_t i);
/* i at '(', '[' or '{': the index after its match. */
size_t mslx__skip_balanced(parser *p, size_t i);
/* i at the '<' of a template parameter/argument list: the index after its '>'. */
size_t mslx__skip_angles(parser *p, size_t i);
/* Splits [first, last) at top-level commas: ends[k] is the end of item k.
 * Returns the item count (at most max). */
size_t mslx__split_commas(parser *p, size_t first, size_t last, size_t *ends, size_t max);
/* Tokens [first, last) as a non-negative integer constant (+ - * / and
 * parentheses), or -1. */
long mslx__eval_index(parser *p, size_t first, size_t last);

/* Records a rewrite of text [start, end) (see mslx_edit). */
void mslx__add_edit(parser *p, size_t start, size_t end, int kind, int constant, const char *text);
/* Blanks tokens [first, last), keeping line breaks so line numbers hold. */
void mslx__blank(parser *p, size_t first, size_t last);
