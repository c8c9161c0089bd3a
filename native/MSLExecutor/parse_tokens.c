/* The Metal-source scanner's tokens and helpers (see parse.h). */
#include "parse.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>

int mslx__parse_error(parser *p, const char *format, ...) {
    if (p->status) return 0;
    p->status = MSLX_ERR_COMPILE;
    if (p->err && p->err_len) {
        va_list args;
        va_start(args, format);
        vsnprintf(p->err, p->err_len, format, args);
        va_end(args);
    }
    return 0;
}

int mslx__parse_oom(parser *p) {
    if (!p->status) {
        p->status = MSLX_ERR_UNAVAILABLE;
        mslx__fail(MSLX_ERR_UNAVAILABLE, p->err, p->err_len, "out of memory while parsing the Metal source");
    }
    return 0;
}

int mslx__parse_grow(parser *p, void **array, size_t *capacity, size_t count, size_t size) {
    if (count < *capacity) return 1;
    size_t capacity2 = *capacity ? *capacity * 2 : 16;
    void *bigger = realloc(*array, capacity2 * size);
    if (!bigger) return mslx__parse_oom(p);
    *array = bigger;
    *capacity = capacity2;
    return 1;
}

/* ---- tokens ---- */

static void push_token(parser *p, int kind, size_t start, size_t end, size_t *capacity) {
    if (!mslx__parse_grow(p, (void **)&p->toks, capacity, p->count, sizeof(token))) return;
    p->toks[p->count++] = (token){kind, start, end - start};
}

static size_t skip_quoted(const char *s, size_t n, size_t i) {
    char quote = s[i++];
    while (i < n && s[i] != quote && s[i] != '\n') i += s[i] == '\\' ? 2 : 1;
    return i < n ? i + 1 : n;
}

/* Lines that start with '#' (line markers, #pragma) are not tokens. */
void mslx__tokenize(parser *p) {
    const char *s = p->text;
    size_t n = p->length, i = 0, capacity = 0;
    int line_start = 1;
    while (i < n && !p->status) {
        char c = s[i];
        if (c == '\n') {
            line_start = 1, i++;
        } else if (isspace((unsigned char)c)) {
            i++;
        } else if (c == '#' && line_start) {
            while (i < n && s[i] != '\n') i += (s[i] == '\\' && i + 1 < n) ? 2 : 1;
        } else if (c == '/' && i + 1 < n && s[i + 1] == '/') {
            while (i < n && s[i] != '\n') i++;
        } else if (c == '/' && i + 1 < n && s[i + 1] == '*') {
            const char *end = strstr(s + i + 2, "*/");
            i = end ? (size_t)(end - s) + 2 : n;
        } else {
            line_start = 0;
            size_t start = i;
            if (isalpha((unsigned char)c) || c == '_') {
                while (i < n && (isalnum((unsigned char)s[i]) || s[i] == '_')) i++;
                size_t len = i - start;
                int raw = i < n && s[i] == '"' && s[i - 1] == 'R' && len <= 3;
                int prefix = i < n && (s[i] == '"' || s[i] == '\'') &&
                             ((len == 1 && strchr("LuU", c)) || (len == 2 && !memcmp(s + start, "u8", 2)));
                if (raw) {
                    size_t open = i + 1, paren = open;
                    while (paren < n && s[paren] != '(' && paren - open < 16) paren++;
                    char closer[20];
                    snprintf(closer, sizeof closer, ")%.*s\"", (int)(paren - open), s + open);
                    const char *end = strstr(s + paren, closer);
                    i = end ? (size_t)(end - s) + strlen(closer) : n;
                    push_token(p, TK_STRING, start, i, &capacity);
                } else if (prefix) {
                    int kind = s[i] == '"' ? TK_STRING : TK_CHAR;
                    i = skip_quoted(s, n, i);
                    push_token(p, kind, start, i, &capacity);
                } else {
                    push_token(p, TK_IDENT, start, i, &capacity);
                }
            } else if (isdigit((unsigned char)c) || (c == '.' && i + 1 < n && isdigit((unsigned char)s[i + 1]))) {
                while (i < n && (isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == '.' || s[i] == '\'' ||
                                 ((s[i] == '+' || s[i] == '-') && strchr("eEpP", s[i - 1]))))
                    i++;
                push_token(p, TK_NUMBER, start, i, &capacity);
            } else if (c == '"' || c == '\'') {
                i = skip_quoted(s, n, i);
                push_token(p, c == '"' ? TK_STRING : TK_CHAR, start, i, &capacity);
            } else {
                if (c == ':' && i + 1 < n && s[i + 1] == ':')
                    i += 2;
                else if (c == '.' && i + 2 < n && s[i + 1] == '.' && s[i + 2] == '.')
                    i += 3;
                else
                    i++;
                push_token(p, TK_PUNCT, start, i, &capacity);
            }
        }
    }
}

/* Source text of tokens [first, last), with line breaks turned into spaces;
 * a token `skip` (or NONE) is left out. */
char *mslx__span_text(parser *p, size_t first, size_t last, size_t skip) {
    mslx_buf buf = {0};
    for (size_t i = first; i < last; i++) {
        if (i == skip) continue;
        if (buf.length && (i == first || p->toks[i].start > tok_end(p, i - 1))) mslx__buf_puts(&buf, " ");
        mslx__buf_append(&buf, p->text + p->toks[i].start, p->toks[i].length);
    }
    if (!buf.data) mslx__buf_puts(&buf, "");
    if (buf.failed) {
        mslx__buf_free(&buf);
        mslx__parse_oom(p);
        return NULL;
    }
    return buf.data;
}

char *mslx__tok_text(parser *p, size_t i) { return mslx__span_text(p, i, i + 1, NONE); }

/* i at '(', '[' or '{': the index after its match. */
size_t mslx__skip_balanced(parser *p, size_t i) {
    int depth = 0;
    for (; i < p->count; i++) {
        if (is(p, i, "(") || is(p, i, "[") || is(p, i, "{"))
            depth++;
        else if ((is(p, i, ")") || is(p, i, "]") || is(p, i, "}")) && --depth == 0)
            return i + 1;
    }
    mslx__parse_error(p, "unbalanced brackets in the Metal source");
    return p->count;
}

/* i at '<' of a template argument/parameter list: the index after its '>'. */
size_t mslx__skip_angles(parser *p, size_t i) {
    int depth = 0;
    while (i < p->count) {
        if (is(p, i, "(") || is(p, i, "[") || is(p, i, "{")) {
            i = mslx__skip_balanced(p, i);
            continue;
        }
        if (is(p, i, "<"))
            depth++;
        else if (is(p, i, ">") && --depth == 0)
            return i + 1;
        else if (is(p, i, ";"))
            break;
        i++;
    }
    mslx__parse_error(p, "unbalanced '<' in the Metal source");
    return p->count;
}

/* Splits tokens [first, last) at top-level commas: ends[k] is the end of
 * item k (the comma's index, or last). Returns the item count. */
size_t mslx__split_commas(parser *p, size_t first, size_t last, size_t *ends, size_t max) {
    size_t count = 0;
    int angle = 0;
    for (size_t i = first; i < last;) {
        if (is(p, i, "(") || is(p, i, "[") || is(p, i, "{")) {
            i = mslx__skip_balanced(p, i);
            continue;
        }
        if (is(p, i, "<")) angle++;
        if (is(p, i, ">") && angle > 0) angle--;
        if (is(p, i, ",") && angle == 0 && count < max) ends[count++] = i;
        i++;
    }
    if (first < last && count < max) ends[count++] = last;
    return count;
}

/* ---- integer constant expressions in attributes: + - * / ( ) ---- */

static int eval_expr(parser *p, size_t *i, size_t last, long *value);

static int eval_primary(parser *p, size_t *i, size_t last, long *value) {
    if (*i >= last) return 0;
    if (is(p, *i, "-") || is(p, *i, "+")) {
        int negate = is(p, *i, "-");
        (*i)++;
        if (!eval_primary(p, i, last, value)) return 0;
        if (negate) *value = -*value;
        return 1;
    }
    if (is(p, *i, "(")) {
        (*i)++;
        if (!eval_expr(p, i, last, value) || !is(p, *i, ")")) return 0;
        (*i)++;
        return 1;
    }
    if (p->toks[*i].kind != TK_NUMBER) return 0;
    char digits[64];
    snprintf(digits, sizeof digits, "%.*s", (int)p->toks[*i].length, p->text + p->toks[*i].start);
    char *end;
    *value = (long)strtoul(digits, &end, 0);
    if (strspn(end, "uUlL") != strlen(end)) return 0;
    (*i)++;
    return 1;
}

static int eval_term(parser *p, size_t *i, size_t last, long *value) {
    if (!eval_primary(p, i, last, value)) return 0;
    while (*i < last && (is(p, *i, "*") || is(p, *i, "/"))) {
        int divide = is(p, *i, "/");
        long rhs;
        (*i)++;
        if (!eval_primary(p, i, last, &rhs) || (divide && rhs == 0)) return 0;
        *value = divide ? *value / rhs : *value * rhs;
    }
    return 1;
}

static int eval_expr(parser *p, size_t *i, size_t last, long *value) {
    if (!eval_term(p, i, last, value)) return 0;
    while (*i < last && (is(p, *i, "+") || is(p, *i, "-"))) {
        int minus = is(p, *i, "-");
        long rhs;
        (*i)++;
        if (!eval_term(p, i, last, &rhs)) return 0;
        *value = minus ? *value - rhs : *value + rhs;
    }
    return 1;
}

/* The value of tokens [first, last) as an integer constant, or -1. */
long mslx__eval_index(parser *p, size_t first, size_t last) {
    long value;
    size_t i = first;
    if (!eval_expr(p, &i, last, &value) || i != last || value < 0) return -1;
    return value;
}

/* ---- edits, kernels, constants ---- */

void mslx__add_edit(parser *p, size_t start, size_t end, int kind, int constant, const char *text) {
    if (p->status) return;
    mslx_parsed *o = p->out;
    if (!mslx__parse_grow(p, (void **)&o->edits, &p->edit_capacity, o->edit_count, sizeof(mslx_edit))) return;
    char *copy = text ? mslx__strndup(text, strlen(text)) : NULL;
    if (text && !copy) {
        mslx__parse_oom(p);
        return;
    }
    o->edits[o->edit_count++] = (mslx_edit){start, end, kind, constant, copy};
}

/* Blanks tokens [first, last) (keeps line breaks so line numbers hold). */
void mslx__blank(parser *p, size_t first, size_t last) {
    if (first >= last) return;
    size_t start = p->toks[first].start, end = tok_end(p, last - 1);
    char *spaces = malloc(end - start + 1);
    if (!spaces) {
        mslx__parse_oom(p);
        return;
    }
    for (size_t i = start; i < end; i++) spaces[i - start] = p->text[i] == '\n' ? '\n' : ' ';
    spaces[end - start] = 0;
    mslx__add_edit(p, start, end, MSLX_EDIT_TEXT, -1, spaces);
    free(spaces);
}
