/* Norms, q/k norm + RoPE and the KV store. */
#include "cpu_ops.h"

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
