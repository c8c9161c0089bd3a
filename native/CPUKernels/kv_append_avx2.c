/* AVX2+FMA+F16C build of kv_append; used only where the CPU has them. */
#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#define PYFA_CPU_AVX2 1
#include "kv_append_body.h"
#pragma clang attribute pop
#endif
