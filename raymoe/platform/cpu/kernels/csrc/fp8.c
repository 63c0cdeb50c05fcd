/* FP8 (float8_e4m3fn) block dequantization. */
#include "cpu_ops.h"

/* The float value of each e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds the
 * subnormals m * 2^-9; 0x7f and 0xff are NaN (e4m3fn has no infinities). */
static void fp8_e4m3fn_table(float *table) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if ((b & 0x7f) == 0x7f) v = NAN;
        table[b] = (b & 0x80) ? -v : v;
    }
}

/* out[g, i, j] = value(w[g, i, j]) * scale[g, i / bn, j / bk] for g < groups, i < n, j < k; w, scale and out
 * contiguous ([groups, n, k] bytes, [groups, gn, gk] floats, [groups, n, k] floats), gn = ceil(n / bn),
 * gk = ceil(k / bk) (partial edge blocks take their block's scale). */
void raymoe_fp8_dequant_f32(const uint8_t *w, int64_t groups, int64_t n, int64_t k, const float *scale,
                            int64_t bn, int64_t bk, float *out) {
    float table[256];
    fp8_e4m3fn_table(table);
    int64_t gn = (n + bn - 1) / bn, gk = (k + bk - 1) / bk;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *row = w + (g * n + i) * k;
            const float *s = scale + (g * gn + i / bn) * gk;
            float *o = out + (g * n + i) * k;
            for (int64_t jb = 0; jb < gk; jb++) {
                int64_t j0 = jb * bk, j1 = j0 + bk < k ? j0 + bk : k;
                float sc = s[jb];
                for (int64_t j = j0; j < j1; j++) o[j] = table[row[j]] * sc;
            }
        }
    }
}
