/* Compile-time pins of every parameter struct's layout; the Swift and Python
 * suites check the same sizes at run time. */
#include "pyfa_params.h"
#include <stddef.h>

_Static_assert(sizeof(pyfa_flash_attn_vec_params) == 40, "pyfa_flash_attn_vec_params layout");
_Static_assert(offsetof(pyfa_flash_attn_vec_params, scale) == 28, "pyfa_flash_attn_vec_params.scale");
_Static_assert(sizeof(pyfa_attn_reduce_params) == 16, "pyfa_attn_reduce_params layout");
_Static_assert(sizeof(pyfa_kv_append_params) == 24, "pyfa_kv_append_params layout");
_Static_assert(sizeof(pyfa_kv_state) == 16, "pyfa_kv_state layout");
_Static_assert(offsetof(pyfa_kv_state, kv_len) == 4 && offsetof(pyfa_kv_state, ring_start) == 8, "pyfa_kv_state fields");
_Static_assert(sizeof(pyfa_kv_advance_params) == 16, "pyfa_kv_advance_params layout");
_Static_assert(sizeof(pyfa_flash_attn_prefill_params) == 184, "pyfa_flash_attn_prefill_params layout");
_Static_assert(offsetof(pyfa_flash_attn_prefill_params, q_strides) == 64, "pyfa_flash_attn_prefill_params.q_strides");
_Static_assert(offsetof(pyfa_flash_attn_prefill_params, mask_strides) == 160, "pyfa_flash_attn_prefill_params.mask_strides");
_Static_assert(sizeof(pyfa_merge_attn_params) == 40, "pyfa_merge_attn_params layout");
_Static_assert(sizeof(pyfa_tq_quantize_params) == 48, "pyfa_tq_quantize_params layout");
_Static_assert(sizeof(pyfa_tq_dequantize_params) == 40, "pyfa_tq_dequantize_params layout");
_Static_assert(sizeof(pyfa_tq_fwht_params) == 24, "pyfa_tq_fwht_params layout");
_Static_assert(sizeof(pyfa_flash_attn_vec_tq_params) == 64, "pyfa_flash_attn_vec_tq_params layout");
_Static_assert(offsetof(pyfa_flash_attn_vec_tq_params, k_bits) == 40, "pyfa_flash_attn_vec_tq_params.k_bits");
_Static_assert(sizeof(pyfa_tq_reduce_undo_params) == 32, "pyfa_tq_reduce_undo_params layout");
_Static_assert(sizeof(pyfa_kv_pages) == 16, "pyfa_kv_pages layout");
/* paged appends */
_Static_assert(sizeof(pyfa_kv_append_paged_params) == 32, "pyfa_kv_append_paged_params layout");
_Static_assert(sizeof(pyfa_tq_quantize_paged_params) == 48, "pyfa_tq_quantize_paged_params layout");
_Static_assert(sizeof(pyfa_prefill_packed) == 16, "pyfa_prefill_packed layout");
_Static_assert(sizeof(pyfa_prefill_split) == 16, "pyfa_prefill_split layout");
_Static_assert(sizeof(pyfa_prefill_persist) == 4, "pyfa_prefill_persist layout");
