/* Baseline-ISA build of the prefill kernels. */
#include "attn_prefill_body.h"

uint64_t pyfa_cpu_prefill_scratch_bytes(uint32_t head_dim) {
    return (uint64_t)PF_SCRATCH_FLOATS(head_dim) * sizeof(float);
}

void pyfa_cpu_prefill_tile(uint32_t *block_q, uint32_t *block_k) {
    *block_q = PF_BQ;
    *block_k = PF_BK;
}
