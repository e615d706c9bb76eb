/* Attention over the paged KV cache, for CPUs: batched decode, and (below) prefill.
 *
 * The torch reference gathers every sequence's blocks into a padded [B, L, KVH, D] copy (twice:
 * K and V), builds a padding mask and calls scaled_dot_product_attention, which is a quarter of
 * a batch-32 decode step on 2 cores. This kernel reads the cache in place instead: one task per
 * (sequence, KV head) walks the sequence's block table one block at a time; the task's query
 * heads (grouped-query attention: query head h uses KV head h / (H / KVH)) score the block's
 * slots, keep a running max and sum (online softmax, as in FlashAttention and vLLM's paged
 * attention) and accumulate the weighted values. Nothing is copied and nothing is padded.
 *
 * The cache holds float32, bfloat16 or float16 values, or q8_0 rows (kv_dtype); queries, scores,
 * weights and outputs are float32. A 16-bit cache is widened as it is read (bfloat16: a shift;
 * float16: vcvtph2ps where the set has F16C), into a small float32 scratch that stays in L1: one
 * block's rows at a time for decode, a sequence's keys and values once per task for prefill. New
 * K/V rows are rounded to the cache's type as they are stored (to nearest even, as PyTorch's
 * casts round), so a row reads back the same bits whichever path stored it.
 *
 * A q8_0 cache (uint8 storage; strides count bytes) holds a row as head_dim int8 quants and then
 * one float16 scale per 32 values (services/engine/core/kv_quant.py, the PyTorch reference of the
 * same arithmetic: scale = max|x| / 127, quants rounded to nearest even). A value is read as
 * float(q) * scale, which is exact in float32, so every path below computes over a q8_0 cache
 * exactly what it computes over a float32 cache holding those values: the q8_0 kernels are the
 * float32 ones with another load, and decode and prefill keep one definition per position.
 *
 * Two options of some families' layers: ``window`` > 0 (sliding-window layers) lets a query at
 * position p see only keys p - window < k <= p: blocks wholly before the window are not read;
 * ``softcap`` > 0 (Gemma 2) turns each score s into softcap * tanh(s / softcap) before the softmax.
 *
 * Tasks run on OpenMP (PyTorch's own runtime; see native_build.py). Built at run time,
 * once per instruction set by services/engine/core/kernels/native_build.py (vector width from
 * tandem_simd.h). Three headers hold parts of this one library: paged_kv_values.h (the cache's
 * element types: widening, storing), paged_scores.h (score_keys, the scores both kernels compute
 * with) and paged_decode_rows.h (decode with the prefill's per-row arithmetic, and
 * tandem_paged_decode_attention), included at the end.
 */
#include <math.h>
#include <stdlib.h>

#include "tandem_simd.h"
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "paged_kv_values.h"

#if defined(__AVX2__)
/* The sums of 8 vectors' lanes as one vector (lane r: the sum of a[r]), by pairwise adds that
 * transpose as they go: 7 horizontal adds and a swap of halves instead of 8 separate sums. */
static inline __m256 sum_lanes8(const __m256 *a) {
    const __m256 ab = _mm256_hadd_ps(a[0], a[1]), cd = _mm256_hadd_ps(a[2], a[3]);
    const __m256 ef = _mm256_hadd_ps(a[4], a[5]), gh = _mm256_hadd_ps(a[6], a[7]);
    const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
    return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                         _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

/* The sums of LANES vectors' lanes as one vector. */
static inline vec sum_lanes(const vec *a) {
#if LANES == 16
    __m256 halves[16];
    for (int r = 0; r < 16; r++)
        halves[r] = _mm256_add_ps(_mm512_castps512_ps256((__m512)a[r]),
                                  _mm512_extractf32x8_ps((__m512)a[r], 1));
    return (vec)_mm512_insertf32x8(_mm512_castps256_ps512(sum_lanes8(halves)),
                                   sum_lanes8(halves + 8), 1);
#else
    return (vec)sum_lanes8((const __m256 *)a);
#endif
}
#endif

/* pg[0:slots] = scale * (q . K[s]) for the slots' keys (rows from element k0, stride ks). Where
 * the head is whole vectors, LANES keys at a time: LANES independent multiply-add chains, summed
 * across lanes together (sum_lanes); a single key's chain would wait on each add's latency and
 * then sum its lanes alone. */
static inline __attribute__((always_inline)) void score_slots(
    float *pg, const float *q, const void *k, int64_t k0, int64_t ks, int64_t slots, int64_t head_dim,
    float scale, const int kv) {
    int64_t s = 0;
#if defined(__AVX2__)
    if (head_dim % LANES == 0)
        for (; s + LANES <= slots; s += LANES) {
            vec acc[LANES];
            for (int r = 0; r < LANES; r++) acc[r] = (vec){0};
            for (int64_t d = 0; d < head_dim; d += LANES) {
                const vec qd = load_vec(q + d);
                for (int r = 0; r < LANES; r++) acc[r] += qd * load_kv(k, k0 + (s + r) * ks, d, head_dim, kv);
            }
            store_vec(pg + s, sum_lanes(acc) * scale);
        }
#endif
    for (; s < slots; s++) { /* explicit multiply-adds: the same bits for every cache type */
        vec acc = {0};
        int64_t d = 0;
        for (; d + LANES <= head_dim; d += LANES)
            acc = fused_madd(load_vec(q + d), load_kv(k, k0 + s * ks, d, head_dim, kv), acc);
        float sum = hsum(acc);
        for (; d < head_dim; d++) sum = fused_madd1(q[d], load_kv1(k, k0 + s * ks, d, head_dim, kv), sum);
        pg[s] = scale * sum;
    }
}

/* acc[0:NV * LANES] = acc * rescale + sum_s p[s] * V[s][0:NV * LANES] (rows from element v0,
 * stride vs), the NV vectors of one head in registers across the block's slots (independent
 * chains, not one per chunk). */
static inline __attribute__((always_inline)) void weighted_values(
    float *acc, const void *v, int64_t v0, int64_t vs, const float *p, int64_t slots, float rescale,
    const int nv, const int kv) {
    vec a[nv];
    for (int c = 0; c < nv; c++) a[c] = load_vec(acc + c * LANES) * rescale;
    for (int64_t s = 0; s < slots; s++) {
        const float ps = p[s];
        for (int c = 0; c < nv; c++) a[c] += ps * load_kv(v, v0 + s * vs, c * LANES, nv * LANES, kv);
    }
    for (int c = 0; c < nv; c++) store_vec(acc + c * LANES, a[c]);
}

/* One decode task of tandem_paged_decode_attention (sequence b, KV head kh), for a cache of type
 * kv (a constant: compiled once per type). */
static inline __attribute__((always_inline)) void decode_task(
    const float *q, int64_t q_sb, int64_t q_sh,
    void *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    void *v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
    const int64_t *tables, int64_t t_sb, int64_t len, float *out,
    int64_t b, int64_t kh, int64_t heads, int64_t group, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap, const int kv) {
    float acc[group * head_dim], running_max[group], total[group], scores[group * block_size];
    memset(acc, 0, sizeof acc);
    for (int64_t g = 0; g < group; g++) running_max[g] = -INFINITY, total[g] = 0.f;
    /* the query (position len - 1) sees positions first .. len - 1 */
    const int64_t first = window > 0 && len > window ? len - window : 0;
    for (int64_t start = first - first % block_size; start < len; start += block_size) {
        const int64_t block = tables[b * t_sb + start / block_size];
        const int64_t skip = first > start ? first - start : 0; /* slots before the window */
        const int64_t slots = (len - start < block_size ? len - start : block_size) - skip;
        const int64_t k0 = block * k_sb + skip * k_ss + kh * k_sh;
        const int64_t v0 = block * v_sb + skip * v_ss + kh * v_sh;
        for (int64_t g = 0; g < group; g++) {
            float *pg = scores + g * block_size, block_max = -INFINITY;
            const float *qg = q + b * q_sb + (kh * group + g) * q_sh;
            score_slots(pg, qg, k, k0, k_ss, slots, head_dim, scale, kv);
            if (softcap > 0.f) soft_cap(pg, slots, softcap);
            for (int64_t s = 0; s < slots; s++) block_max = pg[s] > block_max ? pg[s] : block_max;
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
                weighted_values(ag, v, v0, v_ss, pg, slots, rescale, 64 / LANES, kv);
            } else if (head_dim == 128) {
                weighted_values(ag, v, v0, v_ss, pg, slots, rescale, 128 / LANES, kv);
            } else { /* acc = acc * rescale + sum_s p[s] * V[s], one chunk of D at a time */
                int64_t d = 0;
                for (; d + LANES <= head_dim; d += LANES) {
                    vec a = load_vec(ag + d) * rescale;
                    for (int64_t t = 0; t < slots; t++)
                        a = fused_madd(splat(pg[t]), load_kv(v, v0 + t * v_ss, d, head_dim, kv), a);
                    store_vec(ag + d, a);
                }
                for (; d < head_dim; d++) {
                    float a = ag[d] * rescale;
                    for (int64_t t = 0; t < slots; t++)
                        a = fused_madd1(pg[t], load_kv1(v, v0 + t * v_ss, d, head_dim, kv), a);
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

/* ---- prefill: every query row of a step's prompts, causal, over the paged cache --------------
 *
 * PyTorch's fused CPU attention (flash) takes one prompt with nothing cached at a time, and a
 * cached prefix or several prompts go through a padded [B, max_q] batch under a mask. This
 * kernel reads the cache in place for all of them (the step's K/V are stored first, as for
 * decode): one task per (sequence, KV head, block of PREFILL_ROWS query rows) holds the block's
 * rows times the group's query heads (GROUP x PREFILL_ROWS query vectors) and walks keys 0 ..
 * the block's last position in tiles of KEY_TILE. Per tile, as two small GEMMs:
 *
 *   scores [nq, KEY_TILE] = Q [nq, D] . K^T   (score_keys: K's rows as stored, register blocks
 *                                              of SCORE_Q query vectors x SCORE_K keys)
 *   out    [nq, D]       = out * rescale + P [nq, KEY_TILE] . V  (ATTN_ROWS queries x TILE of D)
 *
 * with an online softmax between them (running max and sum per query vector, as FlashAttention).
 * A query row sees the positions up to its own (causal; with a window, only the last window of
 * them), keys past it get no weight; key tiles wholly before every row's window are skipped. A
 * 16-bit or q8_0 cache's keys and values are widened into float32 rows once per sequence. Tasks
 * run on OpenMP, the ones with the most keys first. */
#define PREFILL_ROWS 16
#define KEY_TILE 64
/* query vectors per register block of the values: ATTN_ROWS x VECS accumulators, 12 of AVX2's 16 registers
 * (8 left FMA chains too few to cover the multiply-add latency), 24 of AVX-512's 32 */
#if LANES == 16
#define ATTN_ROWS 12
#elif LANES == 8
#define ATTN_ROWS 6
#else
#define ATTN_ROWS 4
#endif

#include "paged_scores.h"

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
            for (int c = 0; c < nv; c++) acc[r][c] = fused_madd(ps, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) store_vec(o + r * head_dim + d + c * LANES, acc[r][c]);
}

/* Online-softmax step for one query vector's scores px[lo:seen] of a key tile (lo < seen; the
 * others are outside its causal window), soft-capped first when softcap > 0: updates its running
 * max and total, turns px into the tile's weights (zeros outside lo..seen - 1) and returns the
 * factor the vector's earlier output is scaled by. */
static inline float softmax_tile(float *px, int64_t lo, int64_t seen, float *running_max, float *total,
                                 float softcap) {
    if (softcap > 0.f) soft_cap(px + lo, seen - lo, softcap);
    for (int64_t s = 0; s < lo; s++) px[s] = 0.f;
    vec maxes = splat(-INFINITY);
    int64_t s = lo;
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
    for (s = lo; s + LANES <= seen; s += LANES) {
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


/* q [T, H, D] (strides q_st, q_sh; T = the step's new tokens, sequence after sequence), caches
 * [NB, BS, KVH, D] of type kv_dtype (strides *_sb, *_ss, *_sh in elements; D contiguous) already
 * holding the step's K/V, tables [B, *] (row stride t_sb), context_lens and query_lens [B] as
 * int64 (sequence b's query rows sit at positions context_lens[b] - query_lens[b] ...), out
 * [T, H, D] contiguous; window and softcap as for decode (0: off). head_dim must be a multiple
 * of LANES. */
void tandem_paged_prefill_attention(
    const float *q, int64_t q_st, int64_t q_sh,
    void *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    void *v, int64_t v_sb, int64_t v_ss, int64_t v_sh, int kv_dtype,
    const int64_t *tables, int64_t t_sb, const int64_t *context_lens, const int64_t *query_lens,
    float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, float softcap, int threads) {
    const int64_t group = heads / kv_heads;
    /* a 16-bit or q8_0 cache's keys and values, widened once for all of a sequence's tasks: float32
     * rows [KVH, len, D] from row_start[b] (a float32 cache is read in place) */
    int64_t blocks = 0, rows_size = 0; /* query blocks of all sequences; floats of widened rows */
    int64_t *row_start = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    for (int64_t b = 0; b < batch; b++) {
        blocks += (query_lens[b] + PREFILL_ROWS - 1) / PREFILL_ROWS;
        row_start[b] = rows_size;
        rows_size += kv_heads * head_dim * context_lens[b];
    }
    const int widen = kv_dtype != KV_FLOAT32;
    float *k_all = widen ? malloc(sizeof(float) * (size_t)(rows_size > 0 ? rows_size : 1)) : NULL;
    float *v_all = widen ? malloc(sizeof(float) * (size_t)(rows_size > 0 ? rows_size : 1)) : NULL;
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
        for (int64_t task = 0; task < (widen ? batch * kv_heads : 0); task++) {
            const int64_t b = task / kv_heads, kh = task % kv_heads, len = context_lens[b];
            float *kw = k_all + row_start[b] + kh * head_dim * len;
            float *vw = v_all + row_start[b] + kh * head_dim * len;
            for (int64_t pos = 0; pos < len; pos++) {
                const int64_t block = tables[b * t_sb + pos / block_size], slot = pos % block_size;
                kv_widen(kw + pos * head_dim, k, block * k_sb + slot * k_ss + kh * k_sh, head_dim, kv_dtype);
                kv_widen(vw + pos * head_dim, v, block * v_sb + slot * v_ss + kh * v_sh, head_dim, kv_dtype);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < blocks * kv_heads; task++) {
            const int64_t i = task / kv_heads, kh = task % kv_heads, b = seq_of[i];
            const int64_t j0 = row_of[i];
            const int64_t rows = query_lens[b] - j0 < PREFILL_ROWS ? query_lens[b] - j0 : PREFILL_ROWS;
            const int64_t first_pos = context_lens[b] - query_lens[b] + j0, nq = rows * group;
            const int64_t last_pos = first_pos + rows - 1;
            const int64_t len = context_lens[b];
            const float *kw = widen ? k_all + row_start[b] + kh * head_dim * len : NULL;
            const float *vw = widen ? v_all + row_start[b] + kh * head_dim * len : NULL;
            float qs[PREFILL_ROWS * group * head_dim], o[PREFILL_ROWS * group * head_dim];
            float p[PREFILL_ROWS * group * KEY_TILE];
            float running_max[PREFILL_ROWS * group], total[PREFILL_ROWS * group];
            float rescale[PREFILL_ROWS * group];
            const float *vrows[KEY_TILE];
            int64_t kr[KEY_TILE]; /* each slot's key row: an element of kw, or of the float32 cache */
            for (int64_t r = 0; r < rows; r++) /* query vector r * group + g: row r, head kh * group + g */
                for (int64_t g = 0; g < group; g++)
                    memcpy(qs + (r * group + g) * head_dim,
                           q + (start_of[i] + j0 + r) * q_st + (kh * group + g) * q_sh,
                           (size_t)head_dim * sizeof(float));
            memset(o, 0, sizeof(float) * (size_t)(nq * head_dim));
            for (int64_t x = 0; x < nq; x++) running_max[x] = -INFINITY, total[x] = 0.f;
            /* the first key any row of the block sees: tiles before it are skipped */
            const int64_t first_key = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;
            for (int64_t ks = first_key - first_key % KEY_TILE; ks <= last_pos; ks += KEY_TILE) {
                const int64_t slots = last_pos + 1 - ks < KEY_TILE ? last_pos + 1 - ks : KEY_TILE;
                for (int64_t s = 0; s < slots; s++) {
                    const int64_t pos = ks + s;
                    const int64_t block = tables[b * t_sb + pos / block_size], slot = pos % block_size;
                    kr[s] = widen ? pos * head_dim : block * k_sb + slot * k_ss + kh * k_sh;
                    vrows[s] = widen ? vw + pos * head_dim
                                     : (const float *)v + block * v_sb + slot * v_ss + kh * v_sh;
                }
                score_keys(qs, nq, head_dim, widen ? (const void *)kw : k, kr, slots, p, scale, KV_FLOAT32);
                int64_t used = 0; /* the most keys any query vector of the tile sees */
                for (int64_t x = 0; x < nq; x++) {
                    const int64_t pos = first_pos + x / group;
                    int64_t seen = pos + 1 - ks; /* keys ks .. its position */
                    seen = seen > slots ? slots : seen;
                    int64_t lo = window > 0 ? pos - window + 1 - ks : 0; /* its window's first key */
                    lo = lo > 0 ? lo : 0;
                    if (seen <= lo) { /* the tile is past this row or before its window: no weight */
                        memset(p + x * KEY_TILE, 0, sizeof(float) * KEY_TILE);
                        rescale[x] = 1.f;
                        continue;
                    }
                    used = seen > used ? seen : used;
                    rescale[x] = softmax_tile(p + x * KEY_TILE, lo, seen, running_max + x, total + x,
                                              softcap);
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
    free(v_all);
    free(k_all);
    free(row_start);
}

#include "paged_decode_rows.h"
