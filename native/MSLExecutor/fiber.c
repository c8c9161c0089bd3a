/*
 * Lane fibers: the context switch, fiber stacks, the lane scheduler with its
 * meeting points, and the mslx_runtime table that kernel modules call.
 *
 * Scheduling contract (see runtime.h): the lanes of one threadgroup run one
 * at a time on the worker's thread. A lane runs until it reaches a meeting
 * point or returns. A SIMD-group is released when every lane of it that has
 * not returned waits at a SIMD-group meeting point; the threadgroup is
 * released when every lane that has not returned waits at the threadgroup
 * barrier. Released lanes become ready in the configured lane order. When no
 * lane is ready and some have not returned, the threadgroup is deadlocked
 * (lanes wait at different meeting points) and fails.
 */
#include "runtime.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

__thread mslx_group *mslx__current_group;

#define READY_RING 1024u /* power of two >= MSLX_MAX_THREADS_PER_THREADGROUP */

/* ---- Context switch ------------------------------------------------------
 * mslx__fiber_switch(save_sp, next_sp) pushes the callee-saved registers,
 * stores the stack pointer in *save_sp, switches to next_sp and pops that
 * context's registers; its `ret` resumes the other context. A new fiber's
 * stack (fiber_prepare) holds a frame whose return address is
 * mslx__fiber_boot, which calls fn(arg) from two saved registers.
 * Floating-point control state is not switched: kernels do not change it. */
void mslx__fiber_switch(void **save_sp, void *next_sp);
void mslx__fiber_boot(void);

#if defined(__x86_64__)
__asm__(".text\n"
        ".p2align 4\n"
        ".globl mslx__fiber_switch\n"
        ".hidden mslx__fiber_switch\n"
        ".type mslx__fiber_switch,@function\n"
        "mslx__fiber_switch:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size mslx__fiber_switch, .-mslx__fiber_switch\n"
        ".p2align 4\n"
        ".globl mslx__fiber_boot\n"
        ".hidden mslx__fiber_boot\n"
        ".type mslx__fiber_boot,@function\n"
        "mslx__fiber_boot:\n"
        "    movq %r12, %rdi\n"
        "    callq *%r13\n"
        "    ud2\n"
        ".size mslx__fiber_boot, .-mslx__fiber_boot\n");

/* Frame popped by the first switch: r15 r14 r13(fn) r12(arg) rbx rbp, then
 * the return address. After `ret` the stack is 16-byte aligned, so the call
 * in mslx__fiber_boot enters fn as the ABI requires. */
static void *fiber_prepare(char *top, void (*fn)(void *), void *arg) {
    uintptr_t aligned = ((uintptr_t)top & ~(uintptr_t)15) - 16;
    uintptr_t *frame = (uintptr_t *)(aligned - 7 * sizeof(uintptr_t));
    frame[0] = 0;
    frame[1] = 0;
    frame[2] = (uintptr_t)fn;
    frame[3] = (uintptr_t)arg;
    frame[4] = 0;
    frame[5] = 0;
    frame[6] = (uintptr_t)mslx__fiber_boot;
    return frame;
}
#elif defined(__aarch64__)
__asm__(".text\n"
        ".p2align 4\n"
        ".globl mslx__fiber_switch\n"
        ".hidden mslx__fiber_switch\n"
        ".type mslx__fiber_switch,%function\n"
        "mslx__fiber_switch:\n"
        "    sub sp, sp, #160\n"
        "    stp x19, x20, [sp, #0]\n"
        "    stp x21, x22, [sp, #16]\n"
        "    stp x23, x24, [sp, #32]\n"
        "    stp x25, x26, [sp, #48]\n"
        "    stp x27, x28, [sp, #64]\n"
        "    stp x29, x30, [sp, #80]\n"
        "    stp d8, d9, [sp, #96]\n"
        "    stp d10, d11, [sp, #112]\n"
        "    stp d12, d13, [sp, #128]\n"
        "    stp d14, d15, [sp, #144]\n"
        "    mov x2, sp\n"
        "    str x2, [x0]\n"
        "    mov sp, x1\n"
        "    ldp x19, x20, [sp, #0]\n"
        "    ldp x21, x22, [sp, #16]\n"
        "    ldp x23, x24, [sp, #32]\n"
        "    ldp x25, x26, [sp, #48]\n"
        "    ldp x27, x28, [sp, #64]\n"
        "    ldp x29, x30, [sp, #80]\n"
        "    ldp d8, d9, [sp, #96]\n"
        "    ldp d10, d11, [sp, #112]\n"
        "    ldp d12, d13, [sp, #128]\n"
        "    ldp d14, d15, [sp, #144]\n"
        "    add sp, sp, #160\n"
        "    ret\n"
        ".size mslx__fiber_switch, .-mslx__fiber_switch\n"
        ".p2align 4\n"
        ".globl mslx__fiber_boot\n"
        ".hidden mslx__fiber_boot\n"
        ".type mslx__fiber_boot,%function\n"
        "mslx__fiber_boot:\n"
        "    mov x0, x19\n"
        "    blr x20\n"
        "    brk #0\n"
        ".size mslx__fiber_boot, .-mslx__fiber_boot\n");

/* Frame popped by the first switch: x19(arg) x20(fn) x21..x28 x29 x30(boot)
 * d8..d15; 160 bytes, so the stack stays 16-byte aligned. */
static void *fiber_prepare(char *top, void (*fn)(void *), void *arg) {
    uintptr_t aligned = ((uintptr_t)top & ~(uintptr_t)15) - 16;
    uintptr_t *frame = (uintptr_t *)(aligned - 160);
    memset(frame, 0, 160);
    frame[0] = (uintptr_t)arg;
    frame[1] = (uintptr_t)fn;
    frame[11] = (uintptr_t)mslx__fiber_boot;
    return frame;
}
#else
#error "MSLExecutor fibers: no context switch for this architecture (x86-64 and aarch64 only)"
#endif

/* ---- Fiber stacks ----------------------------------------------------------
 * One reservation of MSLX_MAX_THREADS_PER_THREADGROUP slots, each a guard
 * page followed by the stack; slots become accessible when first needed and
 * are reused by every threadgroup the worker runs. */
static size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

int mslx__group_init(mslx_group *g) {
    memset(g, 0, sizeof *g);
    g->stack_slot = page_size() + MSLX_FIBER_STACK_SIZE;
    size_t total = g->stack_slot * MSLX_MAX_THREADS_PER_THREADGROUP;
    void *stacks = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) return -1;
    g->stacks = stacks;
    g->lanes = calloc(MSLX_MAX_THREADS_PER_THREADGROUP, sizeof *g->lanes);
    g->ctxs = calloc(MSLX_MAX_THREADS_PER_THREADGROUP, sizeof *g->ctxs);
    g->sgs = calloc(MSLX_MAX_SIMDGROUPS, sizeof *g->sgs);
    g->ready = calloc(READY_RING, sizeof *g->ready);
    g->scratch = calloc(MSLX_MAX_THREADS_PER_THREADGROUP, sizeof *g->scratch);
    if (!g->lanes || !g->ctxs || !g->sgs || !g->ready || !g->scratch) {
        errno = ENOMEM;
        return -1;
    }
    return 0;
}

static int ensure_stacks(mslx_group *g, uint32_t count) {
    size_t page = page_size();
    while (g->stacks_ready < count) {
        char *slot = g->stacks + (size_t)g->stacks_ready * g->stack_slot;
        if (mprotect(slot + page, MSLX_FIBER_STACK_SIZE, PROT_READ | PROT_WRITE) != 0) return -1;
        g->stacks_ready++;
    }
    return 0;
}

/* Lane i's stack top, moved down by a lane-dependent multiple of 64 bytes
 * within one page: stacks 128 KiB apart would otherwise map onto the same
 * cache sets. */
static char *stack_top(const mslx_group *g, uint32_t lane) {
    return g->stacks + (size_t)(lane + 1) * g->stack_slot - (size_t)((lane * 7u) % 64u) * 64u;
}

int mslx__group_stack_guard_lane(const mslx_group *g, const void *addr) {
    uintptr_t a = (uintptr_t)addr, base = (uintptr_t)g->stacks;
    if (!g->stacks || a < base || a >= base + g->stack_slot * MSLX_MAX_THREADS_PER_THREADGROUP) return -1;
    size_t offset = (size_t)(a - base);
    if (offset % g->stack_slot >= page_size()) return -1;
    return (int)(offset / g->stack_slot);
}

/* ---- Random streams (splitmix64) ------------------------------------------ */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t next_random(uint64_t *state) {
    *state += 0x9e3779b97f4a7c15ull;
    return mix64(*state);
}

/* ---- Diagnostics ---------------------------------------------------------- */
static int same_op(const char *a, const char *b) { return a == b || (a && b && strcmp(a, b) == 0); }

static void appendf(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void appendf(char *buf, size_t len, const char *fmt, ...) {
    size_t used = strlen(buf);
    if (used + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
}

/* Whether lane l is in the class of `rep`: same state and, when waiting, the
 * same meeting point. */
static int same_class(const mslx_lane *l, const mslx_lane *rep) {
    if (l->state != rep->state) return 0;
    return l->state != MSLX_LANE_WAITING || (l->meet == rep->meet && same_op(l->op, rep->op));
}

/* Describes where the lanes first .. first+count-1 are: "lanes 0-15 wait at
 * simd_sum; lanes 16-31 returned". */
static void describe_lanes(const mslx_group *g, uint32_t first, uint32_t count, char *buf, size_t len) {
    const mslx_lane *reps[8];
    uint32_t nreps = 0;
    for (uint32_t i = first; i < first + count; i++) {
        uint32_t r = 0;
        while (r < nreps && !same_class(&g->lanes[i], reps[r])) r++;
        if (r == nreps && nreps < 8) reps[nreps++] = &g->lanes[i];
    }
    for (uint32_t r = 0; r < nreps; r++) {
        appendf(buf, len, "%slanes ", r ? "; " : "");
        uint32_t runs = 0;
        for (uint32_t i = first; i < first + count; i++) {
            if (!same_class(&g->lanes[i], reps[r])) continue;
            uint32_t end = i;
            while (end + 1 < first + count && same_class(&g->lanes[end + 1], reps[r])) end++;
            if (runs++ == 6) {
                appendf(buf, len, ", ...");
                break;
            }
            if (end == i) appendf(buf, len, "%s%u", runs > 1 ? "," : "", i);
            else appendf(buf, len, "%s%u-%u", runs > 1 ? "," : "", i, end);
            i = end;
        }
        if (reps[r]->state == MSLX_LANE_WAITING) appendf(buf, len, " wait at %s", reps[r]->op ? reps[r]->op : "?");
        else if (reps[r]->state == MSLX_LANE_DONE) appendf(buf, len, " returned");
        else appendf(buf, len, " are ready");
    }
}

/* Fails the threadgroup from the running lane's fiber: records the message
 * and leaves for the scheduler; the lane never resumes. */
static void fail_lane(mslx_group *g, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void fail_lane(mslx_group *g, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->message, sizeof g->message, fmt, ap);
    va_end(ap);
    g->failed = 1;
    g->fail_lane = g->current ? g->current->index : 0;
    void *unused;
    mslx__fiber_switch(&unused, g->scheduler_sp);
    __builtin_trap();
}

/* ---- Scheduler ------------------------------------------------------------ */
static void push_ready(mslx_group *g, uint32_t lane) {
    g->ready[(g->ready_head + g->ready_count) & (READY_RING - 1)] = lane;
    g->ready_count++;
    g->lanes[lane].state = MSLX_LANE_READY;
}

/* Makes g->scratch[0 .. count) (ascending lane indices) ready in lane order. */
static void release_in_order(mslx_group *g, uint32_t count) {
    uint32_t *s = g->scratch;
    switch (g->lane_order) {
    case MSLX_LANES_REVERSE:
        for (uint32_t i = count; i-- > 0;) push_ready(g, s[i]);
        return;
    case MSLX_LANES_RANDOM:
        for (uint32_t i = count; i > 1; i--) {
            uint32_t j = (uint32_t)(next_random(&g->order_rng) % i);
            uint32_t t = s[i - 1];
            s[i - 1] = s[j];
            s[j] = t;
        }
        /* fall through */
    default:
        for (uint32_t i = 0; i < count; i++) push_ready(g, s[i]);
    }
}

/* Every lane of sg that has not returned waits at a SIMD-group meeting point. */
static void release_simdgroup(mslx_group *g, mslx_simdgroup *sg) {
    uint32_t mask = 0, n = 0;
    const mslx_lane *rep = NULL;
    int diverged = 0;
    for (uint32_t i = 0; i < sg->size; i++) {
        const mslx_lane *l = &g->lanes[sg->first_lane + i];
        if (l->state != MSLX_LANE_WAITING) continue;
        mask |= 1u << i;
        g->scratch[n++] = sg->first_lane + i;
        if (!rep) rep = l;
        else if (l->meet != rep->meet || !same_op(l->op, rep->op)) diverged = 1;
    }
    if (g->check && (diverged || (rep->meet == MSLX_MEET_SIMDGROUP_BARRIER && sg->done))) {
        char where[512] = "";
        describe_lanes(g, sg->first_lane, sg->size, where, sizeof where);
        fail_lane(g, "divergent SIMD-group %u: %s", (unsigned)(sg->first_lane / MSLX_SIMD_WIDTH), where);
    }
    sg->active[sg->generation & 1] = mask;
    sg->generation++;
    sg->waiting = 0;
    release_in_order(g, n);
}

/* Every lane of the threadgroup that has not returned waits at the barrier. */
static void release_threadgroup(mslx_group *g) {
    if (g->check && g->done) {
        char where[512] = "";
        describe_lanes(g, 0, g->lane_count, where, sizeof where);
        fail_lane(g, "divergent threadgroup_barrier: %s", where);
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < g->lane_count; i++)
        if (g->lanes[i].state == MSLX_LANE_WAITING) g->scratch[n++] = i;
    g->at_barrier = 0;
    release_in_order(g, n);
}

/* Leaves the running lane (waiting or returned) for the next ready lane, or
 * for the scheduler when none is ready. Returns when the lane is resumed. */
static void lane_yield(mslx_group *g, mslx_lane *self) {
    if (g->ready_count) {
        mslx_lane *next = &g->lanes[g->ready[g->ready_head]];
        g->ready_head = (g->ready_head + 1) & (READY_RING - 1);
        g->ready_count--;
        if (next == self) return;
        g->current = next;
        mslx__fiber_switch(&self->sp, next->sp);
        return;
    }
    mslx__fiber_switch(&self->sp, g->scheduler_sp);
}

static void arrive(mslx_group *g, uint8_t meet, const char *op) {
    mslx_lane *self = g->current;
    self->state = MSLX_LANE_WAITING;
    self->meet = meet;
    self->op = op;
    if (meet == MSLX_MEET_THREADGROUP_BARRIER) {
        if (++g->at_barrier + g->done == g->lane_count) release_threadgroup(g);
    } else {
        mslx_simdgroup *sg = &g->sgs[self->simdgroup];
        if (++sg->waiting + sg->done == sg->size) release_simdgroup(g, sg);
    }
    lane_yield(g, self);
}

static void lane_main(void *arg) {
    mslx_lane *self = arg;
    mslx_group *g = mslx__current_group;
    g->entry(&g->ctxs[self->index]);
    mslx_simdgroup *sg = &g->sgs[self->simdgroup];
    self->state = MSLX_LANE_DONE;
    sg->done++;
    g->done++;
    if (sg->waiting && sg->waiting + sg->done == sg->size) release_simdgroup(g, sg);
    if (g->at_barrier && g->at_barrier + g->done == g->lane_count) release_threadgroup(g);
    lane_yield(g, self);
    __builtin_trap(); /* a returned lane is never made ready again */
}

int mslx__group_run(mslx_group *g, uint64_t threadgroup_linear) {
    uint32_t n = g->lane_count;
    g->failed = 0;
    g->message[0] = 0;
    g->current = NULL;
    if (ensure_stacks(g, n) != 0) {
        snprintf(g->message, sizeof g->message, "cannot map fiber stacks: %s", strerror(errno));
        g->fail_lane = 0;
        return -1;
    }
    g->ready_head = g->ready_count = 0;
    g->at_barrier = g->done = 0;
    g->sg_count = (n + MSLX_SIMD_WIDTH - 1) / MSLX_SIMD_WIDTH;
    for (uint32_t s = 0; s < g->sg_count; s++) {
        mslx_simdgroup *sg = &g->sgs[s];
        sg->first_lane = s * MSLX_SIMD_WIDTH;
        sg->size = n - sg->first_lane < MSLX_SIMD_WIDTH ? n - sg->first_lane : MSLX_SIMD_WIDTH;
        sg->waiting = sg->done = sg->generation = 0;
    }
    uint64_t base = mix64(g->seed ^ mix64(threadgroup_linear + 0x632be59bd9b4e019ull));
    for (uint32_t i = 0; i < n; i++) {
        mslx_lane *l = &g->lanes[i];
        l->simdgroup = (uint16_t)(i / MSLX_SIMD_WIDTH);
        l->index = i;
        l->op = NULL;
        l->rng = mix64(base + i);
        l->sp = fiber_prepare(stack_top(g, i), lane_main, l);
        g->scratch[i] = i;
    }
    g->order_rng = mix64(base ^ 0x5851f42d4c957f2dull);
    release_in_order(g, n);

    mslx_lane *first = &g->lanes[g->ready[0]];
    g->ready_head = 1;
    g->ready_count--;
    g->current = first;
    mslx__fiber_switch(&g->scheduler_sp, first->sp);

    /* Back on the worker's stack: all lanes returned, none is ready, or a lane failed. */
    if (g->failed) return -1;
    if (g->done == n) return 0;
    g->fail_lane = 0;
    while (g->fail_lane < n && g->lanes[g->fail_lane].state == MSLX_LANE_DONE) g->fail_lane++;
    char where[512] = "";
    describe_lanes(g, 0, n, where, sizeof where);
    snprintf(g->message, sizeof g->message, "deadlock: lanes wait at different meeting points: %s", where);
    return -1;
}

/* ---- The runtime table ------------------------------------------------------ */
static mslx_group *calling_group(const char *what) {
    mslx_group *g = mslx__current_group;
    if (!g || !g->current) {
        fprintf(stderr, "mslx: %s called outside a kernel dispatch\n", what);
        abort();
    }
    return g;
}

static void rt_simd_exchange(const char *op, const void *value, unsigned int size, void *all,
                             unsigned int *active) {
    mslx_group *g = calling_group("simd_exchange");
    mslx_lane *self = g->current;
    if (size > MSLX_EXCHANGE_MAX) fail_lane(g, "%s: exchanges %u bytes (at most %u)", op, size, MSLX_EXCHANGE_MAX);
    mslx_simdgroup *sg = &g->sgs[self->simdgroup];
    uint32_t bank = sg->generation & 1;
    unsigned char *slots = sg->slots[bank];
    memcpy(slots + (size_t)size * (self->index - sg->first_lane), value, size);
    arrive(g, MSLX_MEET_SIMD_EXCHANGE, op);
    uint32_t mask = sg->active[bank];
    unsigned char *out = all;
    if (mask == 0xffffffffu) {
        memcpy(out, slots, (size_t)size * MSLX_SIMD_WIDTH);
    } else {
        for (uint32_t i = 0; i < MSLX_SIMD_WIDTH; i++) {
            if (mask >> i & 1) memcpy(out + (size_t)size * i, slots + (size_t)size * i, size);
            else memset(out + (size_t)size * i, 0, size);
        }
    }
    *active = mask;
}

static void rt_threadgroup_barrier(unsigned int flags) {
    (void)flags; /* lanes share one OS thread: every barrier orders all memory */
    mslx_group *g = calling_group("threadgroup_barrier");
    arrive(g, MSLX_MEET_THREADGROUP_BARRIER, "threadgroup_barrier");
}

static void rt_simdgroup_barrier(unsigned int flags) {
    (void)flags;
    mslx_group *g = calling_group("simdgroup_barrier");
    arrive(g, MSLX_MEET_SIMDGROUP_BARRIER, "simdgroup_barrier");
}

static void rt_fail(const char *message) {
    mslx_group *g = calling_group("fail");
    fail_lane(g, "%s", message ? message : "failed");
}

static int rt_check_enabled(void) { return calling_group("check_enabled")->check; }
static int rt_perturb_ulps(void) { return calling_group("perturb_ulps")->perturb_ulps; }

static unsigned long rt_random_u64(void) {
    mslx_group *g = calling_group("random_u64");
    return (unsigned long)next_random(&g->current->rng);
}

static void *rt_threadgroup_static(unsigned long offset) {
    mslx_group *g = calling_group("threadgroup_static");
    if (offset > g->static_size)
        fail_lane(g, "threadgroup variable at offset %lu is outside the kernel's %llu bytes of threadgroup memory",
                  offset, (unsigned long long)g->static_size);
    return (char *)g->static_area + offset;
}

static unsigned int rt_simd_lane(void) {
    mslx_group *g = calling_group("simd_lane");
    return g->current->index % MSLX_SIMD_WIDTH;
}

static const mslx_runtime runtime_table = {
    .abi_version = MSLX_ABI_VERSION,
    .reserved = 0,
    .simd_exchange = rt_simd_exchange,
    .threadgroup_barrier = rt_threadgroup_barrier,
    .simdgroup_barrier = rt_simdgroup_barrier,
    .fail = rt_fail,
    .check_enabled = rt_check_enabled,
    .perturb_ulps = rt_perturb_ulps,
    .random_u64 = rt_random_u64,
    .threadgroup_static = rt_threadgroup_static,
    .simd_lane = rt_simd_lane,
};

const mslx_runtime *mslx__runtime(void) { return &runtime_table; }
