/* MoE routing and routed experts. */
#include "cpu_ops.h"

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
