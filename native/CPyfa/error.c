/* The thread-local last-error slot behind pyfa_last_error(). Swift has no
 * plain thread-local storage, and cffi releases the GIL during calls, so the
 * slot lives here. */
#include "pyfa_internal.h"
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[4096];

const char *pyfa_last_error(void) { return last_error; }

void pyfa_set_last_error(const char *message) {
    if (!message) {
        last_error[0] = 0;
        return;
    }
    snprintf(last_error, sizeof last_error, "%s", message);
}
