/* One GPT-style transformer block in C, over client buffers holding its weights: the workload the
 * SDK's model operations exist for (docs/WASM-ABI.md "Model operations").
 *
 *   forward(tok, emb, pos, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, w1, b1, w2, b2, out,
 *           t, c, heads, f, wdtype) -> 0 or the first error code
 *
 *     x    = emb[tok] + pos[:t]                                  gather (ids read into guest memory)
 *     a    = layernorm(x; ln1_g, ln1_b)
 *     q,k,v per head h: a @ wq[h], a @ wk[h], a @ wv[h]           one strided-batched GEMM each
 *     p    = softmax(causal_mask(q k^T / sqrt(d)))               per head, d = c / heads
 *     x    = x + sum_h (p v)[h] @ wo[h]                          = concat(heads) @ Wo
 *     out  = x + gelu(layernorm(x; ln2_g, ln2_b) @ w1 + b1) @ w2 + b2
 *
 * Shapes (row-major float32 unless said): tok [t] int32, emb [vocab, c], pos [>= t, c], ln*_g/_b [c],
 * wq/wk/wv [heads, c, d] (head h's projection; a [c, heads*d] matrix Wq is wq[h] = Wq[:, h*d:(h+1)*d]),
 * wo [heads*d, c] (= [heads, d, c]), w1 [c, f], b1 [f], w2 [f, c], b2 [c], out [t, c].
 *
 * wdtype TWT_F32: everything in float32. TWT_F16 / TWT_BF16: the six weight matrices arrive in that
 * dtype (half the bytes); attention's are widened to float32 (exact), and the MLP runs as twt_gemm_ex
 * on its activations rounded to the same dtype, accumulating in float32 - a mixed-precision block.
 *
 * Every tensor operation is one host call on whole buffers; only the t token ids enter guest memory. */
#include <stdio.h>
#include <stdlib.h>

#include "tensorwasm.h"

#define TRY(call)                                                                \
    do {                                                                         \
        int32_t rc_ = (call);                                                    \
        if (rc_ != TWT_OK) {                                                     \
            fprintf(stderr, "transformer: %s: %s\n", #call, twt_strerror(rc_)); \
            return rc_;                                                          \
        }                                                                        \
    } while (0)

/* the run's scratch buffers, freed together whatever happened */
enum { X, A, Q, K, V, S, MASK, O, Z, ONES, F, WQ, WK, WV, WO, ALO, FLO, NBUF };

typedef struct {
    twt_handle tok, emb, pos, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, w1, b1, w2, b2, out;
    int64_t t, c, heads, f, d;
    int32_t wdtype;
    twt_handle buf[NBUF];
} block;

static int32_t scratch(block *b, int i, int64_t floats) {
    twt_handle h = twt_alloc(floats * 4);
    if (h < 0) return (int32_t)h; /* e.g. TWT_GPU_QUOTA */
    b->buf[i] = h;
    return TWT_OK;
}

/* float32 copies of the attention weights (exact widening), or the caller's own */
static int32_t attention_weights(block *b, twt_handle *wq, twt_handle *wk, twt_handle *wv, twt_handle *wo) {
    int64_t n = b->heads * b->c * b->d;
    if (b->wdtype == TWT_F32) {
        *wq = b->wq, *wk = b->wk, *wv = b->wv, *wo = b->wo;
        return TWT_OK;
    }
    const twt_handle src[4] = {b->wq, b->wk, b->wv, b->wo};
    const int dst[4] = {WQ, WK, WV, WO};
    for (int i = 0; i < 4; i++) {
        TRY(scratch(b, dst[i], n));
        TRY(twt_cast(src[i], b->wdtype, b->buf[dst[i]], TWT_F32, n));
    }
    *wq = b->buf[WQ], *wk = b->buf[WK], *wv = b->buf[WV], *wo = b->buf[WO];
    return TWT_OK;
}

static int32_t run(block *b, const int32_t *ids) {
    const int64_t t = b->t, c = b->c, h = b->heads, d = b->d, f = b->f;
    twt_handle *s = b->buf;
    twt_handle wq, wk, wv, wo;
    TRY(attention_weights(b, &wq, &wk, &wv, &wo));
    TRY(scratch(b, X, t * c));
    TRY(scratch(b, A, t * c));
    TRY(scratch(b, Q, h * t * d));
    TRY(scratch(b, K, h * t * d));
    TRY(scratch(b, V, h * t * d));
    TRY(scratch(b, S, h * t * t));
    TRY(scratch(b, MASK, t * t));
    TRY(scratch(b, O, h * t * d));
    TRY(scratch(b, Z, h * t * c));
    TRY(scratch(b, ONES, h));
    TRY(scratch(b, F, t * f));

    /* embeddings */
    TRY(twt_gather_rows_f32(b->emb, ids, t, c, s[X]));
    TRY(twt_binary_f32(TWT_BIN_ADD, s[X], b->pos, s[X], t * c));

    /* causal self-attention: per-head projections with the activations broadcast (stride 0) */
    TRY(twt_layernorm_rows_f32(s[X], b->ln1_g, b->ln1_b, s[A], t, c, 1e-5f));
    TRY(twt_gemm_strided_batched_f32(0, 0, t, d, c, 1.0f, s[A], 0, wq, c * d, 0.0f, s[Q], t * d, h));
    TRY(twt_gemm_strided_batched_f32(0, 0, t, d, c, 1.0f, s[A], 0, wk, c * d, 0.0f, s[K], t * d, h));
    TRY(twt_gemm_strided_batched_f32(0, 0, t, d, c, 1.0f, s[A], 0, wv, c * d, 0.0f, s[V], t * d, h));
    float scale = 1.0f / __builtin_sqrtf((float)d);
    TRY(twt_gemm_strided_batched_f32(0, 1, t, t, d, scale, s[Q], t * d, s[K], t * d, 0.0f, s[S], t * t, h));
    /* one [t, t] mask of 0 and -inf, added to every head's scores */
    TRY(twt_fill_f32(s[MASK], 0.0f, t * t));
    TRY(twt_causal_mask_f32(s[MASK], t, t, 0));
    TRY(twt_binary_rows_f32(TWT_BIN_ADD, s[S], s[MASK], s[S], h, t * t));
    TRY(twt_softmax_rows_f32(s[S], h * t, t));
    TRY(twt_gemm_strided_batched_f32(0, 0, t, d, t, 1.0f, s[S], t * t, s[V], t * d, 0.0f, s[O], t * d, h));
    /* z[h] = o[h] @ wo[h]; x += sum over heads (a [1, heads] @ [heads, t*c] GEMM onto x: the residual) */
    TRY(twt_gemm_strided_batched_f32(0, 0, t, c, d, 1.0f, s[O], t * d, wo, d * c, 0.0f, s[Z], t * c, h));
    TRY(twt_fill_f32(s[ONES], 1.0f, h));
    TRY(twt_gemm_f32(0, 0, 1, t * c, h, 1.0f, s[ONES], s[Z], 1.0f, s[X]));

    /* the MLP, its residual onto a copy of x in out */
    TRY(twt_layernorm_rows_f32(s[X], b->ln2_g, b->ln2_b, s[A], t, c, 1e-5f));
    TRY(twt_copy(s[X], 0, b->out, 0, t * c * 4));
    if (b->wdtype == TWT_F32) {
        TRY(twt_gemm_f32(0, 0, t, f, c, 1.0f, s[A], b->w1, 0.0f, s[F]));
    } else {
        TRY(scratch(b, ALO, (t * c + 1) / 2)); /* 2-byte elements */
        TRY(scratch(b, FLO, (t * f + 1) / 2));
        TRY(twt_cast(s[A], TWT_F32, s[ALO], b->wdtype, t * c));
        TRY(twt_gemm_ex(0, 0, t, f, c, 1.0f, s[ALO], b->wdtype, b->w1, 0.0f, s[F], TWT_F32));
    }
    TRY(twt_binary_rows_f32(TWT_BIN_ADD, s[F], b->b1, s[F], t, f));
    TRY(twt_unary_f32(TWT_OP_GELU, s[F], s[F], t * f));
    if (b->wdtype == TWT_F32) {
        TRY(twt_gemm_f32(0, 0, t, c, f, 1.0f, s[F], b->w2, 1.0f, b->out));
    } else {
        TRY(twt_cast(s[F], TWT_F32, s[FLO], b->wdtype, t * f));
        TRY(twt_gemm_ex(0, 0, t, c, f, 1.0f, s[FLO], b->wdtype, b->w2, 1.0f, b->out, TWT_F32));
    }
    TRY(twt_binary_rows_f32(TWT_BIN_ADD, b->out, b->b2, b->out, t, c));
    return TWT_OK;
}

TWT_EXPORT(forward) int32_t forward(twt_handle tok, twt_handle emb, twt_handle pos, twt_handle ln1_g,
                                    twt_handle ln1_b, twt_handle wq, twt_handle wk, twt_handle wv, twt_handle wo,
                                    twt_handle ln2_g, twt_handle ln2_b, twt_handle w1, twt_handle b1, twt_handle w2,
                                    twt_handle b2, twt_handle out, int64_t t, int64_t c, int64_t heads, int64_t f,
                                    int32_t wdtype) {
    if (t <= 0 || c <= 0 || heads <= 0 || f <= 0 || c % heads != 0 || t > (1 << 20)) return TWT_INVALID;
    if (wdtype != TWT_F32 && wdtype != TWT_F16 && wdtype != TWT_BF16) return TWT_INVALID;
    block b = {tok, emb, pos, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, w1, b1, w2, b2, out,
               t, c, heads, f, c / heads, wdtype, {0}};
    int32_t *ids = malloc((size_t)t * sizeof *ids);
    if (ids == NULL) return TWT_INVALID;
    int32_t rc = twt_read(tok, 0, ids, (uint32_t)(t * 4)); /* the token ids, for the gather */
    if (rc == TWT_OK) rc = run(&b, ids);
    for (int i = 0; i < NBUF; i++)
        if (b.buf[i] > 0) twt_free(b.buf[i]);
    free(ids);
    if (rc == TWT_OK) {
        char line[96];
        snprintf(line, sizeof line, "transformer: %lld tokens, d_model %lld, %lld heads, %s weights", (long long)t,
                 (long long)c, (long long)heads, wdtype == TWT_F32 ? "f32" : wdtype == TWT_F16 ? "f16" : "bf16");
        twt_log_str(line);
    }
    return rc;
}
