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
 * tandem_simd.h).
 */
#include <math.h>
#include <stdlib.h>

#include "tandem_simd.h"

/* the cache's element type (cpu_paged_attention.py's KV_DTYPE_CODES) */
enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2, KV_Q8_0 = 3 };
#define Q8_GROUP 32 /* values per q8_0 scale */

static inline int64_t kv_bytes(int kv_dtype) {
    return kv_dtype == KV_FLOAT32 ? 4 : kv_dtype == KV_Q8_0 ? 1 : 2;
}

/* Element ``index`` of a cache of type kv_dtype (strides count elements, not bytes). */
static inline void *kv_at(void *cache, int64_t index, int kv_dtype) {
    return (char *)cache + index * kv_bytes(kv_dtype);
}

/* A float16's value (exact), one at a time: F16C where the set has it, else the bits moved into
 * place and rebiased by 2^112, as f16_to_float does for a vector. */
static inline float kv_half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t bits = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    if ((h & 0x7c00u) == 0x7c00u) {
        bits |= 0x7f800000u;
        memcpy(&f, &bits, sizeof f);
    } else {
        memcpy(&f, &bits, sizeof f);
        f *= 0x1p112f;
    }
    return h & 0x8000u ? -f : f;
#endif
}

/* The scale of value d of the q8_0 row at byte `row` (quants first, then a float16 per group). */
static inline float kv_q8_scale(const void *cache, int64_t row, int64_t d, int64_t head_dim) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)cache + row + head_dim + 2 * (d / Q8_GROUP), sizeof h);
    return kv_half_to_float(h);
}

/* The head_dim values of the cache row at element `row`, as floats (a tail shorter than a
 * vector through a copy). */
static void kv_widen(float *dst, const void *cache, int64_t row, int64_t n, int kv_dtype) {
    if (kv_dtype == KV_Q8_0) {
        const int8_t *q = (const int8_t *)cache + row;
        int64_t d = 0;
        for (; d + LANES <= n; d += LANES) store_vec(dst + d, s8_to_float(q + d) * kv_q8_scale(cache, row, d, n));
        for (; d < n; d++) dst[d] = (float)q[d] * kv_q8_scale(cache, row, d, n);
        return;
    }
    const uint16_t *src = (const uint16_t *)cache + row;
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        store_vec(dst + d, kv_dtype == KV_BFLOAT16 ? bf16_to_float(src + d) : f16_to_float(src + d));
    if (d < n) {
        uint16_t tail[LANES] = {0};
        float wide[LANES];
        memcpy(tail, src + d, (size_t)(n - d) * sizeof(uint16_t));
        store_vec(wide, kv_dtype == KV_BFLOAT16 ? bf16_to_float(tail) : f16_to_float(tail));
        memcpy(dst + d, wide, (size_t)(n - d) * sizeof(float));
    }
}

/* float32 -> bfloat16, to nearest even; a NaN becomes the quiet NaN 0x7fc0 (as PyTorch rounds). */
static inline uint16_t kv_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* float32 -> IEEE float16, to nearest even, overflowing to infinity: F16C's vcvtps2ph, else the
 * FP16 library's fp16_ieee_from_fp32_value (the conversion PyTorch uses), which lets the float
 * unit round: scaling by 2^112 then 2^-110 leaves the bits float16 keeps, rounded. */
static inline uint16_t kv_to_f16(float x) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(x, 0); /* 0: round to nearest even */
#else
    uint32_t w, bits;
    float base = (fabsf(x) * 0x1p+112f) * 0x1p-110f;
    memcpy(&w, &x, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_float;
    memcpy(&bias_float, &bias_bits, sizeof bias_float);
    base = bias_float + base;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
#endif
}

/* n floats as a q8_0 row at dst (kv_quant.quantize's arithmetic: per group of 32, d = max|x| /
 * 127, quants rint(x * (1 / d)) (to nearest even; 0 for an all-zero group), d stored as float16). */
static void kv_q8_store(uint8_t *dst, const float *src, int64_t n) {
    for (int64_t g0 = 0; g0 < n; g0 += Q8_GROUP) {
        const int64_t end = g0 + Q8_GROUP < n ? g0 + Q8_GROUP : n;
        float amax = 0.f;
        for (int64_t d = g0; d < end; d++) amax = fabsf(src[d]) > amax ? fabsf(src[d]) : amax;
        const float scale = amax / 127.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
        for (int64_t d = g0; d < end; d++) {
            float x = src[d] * inverse;
            x = rintf(x);
            x = x > 127.f ? 127.f : x < -127.f ? -127.f : x;
            ((int8_t *)dst)[d] = (int8_t)x;
        }
        const uint16_t h = kv_to_f16(scale);
        memcpy(dst + n + 2 * (g0 / Q8_GROUP), &h, sizeof h);
    }
}

/* n floats into a cache row of type kv_dtype. */
static void kv_store(void *dst, const float *src, int64_t n, int kv_dtype) {
    if (kv_dtype == KV_Q8_0) {
        kv_q8_store(dst, src, n);
        return;
    }
    if (kv_dtype == KV_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = dst;
    for (int64_t d = 0; d < n; d++)
        h[d] = kv_dtype == KV_BFLOAT16 ? kv_to_bf16(src[d]) : kv_to_f16(src[d]);
}

/* tanh of LANES floats as 1 - 2 / (exp(2y) + 1), y clamped to +-9 (tanh(9) is 1 in float32,
 * and vexp's input stays in range): within ~1e-7 of tanh, absolute. */
static inline vec vtanh(vec y) {
    const vec top = splat(9.f), bottom = splat(-9.f);
    y = vselect(y > top, top, y);
    y = vselect(y < bottom, bottom, y);
    return splat(1.f) - splat(2.f) / (vexp(y + y) + splat(1.f));
}

/* x[0:n] = cap * tanh(x / cap): attention-logit soft-capping (Gemma 2). */
static void soft_cap(float *x, int64_t n, float cap) {
    const float inv = 1.f / cap;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store_vec(x + i, splat(cap) * vtanh(load_vec(x + i) * inv));
    for (; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* LANES values d .. d + LANES - 1 of the cache row at element `row` (head_dim values; d a multiple
 * of LANES), as floats (kv a constant: inlined per type). */
static inline __attribute__((always_inline)) vec load_kv(const void *cache, int64_t row, int64_t d,
                                                         int64_t head_dim, const int kv) {
    if (kv == KV_FLOAT32) return load_vec((const float *)cache + row + d);
    if (kv == KV_BFLOAT16) return bf16_to_float((const uint16_t *)cache + row + d);
    if (kv == KV_Q8_0) return s8_to_float((const int8_t *)cache + row + d) * kv_q8_scale(cache, row, d, head_dim);
    return f16_to_float((const uint16_t *)cache + row + d);
}

/* Value d of the cache row at element `row`, as a float (the tail of a head size that is not
 * whole vectors). */
static inline __attribute__((always_inline)) float load_kv1(const void *cache, int64_t row, int64_t d,
                                                            int64_t head_dim, const int kv) {
    if (kv == KV_FLOAT32) return ((const float *)cache)[row + d];
    if (kv == KV_Q8_0) return (float)((const int8_t *)cache)[row + d] * kv_q8_scale(cache, row, d, head_dim);
    const int64_t i = row + d;
    uint16_t h[LANES] = {0};
    float wide[LANES];
    h[0] = ((const uint16_t *)cache)[i];
    store_vec(wide, kv == KV_BFLOAT16 ? bf16_to_float(h) : f16_to_float(h));
    return wide[0];
}

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
    for (; s < slots; s++) {
        vec acc = {0};
        int64_t d = 0;
        for (; d + LANES <= head_dim; d += LANES)
            acc += load_vec(q + d) * load_kv(k, k0 + s * ks, d, head_dim, kv);
        float sum = hsum(acc);
        for (; d < head_dim; d++) sum += q[d] * load_kv1(k, k0 + s * ks, d, head_dim, kv);
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
                        a += pg[t] * load_kv(v, v0 + t * v_ss, d, head_dim, kv);
                    store_vec(ag + d, a);
                }
                for (; d < head_dim; d++) {
                    float a = ag[d] * rescale;
                    for (int64_t t = 0; t < slots; t++)
                        a += pg[t] * load_kv1(v, v0 + t * v_ss, d, head_dim, kv);
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
 *   scores [nq, KEY_TILE] = Q [nq, D] . K^T   (K's tile gathered transposed, [D, KEY_TILE]:
 *                                              register blocks of ROW_BLOCK queries x TILE keys)
 *   out    [nq, D]       = out * rescale + P [nq, KEY_TILE] . V  (ROW_BLOCK queries x TILE of D)
 *
 * with an online softmax between them (running max and sum per query vector, as FlashAttention).
 * A query row sees the positions up to its own (causal; with a window, only the last window of
 * them), keys past it get no weight; key tiles wholly before every row's window are skipped. A
 * 16-bit cache's keys are widened while being transposed, its values into a float32 copy laid
 * out the same way. Tasks run on OpenMP, the ones with the most keys first. */
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

/* Row stride of a sequence's transposed keys: its context in whole tiles, plus 16 floats (one
 * cache line) so that a power-of-two context does not put every row of a tile in one L1 set. */
static inline int64_t key_stride(int64_t len) { return (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE + 16; }

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
    /* each sequence's keys, transposed once for all its tasks: [KVH, D, ldk] from kt_start[b] */
    int64_t blocks = 0, kt_size = 0; /* query blocks of all sequences; floats of transposed keys */
    int64_t *kt_start = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    for (int64_t b = 0; b < batch; b++) {
        blocks += (query_lens[b] + PREFILL_ROWS - 1) / PREFILL_ROWS;
        kt_start[b] = kt_size;
        kt_size += kv_heads * head_dim * key_stride(context_lens[b]);
    }
    float *kt_all = malloc(sizeof(float) * (size_t)(kt_size > 0 ? kt_size : 1));
    /* a 16-bit or q8_0 cache's values as float32 rows: [KVH, len, D] from kt_start[b] (fits: len <= ldk) */
    float *v_all = kv_dtype == KV_FLOAT32 ? NULL
                                          : malloc(sizeof(float) * (size_t)(kt_size > 0 ? kt_size : 1));
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
            float row[head_dim]; /* one key of a 16-bit or q8_0 cache, widened */
            for (int64_t pos = 0; pos < len; pos++) {
                const int64_t block = tables[b * t_sb + pos / block_size], slot = pos % block_size;
                const float *kr = (const float *)k + block * k_sb + slot * k_ss + kh * k_sh;
                if (kv_dtype != KV_FLOAT32) {
                    kv_widen(row, k, block * k_sb + slot * k_ss + kh * k_sh, head_dim, kv_dtype);
                    kv_widen(v_all + kt_start[b] + kh * head_dim * ldk + pos * head_dim, v,
                             block * v_sb + slot * v_ss + kh * v_sh, head_dim, kv_dtype);
                    kr = row;
                }
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
            const float *vt = v_all ? v_all + kt_start[b] + kh * head_dim * ldk : NULL;
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
            /* the first key any row of the block sees: tiles before it are skipped */
            const int64_t first_key = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;
            for (int64_t ks = first_key - first_key % KEY_TILE; ks <= last_pos; ks += KEY_TILE) {
                const int64_t slots = last_pos + 1 - ks < KEY_TILE ? last_pos + 1 - ks : KEY_TILE;
                const int64_t chunks = (slots + TILE - 1) / TILE; /* TILE keys per score block */
                for (int64_t s = 0; s < slots; s++) {
                    const int64_t pos = ks + s;
                    vrows[s] = vt ? vt + pos * head_dim
                                  : (const float *)v + tables[b * t_sb + pos / block_size] * v_sb
                                        + (pos % block_size) * v_ss + kh * v_sh;
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
    free(kt_all);
    free(kt_start);
}

/* ---- decode rows, with the prefill's arithmetic ------------------------------------------------
 *
 * A position's attention must give the same bits whether its token is a prompt token (the prefill
 * kernel above) or a generated one (a decode step), so that the KV and the greedy text of a
 * request never depend on the path it took (a prefix-cache hit, a chunked prefill, a recomputed
 * sequence, a batch). So a decode row runs exactly the prefill's per-row chain: key tiles of
 * KEY_TILE absolute positions, each score a multiply-add chain over D in order (score_block),
 * the same online-softmax step per tile (softmax_tile) and the same value accumulation
 * (value_block), one query vector per head of the group. Only the keys' layout differs: the
 * prefill transposes a sequence's keys once for all its query rows; a decode row transposes one
 * tile at a time into an L1 scratch (8 x 8 blocks in registers on AVX2 and AVX-512), and a 16-bit
 * cache's values are widened per tile. The older per-block decode chain (decode_task) remains for
 * head sizes that are not whole vectors, which the prefill kernel does not take either.
 */

#if defined(__AVX2__)
/* 8 values d .. d + 7 of the cache row at element `row`, as floats (exact widening; d a multiple
 * of 8). */
static inline __attribute__((always_inline)) __m256 load8(const void *cache, int64_t row, int64_t d,
                                                          int64_t head_dim, const int kv) {
    const int64_t i = row + d;
    if (kv == KV_FLOAT32) return _mm256_loadu_ps((const float *)cache + i);
    if (kv == KV_Q8_0) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)cache + i));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                             _mm256_set1_ps(kv_q8_scale(cache, row, d, head_dim)));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i));
    if (kv == KV_BFLOAT16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#if defined(__F16C__)
    return _mm256_cvtph_ps(h);
#else
    float wide[8];
    for (int l = 0; l < 8; l++) wide[l] = load_kv1(cache, row, d + l, head_dim, kv);
    return _mm256_loadu_ps(wide);
#endif
}
#endif

/* kt[d * KEY_TILE + s] = K[rows[s] + d] (elements of a cache of type kv) for s < n (n <=
 * KEY_TILE), d < head_dim (whole vectors): 8 x 8 blocks transposed in registers where there is
 * AVX2, each value widened exactly as it is read; with AVX2, columns n .. (n rounded up to 8) - 1
 * are written too (copies of column n - 1: the caller zeroes what it scores past n). */
static inline __attribute__((always_inline)) void transpose_keys(const void *k, const int64_t *rows,
                                                                 int64_t n, int64_t head_dim, float *kt,
                                                                 const int kv) {
    int64_t s = 0;
#if defined(__AVX2__)
    for (; s < n; s += 8) {
        int64_t at[8]; /* a last, partial block repeats its last key (columns past n are unused) */
        for (int i = 0; i < 8; i++) at[i] = rows[s + i < n ? s + i : n - 1];
        for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 r0 = load8(k, at[0], d, head_dim, kv), r1 = load8(k, at[1], d, head_dim, kv);
            const __m256 r2 = load8(k, at[2], d, head_dim, kv), r3 = load8(k, at[3], d, head_dim, kv);
            const __m256 r4 = load8(k, at[4], d, head_dim, kv), r5 = load8(k, at[5], d, head_dim, kv);
            const __m256 r6 = load8(k, at[6], d, head_dim, kv), r7 = load8(k, at[7], d, head_dim, kv);
            const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
            const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
            const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
            const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = kt + d * KEY_TILE + s;
            _mm256_storeu_ps(o + 0 * KEY_TILE, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * KEY_TILE, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * KEY_TILE, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * KEY_TILE, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * KEY_TILE, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * KEY_TILE, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * KEY_TILE, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * KEY_TILE, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
#endif
    for (; s < n; s++)
        for (int64_t d = 0; d < head_dim; d++) kt[d * KEY_TILE + s] = load_kv1(k, rows[s], d, head_dim, kv);
}

/* value_block over n query vectors (n <= ATTN_ROWS; p and o rows KEY_TILE and head_dim apart)
 * and NV vectors of D from column d, the values read in place from a cache of type kv (vi[s]:
 * element index of row s): o = o * rescale + sum_s p[s] * V[s], per vector the same operations
 * in the same order as value_block over widened rows (widening is exact), each value row loaded
 * once for the n vectors. */
static inline __attribute__((always_inline)) void value_rows(
    float *o, int64_t head_dim, const float *p, const float *rescale, const void *v,
    const int64_t *vi, int64_t slots, int64_t d, const int n, const int nv, const int kv) {
    vec acc[ATTN_ROWS][VECS];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = load_vec(o + r * head_dim + d + c * LANES) * rescale[r];
    for (int64_t s = 0; s < slots; s++) {
        vec vv[VECS];
        for (int c = 0; c < nv; c++) vv[c] = load_kv(v, vi[s], d + c * LANES, head_dim, kv);
        for (int r = 0; r < n; r++) {
            const vec ps = splat(p[r * KEY_TILE + s]);
            for (int c = 0; c < nv; c++) acc[r][c] += ps * vv[c];
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) store_vec(o + r * head_dim + d + c * LANES, acc[r][c]);
}

/* CALL(N) for n (1 .. ATTN_ROWS, a run-time count) query vectors, N a constant (n itself where
 * the set has that many rows), so that each count's register blocks are unrolled. */
#define WITH_ROWS(n, CALL)                                  \
    switch (n) {                                            \
    case 1: CALL(1 < ATTN_ROWS ? 1 : ATTN_ROWS); break;     \
    case 2: CALL(2 < ATTN_ROWS ? 2 : ATTN_ROWS); break;     \
    case 3: CALL(3 < ATTN_ROWS ? 3 : ATTN_ROWS); break;     \
    case 4: CALL(4 < ATTN_ROWS ? 4 : ATTN_ROWS); break;     \
    case 5: CALL(5 < ATTN_ROWS ? 5 : ATTN_ROWS); break;     \
    case 6: CALL(6 < ATTN_ROWS ? 6 : ATTN_ROWS); break;     \
    case 7: CALL(7 < ATTN_ROWS ? 7 : ATTN_ROWS); break;     \
    case 8: CALL(8 < ATTN_ROWS ? 8 : ATTN_ROWS); break;     \
    case 9: CALL(9 < ATTN_ROWS ? 9 : ATTN_ROWS); break;     \
    case 10: CALL(10 < ATTN_ROWS ? 10 : ATTN_ROWS); break;  \
    case 11: CALL(11 < ATTN_ROWS ? 11 : ATTN_ROWS); break;  \
    default: CALL(ATTN_ROWS); break;                        \
    }

/* The first key tile a row at position pos reads (keys pos - window < k <= pos with a window). */
static inline int64_t first_tile(int64_t pos, int64_t window) {
    const int64_t first_key = window > 0 && pos >= window ? pos - window + 1 : 0;
    return first_key - first_key % KEY_TILE;
}

/* How many slots of the key tile at ks a row at position pos >= ks reads (the rest are past it). */
static inline int64_t seen_slots(int64_t pos, int64_t ks) {
    return pos + 1 - ks < KEY_TILE ? pos + 1 - ks : KEY_TILE;
}

/* The group's query heads (kh * group + g) of `rows` consecutive rows of one sequence, at positions
 * pos0 .. pos0 + rows - 1 (its block table row `table`, which maps every position they read),
 * each row over the cache as the prefill kernel attends a row (see above): q and out are the
 * first row's [heads, D] (q's heads q_sh apart, rows q_sb apart; out's rows heads * D apart);
 * head_dim whole vectors.
 *
 * Why rows together: a speculative step's verify rows (a sequence's last token and its drafts,
 * ``model_runner.py``) are decode rows of one table at consecutive positions. Alone, each row
 * gathers and transposes the whole context's keys for just `group` query vectors; together, each
 * key tile is transposed once and scored against every row's vectors in register blocks, and each
 * value row is loaded once per block. A vector's arithmetic is still its row's alone: a row takes
 * part only in the tiles it reads (its window's first tile through its own position's), with its
 * own softmax bounds, and its values are accumulated over exactly its own slots of the tile
 * (rows that see the same slots share a block), so every row has the bits it has computed alone
 * (rows = 1), which are the prefill's. */
static inline __attribute__((always_inline)) void rows_task(
    const float *q, int64_t q_sb, int64_t q_sh,
    void *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    void *v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
    const int64_t *table, int64_t pos0, int64_t rows, float *out,
    int64_t kh, int64_t group, int64_t heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap, const int kv) {
    const int64_t nq = rows * group, last = pos0 + rows - 1; /* vector r * group + g: row r, head g */
    float qs[nq * head_dim], o[nq * head_dim], p[nq * KEY_TILE];
    float running_max[nq], total[nq], rescale[nq];
    float kt[head_dim * KEY_TILE];
    int64_t ki[KEY_TILE], vi[KEY_TILE]; /* element index of each slot's key and value row */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++)
            memcpy(qs + (r * group + g) * head_dim, q + r * q_sb + (kh * group + g) * q_sh,
                   (size_t)head_dim * sizeof(float));
    memset(o, 0, sizeof(float) * (size_t)(nq * head_dim));
    for (int64_t x = 0; x < nq; x++) running_max[x] = -INFINITY, total[x] = 0.f;
    int64_t r_end = 0; /* rows r_begin .. r_end - 1 read the tile at ks (contiguous: positions ascend) */
    for (int64_t ks = first_tile(pos0, window); ks <= last; ks += KEY_TILE) {
        const int64_t r_begin = ks > pos0 ? ks - pos0 : 0; /* the earlier rows end before ks */
        while (r_end < rows && first_tile(pos0 + r_end, window) <= ks) r_end++;
        const int64_t top = pos0 + r_end - 1; /* the last key any of them reads */
        const int64_t slots = seen_slots(top, ks);
        const int64_t chunks = (slots + TILE - 1) / TILE;
        for (int64_t s = 0; s < slots; s++) {
            const int64_t at = ks + s, block = table[at / block_size], slot = at % block_size;
            ki[s] = block * k_sb + slot * k_ss + kh * k_sh;
            vi[s] = block * v_sb + slot * v_ss + kh * v_sh;
        }
        transpose_keys(k, ki, slots, head_dim, kt, kv);
        for (int64_t d = 0; d < head_dim; d++) /* keys past a row: scored, then given no weight */
            for (int64_t s = slots; s < chunks * TILE; s++) kt[d * KEY_TILE + s] = 0.f;
        const int64_t x_begin = r_begin * group, x_end = r_end * group;
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t x = x_begin; x < x_end; x += ATTN_ROWS) {
                const int n = x_end - x < ATTN_ROWS ? (int)(x_end - x) : ATTN_ROWS;
#define SCORES(N) score_block(qs + x * head_dim, head_dim, kt + c * TILE, KEY_TILE, \
                              p + x * KEY_TILE + c * TILE, scale, N)
                WITH_ROWS(n, SCORES)
#undef SCORES
            }
        for (int64_t ra = r_begin, rb; ra < r_end; ra = rb) {
            /* rows ra .. rb - 1 see the same slots of the tile: their values form one block */
            const int64_t seen = seen_slots(pos0 + ra, ks);
            for (rb = ra; rb < r_end && seen_slots(pos0 + rb, ks) == seen; rb++) {
                int64_t lo = window > 0 ? pos0 + rb - window + 1 - ks : 0;
                lo = lo > 0 ? lo : 0;
                for (int64_t x = rb * group; x < (rb + 1) * group; x++)
                    rescale[x] = softmax_tile(p + x * KEY_TILE, lo, seen, running_max + x, total + x, softcap);
            }
            const int64_t xb_end = rb * group;
            for (int64_t x = ra * group; x < xb_end; x += ATTN_ROWS) {
                const int n = xb_end - x < ATTN_ROWS ? (int)(xb_end - x) : ATTN_ROWS;
                int64_t d = 0;
#define VALUES(N) value_rows(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, v, vi, \
                             seen, d, N, NV, kv)
                for (; d + TILE <= head_dim; d += TILE) {
#define NV VECS
                    WITH_ROWS(n, VALUES)
#undef NV
                }
                for (; d < head_dim; d += LANES) {
#define NV 1
                    WITH_ROWS(n, VALUES)
#undef NV
                }
#undef VALUES
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t x = r * group + g;
            float *og = out + r * heads * head_dim + (kh * group + g) * head_dim;
            const float inv = total[x] > 0.f ? 1.f / total[x] : 0.f;
            for (int64_t dd = 0; dd < head_dim; dd++) og[dd] = o[x * head_dim + dd] * inv;
        }
}

/* query vectors a rows_task holds at most (16 rows of SmolLM2's 3 query heads per KV head): its
 * scratch on the thread's stack stays a prefill task's or less */
#define RUN_VECTORS 48

/* Whether decode row b reads what row b - 1 reads and one position more: the next row of the same
 * sequence (a verify step's rows). Its table maps every position row b - 1 reads the same way. */
static int continues_run(const int64_t *tables, int64_t t_sb, const int64_t *lens, int64_t b,
                         int64_t block_size) {
    if (lens[b] != lens[b - 1] + 1) return 0;
    const int64_t *prev = tables + (b - 1) * t_sb, *cur = tables + b * t_sb;
    for (int64_t i = 0; i <= (lens[b - 1] - 1) / block_size; i++)
        if (prev[i] != cur[i]) return 0;
    return 1;
}

/* The step's tasks' rows: unit u is rows first[u] .. first[u] + count[u] - 1, runs of one
 * sequence's consecutive rows (continues_run) in pieces of at most max_rows first, then single
 * rows; returns the number of units (first and count hold batch entries). A run is cut into
 * more pieces when the step would otherwise have fewer than two tasks per thread (a batch-1
 * verify step of a model with few KV heads), since a task runs on one thread. */
static int64_t plan_units(const int64_t *tables, int64_t t_sb, const int64_t *lens, int64_t batch,
                          int64_t block_size, int64_t kv_heads, int64_t max_rows, int threads,
                          int64_t *first, int64_t *count) {
    int64_t units = 0, runs = 0, singles = 0, run_rows = 0;
    for (int64_t b = 0, e; b < batch; b = e) { /* count[b]: the run starting at b */
        for (e = b + 1; e < batch && continues_run(tables, t_sb, lens, e, block_size); e++) {}
        count[b] = e - b;
        if (e - b > 1) runs++, run_rows += e - b;
        else singles++;
    }
    if (!runs) return 0;
    const int64_t wanted = (2 * (int64_t)threads + kv_heads - 1) / kv_heads - singles; /* pieces */
    for (int64_t b = 0, len; b < batch; b += len) {
        len = count[b]; /* read before the units below overwrite it (they never pass b + len) */
        if (len < 2) continue;
        int64_t pieces = (len + max_rows - 1) / max_rows;
        const int64_t share = wanted > 0 ? (wanted * len + run_rows - 1) / run_rows : 0;
        pieces = share > pieces ? share : pieces;
        pieces = pieces < len ? pieces : len;
        for (int64_t i = 0, at = b; i < pieces; i++) { /* as even as they go, longest first */
            const int64_t n = len / pieces + (i < len % pieces);
            first[units] = at, count[units] = n;
            units++, at += n;
        }
    }
    for (int64_t b = 0, n; b < batch; b += n) { /* singles after the runs */
        n = 1;
        while (b + n < batch && continues_run(tables, t_sb, lens, b + n, block_size)) n++;
        if (n == 1) first[units] = b, count[units] = 1, units++;
    }
    return units;
}

/* q [B, H, D] (strides q_sb, q_sh), caches [NB, BS, KVH, D] of type kv_dtype (strides *_sb,
 * *_ss, *_sh in elements; D contiguous), tables [B, *] (row stride t_sb) and lens [B] as int64,
 * out [B, H, D] contiguous; window and softcap as above (0: off). When new_k is not NULL, the
 * step's new K and V rows (new_k, new_v [B, KVH, D] float32, strides nk_* and nv_*; D
 * contiguous) are first written into slot (slot_blocks[b], slot_offsets[b]): the step's store and
 * attention in one call. Rows of one sequence at consecutive positions (a verify step) attend
 * together (rows_task), after every row's K/V is stored; otherwise each task stores its own row's
 * K/V for its KV head and attends. */
void tandem_paged_decode_attention(
    const float *q, int64_t q_sb, int64_t q_sh,
    void *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    void *v, int64_t v_sb, int64_t v_ss, int64_t v_sh, int kv_dtype,
    const int64_t *tables, int64_t t_sb, const int64_t *lens, float *out,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap, int threads,
    const float *new_k, int64_t nk_sb, int64_t nk_sh,
    const float *new_v, int64_t nv_sb, int64_t nv_sh,
    const int64_t *slot_blocks, const int64_t *slot_offsets) {
    const int64_t group = heads / kv_heads;
    /* units of rows: none (each row its own task) unless some rows form runs */
    int64_t *first = batch > 1 && head_dim % LANES == 0 ? malloc(sizeof(int64_t) * 2 * (size_t)batch) : NULL;
    const int64_t max_rows = group < RUN_VECTORS ? RUN_VECTORS / group : 1;
    const int64_t units = first ? plan_units(tables, t_sb, lens, batch, block_size, kv_heads, max_rows,
                                             threads, first, first + batch)
                                : 0;
    const int64_t *count = first ? first + batch : NULL;
    const int64_t tasks = (units ? units : batch) * kv_heads;
#define STORE(b, kh)                                                                              \
    do {                                                                                          \
        const int64_t block_ = slot_blocks[b], offset_ = slot_offsets[b];                         \
        kv_store(kv_at(k, block_ * k_sb + offset_ * k_ss + (kh) * k_sh, kv_dtype),                 \
                 new_k + (b) * nk_sb + (kh) * nk_sh, head_dim, kv_dtype);                          \
        kv_store(kv_at(v, block_ * v_sb + offset_ * v_ss + (kh) * v_sh, kv_dtype),                 \
                 new_v + (b) * nv_sb + (kh) * nv_sh, head_dim, kv_dtype);                          \
    } while (0)
#pragma omp parallel num_threads(threads)
    {
        if (new_k && units) { /* a run's rows read each other's K/V: all stored first */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < batch * kv_heads; task++) STORE(task / kv_heads, task % kv_heads);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t kh = task % kv_heads;
            const int64_t b = units ? first[task / kv_heads] : task / kv_heads;
            const int64_t rows = units ? count[task / kv_heads] : 1;
            if (new_k && !units) STORE(b, kh);
            const int64_t *table = tables + (b + rows - 1) * t_sb; /* the last row's: maps them all */
#define DECODE_TASK(KV)                                                                          \
    if (head_dim % LANES == 0)                                                                    \
        rows_task(q + b * q_sb, q_sb, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, table,      \
                  lens[b] - 1, rows, out + b * heads * head_dim, kh, group, heads, head_dim,      \
                  block_size, scale, window, softcap, KV);                                        \
    else                                                                                          \
        decode_task(q, q_sb, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, tables, t_sb, lens[b], out, \
                    b, kh, heads, group, head_dim, block_size, scale, window, softcap, KV)
            if (kv_dtype == KV_BFLOAT16)
                DECODE_TASK(KV_BFLOAT16);
            else if (kv_dtype == KV_Q8_0)
                DECODE_TASK(KV_Q8_0);
            else if (kv_dtype == KV_FLOAT16)
                DECODE_TASK(KV_FLOAT16);
            else
                DECODE_TASK(KV_FLOAT32);
#undef DECODE_TASK
        }
    }
#undef STORE
    free(first);
}
