/*
 * The runtime's private pieces shared by runtime.c (options, worker pool,
 * dispatch, signals, memory) and fiber.c (context switch, fiber stacks, the
 * lane scheduler and the mslx_runtime table kernels call).
 *
 * One worker thread runs one threadgroup at a time in its mslx_group: every
 * lane (thread) of the threadgroup is a fiber on the worker's thread. A lane
 * runs until it reaches a meeting point (a SIMD-group exchange or barrier, a
 * threadgroup barrier) or returns; when every live lane of the group that
 * meets there has arrived, the group is released and its lanes become ready
 * again. A lane that yields switches straight to the next ready lane; the
 * worker's own stack (the scheduler) runs only at the start, when no lane is
 * ready (all returned, or a deadlock) and on failure.
 */
#pragma once
#include "mslx_internal.h"

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#define MSLX_FIBER_STACK_SIZE (128u * 1024u) /* usable bytes per lane fiber */
#define MSLX_EXCHANGE_MAX 64u                /* bytes one lane passes to simd_exchange */
#define MSLX_MAX_SIMDGROUPS (MSLX_MAX_THREADS_PER_THREADGROUP / MSLX_SIMD_WIDTH)

enum { MSLX_LANE_READY = 0, MSLX_LANE_WAITING = 1, MSLX_LANE_DONE = 2 };
enum { MSLX_MEET_SIMD_EXCHANGE = 1, MSLX_MEET_SIMDGROUP_BARRIER = 2, MSLX_MEET_THREADGROUP_BARRIER = 3 };

typedef struct mslx_lane {
    void *sp;           /* saved stack pointer while the lane is not running */
    uint8_t state;      /* MSLX_LANE_* */
    uint8_t meet;       /* MSLX_MEET_* while WAITING */
    uint16_t simdgroup; /* index of its SIMD-group */
    uint32_t index;     /* thread_index_in_threadgroup */
    const char *op;     /* meeting point name while WAITING (diagnostics, divergence check) */
    uint64_t rng;       /* the lane's random_u64 stream */
} mslx_lane;

typedef struct mslx_simdgroup {
    uint32_t first_lane, size; /* lanes first_lane .. first_lane + size - 1 */
    uint32_t waiting;          /* lanes waiting at a SIMD-group meeting point */
    uint32_t done;             /* lanes that returned */
    uint32_t generation;       /* releases so far; its low bit picks the slot bank */
    uint32_t active[2];        /* per bank: lanes that took part in the last exchange */
    /* Exchange values per bank: lane i's `size` bytes at i * size, so a full
     * SIMD-group's values are one contiguous block. Two banks, so a lane
     * released from exchange k may write exchange k+1 while slower lanes
     * still read k. */
    unsigned char slots[2][MSLX_SIMD_WIDTH * MSLX_EXCHANGE_MAX];
} mslx_simdgroup;

/* A worker thread's threadgroup executor (fiber.c). */
typedef struct mslx_group {
    /* Fixed for the worker's lifetime. */
    char *stacks;             /* MSLX_MAX_THREADS_PER_THREADGROUP slots: guard page + stack */
    size_t stack_slot;        /* bytes per slot */
    uint32_t stacks_ready;    /* slots made accessible so far */
    mslx_lane *lanes;         /* [MSLX_MAX_THREADS_PER_THREADGROUP] */
    mslx_lane_ctx *ctxs;      /* [MSLX_MAX_THREADS_PER_THREADGROUP], filled by runtime.c */
    mslx_simdgroup *sgs;      /* [MSLX_MAX_SIMDGROUPS] */
    uint32_t *ready;          /* ring of ready lane indices */
    uint32_t *scratch;        /* release order */

    /* Set by runtime.c per dispatch (job). */
    mslx_entry_fn entry;
    const char *kernel_name;
    void *static_area;        /* threadgroup memory the kernel declares in its body */
    uint64_t static_size;
    int check, lane_order, perturb_ulps;
    uint64_t seed;

    /* Per threadgroup. */
    uint32_t lane_count, sg_count;
    uint32_t ready_head, ready_count;
    uint32_t at_barrier, done;
    uint64_t order_rng;
    mslx_lane *current;       /* the running lane */
    void *scheduler_sp;       /* the worker's own stack while a lane runs */
    int failed;
    uint32_t fail_lane;
    char message[768];
} mslx_group;

/* The executor of the calling worker thread (NULL on other threads). */
extern __thread mslx_group *mslx__current_group;

/* fiber.c */
int mslx__group_init(mslx_group *g);                 /* 0, or -1 with errno (out of memory) */
/* Runs one threadgroup of g->lane_count lanes (ctxs filled); the caller
 * seeds with the threadgroup's linear index. Returns 0, or -1 with
 * g->message and g->fail_lane set. A fault inside leaves by siglongjmp; the
 * next run starts clean. */
int mslx__group_run(mslx_group *g, uint64_t threadgroup_linear);
/* If addr lies in a guard page of g's fiber stacks, the lane whose stack
 * overflowed; else -1. */
int mslx__group_stack_guard_lane(const mslx_group *g, const void *addr);
