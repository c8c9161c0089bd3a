/* pyfa_supported(): the X-macro lists of the shader headers as text, so
 * Swift and Python read the one definition instead of keeping copies. */
#include "pyfa.h"
#include <string.h>

#define PYFA_ITEM(v) "," PYFA_STR(v)
#define PYFA_STR(v) PYFA_STR_(v)
#define PYFA_STR_(v) #v

/* Each list starts with a comma that the lookup skips. */
static const char head_dims[] = PYFA_FOR_EACH_HEAD_DIM(PYFA_ITEM);
static const char tq_head_dims[] = PYFA_FOR_EACH_TQ_HEAD_DIM(PYFA_ITEM);
static const char tq_bits[] = PYFA_FOR_EACH_TQ_BITS(PYFA_ITEM);
static const char attn_dtypes[] = PYFA_FOR_EACH_ATTN_DTYPE(PYFA_ITEM);

const char *pyfa_supported(const char *what) {
    if (!what) return NULL;
    if (strcmp(what, "head_dims") == 0) return head_dims + 1;
    if (strcmp(what, "tq_head_dims") == 0) return tq_head_dims + 1;
    if (strcmp(what, "tq_bits") == 0) return tq_bits + 1;
    if (strcmp(what, "attn_dtypes") == 0) return attn_dtypes + 1;
    return NULL;
}
