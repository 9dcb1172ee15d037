/* ---- a whole step's decoder layers, in one call ---- */

#include "cpu_kernels.h"

/* One decoder layer's tensors: packed linear weights (pd_pack_linear_weight's layout), norm
   weights [H] or [D] (the model's dtype), its KV cache. qkv_bias, q_norm and k_norm may be
   NULL (Qwen2 has the bias, Qwen3 the per-head norms). */
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o_proj, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache;
} pd_layer;

/* Per-head RMSNorm in place over `heads` heads of D in each of B rows (row_stride apart). */
static void norm_heads(void *x, int64_t row_stride, int64_t B, int64_t heads, int64_t D, const void *weight, float eps,
                       int dtype) {
    float *row = malloc(D * sizeof(float)), *wf = malloc(D * sizeof(float));
    load_row(wf, weight, D, dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < heads; h++) {
            void *p = at(x, b * row_stride + h * D, dtype);
            load_row(row, p, D, dtype);
            normalize_row(row, wf, D, eps, dtype);
            store_row(p, row, D, dtype);
        }
    free(row), free(wf);
}

/* A CPU step's decoder layers, its rows decode tokens and prompt chunks' tokens alike (the
   attention tells them apart by context_lens alone), h: [B, H] (dtype), updated in place
   through every layer: for each,
     h = h + o_proj(attend(rotary(q), store(rotary(k), v))),  q|k|v = qkv(rms_norm(h))
     h = h + down(silu(gate) * up),                           gate|up = gate_up(rms_norm(h))
   with pd_linear's prologues and epilogues, pd_rotary_store_attend, and Qwen3's per-head
   norms of q and k between; every intermediate rounded to dtype as the per-op path rounds
   it. I: the MLP's intermediate size; wdtype: the packed weights' (pd_linear's); the step's
   metadata as pd_rotary_store_attend's. */
void pd_step_layers(void *h, int64_t B, const pd_layer *layers, int64_t num_layers, int64_t H, int64_t Hq, int64_t Hk,
                    int64_t D, int64_t I, float eps, float scale, int dtype, int wdtype, const int64_t *positions,
                    const float *cos_sin, const int64_t *slots, int kv_dtype, const int32_t *block_tables,
                    int64_t table_stride, const int32_t *context_lens, int64_t block_size, int nthreads) {
    const int64_t q_size = Hq * D, kv_size = Hk * D, QKV = q_size + 2 * kv_size, size = dtype == BF16 ? 2 : 4;
    char *qkv = malloc(B * QKV * size), *attn = malloc(B * q_size * size), *gate_up = malloc(B * 2 * I * size);
    for (int64_t l = 0; l < num_layers; l++) {
        const pd_layer *L = layers + l;
        pd_linear(h, LINEAR_RMS_NORM, L->input_norm, eps, L->qkv, L->qkv_bias, NULL, qkv, B, H, QKV, dtype, wdtype, nthreads);
        if (L->q_norm) {
            norm_heads(qkv, QKV, B, Hq, D, L->q_norm, eps, dtype);
            norm_heads(qkv + q_size * size, QKV, B, Hk, D, L->k_norm, eps, dtype);
        }
        pd_rotary_store_attend(attn, qkv, QKV, qkv + q_size * size, QKV, qkv + (q_size + kv_size) * size, QKV, dtype,
                               positions, cos_sin, slots, L->k_cache, L->v_cache, kv_dtype, block_tables, table_stride,
                               context_lens, B, Hq, Hk, D, block_size, scale, nthreads);
        /* residual == y: the epilogue reads each element before it writes it */
        pd_linear(attn, LINEAR_PLAIN, NULL, 0.f, L->o_proj, NULL, h, h, B, q_size, H, dtype, wdtype, nthreads);
        pd_linear(h, LINEAR_RMS_NORM, L->post_norm, eps, L->gate_up, NULL, NULL, gate_up, B, H, 2 * I, dtype, wdtype, nthreads);
        pd_linear(gate_up, LINEAR_SILU_MUL, NULL, 0.f, L->down, NULL, h, h, B, I, H, dtype, wdtype, nthreads);
    }
    free(qkv), free(attn), free(gate_up);
}
