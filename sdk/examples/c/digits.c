/* A digits classifier: a linear model trained by scikit-learn on its bundled
 * load_digits data (8x8 images, 64 pixels of 0..16, 10 classes), run by the
 * host's tensor ops on held-out images (tests/sdk/test_examples.py trains it).
 *
 *   classify(x, w, b, labels, pred, n, d, k) -> correct predictions (>= 0) or an error code
 *       scores = x[n, d] @ w[d, k] + b[k]          two host calls, a buffer of this run
 *       pred   = argmax_rows(scores)               n int32 into guest memory, then into `pred`
 *     and prints the accuracy against `labels` (n int32).
 *
 * All six are client buffers. Guest memory holds only the 2 * n int32 of
 * predictions and labels (malloc); the tensors never enter it. */
#include <stdio.h>
#include <stdlib.h>

#include "tensorwasm.h"

TWT_EXPORT(classify) int64_t classify(twt_handle x, twt_handle w, twt_handle b, twt_handle labels, twt_handle pred,
                                      int64_t n, int64_t d, int64_t k) {
    if (n <= 0 || d <= 0 || k <= 0) return TWT_INVALID;
    twt_handle scores = twt_alloc(n * k * 4);
    if (scores < 0) return scores;
    int32_t *best = malloc((size_t)n * sizeof *best);
    int32_t *truth = malloc((size_t)n * sizeof *truth);
    int64_t result = TWT_INVALID;
    int32_t rc;
    if (best == NULL || truth == NULL) goto done;
    if ((rc = twt_matmul_f32(x, w, scores, n, d, k)) != TWT_OK ||
        (rc = twt_add_rows_f32(scores, b, n, k)) != TWT_OK ||
        (rc = twt_argmax_rows_f32(scores, n, k, best)) != TWT_OK ||
        (rc = twt_write(pred, 0, best, (uint32_t)(n * 4))) != TWT_OK ||
        (rc = twt_read(labels, 0, truth, (uint32_t)(n * 4))) != TWT_OK) {
        fprintf(stderr, "digits: a host call failed: %s\n", twt_strerror(rc));
        result = rc;
        goto done;
    }
    result = 0;
    for (int64_t i = 0; i < n; i++) result += best[i] == truth[i];
    printf("digits: %lld of %lld held-out images correct, accuracy %.4f\n", (long long)result, (long long)n,
           (double)result / (double)n);
done:
    free(best);
    free(truth);
    twt_free(scores);
    return result;
}
