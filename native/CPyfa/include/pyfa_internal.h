/* Helpers the Swift implementation of pyfa.h uses; not part of the ABI. */
#pragma once
#include "pyfa.h"

void pyfa_set_last_error(const char *message);
