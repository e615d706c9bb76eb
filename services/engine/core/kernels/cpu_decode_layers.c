/* Every decoder layer of a float32 decode step in one call, for CPUs.
 *
 * At batch-1 decode of a small model the kernels themselves are fast and the step is dominated by
 * what happens between them: a layer is about ten PyTorch ops and kernel calls from Python (norm,
 * projection, rotary, attention with the K/V store, projection, norm, projection, SwiGLU,
 * projection, residual add), each a few microseconds of interpreter, argument conversion and
 * tensor allocation, times thirty layers. This entry point runs the same kernels in the same
 * order from C, so the step pays that once instead of ~300 times.
 *
 * It is a unity build of the kernels it chains (the files below), so it computes exactly what the
 * per-op path computes, bit for bit: the same matmul chains (cpu_gemv.c / cpu_qgemv.c, and
 * cpu_q4a8_gemm.c's int8-activation decode kernel for q4_a8's projections), the same
 * fused norm, SwiGLU / GeGLU, q/k-norm and rotary loops (cpu_fused.c), the same attention and K/V
 * store (cpu_paged_attention.c: a float32, bfloat16 or float16 cache; a layer's sliding window and
 * score soft-cap), and the same residual adds in the same order.
 *
 * Families: Llama / Mistral / Qwen2 (pre-norm, SwiGLU, QKV bias in the projection), Qwen3 (plus an
 * RMSNorm over each q and k head before the rotation), Gemma 2 / 3 (norms on attention's and the
 * MLP's outputs too, GeGLU, sliding-window layers with their own rope tables, Gemma 2's soft-cap).
 * Gemma's `1 + w` norm weights arrive folded: the RMSNorm kernel only ever multiplies by w.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_fused.c"
#include "cpu_gemv.c"
#include "cpu_paged_attention.c"
#include "cpu_q4a8_gemm.c" /* with cpu_qgemv.c */

enum { FORMAT_FLOAT32 = -1 };

/* One projection: float32 tiles (cpu_gemv.c) or quantized tiles (cpu_qgemv.c's format codes),
 * the latter's rows rounded to int8 when int8 is set (cpu_q4a8_gemm.c's decode kernel, q4_a8). */
typedef struct {
    int64_t format;
    const void *weight;
    const float *bias; /* padded to whole tiles, or NULL */
    int64_t in, out;
    int64_t int8;
} tandem_linear;

/* A projection as stored: 1 to MAX_PARTS runs of output rows, each in one format, whose outputs
 * sit side by side (a Q4_K_M file's fused q/k/v holds Q4_K q and k next to a Q6_K v). */
enum { MAX_PARTS = 3 };
typedef struct {
    int64_t parts;
    tandem_linear part[MAX_PARTS];
} tandem_projection;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    /* [hidden] RMSNorm weights: before attention, before the MLP; on attention's output and on
     * the MLP's output (Gemma's sandwich norms; NULL: none) */
    const float *input_norm, *post_norm, *attn_out_norm, *mlp_out_norm;
    const float *q_norm, *k_norm; /* [head_dim] per-head norms before the rotation, or NULL */
    tandem_projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's [blocks, block_size, kv_heads, head_dim] views */
    int64_t window;    /* sliding window (0: global attention) */
    int64_t local_rope; /* 1: rotate with the local tables (Gemma 3's sliding layers) */
    float scale, softcap; /* score scale; score soft-cap (0: none) */
} tandem_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; /* cache strides, the same for every layer */
    int64_t kv_dtype; /* the cache's element type (KV_FLOAT32, KV_BFLOAT16, KV_FLOAT16) */
    int64_t act;      /* the MLP's activation: ACT_SILU or ACT_GELU_TANH */
    float eps;
} tandem_decode_shape;

static int linear(const tandem_linear *l, const float *x, float *y, int64_t rows, int threads) {
    if (l->format == FORMAT_FLOAT32) {
        tandem_gemv(x, l->in, (const float *)l->weight, l->bias, y, rows, l->in, l->out, threads);
        return 0;
    }
    if (l->int8)
        return tandem_a8_gemv((int)l->format, x, l->in, (const uint8_t *)l->weight, l->bias, y,
                              rows, l->in, l->out, threads);
    return tandem_qgemv((int)l->format, x, l->in, (const uint8_t *)l->weight, l->bias, y, rows,
                        l->in, l->out, threads);
}

/* y [rows, sum of the parts' outs] = x's projection. One part writes y itself; with more, a part's
 * single row lands in its columns of y directly, and more rows go through scratch [rows, its
 * out] (each kernel writes rows of its own width). */
static int projection(const tandem_projection *p, const float *x, float *y, float *scratch,
                      int64_t rows, int threads) {
    if (p->parts == 1) return linear(&p->part[0], x, y, rows, threads);
    int64_t width = 0, offset = 0;
    for (int64_t i = 0; i < p->parts; i++) width += p->part[i].out;
    for (int64_t i = 0; i < p->parts; i++) {
        const tandem_linear *l = &p->part[i];
        int status = linear(l, x, rows == 1 ? y + offset : scratch, rows, threads);
        if (status) return status;
        if (rows > 1)
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + r * width + offset, scratch + r * l->out, (size_t)l->out * sizeof(float));
        offset += l->out;
    }
    return 0;
}

/* x [rows, hidden] contiguous: the residual stream entering layer 0, replaced by the stream
 * leaving the last layer, through final_norm when it is not NULL (the model's last RMSNorm
 * weights and final_eps: the kernel every other path runs it with, so the same bits). positions [rows] int64:
 * each row's position, its rotary row in cos / sin [table_rows, head_dim] (rope.py's tables) and,
 * for layers with local_rope set, local_cos / local_sin (the same shape; else never read), taken
 * here rather than gathered by PyTorch ops per step. tables [rows, *] (row stride t_sb), lens,
 * slot_blocks, slot_offsets [rows] int64: the decode step's attention metadata (one new token
 * per sequence). Returns 0; -1 when the step's buffer can't be allocated or a matmul fails (an
 * unknown format, or no memory for its scratch); -2 for a position outside the tables. */
int tandem_decode_layers(const tandem_decode_shape *s, const tandem_layer *layers,
                         int64_t n_layers, float *x, int64_t rows, const int64_t *positions,
                         const float *cos_table, const float *sin_table,
                         const float *local_cos_table, const float *local_sin_table,
                         int64_t table_rows, const int64_t *tables, int64_t t_sb,
                         const int64_t *lens, const int64_t *slot_blocks,
                         const int64_t *slot_offsets, const float *final_norm, float final_eps,
                         int threads) {
    const int64_t hidden = s->hidden, d = s->head_dim;
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_out = q_size + 2 * kv_size;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= table_rows) return -2;
    /* a part is at most its projection's width: the widest one bounds the scratch */
    int64_t widest = qkv_out > 2 * s->intermediate ? qkv_out : 2 * s->intermediate;
    if (hidden > widest) widest = hidden;
    const size_t floats = (size_t)rows * (size_t)(3 * hidden + qkv_out + q_size +
                                                  3 * s->intermediate + widest + 4 * d);
    float *buffer = malloc(floats * sizeof(float));
    if (!buffer) return -1;
    float *normed = buffer, *h = normed + rows * hidden, *stream = h + rows * hidden;
    float *qkv = stream + rows * hidden, *attn = qkv + rows * qkv_out;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * s->intermediate;
    float *scratch = act + rows * s->intermediate;
    /* the rows' rotary tables [rows, head_dim]: global, then local */
    float *cos = scratch + rows * widest, *sin = cos + rows * d;
    float *local_cos = sin + rows * d, *local_sin = local_cos + rows * d;
    for (int64_t r = 0; r < rows; r++) {
        const size_t row = (size_t)d * sizeof(float);
        memcpy(cos + r * d, cos_table + positions[r] * d, row);
        memcpy(sin + r * d, sin_table + positions[r] * d, row);
        memcpy(local_cos + r * d, local_cos_table + positions[r] * d, row);
        memcpy(local_sin + r * d, local_sin_table + positions[r] * d, row);
    }
    int status = 0;
    for (int64_t index = 0; index < n_layers; index++) {
        const tandem_layer *l = &layers[index];
        const float *c = l->local_rope ? local_cos : cos, *sn = l->local_rope ? local_sin : sin;
        tandem_add_rmsnorm(x, NULL, NULL, l->input_norm, normed, rows, hidden, s->eps);
        if ((status = projection(&l->qkv, normed, qkv, scratch, rows, threads))) break;
        /* q and k heads are adjacent in the fused projection: rotate both in one pass */
        if (l->q_norm)
            tandem_qk_norm_rope(qkv, qkv_out, l->q_norm, l->k_norm, c, sn, rows, s->heads,
                                s->kv_heads, d, s->eps);
        else
            tandem_rope(qkv, qkv_out, c, sn, rows, s->heads + s->kv_heads, d);
        tandem_paged_decode_attention(
            qkv, qkv_out, d, l->k_cache, s->k_sb, s->k_ss, s->k_sh, l->v_cache, s->v_sb, s->v_ss,
            s->v_sh, (int)s->kv_dtype, tables, t_sb, lens, attn, rows, s->heads, s->kv_heads, d,
            s->block_size, l->scale, l->window, l->softcap, threads, qkv + q_size, qkv_out, d,
            qkv + q_size + kv_size, qkv_out, d, slot_blocks, slot_offsets);
        if ((status = projection(&l->o, attn, h, scratch, rows, threads))) break;
        if (l->attn_out_norm) /* Gemma: h = RMSNorm(h), in place */
            tandem_add_rmsnorm(h, NULL, NULL, l->attn_out_norm, h, rows, hidden, s->eps);
        /* stream = x + h (the post-attention residual), normed = RMSNorm(stream) */
        tandem_add_rmsnorm(x, h, stream, l->post_norm, normed, rows, hidden, s->eps);
        if ((status = projection(&l->gate_up, normed, gate_up, scratch, rows, threads))) break;
        if (s->act == ACT_GELU_TANH)
            tandem_gelu_tanh_mul(gate_up, act, rows, s->intermediate);
        else
            tandem_silu_mul(gate_up, act, rows, s->intermediate);
        if ((status = projection(&l->down, act, h, scratch, rows, threads))) break;
        if (l->mlp_out_norm)
            tandem_add_rmsnorm(h, NULL, NULL, l->mlp_out_norm, h, rows, hidden, s->eps);
        for (int64_t i = 0; i < rows * hidden; i++) x[i] = stream[i] + h[i];
    }
    if (!status && final_norm) /* x = RMSNorm(x), in place */
        tandem_add_rmsnorm(x, NULL, NULL, final_norm, x, rows, hidden, final_eps);
    free(buffer);
    return status;
}
