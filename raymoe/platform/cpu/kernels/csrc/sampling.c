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
