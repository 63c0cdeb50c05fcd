/* Paged attention over the KV cache (decode and extend). */
#include "cpu_ops.h"

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
 * r_b = rows ? rows[b] : b (rows lets every token of an extended request share its request's list of the
 * index_rows lists) and attends to its first n_b = min(max(seq_lens[b], 1), width) slots
 * of k_buf/v_buf ([slots, kv_heads, dim], contiguous): a decode row passes its sequence length, an extend token
 * at position p passes p + 1, which makes the attention causal. Query heads are grouped: head h reads kv head
 * h / (heads / kv_heads). q [bs, heads, dim] with token stride q_stride (head stride dim); out [bs, heads, dim]
 * contiguous. Softmax subtracts the row maximum (exact, not online).
 * Returns 0, or (writing nothing) -1 when an attended slot lies outside [0, slots), -3 when a row r_b lies
 * outside [0, index_rows). */
int raymoe_paged_attention_f32(const float *q, int64_t q_stride, const float *k_buf, const float *v_buf,
                               const int64_t *kv_indices, int64_t idx_stride, int64_t width, int64_t index_rows,
                               const int64_t *rows, const int64_t *seq_lens, int64_t bs, int64_t heads,
                               int64_t kv_heads, int64_t dim, float scale, float *out, int64_t slots) {
    int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < bs; b++) {
        if (rows && (rows[b] < 0 || rows[b] >= index_rows)) return -3;
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
