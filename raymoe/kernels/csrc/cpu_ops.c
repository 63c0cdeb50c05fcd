/* raymoe fused CPU kernels (float32, one thread each call).
 *
 * At decode sizes (a few to a few hundred rows, hidden sizes in the hundreds) a step is made of small operators
 * whose cost is the framework's per-call overhead (about 3 us per tensor call on the CI machine), not
 * arithmetic. These kernels do one layer stage each in a single call, reading strided inputs in place.
 * Python binds them through ctypes (raymoe/kernels/cpu_ops.py), which checks dtypes, devices, shapes and
 * strides before every call; nothing here validates its arguments.
 *
 * Reductions accumulate in float (vector lanes where marked `omp simd`, so not in index order); results match
 * the torch operators they replace to float32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x in [-87.3, 88.7] (clamped outside), within about 2 ulp: Cody-Waite range reduction and the
 * Cephes expf polynomial, written so that GCC vectorizes loops that call it (libm's expf is a scalar call). */
static inline float fast_expf(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float g = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * g + 1.3981999507e-3f;
    y = y * g + 8.3334519073e-3f;
    y = y * g + 4.1665795894e-2f;
    y = y * g + 1.6666665459e-1f;
    y = y * g + 5.0000001201e-1f;
    y = y * g * g + g + 1.f;
    union {
        int32_t i;
        float f;
    } scale = {((int32_t)n + 127) << 23};
    return y * scale.f;
}

/* out[r, :] = w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)); when res != NULL, x[r, :] + res[r, :] replaces
 * x[r, :] in that formula and is also written to sum_out[r, :]. Strides are in floats. */
void raymoe_add_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride,
                             float *sum_out, int64_t sum_stride, const float *w, float *out, int64_t out_stride,
                             int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *orow = out + r * out_stride;
        const float *src = xr;
        if (res != NULL) {
            const float *rr = res + r * res_stride;
            float *sr = sum_out + r * sum_stride;
            for (int64_t i = 0; i < dim; i++) sr[i] = xr[i] + rr[i];
            src = sr;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += src[i] * src[i];
        float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) orow[i] = w[i] * (src[i] * inv);
    }
}

/* In place on heads [0, heads) of each token t of x (token stride x_stride, head stride dim, floats):
 * optional per-head RMSNorm (norm_w [heads, dim], NULL: none), then neox RoPE (rotate halves) at positions[t]
 * with cos/sin tables [table_rows, dim] (row stride dim). dim <= 1024 and even.
 * Returns 0, or -1 (and writes nothing) when a position lies outside [0, table_rows). */
int raymoe_qk_norm_rope_f32(float *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t dim,
                            const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                            const int64_t *positions, int64_t table_rows) {
    int64_t half = dim / 2;
    float tmp[1024];
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * dim;
        const float *s = sin_t + positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * x_stride + h * dim;
            if (norm_w != NULL) {
                const float *w = norm_w + h * dim;
                float ss = 0.f;
#pragma omp simd reduction(+ : ss)
                for (int64_t i = 0; i < dim; i++) ss += v[i] * v[i];
                float inv = 1.f / sqrtf(ss / (float)dim + eps);
                for (int64_t i = 0; i < dim; i++) tmp[i] = w[i] * (v[i] * inv);
            } else {
                memcpy(tmp, v, (size_t)dim * sizeof(float));
            }
            for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * c[i] - tmp[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
    }
    return 0;
}

/* k_buf[loc[t], :] = k[t, :] and v_buf[loc[t], :] = v[t, :] for t < tokens; a row holds width floats
 * (kv heads x head dim, contiguous within the token), token strides in floats. Returns 0, or -1 (and writes
 * nothing) when a slot lies outside [0, slots). */
int raymoe_kv_store_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *loc,
                        int64_t tokens, int64_t width, float *k_buf, float *v_buf, int64_t slots) {
    size_t bytes = (size_t)width * sizeof(float);
    for (int64_t t = 0; t < tokens; t++)
        if (loc[t] < 0 || loc[t] >= slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_buf + loc[t] * width, k + t * k_stride, bytes);
        memcpy(v_buf + loc[t] * width, v + t * v_stride, bytes);
    }
    return 0;
}

/* One query row's attention for one kv head: the group's query heads qh [group, dim] over the n cache rows
 * idx[0:n] (keys and values at k_buf/v_buf + idx[j] * row_floats + koff), softmax of scale * q.k, into
 * o [group, dim]. scores holds group * width floats. Values are summed into a local accumulator (when group * dim
 * fits), which the compiler keeps in vector registers without aliasing checks. */
#define ATTEND_ACC_FLOATS 2048
static inline __attribute__((always_inline)) void attend_kv_head(
    const float *qh, const float *k_buf, const float *v_buf, const int64_t *idx, int64_t n, int64_t row_floats,
    int64_t koff, int64_t group, const int64_t dim, float scale, float *scores, int64_t width, float *o) {
    for (int64_t j = 0; j < n; j++) {
        const float *kr = k_buf + idx[j] * row_floats + koff;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * dim;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int64_t i = 0; i < dim; i++) d += qg[i] * kr[i];
            scores[g * width + j] = d * scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * width;
        float m = sg[0];
#pragma omp simd reduction(max : m)
        for (int64_t j = 1; j < n; j++) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            sg[j] = fast_expf(sg[j] - m);
            sum += sg[j];
        }
        float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sg[j] *= inv;
    }
    float local[ATTEND_ACC_FLOATS];
    float *acc = group * dim <= ATTEND_ACC_FLOATS ? local : o;
    for (int64_t i = 0; i < group * dim; i++) acc[i] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const float *vr = v_buf + idx[j] * row_floats + koff;
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * width + j];
            float *a = acc + g * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) a[i] += p * vr[i];
        }
    }
    if (acc == local) memcpy(o, local, (size_t)(group * dim) * sizeof(float));
}

/* Paged attention, one query token per row b. Row b reads the slot list kv_indices[r_b, :] with
 * r_b = rows ? rows[b] : b (rows lets every token of an extended request share its request's list; the caller
 * checks each r_b lies in [0, index_rows)) and attends to its first n_b = min(max(seq_lens[b], 1), width) slots
 * of k_buf/v_buf ([slots, kv_heads, dim], contiguous): a decode row passes its sequence length, an extend token
 * at position p passes p + 1, which makes the attention causal. Query heads are grouped: head h reads kv head
 * h / (heads / kv_heads). q [bs, heads, dim] with token stride q_stride (head stride dim); out [bs, heads, dim]
 * contiguous. Softmax subtracts the row maximum (exact, not online).
 * Returns 0, or -1 (and writes nothing) when an attended slot lies outside [0, slots). */
int raymoe_paged_attention_f32(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                               const int64_t *kv_indices, int64_t idx_stride, int64_t width, const int64_t *rows,
                               const int64_t *seq_lens, int64_t bs, int64_t heads, int64_t kv_heads,
                               int64_t dim, float scale, float *out, int64_t slots) {
    int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < bs; b++) {
        int64_t n = seq_lens[b] > width ? width : (seq_lens[b] < 1 ? 1 : seq_lens[b]);
        const int64_t *idx = kv_indices + (rows ? rows[b] : b) * idx_stride;
        for (int64_t j = 0; j < n; j++)
            if (idx[j] < 0 || idx[j] >= slots) return -1;
    }
    size_t need = (size_t)(group * width) * sizeof(float);
    float stack_scores[4096];
    float *scores = need <= sizeof(stack_scores) ? stack_scores : (float *)malloc(need);
    if (scores == NULL) return -2;
    int64_t row_floats = kv_heads * dim;
    for (int64_t b = 0; b < bs; b++) {
        int64_t n = seq_lens[b];
        if (n > width) n = width;
        if (n < 1) n = 1;
        const int64_t *idx = kv_indices + (rows ? rows[b] : b) * idx_stride;
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const float *qh = q + b * q_stride + kh * group * dim;
            float *o = out + (b * heads + kh * group) * dim;
            /* a head size known at compile time lets the compiler unroll the dot products and the value sums */
            if (dim == 32)
                attend_kv_head(qh, k_buf, v_buf, idx, n, row_floats, kh * 32, group, 32, scale, scores, width, o);
            else if (dim == 64)
                attend_kv_head(qh, k_buf, v_buf, idx, n, row_floats, kh * 64, group, 64, scale, scores, width, o);
            else if (dim == 128)
                attend_kv_head(qh, k_buf, v_buf, idx, n, row_floats, kh * 128, group, 128, scale, scores, width, o);
            else
                attend_kv_head(qh, k_buf, v_buf, idx, n, row_floats, kh * dim, group, dim, scale, scores, width, o);
        }
    }
    if (scores != stack_scores) free(scores);
    return 0;
}

/* Softmax routing with greedy top-k: for each token t, the k largest of logits[t, 0:experts] (first index wins
 * a tie, as a stable descending sort), their softmax probabilities (over all experts) in weights[t, :], divided
 * by their sum when renorm, times scale; expert ids in ids[t, :] (descending by probability). */
void raymoe_topk_softmax_f32(const float *logits, int64_t stride, int64_t tokens, int64_t experts, int64_t k,
                             int renorm, float scale, float *weights, int64_t *ids) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *l = logits + t * stride;
        float m = l[0];
        for (int64_t e = 1; e < experts; e++) m = l[e] > m ? l[e] : m;
        float sum = 0.f;
        for (int64_t e = 0; e < experts; e++) sum += expf(l[e] - m);
        float *w = weights + t * k;
        int64_t *id = ids + t * k;
        for (int64_t s = 0; s < k; s++) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++) {
                int taken = 0;
                for (int64_t p = 0; p < s; p++) taken |= id[p] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[s] = best;
            w[s] = expf(l[best] - m) / sum;
        }
        float denom = 0.f;
        for (int64_t s = 0; s < k; s++) denom += w[s];
        for (int64_t s = 0; s < k; s++) w[s] = (renorm ? w[s] / denom : w[s]) * scale;
    }
}

/* Routed SwiGLU experts over token rows in blocks (the RoutedTokenRows layout). Row (b, r), b < blocks,
 * r < rows, is x + b * x_bs + r * x_rs (hidden floats), with top-k ids at ids + b * ids_bs + r * ids_rs and weights
 * at wts + b * w_bs + r * w_rs (k each; strides in elements). Experts [first, first + experts) are this rank's,
 * expert e's weights w13 [e] (2 * inter rows of hidden: gate rows, then up rows) and w2 [e] (hidden rows of inter),
 * contiguous. out[b * rows + r, :] = sum over this rank's picks j of the row, in expert order, of
 * wts[j] * down_e(silu(gate_e(x)) * up_e(x)); 0 for a row with no pick here (its x and weights are never read).
 * Each expert takes its rows in blocks of MOE_BLOCK, so a weight row read from cache serves the whole block.
 * Returns 0, or -2 when the scratch buffers cannot be allocated. */
#define MOE_BLOCK 4
int raymoe_moe_routed_rows_f32(const float *x, int64_t x_bs, int64_t x_rs, const int64_t *ids, int64_t ids_bs,
                               int64_t ids_rs, const float *wts, int64_t w_bs, int64_t w_rs, int64_t blocks,
                               int64_t rows, int64_t k, int64_t first, int64_t experts, const float *w13,
                               const float *w2, int64_t hidden, int64_t inter, float *out) {
    int64_t total = blocks * rows;
    size_t floats = (size_t)MOE_BLOCK * (2 * inter + hidden) + (size_t)inter + (size_t)(total > 0 ? total : 1);
    float *act = (float *)malloc(floats * sizeof(float));
    int64_t *sel = (int64_t *)malloc((size_t)(total > 0 ? total : 1) * sizeof(int64_t));
    if (act == NULL || sel == NULL) {
        free(act);
        free(sel);
        return -2;
    }
    float *y = act + MOE_BLOCK * 2 * inter;
    float *ex = y + MOE_BLOCK * hidden;
    float *selw = ex + inter;
    memset(out, 0, (size_t)(total * hidden) * sizeof(float));
    for (int64_t e = 0; e < experts; e++) {
        int64_t count = 0;
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t *id = ids + b * ids_bs + r * ids_rs;
                for (int64_t j = 0; j < k; j++)
                    if (id[j] == first + e) {
                        sel[count] = b * rows + r;
                        selw[count++] = wts[b * w_bs + r * w_rs + j];
                        break;
                    }
            }
        const float *g = w13 + e * 2 * inter * hidden;
        const float *dw = w2 + e * hidden * inter;
        for (int64_t b0 = 0; b0 < count; b0 += MOE_BLOCK) {
            int64_t nb = count - b0 < MOE_BLOCK ? count - b0 : MOE_BLOCK;
            const float *xr[MOE_BLOCK];
            for (int64_t i = 0; i < MOE_BLOCK; i++) {
                int64_t row = sel[b0 + (i < nb ? i : 0)];
                xr[i] = x + (row / rows) * x_bs + (row % rows) * x_rs;
            }
            for (int64_t j = 0; j < 2 * inter; j++) {
                const float *wr = g + j * hidden;
                float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int64_t i = 0; i < hidden; i++) {
                    d0 += wr[i] * xr[0][i];
                    d1 += wr[i] * xr[1][i];
                    d2 += wr[i] * xr[2][i];
                    d3 += wr[i] * xr[3][i];
                }
                act[0 * 2 * inter + j] = d0;
                act[1 * 2 * inter + j] = d1;
                act[2 * 2 * inter + j] = d2;
                act[3 * 2 * inter + j] = d3;
            }
            for (int64_t i = 0; i < nb; i++) {
                float *a = act + i * 2 * inter;
#pragma omp simd
                for (int64_t j = 0; j < inter; j++) ex[j] = fast_expf(-a[j]);
#pragma omp simd
                for (int64_t j = 0; j < inter; j++) a[j] = a[j] / (1.f + ex[j]) * a[inter + j];
            }
            for (int64_t h = 0; h < hidden; h++) {
                const float *wr = dw + h * inter;
                float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int64_t i = 0; i < inter; i++) {
                    d0 += wr[i] * act[i];
                    d1 += wr[i] * act[2 * inter + i];
                    d2 += wr[i] * act[4 * inter + i];
                    d3 += wr[i] * act[6 * inter + i];
                }
                y[0 * hidden + h] = d0;
                y[1 * hidden + h] = d1;
                y[2 * hidden + h] = d2;
                y[3 * hidden + h] = d3;
            }
            for (int64_t i = 0; i < nb; i++) {
                float wt = selw[b0 + i];
                float *o = out + sel[b0 + i] * hidden;
                const float *yb = y + i * hidden;
                for (int64_t h = 0; h < hidden; h++) o[h] += wt * yb[h];
            }
        }
    }
    free(sel);
    free(act);
    return 0;
}

/* Sampling without candidate filters, one token per row of logits [bs, vocab] (row stride `stride`): a row with
 * temps[b] == 0 takes its first maximum (greedy); any other row inverts the CDF of softmax(logits / temps[b]) at
 * u[b] in [0, 1): the first token whose running sum of weights exp((x - max) / t) exceeds u[b] times their total.
 * Weights are summed in blocks of SAMPLE_BLOCK tokens (vector lanes inside a block, blocks in order); the block
 * sums give the total and pick the block, so the target always falls in a block, and inside it the scan runs in
 * index order. Should float rounding leave a scan short, the last token of non-zero weight scanned is taken: a
 * zero-weight token is never chosen. `scratch` holds vocab + ceil(vocab / SAMPLE_BLOCK) floats; ids[b] receives
 * the token. */
#define SAMPLE_BLOCK 64
void raymoe_sample_rows_f32(const float *logits, int64_t stride, int64_t bs, int64_t vocab, const float *temps,
                            const float *u, float *scratch, int64_t *ids) {
    int64_t nb = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float *w = scratch, *bsum = scratch + vocab;
    for (int64_t b = 0; b < bs; b++) {
        const float *l = logits + b * stride;
        float m = l[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < vocab; i++) m = l[i] > m ? l[i] : m;
        if (temps[b] == 0.f) {
            int64_t best = 0;
            while (best < vocab - 1 && l[best] != m) best++;  /* bounded: a NaN maximum matches nothing */
            ids[b] = best;
            continue;
        }
        float inv_t = 1.f / temps[b];
#pragma omp simd
        for (int64_t i = 0; i < vocab; i++) {
            float z = (l[i] - m) * inv_t;
            w[i] = z < -87.3f ? 0.f : fast_expf(z);  /* exp underflows to 0 there (also for -inf logits) */
        }
        float total = 0.f;
        for (int64_t k = 0; k < nb; k++) {
            int64_t e = (k + 1) * SAMPLE_BLOCK < vocab ? (k + 1) * SAMPLE_BLOCK : vocab;
            float part = 0.f;
#pragma omp simd reduction(+ : part)
            for (int64_t i = k * SAMPLE_BLOCK; i < e; i++) part += w[i];
            bsum[k] = part;
            total += part;
        }
        float target = u[b] * total, acc = 0.f;
        int64_t k = 0, last = 0;
        for (; k < nb; k++) {
            if (bsum[k] > 0.f) last = k;
            if (acc + bsum[k] > target) break;
            acc += bsum[k];
        }
        if (k == nb) {  /* rounding put the target at the total: the last block of non-zero weight, scanned out */
            k = last;
            target = INFINITY;
        }
        int64_t e = (k + 1) * SAMPLE_BLOCK < vocab ? (k + 1) * SAMPLE_BLOCK : vocab, pick = k * SAMPLE_BLOCK;
        for (int64_t i = k * SAMPLE_BLOCK; i < e; i++) {
            if (w[i] > 0.f) {
                pick = i;
                acc += w[i];
                if (acc > target) break;
            }
        }
        ids[b] = pick;
    }
}
