/* Attention scores for the CPU paged-attention kernels: score_keys, the one function the decode
 * and the prefill kernel both score keys with, through fused_madd (paged_kv_values.h), the
 * explicit multiply-add every score and value sum goes through. Part of cpu_paged_attention.c's kernel library, included
 * once where its prefill section begins (after KEY_TILE and sum_lanes). A header, not a .c file:
 * native_build.py builds every .c beside it as a kernel library of its own. */
#ifndef TANDEM_PAGED_SCORES_H
#define TANDEM_PAGED_SCORES_H

/* ---- scores: one arithmetic for every path ---------------------------------------------------
 *
 * A score is scale * (q . K[s]) computed as LANES lane chains and a fixed sum: lane l holds the
 * multiply-add chain over d = l, l + LANES, l + 2 LANES, ... in order (one vector accumulator per
 * query vector and key), and reduce_lanes adds a key's lanes by one fixed tree. The decode and
 * the prefill kernel both call score_keys, and a score's operations never depend on which other
 * queries or keys share its register block, so a position's scores have the same bits on every
 * path (a prompt token, a generated one, a verify run, any batch).
 *
 * Why this form and not a chain over d per score (one lane per key): that needs the keys
 * transposed ([D, keys]). The prefill transposed a sequence's keys once for all its rows, but a
 * decode row transposed every key tile it read for just one group of query vectors (8 x 8
 * register blocks: more shuffles than multiply-adds when a group is 2-4 vectors). Here keys are
 * read as the cache stores them (a row of D values, widened as loaded), and each key vector is
 * loaded once for a register block of query vectors. */

/* query vectors x keys per register block of score_keys: SCORE_Q x SCORE_K accumulators */
#if LANES == 16
#define SCORE_Q 6
#else
#define SCORE_Q 3
#endif
#define SCORE_K 4

/* One value per lane: lane r the sum of a[r]'s lanes (a fixed tree per instruction set). */
static inline vec reduce_lanes(const vec *a) {
#if defined(__AVX2__)
    return sum_lanes(a);
#else
    float out[LANES];
    for (int r = 0; r < LANES; r++) out[r] = hsum(a[r]);
    return load_vec(out);
#endif
}

/* Per step of d, AVX2 (16 registers) loads the query vectors first and uses each key vector as
 * it is loaded: SCORE_Q x SCORE_K accumulators, SCORE_Q query vectors and one key fill its
 * registers, where all SCORE_K keys held at once needed 17 and GCC kept an accumulator on the
 * stack (a store-to-load round trip on its chain every step). The 32-register sets keep the keys
 * held: there, loading the query vectors first ran out of address registers and GCC copied them
 * to the stack. Either order gives each accumulator the same chain (the same bits). */
#if LANES == 8
#define SCORE_KEY_AT_A_TIME 1
#else
#define SCORE_KEY_AT_A_TIME 0
#endif

/* part[r * LANES + j] = the lane chains of query vector r (qs, rows head_dim apart) against key j,
 * the row at element kr[j] of a cache of type kv, for r < nq, j < nk (both constants after
 * inlining: the accumulators stay in registers). A q8_0 row's scale is read once per group. */
static inline __attribute__((always_inline)) void score_micro(
    const float *qs, int64_t head_dim, const void *k, const int64_t *kr, vec *part, const int nq,
    const int nk, const int kv) {
    vec acc[SCORE_Q][SCORE_K];
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) acc[r][j] = (vec){0};
    if (kv == KV_Q8_0) {
        for (int64_t g = 0; g < head_dim; g += Q8_GROUP) {
            vec scale[SCORE_K];
            for (int j = 0; j < nk; j++) scale[j] = splat(kv_q8_scale(k, kr[j], g, head_dim));
            const int64_t end = g + Q8_GROUP < head_dim ? g + Q8_GROUP : head_dim;
            for (int64_t d = g; d < end; d += LANES) {
#if SCORE_KEY_AT_A_TIME
                vec qv[SCORE_Q];
                for (int r = 0; r < nq; r++) qv[r] = load_vec(qs + r * head_dim + d);
                for (int j = 0; j < nk; j++) {
                    const vec key = s8_to_float((const int8_t *)k + kr[j] + d) * scale[j];
                    for (int r = 0; r < nq; r++) acc[r][j] = fused_madd(qv[r], key, acc[r][j]);
                }
#else
                vec kv_[SCORE_K];
                for (int j = 0; j < nk; j++) kv_[j] = s8_to_float((const int8_t *)k + kr[j] + d) * scale[j];
                for (int r = 0; r < nq; r++) {
                    const vec qv = load_vec(qs + r * head_dim + d);
                    for (int j = 0; j < nk; j++) acc[r][j] = fused_madd(qv, kv_[j], acc[r][j]);
                }
#endif
            }
        }
    } else {
        for (int64_t d = 0; d < head_dim; d += LANES) {
#if SCORE_KEY_AT_A_TIME
            vec qv[SCORE_Q];
            for (int r = 0; r < nq; r++) qv[r] = load_vec(qs + r * head_dim + d);
            for (int j = 0; j < nk; j++) {
                const vec key = load_kv(k, kr[j], d, head_dim, kv);
                for (int r = 0; r < nq; r++) acc[r][j] = fused_madd(qv[r], key, acc[r][j]);
            }
#else
            vec kv_[SCORE_K];
            for (int j = 0; j < nk; j++) kv_[j] = load_kv(k, kr[j], d, head_dim, kv);
            for (int r = 0; r < nq; r++) {
                const vec qv = load_vec(qs + r * head_dim + d);
                for (int j = 0; j < nk; j++) acc[r][j] = fused_madd(qv, kv_[j], acc[r][j]);
            }
#endif
        }
    }
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) part[r * LANES + j] = acc[r][j];
}

/* sc[x * KEY_TILE + s] = scale * (q_x . K[s]) for the n query vectors qs (rows head_dim apart;
 * head_dim whole vectors) and the ns <= KEY_TILE keys at elements kr[0 .. ns - 1] of a cache of
 * type kv; columns ns .. (ns rounded up to LANES) - 1 are written as 0. */
static inline __attribute__((always_inline)) void score_keys(
    const float *qs, int64_t n, int64_t head_dim, const void *k, const int64_t *kr, int64_t ns,
    float *sc, float scale, const int kv) {
    vec part[SCORE_Q * LANES];
    for (int64_t x = 0; x < n; x += SCORE_Q) {
        const int nq = n - x < SCORE_Q ? (int)(n - x) : SCORE_Q;
        for (int64_t s0 = 0; s0 < ns; s0 += LANES) {
            const int keys = ns - s0 < LANES ? (int)(ns - s0) : LANES;
            for (int j0 = 0; j0 < keys; j0 += SCORE_K) {
                const int nk = keys - j0 < SCORE_K ? keys - j0 : SCORE_K;
#define MICRO(Q, K) score_micro(qs + x * head_dim, head_dim, k, kr + s0 + j0, part + j0, Q, K, kv)
#define MICRO_K(Q)                      \
    switch (nk) {                       \
    case 1: MICRO(Q, 1); break;         \
    case 2: MICRO(Q, 2); break;         \
    case 3: MICRO(Q, 3); break;         \
    default: MICRO(Q, SCORE_K); break;  \
    }
                if (nq == SCORE_Q) {
                    MICRO_K(SCORE_Q)
                } else if (nq == 1) {
                    MICRO_K(1)
                } else if (nq == 2) {
                    MICRO_K(2)
#if SCORE_Q > 3
                } else if (nq == 3) {
                    MICRO_K(3)
                } else if (nq == 4) {
                    MICRO_K(4)
                } else {
                    MICRO_K(5)
#endif
                }
#undef MICRO_K
#undef MICRO
            }
            for (int r = 0; r < nq; r++) {
                for (int j = keys; j < LANES; j++) part[r * LANES + j] = (vec){0};
                store_vec(sc + (x + r) * KEY_TILE + s0, reduce_lanes(part + r * LANES) * scale);
            }
        }
    }
}

#endif /* TANDEM_PAGED_SCORES_H */
