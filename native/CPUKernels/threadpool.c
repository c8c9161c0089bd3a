/* A persistent pthread pool that runs the threadgroups of one job at a time:
 * one dispatch (pyfa_cpu_run) or several interleaved (pyfa_cpu_run_many, the
 * barrier-stress mode). The calling thread works too; threadgroups are handed
 * out through an atomic counter so uneven groups balance themselves.
 *
 * Workers join a job when they wake, if it is still open; the caller closes it
 * once every threadgroup has been taken and waits only for the workers that
 * joined. A small job (a decode step's few workgroups) is then done by the
 * caller alone when the workers wake late, instead of waiting for the
 * scheduler to run each of them: on a 2-core machine that wait made a
 * one-layer CPU cache step 3x slower with two threads than with one. */
#include "pyfa_cpu.h"
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_THREADS 256

/* Item i of a job is threadgroup i / count of dispatch i % count (items past
 * a dispatch's grid are skipped), so with count > 1 the dispatches' groups
 * alternate in the order they are handed out. */
typedef struct job {
    const pyfa_cpu_dispatch *const *d;
    const pyfa_cpu_kernel *kernels;
    const uint64_t *totals; /* threadgroups of each dispatch */
    uint32_t count;
    uint64_t items;         /* count * the largest total */
    uint64_t scratch;       /* the largest threadgroup_memory */
    _Atomic uint64_t next;
    uint32_t joined; /* workers running the job's threadgroups (under state_lock) */
} job;

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static uint32_t pool_threads = 1;
static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER;
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;
static job *current_job; /* the open job, NULL once closed (under state_lock) */
static uint64_t job_generation;
static int pool_failed;

static _Thread_local void *scratch_mem;
static _Thread_local uint64_t scratch_bytes;

static void *scratch_for(uint64_t bytes) {
    if (bytes == 0) return NULL;
    if (bytes > scratch_bytes) {
        free(scratch_mem);
        scratch_mem = NULL;
        scratch_bytes = 0;
        uint64_t rounded = (bytes + 63) & ~(uint64_t)63;
        if (posix_memalign(&scratch_mem, 64, rounded) != 0) return NULL;
        scratch_bytes = rounded;
    }
    return scratch_mem;
}

static void run_share(job *j) {
    void *scratch = scratch_for(j->scratch);
    for (;;) {
        uint64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->items) break;
        const uint32_t k = (uint32_t)(i % j->count);
        const uint64_t g = i / j->count;
        if (g >= j->totals[k]) continue;
        const pyfa_cpu_dispatch *d = j->d[k];
        const uint64_t gx = d->grid[0], gy = d->grid[1];
        uint32_t x = (uint32_t)(g % gx), y = (uint32_t)((g / gx) % gy), z = (uint32_t)(g / (gx * gy));
        j->kernels[k](d, x, y, z, scratch);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&state_lock);
    for (;;) {
        while (job_generation == seen) pthread_cond_wait(&work_ready, &state_lock);
        seen = job_generation;
        job *j = current_job;
        /* Closed before this worker woke, or every threadgroup already taken: nothing to do,
         * and joining would only make the caller wait for this worker. */
        if (j == NULL || atomic_load_explicit(&j->next, memory_order_relaxed) >= j->items) continue;
        j->joined++;
        pthread_mutex_unlock(&state_lock);
        /* A worker that cannot get scratch memory leaves the groups to others. */
        if (!(j->scratch && !scratch_for(j->scratch))) run_share(j);
        pthread_mutex_lock(&state_lock);
        if (--j->joined == 0 && current_job != j) pthread_cond_broadcast(&work_done);
    }
    return NULL;
}

static void pool_start(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    const char *env = getenv("PYFA_NUM_THREADS");
    if (env && atoi(env) > 0) n = atoi(env);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pool_threads = (uint32_t)n;
    for (uint32_t i = 1; i < pool_threads; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker_main, NULL) != 0) {
            pool_threads = i; /* run with the threads we got */
            pool_failed = 1;
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
    }
}

uint32_t pyfa_cpu_thread_count(void) {
    pthread_once(&pool_once, pool_start);
    return pool_threads;
}

void pyfa_cpu_fail(const pyfa_cpu_dispatch *d, const char *format, ...) {
    /* The caller owns a mutable dispatch (const only to kernels); the pool's
     * join publishes the message before the caller reads it. */
    pyfa_cpu_dispatch *m = (pyfa_cpu_dispatch *)d;
    int32_t expected = 0;
    if (!__atomic_compare_exchange_n(&m->failed, &expected, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return;
    va_list ap;
    va_start(ap, format);
    vsnprintf(m->failure, sizeof m->failure, format, ap);
    va_end(ap);
    __atomic_store_n(&m->failed, 1, __ATOMIC_RELEASE);
}

static int run_job(job *j) {
    pthread_once(&pool_once, pool_start);
    if (j->items == 0) return 0;
    if (j->scratch && !scratch_for(j->scratch)) return -1;
    atomic_init(&j->next, 0);
    uint32_t helpers = pool_threads - 1;
    if (j->items == 1 || helpers == 0) {
        run_share(j);
        return 0;
    }
    pthread_mutex_lock(&submit_lock);
    j->joined = 0;
    pthread_mutex_lock(&state_lock);
    current_job = j;
    job_generation++;
    pthread_cond_broadcast(&work_ready);
    pthread_mutex_unlock(&state_lock);
    run_share(j); /* returns once every threadgroup has been taken */
    pthread_mutex_lock(&state_lock);
    current_job = NULL; /* closed: no worker joins after this */
    while (j->joined != 0) pthread_cond_wait(&work_done, &state_lock);
    pthread_mutex_unlock(&state_lock);
    pthread_mutex_unlock(&submit_lock);
    return 0;
}

int pyfa_cpu_run(const pyfa_cpu_dispatch *d, pyfa_cpu_kernel kernel) {
    const uint64_t total = (uint64_t)d->grid[0] * d->grid[1] * d->grid[2];
    job j = {.d = &d, .kernels = &kernel, .totals = &total, .count = 1, .items = total,
             .scratch = d->threadgroup_memory};
    return run_job(&j);
}

int pyfa_cpu_run_many(const pyfa_cpu_dispatch *const *d, const pyfa_cpu_kernel *kernels, uint32_t count) {
    if (count == 0) return 0;
    uint64_t *totals = malloc(sizeof(uint64_t) * count);
    if (!totals) return -1;
    job j = {.d = d, .kernels = kernels, .totals = totals, .count = count};
    uint64_t largest = 0;
    for (uint32_t k = 0; k < count; k++) {
        totals[k] = (uint64_t)d[k]->grid[0] * d[k]->grid[1] * d[k]->grid[2];
        if (totals[k] > largest) largest = totals[k];
        if (d[k]->threadgroup_memory > j.scratch) j.scratch = d[k]->threadgroup_memory;
    }
    j.items = largest * count;
    const int r = run_job(&j);
    free(totals);
    return r;
}
