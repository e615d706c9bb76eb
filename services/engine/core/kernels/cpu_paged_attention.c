/* Float32 attention over the paged KV cache, for CPUs: batched decode, and (below) prefill.
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
#include <stdlib.h>

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

/* ---- prefill: every query row of a step's prompts, causal, over the paged cache --------------
 *
 * PyTorch's fused CPU attention (flash) takes one prompt with nothing cached at a time, and a
 * cached prefix or several prompts go through a padded [B, max_q] batch under a mask. This
 * kernel reads the cache in place for all of them (the step's K/V are stored first, as for
 * decode): one task per (sequence, KV head, block of PREFILL_ROWS query rows) holds the block's
 * rows times the group's query heads (GROUP x PREFILL_ROWS query vectors) and walks keys 0 ..
 * the block's last position in tiles of KEY_TILE. Per tile, as two small GEMMs:
 *
 *   scores [nq, KEY_TILE] = Q [nq, D] . K^T   (K's tile gathered transposed, [D, KEY_TILE]:
 *                                              register blocks of ROW_BLOCK queries x TILE keys)
 *   out    [nq, D]       = out * rescale + P [nq, KEY_TILE] . V  (ROW_BLOCK queries x TILE of D)
 *
 * with an online softmax between them (running max and sum per query vector, as FlashAttention).
 * A query row sees the positions up to its own (causal), keys past it get no weight. Tasks run
 * on OpenMP, the ones with the most keys first. */
#define PREFILL_ROWS 16
#define KEY_TILE 64
/* query vectors per register block: ATTN_ROWS x VECS accumulators, 12 of AVX2's 16 registers
 * (8 left FMA chains too few to cover the multiply-add latency), 24 of AVX-512's 32 */
#if LANES == 16
#define ATTN_ROWS 12
#elif LANES == 8
#define ATTN_ROWS 6
#else
#define ATTN_ROWS 4
#endif

/* Scores of ATTN_ROWS query vectors (rows qs, stride head_dim) against TILE keys (kt: [D, ldk]
 * from column 0), into sc (stride KEY_TILE), times scale. n: query vectors, at most ATTN_ROWS. */
static inline __attribute__((always_inline)) void score_block(
    const float *qs, int64_t head_dim, const float *kt, int64_t ldk, float *sc, float scale,
    const int n) {
    vec acc[ATTN_ROWS][VECS];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < VECS; c++) acc[r][c] = (vec){0};
    for (int64_t d = 0; d < head_dim; d++) {
        vec kv[VECS];
        for (int c = 0; c < VECS; c++) kv[c] = load_vec(kt + d * ldk + c * LANES);
        for (int r = 0; r < n; r++) {
            const vec qd = splat(qs[r * head_dim + d]);
            for (int c = 0; c < VECS; c++) acc[r][c] += qd * kv[c];
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < VECS; c++) store_vec(sc + r * KEY_TILE + c * LANES, acc[r][c] * scale);
}

/* o[r] (stride head_dim) = o[r] * rescale[r] + sum_s p[r][s] * V[s] over ATTN_ROWS query vectors and
 * NV vectors of D from column d; V rows at vrows[s] + d. n: query vectors, at most ATTN_ROWS. */
static inline __attribute__((always_inline)) void value_block(
    float *o, int64_t head_dim, const float *p, const float *rescale, const float *const *vrows,
    int64_t slots, int64_t d, const int n, const int nv) {
    vec acc[ATTN_ROWS][VECS];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = load_vec(o + r * head_dim + d + c * LANES) * rescale[r];
    for (int64_t s = 0; s < slots; s++) {
        vec vv[VECS];
        for (int c = 0; c < nv; c++) vv[c] = load_vec(vrows[s] + d + c * LANES);
        for (int r = 0; r < n; r++) {
            const vec ps = splat(p[r * KEY_TILE + s]);
            for (int c = 0; c < nv; c++) acc[r][c] += ps * vv[c];
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) store_vec(o + r * head_dim + d + c * LANES, acc[r][c]);
}

/* Online-softmax step for one query vector's scores px[0:seen] of a key tile (seen >= 1): updates
 * its running max and total, turns px into the tile's weights (zeros from seen to KEY_TILE) and
 * returns the factor the vector's earlier output is scaled by. */
static inline float softmax_tile(float *px, int64_t seen, float *running_max, float *total) {
    vec maxes = splat(-INFINITY);
    int64_t s = 0;
    for (; s + LANES <= seen; s += LANES) {
        const vec x = load_vec(px + s);
        maxes = vselect(x > maxes, x, maxes);
    }
    float lanes[LANES], tile_max = -INFINITY;
    memcpy(lanes, &maxes, sizeof lanes);
    for (int l = 0; l < LANES; l++) tile_max = lanes[l] > tile_max ? lanes[l] : tile_max;
    for (; s < seen; s++) tile_max = px[s] > tile_max ? px[s] : tile_max;
    const float new_max = tile_max > *running_max ? tile_max : *running_max;
    const float rescale = expf(*running_max - new_max); /* 0 on the first tile */
    *running_max = new_max;
    vec totals = {0};
    for (s = 0; s + LANES <= seen; s += LANES) {
        const vec e = vexp(load_vec(px + s) - new_max);
        store_vec(px + s, e);
        totals += e;
    }
    float tile_total = hsum(totals);
    for (; s < seen; s++) tile_total += px[s] = expf(px[s] - new_max);
    for (; s < KEY_TILE; s++) px[s] = 0.f;
    *total = *total * rescale + tile_total;
    return rescale;
}

/* Row stride of a sequence's transposed keys: its context in whole tiles, plus 16 floats (one
 * cache line) so that a power-of-two context does not put every row of a tile in one L1 set. */
static inline int64_t key_stride(int64_t len) { return (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE + 16; }

/* q [T, H, D] (strides q_st, q_sh; T = the step's new tokens, sequence after sequence), caches
 * [NB, BS, KVH, D] (strides *_sb, *_ss, *_sh; D contiguous) already holding the step's K/V,
 * tables [B, *] (row stride t_sb), context_lens and query_lens [B] as int64 (sequence b's query
 * rows sit at positions context_lens[b] - query_lens[b] ...), out [T, H, D] contiguous.
 * head_dim must be a multiple of LANES. */
void tandem_paged_prefill_attention(
    const float *q, int64_t q_st, int64_t q_sh,
    const float *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    const float *v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
    const int64_t *tables, int64_t t_sb, const int64_t *context_lens, const int64_t *query_lens,
    float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int threads) {
    const int64_t group = heads / kv_heads;
    /* each sequence's keys, transposed once for all its tasks: [KVH, D, ldk] from kt_start[b] */
    int64_t blocks = 0, kt_size = 0; /* query blocks of all sequences; floats of transposed keys */
    int64_t *kt_start = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    for (int64_t b = 0; b < batch; b++) {
        blocks += (query_lens[b] + PREFILL_ROWS - 1) / PREFILL_ROWS;
        kt_start[b] = kt_size;
        kt_size += kv_heads * head_dim * key_stride(context_lens[b]);
    }
    float *kt_all = malloc(sizeof(float) * (size_t)(kt_size > 0 ? kt_size : 1));
    /* block i -> (sequence, first row of the sequence's tokens, first query row of the block);
     * ordered by the block's last position, descending, so the longest tasks start first */
    int64_t *seq_of = malloc(sizeof(int64_t) * 3 * (size_t)(blocks > 0 ? blocks : 1));
    int64_t *start_of = seq_of + blocks, *row_of = start_of + blocks;
    {
        int64_t i = 0, start = 0;
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t j = 0; j < query_lens[b]; j += PREFILL_ROWS, i++)
                seq_of[i] = b, start_of[i] = start, row_of[i] = j;
            start += query_lens[b];
        }
        for (int64_t a = 1; a < blocks; a++) { /* insertion sort, by the block's first position */
            const int64_t sb = seq_of[a], st = start_of[a], rw = row_of[a];
            const int64_t first = context_lens[sb] - query_lens[sb] + rw;
            int64_t c = a;
            for (; c > 0 && context_lens[seq_of[c - 1]] - query_lens[seq_of[c - 1]] + row_of[c - 1] < first; c--)
                seq_of[c] = seq_of[c - 1], start_of[c] = start_of[c - 1], row_of[c] = row_of[c - 1];
            seq_of[c] = sb, start_of[c] = st, row_of[c] = rw;
        }
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < batch * kv_heads; task++) {
            const int64_t b = task / kv_heads, kh = task % kv_heads, len = context_lens[b];
            const int64_t ldk = key_stride(len);
            float *kt = kt_all + kt_start[b] + kh * head_dim * ldk;
            for (int64_t pos = 0; pos < len; pos++) {
                const float *kr = k + tables[b * t_sb + pos / block_size] * k_sb + (pos % block_size) * k_ss + kh * k_sh;
                for (int64_t d = 0; d < head_dim; d++) kt[d * ldk + pos] = kr[d];
            }
            for (int64_t d = 0; d < head_dim; d++)
                for (int64_t pos = len; pos < ldk; pos++) kt[d * ldk + pos] = 0.f;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < blocks * kv_heads; task++) {
            const int64_t i = task / kv_heads, kh = task % kv_heads, b = seq_of[i];
            const int64_t j0 = row_of[i];
            const int64_t rows = query_lens[b] - j0 < PREFILL_ROWS ? query_lens[b] - j0 : PREFILL_ROWS;
            const int64_t first_pos = context_lens[b] - query_lens[b] + j0, nq = rows * group;
            const int64_t last_pos = first_pos + rows - 1;
            const int64_t ldk = key_stride(context_lens[b]);
            const float *kt = kt_all + kt_start[b] + kh * head_dim * ldk;
            float qs[PREFILL_ROWS * group * head_dim], o[PREFILL_ROWS * group * head_dim];
            float p[PREFILL_ROWS * group * KEY_TILE];
            float running_max[PREFILL_ROWS * group], total[PREFILL_ROWS * group];
            float rescale[PREFILL_ROWS * group];
            const float *vrows[KEY_TILE];
            for (int64_t r = 0; r < rows; r++) /* query vector r * group + g: row r, head kh * group + g */
                for (int64_t g = 0; g < group; g++)
                    memcpy(qs + (r * group + g) * head_dim,
                           q + (start_of[i] + j0 + r) * q_st + (kh * group + g) * q_sh,
                           (size_t)head_dim * sizeof(float));
            memset(o, 0, sizeof(float) * (size_t)(nq * head_dim));
            for (int64_t x = 0; x < nq; x++) running_max[x] = -INFINITY, total[x] = 0.f;
            for (int64_t ks = 0; ks <= last_pos; ks += KEY_TILE) {
                const int64_t slots = last_pos + 1 - ks < KEY_TILE ? last_pos + 1 - ks : KEY_TILE;
                const int64_t chunks = (slots + TILE - 1) / TILE; /* TILE keys per score block */
                for (int64_t s = 0; s < slots; s++) {
                    const int64_t pos = ks + s;
                    vrows[s] = v + tables[b * t_sb + pos / block_size] * v_sb + (pos % block_size) * v_ss + kh * v_sh;
                }
                for (int64_t c = 0; c < chunks; c++) {
                    const float *kc = kt + ks + c * TILE;
                    int64_t x = 0;
                    for (; x + ATTN_ROWS <= nq; x += ATTN_ROWS)
                        score_block(qs + x * head_dim, head_dim, kc, ldk, p + x * KEY_TILE + c * TILE, scale,
                                    ATTN_ROWS);
                    for (; x < nq; x++)
                        score_block(qs + x * head_dim, head_dim, kc, ldk, p + x * KEY_TILE + c * TILE, scale, 1);
                }
                int64_t used = 0; /* the most keys any query vector of the tile sees */
                for (int64_t x = 0; x < nq; x++) {
                    int64_t seen = first_pos + x / group + 1 - ks; /* keys ks .. its position */
                    seen = seen > slots ? slots : seen;
                    if (seen <= 0) { /* the whole tile is past this row: no weight, nothing rescaled */
                        memset(p + x * KEY_TILE, 0, sizeof(float) * KEY_TILE);
                        rescale[x] = 1.f;
                        continue;
                    }
                    used = seen > used ? seen : used;
                    rescale[x] = softmax_tile(p + x * KEY_TILE, seen, running_max + x, total + x);
                }
                int64_t d = 0;
                for (; d + TILE <= head_dim; d += TILE) {
                    int64_t x = 0;
                    for (; x + ATTN_ROWS <= nq; x += ATTN_ROWS)
                        value_block(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, vrows, used,
                                    d, ATTN_ROWS, VECS);
                    for (; x < nq; x++)
                        value_block(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, vrows, used,
                                    d, 1, VECS);
                }
                for (; d < head_dim; d += LANES) {
                    int64_t x = 0;
                    for (; x + ATTN_ROWS <= nq; x += ATTN_ROWS)
                        value_block(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, vrows, used,
                                    d, ATTN_ROWS, 1);
                    for (; x < nq; x++)
                        value_block(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, vrows, used,
                                    d, 1, 1);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t x = r * group + g;
                    float *ox = out + (start_of[i] + j0 + r) * heads * head_dim + (kh * group + g) * head_dim;
                    const float inv = total[x] > 0.f ? 1.f / total[x] : 0.f;
                    for (int64_t dd = 0; dd < head_dim; dd++) ox[dd] = o[x * head_dim + dd] * inv;
                }
        }
    }
    free(seq_of);
    free(kt_all);
    free(kt_start);
}
