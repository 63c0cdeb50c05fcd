/* The attention half of a pre-norm decoder layer for decode tokens, in one call: RMSNorm, qkv projection, q/k
 * norm + RoPE, KV store, paged attention, o projection, residual add + RMSNorm, router logits and top-k. */
#include "cpu_ops.h"

/* What a layer's attention block keeps from step to step: sizes, norm constants and weight pointers (mirrored
 * by AttnBlockParams in raymoe/platform/cpu/kernels/attn_block.py; keep the two in the same order). experts == 0: a layer
 * without a router (a dense MLP follows), router fields unused. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, experts, top_k, renorm, table_rows;
    float norm_eps, qk_eps, scale, routed_scale;
    const float *ln1_w;     /* [hidden] */
    const float *w_qkv_p;   /* [(heads + 2 * kv_heads) * head_dim, hidden] packed (gemm.c): q, k, v outputs */
    const float *qk_norm_w; /* [heads + kv_heads, head_dim], NULL: no q/k norm */
    const float *cos_t;     /* [table_rows, head_dim] */
    const float *sin_t;     /* [table_rows, head_dim] */
    const float *w_o_p;     /* [hidden, heads * head_dim] packed */
    const float *ln2_w;     /* [hidden] */
    const float *w_gate_p;  /* [experts, hidden] packed */
} raymoe_attn_block_params;

/* One token per row t < rows (x [rows, hidden], row stride xs: the residual stream entering the layer):
 *   h = rms_norm(x) * ln1; q, k, v = h @ w_qkv^T; per-head RMSNorm of q and k (when qk_norm_w), neox RoPE at
 *   positions[t]; k and v of every token stored at slot loc[t] of k_buf/v_buf ([slots, kv_heads, head_dim]);
 *   attention of q over the first seq_lens[t] slots of slot list r_t of kv_indices ([index_rows, width], row
 *   stride idx_stride), r_t = token_rows ? token_rows[t] : t (as raymoe_paged_attention_f32: a decode token
 *   passes its sequence length, an extend token at position p its request's row and p + 1); o = attn @ w_o^T;
 *   res_out = x + o; h_out = rms_norm(res_out) * ln2; and with a router, the top_k experts of softmax(h_out @
 *   w_gate^T) in topk_ids / topk_w (as raymoe_topk_softmax_f32).
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
    raymoe_linear_packed_f32(h, hidden, rows, p->w_qkv_p, qkv_cols, hidden, qkv, qkv_cols);
    raymoe_qk_norm_rope_f32(qkv, qkv_cols, rows, hq + hkv, d, p->qk_norm_w, p->qk_eps, p->cos_t, p->sin_t,
                            positions, p->table_rows);
    raymoe_kv_store_f32(qkv + hq * d, qkv_cols, qkv + (hq + hkv) * d, qkv_cols, loc, rows, hkv * d, k_buf, v_buf,
                        slots);
    int rc = raymoe_paged_attention_f32(qkv, qkv_cols, k_buf, v_buf, kv_indices, idx_stride, width, index_rows,
                                        token_rows, seq_lens, rows, hq, hkv, d, p->scale, attn, slots);
    if (rc == 0) {
        raymoe_linear_packed_f32(attn, hq * d, rows, p->w_o_p, hidden, hq * d, o, hidden);
        raymoe_add_rms_norm_f32(o, hidden, x, xs, res_out, hidden, p->ln2_w, h_out, hidden, rows, hidden,
                                p->norm_eps);
        if (p->experts > 0) {
            raymoe_linear_packed_f32(h_out, hidden, rows, p->w_gate_p, p->experts, hidden, logits, p->experts);
            raymoe_topk_softmax_f32(logits, p->experts, rows, p->experts, p->top_k, (int)p->renorm,
                                    p->routed_scale, topk_w, topk_ids);
        }
    }
    free(scratch);
    return rc;
}
