/* The image fold of runner/media/prepare.py (Go's foldValue). */
#include "internal.h"

/* FNV-1a 64 of n bytes from h: the image fold of runner/media/prepare.py (Go's foldValue),
 * one byte at a time by definition, ~120 ms a megabyte in Python. */
unsigned long long runner_fnv1a64(const unsigned char *data, size_t n, unsigned long long h) {
    for (size_t i = 0; i < n; i++) h = (h ^ data[i]) * 0x100000001B3ULL;
    return h;
}
