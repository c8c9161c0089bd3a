/* Process-wide event counters behind pyfa_counters_get(): what a call cost
 * beyond its kernels (allocations, synchronisations, copies), so tests can
 * check that a steady-state call does none of them. Relaxed atomics: the
 * counts are exact, their order against other memory is not needed. */
#include "pyfa_internal.h"

static uint64_t counts[PYFA_COUNTER_KINDS];

void pyfa_count(int kind) {
    if (kind >= 0 && kind < PYFA_COUNTER_KINDS) __atomic_fetch_add(&counts[kind], 1, __ATOMIC_RELAXED);
}

int pyfa_counters_get(pyfa_counters *out) {
    if (!out) {
        pyfa_set_last_error("out: out-pointer is NULL");
        return PYFA_ERR_INVALID_ARGUMENT;
    }
    out->device_allocations = __atomic_load_n(&counts[PYFA_COUNT_DEVICE_ALLOCATION], __ATOMIC_RELAXED);
    out->pinned_allocations = __atomic_load_n(&counts[PYFA_COUNT_PINNED_ALLOCATION], __ATOMIC_RELAXED);
    out->host_allocations = __atomic_load_n(&counts[PYFA_COUNT_HOST_ALLOCATION], __ATOMIC_RELAXED);
    out->synchronizations = __atomic_load_n(&counts[PYFA_COUNT_SYNCHRONIZATION], __ATOMIC_RELAXED);
    out->host_to_device_copies = __atomic_load_n(&counts[PYFA_COUNT_HOST_TO_DEVICE], __ATOMIC_RELAXED);
    out->device_to_host_copies = __atomic_load_n(&counts[PYFA_COUNT_DEVICE_TO_HOST], __ATOMIC_RELAXED);
    out->kernel_launches = __atomic_load_n(&counts[PYFA_COUNT_KERNEL_LAUNCH], __ATOMIC_RELAXED);
    out->plans_created = __atomic_load_n(&counts[PYFA_COUNT_PLAN], __ATOMIC_RELAXED);
    out->cluster_launches = __atomic_load_n(&counts[PYFA_COUNT_CLUSTER_LAUNCH], __ATOMIC_RELAXED);
    out->split_launches = __atomic_load_n(&counts[PYFA_COUNT_SPLIT_LAUNCH], __ATOMIC_RELAXED);
    out->persistent_launches = __atomic_load_n(&counts[PYFA_COUNT_PERSISTENT_LAUNCH], __ATOMIC_RELAXED);
    pyfa_set_last_error(NULL);
    return PYFA_OK;
}
