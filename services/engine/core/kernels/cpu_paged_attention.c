/* Float32 batched decode attention over the paged KV cache, for CPUs.
 *
 * The torch reference gathers every sequence's blocks into a padded [B, L, KVH, D] copy (twice:
 * K and V), builds a padding mask and calls scaled_dot_product_attention, which is a quarter of
 * a batch-32 decode step on 2 cores. This kernel reads the cache in place instead: one task per
 * (sequence, KV head) walks the sequence's block table one block at a time; the task's query
 * heads (grouped-query attention: query head h uses KV head h / (H / KVH)) score the block's
 * slots, keep a running max and sum (online softmax, as in FlashAttention and vLLM's paged
 * attention) and accumulate the weighted values. Nothing is copied and nothing is padded.
 *
 * Tasks run on OpenMP (PyTorch's own runtime; see native_build.py). Built at run time,
 * once per instruction set by services/engine/core/kernels/native_build.py (vector width from
 * tandem_simd.h).
 */
#include <math.h>

#include "tandem_simd.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    vec acc = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) acc += load_vec(a + d) * load_vec(b + d);
    float sum = hsum(acc);
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* acc[0:NV * LANES] = acc * rescale + sum_s p[s] * v[s * v_ss + 0:NV * LANES], the NV vectors of
 * one head in registers across the block's slots (independent chains, not one per chunk). */
static inline __attribute__((always_inline)) void weighted_values(
    float *acc, const float *v, int64_t v_ss, const float *p, int64_t slots, float rescale,
    const int nv) {
    vec a[nv];
    for (int c = 0; c < nv; c++) a[c] = load_vec(acc + c * LANES) * rescale;
    for (int64_t s = 0; s < slots; s++) {
        const float ps = p[s];
        for (int c = 0; c < nv; c++) a[c] += ps * load_vec(v + s * v_ss + c * LANES);
    }
    for (int c = 0; c < nv; c++) store_vec(acc + c * LANES, a[c]);
}

/* q [B, H, D] (strides q_sb, q_sh), caches [NB, BS, KVH, D] (strides *_sb, *_ss, *_sh; D
 * contiguous), tables [B, *] (row stride t_sb) and lens [B] as int64, out [B, H, D] contiguous.
 * When new_k is not NULL, each task first writes its sequence's new K and V rows (new_k, new_v
 * [B, KVH, D], strides nk_* and nv_*; D contiguous) for its KV head into slot (slot_blocks[b],
 * slot_offsets[b]): the step's store and attention in one call. */
void tandem_paged_decode_attention(
    const float *q, int64_t q_sb, int64_t q_sh,
    float *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    float *v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
    const int64_t *tables, int64_t t_sb, const int64_t *lens, float *out,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int threads,
    const float *new_k, int64_t nk_sb, int64_t nk_sh,
    const float *new_v, int64_t nv_sb, int64_t nv_sh,
    const int64_t *slot_blocks, const int64_t *slot_offsets) {
    const int64_t group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, kh = task % kv_heads, len = lens[b];
        if (new_k) {
            const int64_t block = slot_blocks[b], offset = slot_offsets[b];
            memcpy(k + block * k_sb + offset * k_ss + kh * k_sh,
                   new_k + b * nk_sb + kh * nk_sh, (size_t)head_dim * sizeof(float));
            memcpy(v + block * v_sb + offset * v_ss + kh * v_sh,
                   new_v + b * nv_sb + kh * nv_sh, (size_t)head_dim * sizeof(float));
        }
        float acc[group * head_dim], running_max[group], total[group], scores[group * block_size];
        memset(acc, 0, sizeof acc);
        for (int64_t g = 0; g < group; g++) running_max[g] = -INFINITY, total[g] = 0.f;
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t block = tables[b * t_sb + start / block_size];
            const int64_t slots = len - start < block_size ? len - start : block_size;
            const float *kb = k + block * k_sb + kh * k_sh, *vb = v + block * v_sb + kh * v_sh;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + b * q_sb + (kh * group + g) * q_sh;
                float *pg = scores + g * block_size, block_max = -INFINITY;
                for (int64_t s = 0; s < slots; s++) {
                    pg[s] = scale * dot(qg, kb + s * k_ss, head_dim);
                    block_max = pg[s] > block_max ? pg[s] : block_max;
                }
                const float new_max = block_max > running_max[g] ? block_max : running_max[g];
                const float rescale = expf(running_max[g] - new_max);  /* 0 on the first block */
                running_max[g] = new_max;
                int64_t s = 0;
                vec totals = {0};
                for (; s + LANES <= slots; s += LANES) {
                    const vec e = vexp(load_vec(pg + s) - new_max);
                    store_vec(pg + s, e);
                    totals += e;
                }
                float block_total = hsum(totals);
                for (; s < slots; s++) block_total += pg[s] = expf(pg[s] - new_max);
                total[g] = total[g] * rescale + block_total;
                float *ag = acc + g * head_dim;
                if (head_dim == 64) {
                    weighted_values(ag, vb, v_ss, pg, slots, rescale, 64 / LANES);
                } else if (head_dim == 128) {
                    weighted_values(ag, vb, v_ss, pg, slots, rescale, 128 / LANES);
                } else { /* acc = acc * rescale + sum_s p[s] * V[s], one chunk of D at a time */
                    int64_t d = 0;
                    for (; d + LANES <= head_dim; d += LANES) {
                        vec a = load_vec(ag + d) * rescale;
                        for (int64_t t = 0; t < slots; t++) a += pg[t] * load_vec(vb + t * v_ss + d);
                        store_vec(ag + d, a);
                    }
                    for (; d < head_dim; d++) {
                        float a = ag[d] * rescale;
                        for (int64_t t = 0; t < slots; t++) a += pg[t] * vb[t * v_ss + d];
                        ag[d] = a;
                    }
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *og = out + (b * heads + kh * group + g) * head_dim;
            const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
            for (int64_t d = 0; d < head_dim; d++) og[d] = acc[g * head_dim + d] * inv;
        }
    }
}
