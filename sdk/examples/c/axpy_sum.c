/* axpy + sum: y = a*x + y on two client buffers, then sum(y) - the demo's first tenant, in C.
 *
 *   twt build sdk/examples/c/axpy_sum.c -o axpy_sum.wasm
 *   twt run acme axpy_sum.wasm --invoke run --arg handle=1:1 --arg handle=1:2 --arg 1000 --arg 0.5
 *
 * run(x, y, n, a) -> sum(y) after y = a*x + y, or NaN on an error (printed).
 * It copies x into a scratch buffer of its own through a malloc'd chunk of
 * guest memory (read + write), to show both directions of the copy. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tensorwasm.h"

#define CHUNK (64 * 1024)

static float fail(const char *what, int64_t code) {
    printf("axpy_sum: %s failed: %s (%lld)\n", what, twt_strerror(code), (long long)code);
    return NAN;
}

TWT_EXPORT(run) float run(twt_handle x, twt_handle y, int64_t n, float a) {
    int64_t bytes = n * 4;
    twt_handle scratch = twt_alloc(bytes);
    if (scratch < 0) return fail("alloc", scratch);
    unsigned char *chunk = malloc(CHUNK);
    if (chunk == NULL) return fail("malloc", TWT_INVALID);
    for (int64_t off = 0; off < bytes; off += CHUNK) {
        uint32_t len = (uint32_t)(bytes - off < CHUNK ? bytes - off : CHUNK);
        int32_t rc = twt_read(x, off, chunk, len);
        if (rc != TWT_OK) return fail("read", rc);
        rc = twt_write(scratch, off, chunk, len);
        if (rc != TWT_OK) return fail("write", rc);
    }
    free(chunk);
    int32_t rc = twt_axpy_f32(n, a, scratch, y);
    if (rc != TWT_OK) return fail("axpy_f32", rc);
    float total = 0.0f;
    rc = twt_sum_f32(y, n, &total);
    if (rc != TWT_OK) return fail("sum_f32", rc);
    twt_free(scratch);
    printf("axpy_sum: n=%lld a=%g sum=%g\n", (long long)n, (double)a, (double)total);
    return total;
}
