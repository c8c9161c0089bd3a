/* Baseline-ISA build of the decode kernels. */
#include "attn_vec_body.h"
#include "turboquant_body.h"

uint64_t pyfa_cpu_vec_scratch_bytes(uint32_t group, uint32_t head_dim) {
    return (uint64_t)VEC_SCRATCH_FLOATS(group, head_dim) * sizeof(float);
}
