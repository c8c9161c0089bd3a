/*
 * The front end's plumbing: growable strings, files and directories,
 * running clang, SHA-256 for cache keys, and the three things resolved once
 * per process (which clang, the cache directory, the embedded headers'
 * directory).
 */
#include "frontend.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* ---- strings ---- */

static int buf_reserve(mslx_buf *buf, size_t extra) {
    if (buf->failed) return 0;
    size_t need = buf->length + extra + 1;
    if (need <= buf->capacity) return 1;
    size_t capacity = buf->capacity ? buf->capacity : 256;
    while (capacity < need) capacity *= 2;
    char *data = realloc(buf->data, capacity);
    if (!data) {
        buf->failed = 1;
        return 0;
    }
    buf->data = data;
    buf->capacity = capacity;
    return 1;
}

void mslx__buf_append(mslx_buf *buf, const char *bytes, size_t length) {
    if (!buf_reserve(buf, length)) return;
    memcpy(buf->data + buf->length, bytes, length);
    buf->length += length;
    buf->data[buf->length] = 0;
}

void mslx__buf_puts(mslx_buf *buf, const char *text) { mslx__buf_append(buf, text, strlen(text)); }

void mslx__buf_printf(mslx_buf *buf, const char *format, ...) {
    va_list args;
    va_start(args, format);
    char small[256];
    int n = vsnprintf(small, sizeof small, format, args);
    va_end(args);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        mslx__buf_append(buf, small, (size_t)n);
        return;
    }
    if (!buf_reserve(buf, (size_t)n)) return;
    va_start(args, format);
    vsnprintf(buf->data + buf->length, (size_t)n + 1, format, args);
    va_end(args);
    buf->length += (size_t)n;
}

void mslx__buf_free(mslx_buf *buf) {
    free(buf->data);
    *buf = (mslx_buf){0};
}

int mslx__fail(int status, char *err, size_t err_len, const char *format, ...) {
    if (err && err_len) {
        va_list args;
        va_start(args, format);
        vsnprintf(err, err_len, format, args);
        va_end(args);
    }
    return status;
}

char *mslx__strndup(const char *text, size_t length) {
    char *copy = malloc(length + 1);
    if (!copy) return NULL;
    memcpy(copy, text, length);
    copy[length] = 0;
    return copy;
}

/* ---- files ---- */

int mslx__write_file(const char *path, const void *data, size_t length) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return errno;
    const char *p = data;
    while (length) {
        ssize_t n = write(fd, p, length);
        if (n < 0) {
            if (errno == EINTR) continue;
            int e = errno;
            close(fd);
            return e;
        }
        p += n;
        length -= (size_t)n;
    }
    return close(fd) == 0 ? 0 : errno;
}

int mslx__read_file(const char *path, mslx_buf *out) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno;
    char chunk[65536];
    for (;;) {
        ssize_t n = read(fd, chunk, sizeof chunk);
        if (n < 0) {
            if (errno == EINTR) continue;
            int e = errno;
            close(fd);
            return e;
        }
        if (n == 0) break;
        mslx__buf_append(out, chunk, (size_t)n);
    }
    close(fd);
    if (!out->data) mslx__buf_append(out, "", 0);
    return out->failed ? ENOMEM : 0;
}

int mslx__make_dirs(const char *path) {
    char copy[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof copy) return ENAMETOOLONG;
    memcpy(copy, path, n + 1);
    for (char *p = copy + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(copy, 0755) != 0 && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(copy, 0755) != 0 && errno != EEXIST) return errno;
    struct stat st;
    if (stat(copy, &st) != 0) return errno;
    return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

int mslx__make_work_dir(char *path, size_t path_len, char *err, size_t err_len) {
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    if ((size_t)snprintf(path, path_len, "%s/mslx-XXXXXX", tmp) >= path_len)
        return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "temporary directory path too long: %s", tmp);
    if (!mkdtemp(path))
        return mslx__fail(MSLX_ERR_UNAVAILABLE, err, err_len, "cannot create a temporary directory in %s: %s", tmp,
                          strerror(errno));
    return MSLX_OK;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st, (void)ftw;
    if (type == FTW_DP)
        rmdir(path);
    else
        unlink(path);
    return 0;
}

void mslx__remove_tree(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* ---- processes ---- */

int mslx__run(const char *const *argv, const char *stdout_path, const char *scratch_dir, mslx_buf *stderr_text,
              int *exit_status) {
    char stderr_path[PATH_MAX];
    snprintf(stderr_path, sizeof stderr_path, "%s/stderr.txt", scratch_dir);
    posix_spawn_file_actions_t actions;
    if (posix_spawn_file_actions_init(&actions) != 0) return ENOMEM;
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 1, stdout_path ? stdout_path : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &actions, NULL, (char *const *)argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return rc;
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return errno;
    }
    *exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (stderr_text) mslx__read_file(stderr_path, stderr_text);
    unlink(stderr_path);
    return 0;
}

/* ---- SHA-256 ---- */

static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_block(mslx_sha256 *ctx, const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = ctx->state[0], b = ctx->state[1], c = ctx->state[2], d = ctx->state[3];
    uint32_t e = ctx->state[4], f = ctx->state[5], g = ctx->state[6], h = ctx->state[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    ctx->state[0] += a, ctx->state[1] += b, ctx->state[2] += c, ctx->state[3] += d;
    ctx->state[4] += e, ctx->state[5] += f, ctx->state[6] += g, ctx->state[7] += h;
}

void mslx__sha256_init(mslx_sha256 *ctx) {
    static const uint32_t initial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(ctx->state, initial, sizeof initial);
    ctx->length = 0;
    ctx->used = 0;
}

void mslx__sha256_update(mslx_sha256 *ctx, const void *data, size_t length) {
    const uint8_t *p = data;
    ctx->length += length;
    while (length) {
        size_t take = 64 - ctx->used < length ? 64 - ctx->used : length;
        memcpy(ctx->block + ctx->used, p, take);
        ctx->used += take, p += take, length -= take;
        if (ctx->used == 64) {
            sha256_block(ctx, ctx->block);
            ctx->used = 0;
        }
    }
}

void mslx__sha256_field(mslx_sha256 *ctx, const void *data, size_t length) {
    uint8_t prefix[8];
    for (int i = 0; i < 8; i++) prefix[i] = (uint8_t)((uint64_t)length >> (8 * i));
    mslx__sha256_update(ctx, prefix, sizeof prefix);
    mslx__sha256_update(ctx, data, length);
}

void mslx__sha256_final(mslx_sha256 *ctx, uint8_t digest[32]) {
    uint64_t bits = ctx->length * 8;
    uint8_t pad = 0x80;
    mslx__sha256_update(ctx, &pad, 1);
    pad = 0;
    while (ctx->used != 56) mslx__sha256_update(ctx, &pad, 1);
    uint8_t tail[8];
    for (int i = 0; i < 8; i++) tail[i] = (uint8_t)(bits >> (56 - 8 * i));
    mslx__sha256_update(ctx, tail, 8);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (uint8_t)(ctx->state[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(ctx->state[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(ctx->state[i] >> 8);
        digest[4 * i + 3] = (uint8_t)ctx->state[i];
    }
}

void mslx__hex(const uint8_t *bytes, size_t count, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < count; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * count] = 0;
}

/* ---- resolved once per process ---- */

typedef struct once_result {
    int status;
    char message[2 * PATH_MAX + 512];
    char value[PATH_MAX];
} once_result;

static once_result clang_result;
static char clang_version[256];
static pthread_once_t clang_once = PTHREAD_ONCE_INIT;

/* Finds `name` in the directories of $PATH (names with a '/' are taken as given). */
static int find_program(const char *name, char *out, size_t out_len) {
    if (strchr(name, '/')) {
        if (access(name, X_OK) != 0) return 0;
        if (!realpath(name, out)) snprintf(out, out_len, "%s", name);
        return 1;
    }
    const char *path = getenv("PATH");
    if (!path) return 0;
    for (const char *p = path; *p;) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0 && (size_t)snprintf(out, out_len, "%.*s/%s", (int)n, p, name) < out_len) {
            struct stat st;
            if (stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0) return 1;
        }
        p += n;
        if (*p == ':') p++;
    }
    return 0;
}

static void resolve_clang(void) {
    once_result *r = &clang_result;
    const char *requested = getenv("PYFA_MSL_CLANG");
    int from_env = requested && *requested;
    const char *name = from_env ? requested : "clang";
    if (!find_program(name, r->value, sizeof r->value)) {
        const char *path = getenv("PATH");
        r->status = MSLX_ERR_UNAVAILABLE;
        if (from_env && strchr(requested, '/'))
            snprintf(r->message, sizeof r->message, "no clang: PYFA_MSL_CLANG=%s is not an executable file", requested);
        else if (from_env)
            snprintf(r->message, sizeof r->message, "no clang: PYFA_MSL_CLANG=%s is not an executable on PATH=%s",
                     requested, path ? path : "(unset)");
        else
            snprintf(r->message, sizeof r->message,
                     "no clang: PYFA_MSL_CLANG is unset and no executable 'clang' is on PATH=%s "
                     "(the Swift toolchain's clang compiles Metal kernels on Linux)",
                     path ? path : "(unset)");
        return;
    }
    char dir[PATH_MAX];
    if (mslx__make_work_dir(dir, sizeof dir, r->message, sizeof r->message) != MSLX_OK) {
        r->status = MSLX_ERR_UNAVAILABLE;
        return;
    }
    char out_path[PATH_MAX + 16];
    snprintf(out_path, sizeof out_path, "%s/version.txt", dir);
    const char *argv[] = {r->value, "--version", NULL};
    int exit_status = 1;
    mslx_buf out = {0};
    int rc = mslx__run(argv, out_path, dir, NULL, &exit_status);
    if (rc == 0 && exit_status == 0) mslx__read_file(out_path, &out);
    mslx__remove_tree(dir);
    if (rc != 0 || exit_status != 0 || !out.data || strstr(out.data, "clang") == NULL) {
        r->status = MSLX_ERR_UNAVAILABLE;
        snprintf(r->message, sizeof r->message, "clang at %s does not run (%s --version: %s)", r->value, r->value,
                 rc ? strerror(rc) : "failed");
        mslx__buf_free(&out);
        return;
    }
    size_t line = strcspn(out.data, "\r\n");
    snprintf(clang_version, sizeof clang_version, "%.*s", (int)line, out.data);
    mslx__buf_free(&out);
    r->status = MSLX_OK;
}

int mslx__clang(const char **path, const char **version, char *err, size_t err_len) {
    pthread_once(&clang_once, resolve_clang);
    if (clang_result.status != MSLX_OK)
        return mslx__fail(clang_result.status, err, err_len, "%s", clang_result.message);
    if (path) *path = clang_result.value;
    if (version) *version = clang_version;
    return MSLX_OK;
}

static char compiler_description[2 * PATH_MAX + 512];

/* "clang version 21.0.0 (...)" -> "clang 21.0.0 (/path/to/clang)" */
static void describe_compiler(void) {
    pthread_once(&clang_once, resolve_clang);
    if (clang_result.status != MSLX_OK) {
        snprintf(compiler_description, sizeof compiler_description, "%s", clang_result.message);
        return;
    }
    const char *v = strstr(clang_version, "version ");
    v = v ? v + 8 : clang_version;
    size_t n = strcspn(v, " ");
    snprintf(compiler_description, sizeof compiler_description, "clang %.*s (%s)", (int)n, v, clang_result.value);
}

const char *mslx__compiler_description(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, describe_compiler);
    return compiler_description;
}

static once_result cache_result;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static char private_cache[PATH_MAX];

static void remove_private_cache(void) {
    if (private_cache[0]) mslx__remove_tree(private_cache);
}

/* A directory only this process uses, removed at exit (PYFA_CACHE_DIR=off). */
static int make_private_cache(once_result *r) {
    if (mslx__make_work_dir(r->value, sizeof r->value, r->message, sizeof r->message) != MSLX_OK) {
        r->status = MSLX_ERR_UNAVAILABLE;
        return 0;
    }
    snprintf(private_cache, sizeof private_cache, "%s", r->value);
    atexit(remove_private_cache);
    r->status = MSLX_OK;
    return 1;
}

/* Whether compiled modules at `path` may be loaded: it belongs to this user
 * and nobody else can write it (loading a shared object runs its code). */
int mslx__owned_privately(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && st.st_uid == geteuid() && !(st.st_mode & (S_IWGRP | S_IWOTH));
}

static void resolve_cache_dir(void) {
    once_result *r = &cache_result;
    const char *setting = getenv("PYFA_CACHE_DIR");
    if (setting && strcmp(setting, "off") == 0) {
        make_private_cache(r);
        return;
    }
    if (setting && *setting) {
        if ((size_t)snprintf(r->value, sizeof r->value, "%s/msl", setting) >= sizeof r->value) {
            r->status = MSLX_ERR_UNAVAILABLE;
            snprintf(r->message, sizeof r->message, "PYFA_CACHE_DIR is too long");
            return;
        }
        int e = mslx__make_dirs(r->value);
        r->status = e ? MSLX_ERR_UNAVAILABLE : MSLX_OK;
        if (e) snprintf(r->message, sizeof r->message, "cannot create the kernel cache %s: %s", r->value, strerror(e));
        else if (!mslx__owned_privately(r->value)) make_private_cache(r); /* shared with others: not trusted */
        return;
    }
    /* The default location is a convenience: without it, compile privately. */
    const char *home = getenv("HOME");
    if (home && *home && (size_t)snprintf(r->value, sizeof r->value, "%s/.cache/pyfa/msl", home) < sizeof r->value &&
        mslx__make_dirs(r->value) == 0 && mslx__owned_privately(r->value)) {
        r->status = MSLX_OK;
        return;
    }
    make_private_cache(r);
}

int mslx__cache_dir(const char **dir, char *err, size_t err_len) {
    pthread_once(&cache_once, resolve_cache_dir);
    if (cache_result.status != MSLX_OK)
        return mslx__fail(cache_result.status, err, err_len, "%s", cache_result.message);
    *dir = cache_result.value;
    return MSLX_OK;
}

static once_result include_result;
static pthread_once_t include_once = PTHREAD_ONCE_INIT;

/* cache/include-<hash>/ holds the embedded headers; made under a temporary
 * name and renamed, so a compile never sees a half-written header. */
static void resolve_include_dir(void) {
    once_result *r = &include_result;
    size_t count;
    const mslx_embedded_file *files = mslx__embedded_headers(&count);
    mslx_sha256 sha;
    mslx__sha256_init(&sha);
    for (size_t i = 0; i < count; i++) {
        mslx__sha256_field(&sha, files[i].name, strlen(files[i].name));
        mslx__sha256_field(&sha, files[i].text, files[i].length);
    }
    uint8_t digest[32];
    mslx__sha256_final(&sha, digest);
    char hex[65];
    mslx__hex(digest, 8, hex);
    const char *cache;
    if (mslx__cache_dir(&cache, r->message, sizeof r->message) != MSLX_OK) {
        r->status = MSLX_ERR_UNAVAILABLE;
        return;
    }
    snprintf(r->value, sizeof r->value, "%s/include-%s", cache, hex);
    char probe[PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s/%s", r->value, files[count - 1].name);
    if (access(probe, R_OK) == 0) {
        r->status = MSLX_OK;
        return;
    }
    char staging[PATH_MAX + 64];
    snprintf(staging, sizeof staging, "%s.tmp-%ld-XXXXXX", r->value, (long)getpid());
    if (!mkdtemp(staging)) {
        r->status = MSLX_ERR_UNAVAILABLE;
        snprintf(r->message, sizeof r->message, "cannot write headers into %s: %s", cache, strerror(errno));
        return;
    }
    for (size_t i = 0; i < count; i++) {
        char path[PATH_MAX + 128];
        snprintf(path, sizeof path, "%s/%s", staging, files[i].name);
        int e = mslx__write_file(path, files[i].text, files[i].length);
        if (e) {
            mslx__remove_tree(staging);
            r->status = MSLX_ERR_UNAVAILABLE;
            snprintf(r->message, sizeof r->message, "cannot write %s: %s", path, strerror(e));
            return;
        }
    }
    chmod(staging, 0755);
    if (rename(staging, r->value) != 0) {
        /* Another process got there first; its copy has the same contents. */
        mslx__remove_tree(staging);
        if (access(probe, R_OK) != 0) {
            r->status = MSLX_ERR_UNAVAILABLE;
            snprintf(r->message, sizeof r->message, "cannot create %s: %s", r->value, strerror(errno));
            return;
        }
    }
    r->status = MSLX_OK;
}

int mslx__include_dir(const char **dir, char *err, size_t err_len) {
    pthread_once(&include_once, resolve_include_dir);
    if (include_result.status != MSLX_OK)
        return mslx__fail(include_result.status, err, err_len, "%s", include_result.message);
    *dir = include_result.value;
    return MSLX_OK;
}
