/* Helpers the Swift implementation of pyfa.h uses; not part of the ABI. */
#pragma once
#include "pyfa.h"

void pyfa_set_last_error(const char *message);

/* The cached f32 Lloyd-Max codebook of N(0,1) at `bits` (2, 3, 4, 8): 2^bits
 * sorted centroids; NULL for other widths (turboquant_codebook.c). */
const float *pyfa_turboquant_codebook_table(uint32_t bits);

/* Event kinds of pyfa_count (counters.c), reported by pyfa_counters_get. */
#define PYFA_COUNT_DEVICE_ALLOCATION 0
#define PYFA_COUNT_PINNED_ALLOCATION 1
#define PYFA_COUNT_HOST_ALLOCATION 2
#define PYFA_COUNT_SYNCHRONIZATION 3
#define PYFA_COUNT_HOST_TO_DEVICE 4
#define PYFA_COUNT_DEVICE_TO_HOST 5
#define PYFA_COUNT_KERNEL_LAUNCH 6
#define PYFA_COUNT_PLAN 7
#define PYFA_COUNT_CLUSTER_LAUNCH 8
#define PYFA_COUNT_SPLIT_LAUNCH 9
#define PYFA_COUNT_PERSISTENT_LAUNCH 10
#define PYFA_COUNTER_KINDS 11
void pyfa_count(int kind);
