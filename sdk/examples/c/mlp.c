/* The demo's 2-layer MLP (worker/guests/mlp.wat), in C: the shape of a real inference tenant.
 *
 *   forward(x, w1, b1, w2, b2, out, batch, d_in, hidden, d_out) -> 0 or the first error code
 *       h   = relu(x[batch, d_in] @ w1[d_in, hidden] + b1)      h: a buffer of this run
 *       out = softmax_rows(h @ w2[hidden, d_out] + b2)          out: the caller's buffer
 *   classes(out, batch, d_out) -> the sum over rows of argmax(out[row]), or the error code
 *
 * Every tensor operation is one host call on whole buffers; only the argmax
 * result (batch int32) comes into guest memory, in a malloc'd array. */
#include <stdio.h>
#include <stdlib.h>

#include "tensorwasm.h"

#define TRY(call)                                                        \
    do {                                                                 \
        int32_t rc_ = (call);                                            \
        if (rc_ != TWT_OK) {                                             \
            fprintf(stderr, "mlp: %s: %s\n", #call, twt_strerror(rc_)); \
            return rc_;                                                  \
        }                                                                \
    } while (0)

static int32_t layers(twt_handle x, twt_handle w1, twt_handle b1, twt_handle w2, twt_handle b2, twt_handle out,
                      twt_handle h, int64_t batch, int64_t d_in, int64_t hidden, int64_t d_out) {
    TRY(twt_matmul_f32(x, w1, h, batch, d_in, hidden));
    TRY(twt_add_rows_f32(h, b1, batch, hidden));
    TRY(twt_unary_f32(TWT_OP_RELU, h, h, batch * hidden));
    TRY(twt_matmul_f32(h, w2, out, batch, hidden, d_out));
    TRY(twt_add_rows_f32(out, b2, batch, d_out));
    TRY(twt_softmax_rows_f32(out, batch, d_out));
    return TWT_OK;
}

TWT_EXPORT(forward) int32_t forward(twt_handle x, twt_handle w1, twt_handle b1, twt_handle w2, twt_handle b2,
                                    twt_handle out, int64_t batch, int64_t d_in, int64_t hidden, int64_t d_out) {
    twt_handle h = twt_alloc(batch * hidden * 4);
    if (h < 0) return (int32_t)h; /* e.g. TWT_GPU_QUOTA: the caller sees the code */
    int32_t rc = layers(x, w1, b1, w2, b2, out, h, batch, d_in, hidden, d_out);
    twt_free(h);
    return rc;
}

TWT_EXPORT(classes) int64_t classes(twt_handle out, int64_t batch, int64_t d_out) {
    int32_t *best = malloc((size_t)batch * sizeof *best + 1);
    if (best == NULL) return TWT_INVALID;
    int32_t rc = twt_argmax_rows_f32(out, batch, d_out, best);
    if (rc != TWT_OK) {
        free(best);
        return rc;
    }
    int64_t sum = 0;
    for (int64_t i = 0; i < batch; i++) sum += best[i];
    free(best);
    return sum;
}
