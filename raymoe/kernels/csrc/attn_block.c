/* The attention half of a pre-norm decoder layer for decode tokens, in one call: RMSNorm, qkv projection, q/k
 * norm + RoPE, KV store, paged attention, o projection, residual add + RMSNorm, router logits and top-k. */
#include "cpu_ops.h"

/* Eight floats in a vector register (GCC/Clang vector extension; aligned(4): loads need no 32-byte alignment). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

/* y[t, n] = sum_i x[t, i] * wt[i, n] for t < rows, n < out: a linear layer without bias over its transposed
 * weight wt [in, out] contiguous, row strides xs and ys in floats. Tiles of four rows by 16 outputs keep their
 * sums in eight vector registers, and each weight vector loaded feeds four rows; the last out % 16 outputs take a
 * scalar loop. */
static void linear_t(const float *x, int64_t xs, const float *wt, int64_t in, int64_t out, int64_t rows, float *y,
                     int64_t ys) {
    int64_t tiled = out - out % 16;
    for (int64_t t0 = 0; t0 < rows; t0 += 4) {
        int64_t nb = rows - t0 < 4 ? rows - t0 : 4;
        const float *xr[4];
        for (int64_t r = 0; r < 4; r++) xr[r] = x + (t0 + (r < nb ? r : 0)) * xs;
        for (int64_t n0 = 0; n0 < tiled; n0 += 16) {
            v8f a0 = {0.f}, a1 = {0.f}, b0 = {0.f}, b1 = {0.f}, c0 = {0.f}, c1 = {0.f}, d0 = {0.f}, d1 = {0.f};
            for (int64_t i = 0; i < in; i++) {
                v8f w0 = *(const v8f *)(wt + i * out + n0), w1 = *(const v8f *)(wt + i * out + n0 + 8);
                float p = xr[0][i], q = xr[1][i], r = xr[2][i], s = xr[3][i];
                a0 += p * w0;
                a1 += p * w1;
                b0 += q * w0;
                b1 += q * w1;
                c0 += r * w0;
                c1 += r * w1;
                d0 += s * w0;
                d1 += s * w1;
            }
            v8f res[4][2] = {{a0, a1}, {b0, b1}, {c0, c1}, {d0, d1}};
            for (int64_t r = 0; r < nb; r++) memcpy(y + (t0 + r) * ys + n0, res[r], 16 * sizeof(float));
        }
        for (int64_t n = tiled; n < out; n++)
            for (int64_t r = 0; r < nb; r++) {
                float acc = 0.f;
                for (int64_t i = 0; i < in; i++) acc += xr[r][i] * wt[i * out + n];
                y[(t0 + r) * ys + n] = acc;
            }
    }
}

/* What a layer's attention block keeps from step to step: sizes, norm constants and weight pointers (mirrored
 * by AttnBlockParams in raymoe/kernels/attn_block.py; keep the two in the same order). experts == 0: a layer
 * without a router (a dense MLP follows), router fields unused. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, experts, top_k, renorm, table_rows;
    float norm_eps, qk_eps, scale, routed_scale;
    const float *ln1_w;     /* [hidden] */
    const float *w_qkv_t;   /* [hidden, (heads + 2 * kv_heads) * head_dim]: q columns, k columns, v columns */
    const float *qk_norm_w; /* [heads + kv_heads, head_dim], NULL: no q/k norm */
    const float *cos_t;     /* [table_rows, head_dim] */
    const float *sin_t;     /* [table_rows, head_dim] */
    const float *w_o_t;     /* [heads * head_dim, hidden] */
    const float *ln2_w;     /* [hidden] */
    const float *w_gate_t;  /* [hidden, experts] */
} raymoe_attn_block_params;

/* One token per row t < rows (x [rows, hidden], row stride xs: the residual stream entering the layer):
 *   h = rms_norm(x) * ln1; q, k, v = h @ w_qkv_t; per-head RMSNorm of q and k (when qk_norm_w), neox RoPE at
 *   positions[t]; k and v of every token stored at slot loc[t] of k_buf/v_buf ([slots, kv_heads, head_dim]);
 *   attention of q over the first seq_lens[t] slots of slot list r_t of kv_indices ([index_rows, width], row
 *   stride idx_stride), r_t = token_rows ? token_rows[t] : t (as raymoe_paged_attention_f32: a decode token
 *   passes its sequence length, an extend token at position p its request's row and p + 1); o = attn @ w_o_t;
 *   res_out = x + o; h_out = rms_norm(res_out) * ln2; and with a router, the top_k experts of softmax(h_out @
 *   w_gate_t) in topk_ids / topk_w (as raymoe_topk_softmax_f32).
 * res_out and h_out are [rows, hidden] contiguous; topk_w [rows, top_k] float, topk_ids [rows, top_k] int64.
 * Every index is checked before anything is written. Returns 0; -1 a slot (loc or attended) outside
 * [0, slots); -2 no memory for the scratch rows; -3 a token row outside [0, index_rows); -4 a position outside the
 * rotary table. */
int raymoe_attn_block_f32(const raymoe_attn_block_params *p, const float *x, int64_t xs, int64_t rows,
                          const int64_t *positions, const int64_t *loc, float *k_buf, float *v_buf, int64_t slots,
                          const int64_t *kv_indices, int64_t idx_stride, int64_t width, int64_t index_rows,
                          const int64_t *token_rows, const int64_t *seq_lens, float *res_out, float *h_out,
                          float *topk_w, int64_t *topk_ids) {
    int64_t d = p->head_dim, hq = p->heads, hkv = p->kv_heads, hidden = p->hidden;
    int64_t qkv_cols = (hq + 2 * hkv) * d;
    for (int64_t t = 0; t < rows; t++) {
        if (positions[t] < 0 || positions[t] >= p->table_rows) return -4;
        if (loc[t] < 0 || loc[t] >= slots) return -1;
        if (token_rows && (token_rows[t] < 0 || token_rows[t] >= index_rows)) return -3;
        int64_t n = seq_lens[t] > width ? width : (seq_lens[t] < 1 ? 1 : seq_lens[t]);
        const int64_t *idx = kv_indices + (token_rows ? token_rows[t] : t) * idx_stride;
        for (int64_t j = 0; j < n; j++)
            if (idx[j] < 0 || idx[j] >= slots) return -1;
    }
    size_t floats = (size_t)rows * (size_t)(hidden + qkv_cols + hq * d + hidden + (p->experts > 0 ? p->experts : 1));
    float *scratch = (float *)malloc((floats > 0 ? floats : 1) * sizeof(float));
    if (scratch == NULL) return -2;
    float *h = scratch;
    float *qkv = h + rows * hidden;
    float *attn = qkv + rows * qkv_cols;
    float *o = attn + rows * hq * d;
    float *logits = o + rows * hidden;
    raymoe_add_rms_norm_f32(x, xs, NULL, 0, NULL, 0, p->ln1_w, h, hidden, rows, hidden, p->norm_eps);
    linear_t(h, hidden, p->w_qkv_t, hidden, qkv_cols, rows, qkv, qkv_cols);
    raymoe_qk_norm_rope_f32(qkv, qkv_cols, rows, hq + hkv, d, p->qk_norm_w, p->qk_eps, p->cos_t, p->sin_t,
                            positions, p->table_rows);
    raymoe_kv_store_f32(qkv + hq * d, qkv_cols, qkv + (hq + hkv) * d, qkv_cols, loc, rows, hkv * d, k_buf, v_buf,
                        slots);
    int rc = raymoe_paged_attention_f32(qkv, qkv_cols, k_buf, v_buf, kv_indices, idx_stride, width, index_rows,
                                        token_rows, seq_lens, rows, hq, hkv, d, p->scale, attn, slots);
    if (rc == 0) {
        linear_t(attn, hq * d, p->w_o_t, hq * d, hidden, rows, o, hidden);
        raymoe_add_rms_norm_f32(o, hidden, x, xs, res_out, hidden, p->ln2_w, h_out, hidden, rows, hidden,
                                p->norm_eps);
        if (p->experts > 0) {
            linear_t(h_out, hidden, p->w_gate_t, hidden, p->experts, rows, logits, p->experts);
            raymoe_topk_softmax_f32(logits, p->experts, rows, p->experts, p->top_k, (int)p->renorm,
                                    p->routed_scale, topk_w, topk_ids);
        }
    }
    free(scratch);
    return rc;
}
