#ifndef RAYMOE_CPU_OPS_H
#define RAYMOE_CPU_OPS_H

/* raymoe fused CPU kernels (float32, one thread each call): what every kernel source shares.
 *
 * At decode sizes (a few to a few hundred rows, hidden sizes in the hundreds) a step is made of small operators
 * whose cost is the framework's per-call overhead (about 3 us per tensor call on the CI machine), not
 * arithmetic. These kernels do one layer stage each in a single call, reading strided inputs in place.
 * Python binds them through ctypes (raymoe/platform/cpu/kernels/cpu_ops.py), which checks dtypes, devices, shapes and
 * strides before every call; the C code checks only the indices it reads through (positions, KV slots, table
 * rows), before it writes anything.
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

/* Kernels that other kernels call (each documented where it is defined). */
int raymoe_qk_norm_rope_f32(float *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t dim,
                            const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                            const int64_t *positions, int64_t table_rows);
int raymoe_kv_store_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *loc,
                        int64_t tokens, int64_t width, float *k_buf, float *v_buf, int64_t slots);
int raymoe_paged_attention_f32(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                               const int64_t *kv_indices, int64_t idx_stride, int64_t width, int64_t index_rows,
                               const int64_t *rows, const int64_t *seq_lens, int64_t bs, int64_t heads,
                               int64_t kv_heads, int64_t dim, float scale, float *out, int64_t slots);
void raymoe_add_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride,
                             float *sum_out, int64_t sum_stride, const float *w, float *out, int64_t out_stride,
                             int64_t rows, int64_t dim, float eps);
void raymoe_linear_packed_f32(const float *x, int64_t xs, int64_t rows, const float *p, int64_t n, int64_t k,
                              float *y, int64_t ys);
int raymoe_apply_penalties_f32(float *x, int64_t x_stride, int64_t n, int64_t vocab, const float *counts,
                               int64_t c_stride, const uint8_t *seen, int64_t s_stride, const int64_t *rows,
                               int64_t table_rows, const float *pres, const float *freq, const float *rep);
void raymoe_topk_softmax_f32(const float *logits, int64_t stride, int64_t tokens, int64_t experts, int64_t k,
                             int renorm, float scale, float *weights, int64_t *ids);

#endif
