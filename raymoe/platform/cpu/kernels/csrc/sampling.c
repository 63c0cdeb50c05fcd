/* Token sampling. */
#include "cpu_ops.h"

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

/* Presence, frequency and repetition penalties of n rows in place, one pass over each row: row i of x (row
 * stride x_stride, its first vocab columns) reads the token counts of table row rows[i] (counts, row stride
 * c_stride) and, when seen is not NULL, its prompt marks (bytes, row stride s_stride). Per token with count c and
 * seen = prompt mark or c > 0: where seen and rep[i] != 1, x > 0 ? x / rep : x * rep (HF transformers'
 * RepetitionPenaltyLogitsProcessor); then x - freq[i] * c - pres[i] * (c > 0) (OpenAI's formula). Returns 0, or
 * -1 (writing nothing) when a row index lies outside [0, table_rows). */
int raymoe_apply_penalties_f32(float *x, int64_t x_stride, int64_t n, int64_t vocab, const float *counts,
                               int64_t c_stride, const uint8_t *seen, int64_t s_stride, const int64_t *rows,
                               int64_t table_rows, const float *pres, const float *freq, const float *rep) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= table_rows) return -1;
    for (int64_t i = 0; i < n; i++) {
        float *xr = x + i * x_stride;
        const float *cr = counts + rows[i] * c_stride;
        const float p = pres[i], f = freq[i], r = rep[i];
        if (r != 1.f) {
            const uint8_t *sr = seen ? seen + rows[i] * s_stride : NULL;
            for (int64_t j = 0; j < vocab; j++) {
                float v = xr[j], c = cr[j];
                int s = c > 0.f || (sr != NULL && sr[j]);
                float t = s ? (v > 0.f ? v / r : v * r) : v;
                xr[j] = t - f * c - (c > 0.f ? p : 0.f);
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < vocab; j++) {
                float c = cr[j];
                xr[j] = xr[j] - f * c - (c > 0.f ? p : 0.f);
            }
        }
    }
    return 0;
}
