/*
 * The executor's runtime: options, dispatch validation, the worker pool that
 * runs threadgroups, threadgroup memory, fault handling, buffer memory and
 * the describe line. Lane scheduling lives in fiber.c.
 *
 * Workers: a process-wide pool of OS threads, grown on demand to the largest
 * PYFA_MSL_THREADS a dispatch has asked for. A dispatch becomes a job on the
 * pool's list; up to `threads` workers join it and take threadgroups from an
 * atomic counter until none are left or one failed; the dispatching thread
 * waits. Several dispatches may be in flight at once.
 *
 * Faults: SIGSEGV/SIGBUS handlers (installed once, on an alternate stack per
 * worker) turn a fault inside a kernel on a worker thread into a failed
 * dispatch via siglongjmp; any other fault goes to the handler that was
 * installed before ours (or the default action).
 */
#include "runtime.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_WORKERS 256
#define ALT_STACK_SIZE (64u * 1024u)

static size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }
static uint64_t round16(uint64_t n) { return (n + 15) & ~(uint64_t)15; }
static size_t round_pages(size_t n) { return (n + page_size() - 1) & ~(page_size() - 1); }

/* ---- Options ---------------------------------------------------------------- */
static pthread_once_t options_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t options_lock = PTHREAD_MUTEX_INITIALIZER;
static mslx_options options;

static int default_threads(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores < 1 ? 1 : cores > MAX_WORKERS ? MAX_WORKERS : (int)cores;
}

static void sanitize(mslx_options *o) {
    o->check = o->check != 0;
    if (o->lane_order < MSLX_LANES_FORWARD || o->lane_order > MSLX_LANES_RANDOM) o->lane_order = MSLX_LANES_FORWARD;
    if (o->perturb_ulps < 0) o->perturb_ulps = 0;
    if (o->threads <= 0) o->threads = default_threads();
    if (o->threads > MAX_WORKERS) o->threads = MAX_WORKERS;
}

static void read_environment(void) {
    const char *v;
    options.check = (v = getenv("PYFA_MSL_CHECK")) && *v && strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 &&
                    strcasecmp(v, "no") != 0 && strcasecmp(v, "off") != 0;
    options.lane_order = MSLX_LANES_FORWARD;
    if ((v = getenv("PYFA_MSL_LANE_ORDER"))) {
        if (strcasecmp(v, "reverse") == 0) options.lane_order = MSLX_LANES_REVERSE;
        else if (strcasecmp(v, "random") == 0) options.lane_order = MSLX_LANES_RANDOM;
    }
    options.seed = (v = getenv("PYFA_MSL_SEED")) ? strtoull(v, NULL, 0) : 0;
    options.perturb_ulps = (v = getenv("PYFA_MSL_PERTURB_ULPS")) ? atoi(v) : 0;
    options.threads = (v = getenv("PYFA_MSL_THREADS")) ? atoi(v) : 0;
    sanitize(&options);
}

void mslx_get_options(mslx_options *out) {
    pthread_once(&options_once, read_environment);
    pthread_mutex_lock(&options_lock);
    *out = options;
    pthread_mutex_unlock(&options_lock);
}

void mslx_set_options(const mslx_options *in) {
    pthread_once(&options_once, read_environment);
    mslx_options o = *in;
    sanitize(&o);
    pthread_mutex_lock(&options_lock);
    options = o;
    pthread_mutex_unlock(&options_lock);
}

/* ---- Jobs and workers ------------------------------------------------------- */
typedef struct job {
    const mslx_dispatch_desc *desc;
    mslx_entry_fn entry;
    const char *name;
    mslx_options opt;
    uint64_t static_size;
    uint64_t total;               /* threadgroups in the grid */
    _Atomic uint64_t next;        /* next threadgroup to take */
    atomic_int failed;
    int participants, max_participants, finished; /* under pool.lock */
    char message[1024];           /* first failure, under pool.lock */
    struct job *link;
} job;

typedef struct worker {
    mslx_group group;
    char *tg_arena;       /* guard page, then 32 slots of [usable][guard page] */
    size_t tg_usable;     /* usable bytes per slot (>= 32 KiB, whole pages) */
    void *tg_blocks[MSLX_MAX_BINDINGS + 1]; /* slot 0: static area; slot i+1: [[threadgroup(i)]] */
    uint64_t tg_lengths[MSLX_MAX_BINDINGS + 1];
    stack_t alt_stack;
    sigjmp_buf fault_jump;
    volatile sig_atomic_t in_kernel;
    void *volatile fault_addr;
    volatile int fault_signal;
} worker;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    job *jobs;
    int count;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0};

/* The workers by thread, for the fault handler: it must not use thread-local
 * storage, since a thread's first access to a dlopen'ed library's TLS may
 * allocate, which a signal handler must not do. Append-only, under the pool's
 * lock; read without it. */
static struct {
    _Atomic(worker *) by_index[MAX_WORKERS];
    pthread_t thread[MAX_WORKERS];
    atomic_int count;
} worker_threads;

static void register_worker_thread(worker *w) {
    int i = atomic_load(&worker_threads.count);
    if (i >= MAX_WORKERS) return;
    worker_threads.thread[i] = pthread_self();
    atomic_store(&worker_threads.by_index[i], w);
    atomic_store(&worker_threads.count, i + 1);
}

static worker *worker_of_this_thread(void) {
    pthread_t self = pthread_self();
    int n = atomic_load(&worker_threads.count);
    for (int i = 0; i < n; i++) {
        worker *w = atomic_load(&worker_threads.by_index[i]);
        if (w && pthread_equal(worker_threads.thread[i], self)) return w;
    }
    return NULL;
}

static char *tg_slot_end(const worker *w, uint32_t slot) {
    size_t page = page_size();
    return w->tg_arena + page + (size_t)slot * (w->tg_usable + page) + w->tg_usable;
}

/* The dispatch's threadgroup blocks end at a slot's guard page, so an access
 * past a block's (16-byte rounded) length faults. */
static void worker_join(worker *w, const job *j) {
    const mslx_dispatch_desc *d = j->desc;
    mslx_group *g = &w->group;
    g->entry = j->entry;
    g->kernel_name = j->name;
    g->check = j->opt.check;
    g->lane_order = j->opt.lane_order;
    g->perturb_ulps = j->opt.perturb_ulps;
    g->seed = j->opt.seed;
    g->static_size = j->static_size;
    for (uint32_t s = 0; s <= MSLX_MAX_BINDINGS; s++) {
        uint64_t len = s == 0 ? j->static_size : d->threadgroup_memory_length[s - 1];
        w->tg_lengths[s] = len;
        w->tg_blocks[s] = tg_slot_end(w, s) - round16(len);
    }
    g->static_area = w->tg_blocks[0];

    const uint32_t *tpt = d->threads_per_threadgroup;
    uint32_t lanes = tpt[0] * tpt[1] * tpt[2];
    g->lane_count = lanes;
    mslx_lane_ctx proto;
    memset(&proto, 0, sizeof proto);
    for (uint32_t i = 0; i < MSLX_MAX_BINDINGS; i++) {
        const mslx_binding *b = &d->buffers[i];
        proto.buffers[i] = b->kind == MSLX_BIND_NONE ? NULL : (void *)b->data;
        proto.buffer_lengths[i] = b->kind == MSLX_BIND_NONE ? 0 : (unsigned long)b->length;
        proto.threadgroup[i] = d->threadgroup_memory_length[i] ? w->tg_blocks[i + 1] : NULL;
    }
    for (int k = 0; k < 3; k++) {
        proto.threadgroups_per_grid[k] = d->threadgroups[k];
        proto.threads_per_threadgroup[k] = tpt[k];
        proto.threads_per_grid[k] = d->threadgroups[k] * tpt[k];
    }
    proto.simdgroups_per_threadgroup = (lanes + MSLX_SIMD_WIDTH - 1) / MSLX_SIMD_WIDTH;
    proto.threads_per_simdgroup = MSLX_SIMD_WIDTH;
    for (uint32_t i = 0; i < lanes; i++) {
        mslx_lane_ctx *c = &g->ctxs[i];
        *c = proto;
        c->thread_position_in_threadgroup[0] = i % tpt[0];
        c->thread_position_in_threadgroup[1] = (i / tpt[0]) % tpt[1];
        c->thread_position_in_threadgroup[2] = i / (tpt[0] * tpt[1]);
        c->thread_index_in_threadgroup = i;
        c->thread_index_in_simdgroup = i % MSLX_SIMD_WIDTH;
        c->simdgroup_index_in_threadgroup = i / MSLX_SIMD_WIDTH;
    }
}

static const char *describe_fault(const worker *w, const job *j, const void *addr, char *buf, size_t len) {
    uintptr_t a = (uintptr_t)addr;
    size_t page = page_size();
    int lane = mslx__group_stack_guard_lane(&w->group, addr);
    if (lane >= 0) {
        snprintf(buf, len, "stack overflow (lane %d used more than its %u KiB fiber stack)", lane,
                 MSLX_FIBER_STACK_SIZE / 1024);
        return buf;
    }
    uintptr_t arena = (uintptr_t)w->tg_arena;
    if (a >= arena && a < (uintptr_t)tg_slot_end(w, MSLX_MAX_BINDINGS) + page) {
        for (uint32_t s = 0; s <= MSLX_MAX_BINDINGS; s++) {
            uintptr_t end = (uintptr_t)tg_slot_end(w, s);
            if (a < end - w->tg_usable || a >= end + page) continue;
            if (s == 0)
                snprintf(buf, len, "out of bounds: byte %" PRIuPTR " of the kernel's threadgroup variables (%" PRIu64 " bytes)",
                         a - (uintptr_t)w->tg_blocks[0], w->tg_lengths[0]);
            else
                snprintf(buf, len, "out of bounds: byte %" PRIdPTR " of [[threadgroup(%u)]] (%" PRIu64 " bytes)",
                         (intptr_t)(a - (uintptr_t)w->tg_blocks[s]), s - 1, w->tg_lengths[s]);
            return buf;
        }
    }
    /* Past a buffer's end first: buffers from mslx_alloc lie back to back, so
     * the guard page after one is also just before the next. */
    for (int before = 0; before < 2; before++) {
        for (uint32_t i = 0; i < MSLX_MAX_BINDINGS; i++) {
            const mslx_binding *b = &j->desc->buffers[i];
            if (b->kind == MSLX_BIND_NONE || !b->data) continue;
            uintptr_t start = (uintptr_t)b->data, end = start + b->length;
            int hit = before ? a < start && a + page >= start : a >= end && a < end + page + 16;
            if (!hit) continue;
            snprintf(buf, len, "out of bounds: byte %" PRIdPTR " of [[buffer(%u)]]%s%s%s (%" PRIu64 " bytes)",
                     (intptr_t)(a - start), i, b->label ? " \"" : "", b->label ? b->label : "",
                     b->label ? "\"" : "", b->length);
            return buf;
        }
    }
    snprintf(buf, len, "invalid memory access at %p", addr);
    return buf;
}

static void job_fail(job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void job_fail(job *j, const char *fmt, ...) {
    pthread_mutex_lock(&pool.lock);
    if (!atomic_load(&j->failed)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->message, sizeof j->message, fmt, ap);
        va_end(ap);
        atomic_store(&j->failed, 1);
    }
    pthread_mutex_unlock(&pool.lock);
}

static void run_threadgroup(worker *w, job *j, uint64_t linear) {
    const mslx_dispatch_desc *d = j->desc;
    mslx_group *g = &w->group;
    uint32_t pos[3] = {(uint32_t)(linear % d->threadgroups[0]),
                       (uint32_t)(linear / d->threadgroups[0] % d->threadgroups[1]),
                       (uint32_t)(linear / ((uint64_t)d->threadgroups[0] * d->threadgroups[1]))};
    const uint32_t *tpt = d->threads_per_threadgroup;
    for (uint32_t i = 0; i < g->lane_count; i++) {
        mslx_lane_ctx *c = &g->ctxs[i];
        for (int k = 0; k < 3; k++) {
            c->threadgroup_position_in_grid[k] = pos[k];
            c->thread_position_in_grid[k] = pos[k] * tpt[k] + c->thread_position_in_threadgroup[k];
        }
    }
    if (j->opt.check) {
        for (uint32_t s = 0; s <= MSLX_MAX_BINDINGS; s++)
            if (w->tg_lengths[s]) memset(w->tg_blocks[s], 0xFF, round16(w->tg_lengths[s]));
    }
    int rc;
    if (sigsetjmp(w->fault_jump, 0) == 0) {
        w->in_kernel = 1;
        rc = mslx__group_run(g, linear);
        w->in_kernel = 0;
    } else {
        char what[512];
        describe_fault(w, j, w->fault_addr, what, sizeof what);
        snprintf(g->message, sizeof g->message, "%s: %s", w->fault_signal == SIGBUS ? "bus error" : "segmentation fault",
                 what);
        g->fail_lane = g->current ? g->current->index : 0;
        rc = -1;
    }
    if (rc != 0)
        job_fail(j, "kernel %s: %s (threadgroup (%u,%u,%u), lane %u)", j->name, g->message, pos[0], pos[1], pos[2],
                 g->fail_lane);
}

static job *find_work(void) {
    for (job *j = pool.jobs; j; j = j->link)
        if (!atomic_load(&j->failed) && atomic_load(&j->next) < j->total && j->participants < j->max_participants)
            return j;
    return NULL;
}

static void *worker_main(void *arg) {
    worker *w = arg;
    mslx__current_group = &w->group;
    sigaltstack(&w->alt_stack, NULL);
    pthread_mutex_lock(&pool.lock);
    register_worker_thread(w);
    for (;;) {
        job *j = find_work();
        if (!j) {
            pthread_cond_wait(&pool.work, &pool.lock);
            continue;
        }
        j->participants++;
        pthread_mutex_unlock(&pool.lock);
        worker_join(w, j);
        while (!atomic_load_explicit(&j->failed, memory_order_relaxed)) {
            uint64_t i = atomic_fetch_add(&j->next, 1);
            if (i >= j->total) break;
            run_threadgroup(w, j, i);
        }
        pthread_mutex_lock(&pool.lock);
        if (--j->participants == 0 && (atomic_load(&j->failed) || atomic_load(&j->next) >= j->total)) {
            j->finished = 1;
            pthread_cond_broadcast(&pool.done);
        }
    }
    return NULL;
}

/* ---- Fault handling ---------------------------------------------------------- */
static struct sigaction previous_segv, previous_bus;

static void fault_handler(int sig, siginfo_t *info, void *context) {
    worker *w = worker_of_this_thread();
    if (w && w->in_kernel) {
        w->in_kernel = 0;
        w->fault_addr = info->si_addr;
        w->fault_signal = sig;
        siglongjmp(w->fault_jump, 1);
    }
    const struct sigaction *prev = sig == SIGSEGV ? &previous_segv : &previous_bus;
    if (prev->sa_flags & SA_SIGINFO) {
        prev->sa_sigaction(sig, info, context);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
    } else {
        /* Default action: restore it; a fault re-executes and terminates. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
        if (info->si_code <= 0) raise(sig);
    }
}

static void install_fault_handlers(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = fault_handler;
    /* SA_NODEFER: leaving by siglongjmp (without saving the mask at sigsetjmp,
     * which would cost a syscall per threadgroup) must not leave the signal blocked. */
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
}

/* ---- Pool ---------------------------------------------------------------------- */
static worker *worker_create(void) {
    worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    if (mslx__group_init(&w->group) != 0) goto fail;
    size_t page = page_size();
    w->tg_usable = round_pages(MSLX_MAX_THREADGROUP_MEMORY);
    size_t arena = page + (size_t)(MSLX_MAX_BINDINGS + 1) * (w->tg_usable + page);
    void *mem = mmap(NULL, arena, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) goto fail;
    w->tg_arena = mem;
    for (uint32_t s = 0; s <= MSLX_MAX_BINDINGS; s++)
        if (mprotect(tg_slot_end(w, s) - w->tg_usable, w->tg_usable, PROT_READ | PROT_WRITE) != 0) goto fail;
    void *alt = mmap(NULL, ALT_STACK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (alt == MAP_FAILED) goto fail;
    w->alt_stack.ss_sp = alt;
    w->alt_stack.ss_size = ALT_STACK_SIZE;
    w->alt_stack.ss_flags = 0;
    return w;
fail:
    /* Worker memory is never returned: a failure here leaves the pool as it was. */
    return NULL;
}

/* A forked child has none of the parent's workers (only the forking thread
 * survives fork): it starts with an empty pool and fresh locks. */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.jobs = NULL;
    pool.count = 0;
    atomic_store(&worker_threads.count, 0);
}

static void pool_setup(void) {
    install_fault_handlers();
    pthread_atfork(NULL, NULL, pool_after_fork_child);
}

/* Grows the pool to `count` workers (under pool.lock). Returns the count reached. */
static int pool_grow(int count) {
    static pthread_once_t setup_once = PTHREAD_ONCE_INIT;
    pthread_once(&setup_once, pool_setup);
    while (pool.count < count) {
        worker *w = worker_create();
        if (!w) break;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t tid;
        int rc = pthread_create(&tid, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.count++;
    }
    return pool.count;
}

/* ---- Dispatch ---------------------------------------------------------------------- */
static int set_error(char *err, size_t err_len, int status, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int set_error(char *err, size_t err_len, int status, const char *fmt, ...) {
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return status;
}

static int validate(const mslx_dispatch_desc *d, const char *name, char *err, size_t err_len) {
    const uint32_t *t = d->threads_per_threadgroup, *g = d->threadgroups;
    uint64_t lanes = (uint64_t)t[0] * t[1] * t[2];
    if (lanes == 0 || lanes > MSLX_MAX_THREADS_PER_THREADGROUP)
        return set_error(err, err_len, MSLX_ERR_INVALID,
                         "kernel %s: threads per threadgroup (%u,%u,%u) must total 1..%u", name, t[0], t[1], t[2],
                         MSLX_MAX_THREADS_PER_THREADGROUP);
    if (g[0] == 0 || g[1] == 0 || g[2] == 0)
        return set_error(err, err_len, MSLX_ERR_INVALID, "kernel %s: empty grid of threadgroups (%u,%u,%u)", name,
                         g[0], g[1], g[2]);
    for (int k = 0; k < 3; k++)
        if ((uint64_t)g[k] * t[k] > UINT32_MAX)
            return set_error(err, err_len, MSLX_ERR_INVALID, "kernel %s: grid dimension %d exceeds 2^32 threads", name, k);
    uint32_t bmask = mslx__function_buffer_mask(d->function), tmask = mslx__function_threadgroup_mask(d->function);
    for (uint32_t i = 0; i < MSLX_MAX_BINDINGS; i++) {
        const mslx_binding *b = &d->buffers[i];
        if ((bmask >> i & 1) && (b->kind == MSLX_BIND_NONE || (b->kind == MSLX_BIND_BUFFER && !b->data)))
            return set_error(err, err_len, MSLX_ERR_INVALID, "kernel %s: [[buffer(%u)]] is not bound", name, i);
        if ((tmask >> i & 1) && d->threadgroup_memory_length[i] == 0)
            return set_error(err, err_len, MSLX_ERR_INVALID,
                             "kernel %s: [[threadgroup(%u)]] has no threadgroup memory length", name, i);
    }
    /* Each length is bounded before rounding or summing, so neither wraps. */
    uint64_t total = round16(mslx_function_static_threadgroup_memory(d->function));
    for (uint32_t i = 0; i < MSLX_MAX_BINDINGS; i++) {
        if (d->threadgroup_memory_length[i] > MSLX_MAX_THREADGROUP_MEMORY)
            return set_error(err, err_len, MSLX_ERR_INVALID, "kernel %s: [[threadgroup(%u)]] length %" PRIu64
                             " exceeds %u", name, i, d->threadgroup_memory_length[i], MSLX_MAX_THREADGROUP_MEMORY);
        total += round16(d->threadgroup_memory_length[i]);
    }
    if (total > MSLX_MAX_THREADGROUP_MEMORY)
        return set_error(err, err_len, MSLX_ERR_INVALID,
                         "kernel %s: %" PRIu64 " bytes of threadgroup memory (kernel's own and [[threadgroup(i)]] "
                         "blocks) exceed %u",
                         name, total, MSLX_MAX_THREADGROUP_MEMORY);
    return MSLX_OK;
}

int mslx_dispatch(const mslx_dispatch_desc *desc, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!desc || !desc->function) return set_error(err, err_len, MSLX_ERR_INVALID, "mslx_dispatch: no function");
    const char *name = mslx_function_name(desc->function);
    if (!name) name = "?";
    mslx_entry_fn entry = mslx__function_entry(desc->function);
    if (!entry) return set_error(err, err_len, MSLX_ERR_INVALID, "kernel %s: function has no entry point", name);
    int rc = validate(desc, name, err, err_len);
    if (rc != MSLX_OK) return rc;

    job *j = calloc(1, sizeof *j);
    if (!j) return set_error(err, err_len, MSLX_ERR_UNAVAILABLE, "kernel %s: out of memory", name);
    j->desc = desc;
    j->entry = entry;
    j->name = name;
    mslx_get_options(&j->opt);
    j->static_size = mslx_function_static_threadgroup_memory(desc->function);
    j->total = (uint64_t)desc->threadgroups[0] * desc->threadgroups[1] * desc->threadgroups[2];
    j->max_participants = j->total < (uint64_t)j->opt.threads ? (int)j->total : j->opt.threads;
    atomic_init(&j->next, 0);
    atomic_init(&j->failed, 0);

    pthread_mutex_lock(&pool.lock);
    if (pool_grow(j->opt.threads) == 0) {
        pthread_mutex_unlock(&pool.lock);
        free(j);
        return set_error(err, err_len, MSLX_ERR_UNAVAILABLE, "kernel %s: cannot start executor threads (%s)", name,
                         strerror(errno));
    }
    j->link = pool.jobs;
    pool.jobs = j;
    pthread_cond_broadcast(&pool.work);
    while (!j->finished) pthread_cond_wait(&pool.done, &pool.lock);
    for (job **p = &pool.jobs; *p; p = &(*p)->link)
        if (*p == j) {
            *p = j->link;
            break;
        }
    pthread_mutex_unlock(&pool.lock);

    rc = atomic_load(&j->failed) ? set_error(err, err_len, MSLX_ERR_EXECUTION, "%s", j->message) : MSLX_OK;
    free(j);
    return rc;
}

/* ---- Buffer memory ------------------------------------------------------------------- */
/* The mapping: whole pages holding round16(length), then one PROT_NONE page.
 * In checking mode the usable range ends at the guard page; otherwise it
 * starts at the mapping (page-aligned). Either way the mapping starts at the
 * page holding the returned pointer, so mslx_free needs only the length. */
static size_t mapping_length(size_t length, size_t *data_pages) {
    *data_pages = round_pages(round16(length ? length : 1));
    return *data_pages + page_size();
}

void *mslx_alloc(size_t length) {
    size_t data_pages, total = mapping_length(length, &data_pages);
    char *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    if (mprotect(base + data_pages, page_size(), PROT_NONE) != 0) {
        munmap(base, total);
        return NULL;
    }
    mslx_options o;
    mslx_get_options(&o);
    return o.check ? base + data_pages - round16(length ? length : 1) : base;
}

void mslx_free(void *pointer, size_t length) {
    if (!pointer) return;
    size_t data_pages, total = mapping_length(length, &data_pages);
    char *base = (char *)((uintptr_t)pointer & ~(uintptr_t)(page_size() - 1));
    munmap(base, total);
}

/* ---- Describe ------------------------------------------------------------------------- */
const char *mslx_describe(void) {
    static __thread char line[512];
    static const char *orders[] = {"forward", "reverse", "random"};
    mslx_options o;
    mslx_get_options(&o);
    const char *compiler = mslx__compiler_description();
    snprintf(line, sizeof line,
             "MSL CPU executor: %s; checking %s, lane order %s, seed %" PRIu64 ", perturb %d ulps, %d threads",
             compiler ? compiler : "no compiler", o.check ? "on" : "off", orders[o.lane_order], o.seed,
             o.perturb_ulps, o.threads);
    return line;
}
