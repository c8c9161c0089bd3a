/* Baseline-ISA build of kv_append. */
#include "kv_append_body.h"
