/* Name -> CPU kernel table, with the ISA chosen once per process. */
#include "pyfa_cpu.h"
#include <stdlib.h>
#include <string.h>

#define PYFA_CPU_KERNEL(name)                                                                      \
    void name##_generic(const pyfa_cpu_dispatch *, uint32_t, uint32_t, uint32_t, void *);         \
    void name##_avx2(const pyfa_cpu_dispatch *, uint32_t, uint32_t, uint32_t, void *);
#include "kernel_list.h"
#undef PYFA_CPU_KERNEL

static int use_avx2(void) {
#if defined(__x86_64__) && defined(__clang__)
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        /* PYFA_CPU_ISA=generic forces the baseline build (tests compare the two). */
        const char *force = getenv("PYFA_CPU_ISA");
        cached = !(force && strcmp(force, "generic") == 0) && __builtin_cpu_supports("avx2") &&
                 __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
#else
    return 0;
#endif
}

const char *pyfa_cpu_isa(void) { return use_avx2() ? "avx2" : "generic"; }

typedef struct entry {
    const char *name;
    pyfa_cpu_kernel generic, avx2;
} entry;

#if defined(__x86_64__) && defined(__clang__)
#define PYFA_CPU_KERNEL(name) {&#name[sizeof("pyfa_cpu_") - 1], name##_generic, name##_avx2},
#else
#define PYFA_CPU_KERNEL(name) {&#name[sizeof("pyfa_cpu_") - 1], name##_generic, name##_generic},
#endif
static const entry table[] = {
#include "kernel_list.h"
};
#undef PYFA_CPU_KERNEL

pyfa_cpu_kernel pyfa_cpu_find_kernel(const char *name) {
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(table[i].name, name) == 0) return use_avx2() ? table[i].avx2 : table[i].generic;
    return NULL;
}
