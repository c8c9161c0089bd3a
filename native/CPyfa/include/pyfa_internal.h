/* Helpers the Swift implementation of pyfa.h uses; not part of the ABI. */
#pragma once
#include "pyfa.h"

void pyfa_set_last_error(const char *message);

/* The cached f32 Lloyd-Max codebook of N(0,1) at `bits` (2, 3, 4, 8): 2^bits
 * sorted centroids; NULL for other widths (turboquant_codebook.c). */
const float *pyfa_turboquant_codebook_table(uint32_t bits);
