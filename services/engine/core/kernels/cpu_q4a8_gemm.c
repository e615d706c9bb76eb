/* y = x @ W^T (+ bias) for many rows over 4-bit weights with 8-bit activations (prefill).
 *
 * The weight-only kernel (cpu_qgemv.c) keeps activations float32, so a prompt's matmuls cost
 * float32 multiply-adds: on an AVX2 CPU two 8-lane FMAs a cycle, which PyTorch's SGEMM already
 * nearly reaches. This kernel rounds each row of x to int8 per group of 32 inputs, as llama.cpp
 * does (Q8 activations: d = max|x| / 127, q = round(x / d)), and multiplies the weight's 4-bit
 * values by them in integers: vpmaddubsw makes 32 (AVX2) or 64 (AVX-512) 8-bit products a
 * cycle's slot, summed in 16-bit lanes over a group (8 steps of <= 2 * 15 * 127 stay below
 * 2^15), then vpmaddwd widens them to one int32 per output. Per group and output:
 *   y += (scale[o, g] * d[g]) * sum_j q[o, j] qx[j] + min[o, g] * (d[g] * sum_j qx[j])
 * i.e. exactly the rounded row times the weight. The offset term takes the sum of the rounded
 * inputs, as llama.cpp's Q8_1 does, not the exact sum of x: a 4-bit weight's offset is about
 * -8 scales, so mixing the exact sum with rounded products leaves min * sum(rounding errors)
 * uncancelled (measured on SmolLM2: layer outputs 2-7x further from float32, KL 0.02 instead of
 * 0.004). This still changes the numbers: --dtype q4_a8 (auto's pick for 4-bit GGUFs), never q4.
 *
 * Weights are cpu_qgemv.c's q4 or q4_k tiles, read as they are (each group's scale and offset,
 * q4's f16 pair or q4_k's d * sc and -dmin * m, are unpacked into float32s next to the panel,
 * once per tile, so the row blocks run one code; q4_k's nibbles are laid out as q4's, a
 * super-block's 8 groups one after another; stored in step order, [8 k-quads][TILE / 2 output bytes][4 inputs]): a thread
 * splits one tile's nibbles at a time into a panel (per group: [8 k-quads][TILE outputs][4
 * inputs] bytes, the order vpmaddubsw pairs them in) in its own buffer, then runs every row block
 * over it. The split costs three instructions per 64 weights once per call; the panel (in / 32 * 512 bytes on AVX2) stays in L1/L2 while
 * all rows pass. No second copy of the weight is kept.
 *
 * With VNNI (the avx512vnni and avxvnni builds) each 4-input step is instead one vpdpbusd into
 * 32-bit sums, here and in the decode rows below: the same integers (see dpbusd), so the same bits.
 *
 * Register blocks: Q8_ROWS rows x TILE outputs (two integer vectors): AVX-512 4 rows, AVX2 3.
 * The generic build (no byte multiply-add) emulates vpmaddubsw lane by lane: correct, slow, and
 * the autotune then keeps the float path.
 */
#include <omp.h>
#include <stdlib.h>

#include "tile_claims.h"
#include "cpu_qgemv.c" /* the tile layouts, format codes and scales this file reads */

#define GROUP 32
#define Q4_BLOCK q4_BLOCK
#define Q4K_NIBBLES (16 * TILE)                     /* cpu_qgemv.c's q4_k block: f16 d, dmin, */
#define Q4K_BLOCK (Q4K_NIBBLES + 8 * GROUP * TILE / 2) /* 12 bytes of 6-bit scales, nibbles */
#define PANEL_GROUP (GROUP * TILE) /* one group of a tile's panel: [8][TILE][4] bytes */
#ifndef KSTEP_UNROLL
#define KSTEP_UNROLL 2 /* measured on Zen 3 (AVX2): 3 rows x by 2 150 GMAC/s; by 1 119, by 7 101 */
#endif
#define PRAGMA(text) _Pragma(#text)
#define UNROLL(n) PRAGMA(GCC unroll n)
#define UNROLL_BY(n) UNROLL(n) /* n macro-expanded first */

#if defined(__AVX512F__)
#ifndef Q8_ROWS
#define Q8_ROWS 4
#endif
typedef __m512i ivec;
static inline ivec load_i(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec quad_i(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline ivec maddubs(ivec u, ivec s) { return _mm512_maddubs_epi16(u, s); }
static inline ivec add_i16(ivec a, ivec b) { return _mm512_add_epi16(a, b); }
static inline int_vec widen_pairs(ivec a) { return (int_vec)_mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
#elif defined(__AVX2__)
#ifndef Q8_ROWS
#define Q8_ROWS 3 /* 6 partial sums + 6 accumulators + 2 weights + 1 broadcast of 16 registers */
#endif
typedef __m256i ivec;
static inline ivec load_i(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec quad_i(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline ivec maddubs(ivec u, ivec s) { return _mm256_maddubs_epi16(u, s); }
static inline ivec add_i16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
static inline int_vec widen_pairs(ivec a) { return (int_vec)_mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* NEON (the aarch64 baseline): vpmaddubsw's pair sums from 16-bit products (u8 widened is below
 * 2^15; u * s fits 16 bits) and pairwise adds. The sums wrap where vpmaddubsw would saturate,
 * which no format's values reach (SAFE below), so the integers are the same. */
#include <arm_neon.h>
#define Q8_ROWS 2
typedef int16_t ivec __attribute__((vector_size(LANES * 4)));
static inline ivec load_i(const uint8_t *p) { return (ivec)vld1q_u8(p); }
static inline ivec quad_i(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (ivec)vdupq_n_s32(v);
}
static inline ivec maddubs(ivec u, ivec s) {
    const uint8x16_t a = (uint8x16_t)u;
    const int8x16_t b = (int8x16_t)s;
    const int16x8_t lo =
        vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(a))), vmovl_s8(vget_low_s8(b)));
    const int16x8_t hi =
        vmulq_s16(vreinterpretq_s16_u16(vmovl_high_u8(a)), vmovl_high_s8(b));
    return (ivec)vpaddq_s16(lo, hi);
}
static inline ivec add_i16(ivec a, ivec b) { return a + b; }
static inline int_vec widen_pairs(ivec a) { return (int_vec)vpaddlq_s16((int16x8_t)a); }
#else
#define Q8_ROWS 2
typedef int16_t ivec __attribute__((vector_size(LANES * 4)));
typedef uint8_t u8_quads __attribute__((vector_size(LANES * 4)));
typedef int8_t s8_quads __attribute__((vector_size(LANES * 4)));
static inline ivec load_i(const uint8_t *p) { ivec v; memcpy(&v, p, sizeof v); return v; }
static inline ivec quad_i(const int8_t *p) {
    s8_quads v;
    for (int i = 0; i < LANES * 4; i++) v[i] = p[i % 4];
    return (ivec)v;
}
static inline ivec maddubs(ivec u, ivec s) {
    const u8_quads a = (u8_quads)u;
    const s8_quads b = (s8_quads)s;
    ivec r;
    for (int i = 0; i < LANES * 2; i++) r[i] = (int16_t)(a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1]);
    return r;
}
static inline ivec add_i16(ivec a, ivec b) { return a + b; }
static inline int_vec widen_pairs(ivec a) {
    int_vec r;
    for (int i = 0; i < LANES; i++) r[i] = (int32_t)a[2 * i] + a[2 * i + 1];
    return r;
}
#endif

/* The integer dot's 4-input step, dot += u . s per 32-bit lane (u unsigned bytes, s signed, 4
 * products a lane). With VNNI (AVX-512 VNNI's or AVX-VNNI's vpdpbusd) it is one instruction summing
 * exactly in 32 bits (A8_DPBUSD 1); without it, vpmaddubsw's 16-bit pair sums are added over SAFE
 * steps and widened by vpmaddwd (A8_DPBUSD 0). The two give the same integers, hence the same bits:
 * for the values the formats hold neither a pair sum nor SAFE steps of them leave 16 bits (SAFE
 * below), so every sum is exact either way. TANDEM_EMULATE_DPBUSD builds the VNNI loops where the
 * instruction is missing (maddubs + madd per step, exact for the same reason), so the tests check
 * the loops bit-exact on a CPU without VNNI too. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define A8_DPBUSD 1
static inline int_vec dpbusd(int_vec acc, ivec u, ivec s) {
    return (int_vec)_mm512_dpbusd_epi32((__m512i)acc, u, s);
}
#elif defined(__AVX2__) && !defined(__AVX512F__) && defined(__AVXVNNI__)
#define A8_DPBUSD 1
static inline int_vec dpbusd(int_vec acc, ivec u, ivec s) {
    return (int_vec)_mm256_dpbusd_avx_epi32((__m256i)acc, u, s);
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
/* Arm's dot product (the neondot build): sdot multiplies signed bytes by signed bytes. Every u
 * the decode rows and the GEMM pass is below 128 (4-, 5- and 6-bit quants), which reads the same
 * as a signed byte, and q8_0's signed weights go in as stored (A8_SIGNED_DOT: no |w| and moved
 * sign, whose |-128| = 128 a signed byte can't hold): the same products, the same integers. */
#define A8_DPBUSD 1
#define A8_SIGNED_DOT 1
static inline int_vec dpbusd(int_vec acc, ivec u, ivec s) {
    return (int_vec)vdotq_s32((int32x4_t)acc, (int8x16_t)u, (int8x16_t)s);
}
#elif defined(TANDEM_EMULATE_DPBUSD)
/* Exact for any unsigned byte, as vpdpbusd is (A8_HIGH_SCALED's 16 x nibble reaches 240, whose
 * pair sums would saturate vpmaddubsw's 16 bits): the low and high nibbles' dots, the high one
 * times 16. */
#define A8_DPBUSD 1
static inline int_vec dpbusd(int_vec acc, ivec u, ivec s) {
    const ivec low = (ivec)((int_vec)u & 0x0F0F0F0F), high = (ivec)(((int_vec)u >> 4) & 0x0F0F0F0F);
    return acc + widen_pairs(maddubs(low, s)) + (widen_pairs(maddubs(high, s)) << 4);
}
#else
#define A8_DPBUSD 0
#endif
#ifndef A8_SIGNED_DOT
#define A8_SIGNED_DOT 0 /* the first operand is unsigned: q8_0 goes in as |w| and s * sign(w) */
#endif

/* The nearest integers (ties to even) of the already rounded products p: a conversion in the
 * current rounding mode, not p + 1.5 * 2^23, which a compiler may fuse with the multiply into one
 * FMA (rounding once: a different integer at ties, and a result that depends on the ISA). */
static inline int_vec round_even(vec p) {
#if defined(__AVX512F__)
    return (int_vec)_mm512_cvtps_epi32((__m512)p);
#elif defined(__AVX2__)
    return (int_vec)_mm256_cvtps_epi32((__m256)p);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return (int_vec)vcvtnq_s32_f32((float32x4_t)p); /* ties to even, whatever the mode */
#else
    int_vec n;
    for (int i = 0; i < LANES; i++) n[i] = (int32_t)__builtin_nearbyintf(p[i]);
    return n;
#endif
}

/* v's lanes swapped with those W away (W a power of two below LANES), with a constant order: one
 * step of the trees below, in registers (a tree through an array in memory stalls on store
 * forwarding; an order built at run time is a general permute). */
#if LANES == 16
#define SWAP_LANES(v, W)                                                                          \
    __builtin_shuffle(v, (int_vec){0 ^ W, 1 ^ W, 2 ^ W, 3 ^ W, 4 ^ W, 5 ^ W, 6 ^ W, 7 ^ W, 8 ^ W, \
                                   9 ^ W, 10 ^ W, 11 ^ W, 12 ^ W, 13 ^ W, 14 ^ W, 15 ^ W})
#elif LANES == 8
#define SWAP_LANES(v, W) \
    __builtin_shuffle(v, (int_vec){0 ^ W, 1 ^ W, 2 ^ W, 3 ^ W, 4 ^ W, 5 ^ W, 6 ^ W, 7 ^ W})
#else
#define SWAP_LANES(v, W) __builtin_shuffle(v, (int_vec){0 ^ W, 1 ^ W, 2 ^ W, 3 ^ W})
#endif
/* STEP(W) for each W of the tree, widest first */
#if LANES == 16
#define LANE_TREE(STEP) STEP(8) STEP(4) STEP(2) STEP(1)
#elif LANES == 8
#define LANE_TREE(STEP) STEP(4) STEP(2) STEP(1)
#else
#define LANE_TREE(STEP) STEP(2) STEP(1)
#endif

/* The largest lane of v, whose lanes are no NaN: a tree of halves (exact in any order). */
static inline float hmax(vec v) {
#define MAX_STEP(W)                                                                               \
    {                                                                                             \
        const vec other = (vec)SWAP_LANES((int_vec)v, W);                                         \
        v = vselect(v < other, other, v);                                                         \
    }
    LANE_TREE(MAX_STEP)
#undef MAX_STEP
    return v[0];
}

/* The sum of v's lanes (a tree of halves; integers, so exact). */
static inline int32_t hsum_i(int_vec v) {
#define SUM_STEP(W) v += SWAP_LANES(v, W);
    LANE_TREE(SUM_STEP)
#undef SUM_STEP
    return v[0];
}

/* Row r of x rounded to int8 per group of 32 (d = max|x| / 127, q = round(x * 127 / max|x|), so
 * |q| <= 127): q [rows, in], d and s = d * sum(q) [rows, in / 32]. Whole vectors throughout (the
 * lanes' max and sum as trees, LANES groups' divisions as one, the bytes narrowed and stored LANES
 * at a time): a decode step rounds every projection's input row, each a serial stretch while
 * memory idles. */
static inline void quantize_row(const float *x, int64_t ldx, int64_t r, int64_t in, int8_t *q,
                                float *d, float *s) {
    const int64_t groups = in / GROUP;
    for (int64_t g0 = 0; g0 < groups; g0 += LANES) {
        const int count = groups - g0 < LANES ? (int)(groups - g0) : LANES;
        vec m = splat(0.0f);
        for (int c = 0; c < count; c++) {
            const float *xg = x + r * ldx + (g0 + c) * GROUP;
            vec amax = splat(0.0f);
            for (int j = 0; j < GROUP; j += LANES) {
                const vec v = (vec)((int_vec)load_vec(xg + j) & 0x7fffffff);
                amax = vselect(amax < v, v, amax);
            }
            m[c] = hmax(amax);
        }
        const vec scale = m / splat(127.0f);
        const vec inverse = vselect(m > splat(0.0f), splat(127.0f) / m, splat(0.0f));
        for (int c = 0; c < count; c++) {
            const int64_t g = g0 + c;
            const float *xg = x + r * ldx + g * GROUP;
            int8_t *qg = q + r * in + g * GROUP;
            int_vec total = {0};
            for (int j = 0; j < GROUP; j += LANES) {
                const int_vec n = round_even(load_vec(xg + j) * splat(inverse[c]));
                total += n;
                *(sbytes_vec_u *)(qg + j) = __builtin_convertvector(n, sbytes_vec);
            }
            d[r * groups + g] = scale[c];
            s[r * groups + g] = scale[c] * (float)hsum_i(total);
        }
    }
}

/* quantize_row for each of x's rows, on `threads` threads; one thread runs them here, outside
 * any OpenMP region (libgomp would still start a team of one for it: a decode row's call does
 * this once per projection). */
static void quantize_rows(const float *x, int64_t ldx, int64_t rows, int64_t in, int8_t *q,
                          float *d, float *s, int threads) {
    if (threads <= 1) {
        for (int64_t r = 0; r < rows; r++) quantize_row(x, ldx, r, in, q, d, s);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row(x, ldx, r, in, q, d, s);
}

/* Bytes of one tile: groups (tile, group) blocks, or groups / 8 super-blocks. */
static int64_t tile_bytes(int format, int64_t groups) {
    return format == FORMAT_Q4_K ? groups / 8 * Q4K_BLOCK : groups * Q4_BLOCK;
}

/* Group g's nibbles in a tile ([32][TILE / 2] bytes, the same order in both formats). */
static inline const uint8_t *group_nibbles(int format, const uint8_t *tile, int64_t g) {
    if (format == FORMAT_Q4_K)
        return tile + g / 8 * Q4K_BLOCK + Q4K_NIBBLES + g % 8 * (GROUP * TILE / 2);
    return tile + g * Q4_BLOCK + Q4_NIBBLES;
}

/* A tile's scale and offset per group and output, float32 [groups][2][TILE] (its scales, then
 * its offsets), from cpu_qgemv.c's own scale function for the format: q4's f16 scale and offset
 * widened; q4_k's d * sc and -(dmin * m), exact products of an f16 and a 6-bit integer. Made once
 * per tile with its panel, so the row blocks read float32s whatever the format. */
static void tile_scales(int format, const uint8_t *tile, int64_t groups, float *out) {
    const qformat *f = format_of(format);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = tile + g * GROUP / f->span * f->block;
        vec scale[VECS], min[VECS];
        f->scale(block, (int)(g * GROUP % f->span / f->sub), scale, min);
        for (int v = 0; v < VECS; v++) {
            store_vec(out + g * 2 * TILE + v * LANES, scale[v]);
            store_vec(out + g * 2 * TILE + TILE + v * LANES, min[v]);
        }
    }
}

/* One tile's values, all groups, into the panel order: panel[g][k][c][j] = q[g][4k + j][c]
 * (k-quad k, output c of the tile, input j of the quad). The tile's nibbles are already in that
 * order (cpu_qgemv.c's step order: step k's column byte c holds inputs 4k..4k+3 of outputs c and
 * c + LANES), so a step splits into its low nibbles (outputs 0..LANES-1) and high ones. */
static void pack_tile(int format, const uint8_t *tile, int64_t groups, uint8_t *panel) {
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *q = group_nibbles(format, tile, g);
        uint8_t *p = panel + g * PANEL_GROUP;
        for (int k = 0; k < 8; k++) {
            const int_vec raw = load_words(q + k * 4 * LANES);
            int_vec low = raw & 0x0F0F0F0F, high = (raw >> 4) & 0x0F0F0F0F;
            memcpy(p + k * 4 * TILE, &low, sizeof low);
            memcpy(p + k * 4 * TILE + 4 * LANES, &high, sizeof high);
        }
    }
}

/* R rows x one tile (two integer vectors of LANES outputs) over all groups. */
/* sm: tile_scales' float32 scales [TILE] and offsets [TILE] per group. */
static inline __attribute__((always_inline)) void rows_tile(
    int R, const uint8_t *panel, const float *sm, int64_t groups,
    const int8_t *q, int64_t in, const float *d, const float *s, const float *bias, float *y,
    int64_t ldy, int64_t cols) {
    vec acc[Q8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 2; v++) acc[r][v] = bias ? load_vec(bias + v * LANES) : splat(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = panel + g * PANEL_GROUP;
        const int8_t *qg = q + g * GROUP;
#if A8_DPBUSD
        int_vec sums[Q8_ROWS][2];
        for (int r = 0; r < R; r++) sums[r][0] = sums[r][1] = (int_vec){0};
        UNROLL_BY(KSTEP_UNROLL)
        for (int k = 0; k < 8; k++) {
            const ivec w0 = load_i(p + k * 4 * TILE), w1 = load_i(p + k * 4 * TILE + 4 * LANES);
            for (int r = 0; r < R; r++) {
                const ivec a = quad_i(qg + r * in + 4 * k);
                sums[r][0] = dpbusd(sums[r][0], w0, a);
                sums[r][1] = dpbusd(sums[r][1], w1, a);
            }
        }
#else
        ivec part[Q8_ROWS][2];
        {
            const ivec w0 = load_i(p), w1 = load_i(p + 4 * LANES);
            for (int r = 0; r < R; r++) {
                const ivec a = quad_i(qg + r * in);
                part[r][0] = maddubs(w0, a);
                part[r][1] = maddubs(w1, a);
            }
        }
        /* unrolled by 2, not 7: fully unrolled, GCC hoists the steps' loads and spills the sums */
        UNROLL_BY(KSTEP_UNROLL)
        for (int k = 1; k < 8; k++) {
            const ivec w0 = load_i(p + k * 4 * TILE), w1 = load_i(p + k * 4 * TILE + 4 * LANES);
            for (int r = 0; r < R; r++) {
                const ivec a = quad_i(qg + r * in + 4 * k);
                part[r][0] = add_i16(part[r][0], maddubs(w0, a));
                part[r][1] = add_i16(part[r][1], maddubs(w1, a));
            }
        }
#endif
        const float *scale = sm + g * 2 * TILE, *min = scale + TILE;
        const vec sc[2] = {load_vec(scale), load_vec(scale + LANES)};
        const vec mn[2] = {load_vec(min), load_vec(min + LANES)};
        for (int r = 0; r < R; r++) {
            const vec dr = splat(d[r * groups + g]), sr = splat(s[r * groups + g]);
            for (int v = 0; v < 2; v++) {
#if A8_DPBUSD
                const vec dot = __builtin_convertvector(sums[r][v], vec);
#else
                const vec dot = __builtin_convertvector(widen_pairs(part[r][v]), vec);
#endif
                acc[r][v] += dot * (sc[v] * dr) + mn[v] * sr;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols == TILE) {
            for (int v = 0; v < 2; v++) store_vec(y + r * ldy + v * LANES, acc[r][v]);
        } else {
            float tmp[TILE];
            for (int v = 0; v < 2; v++) store_vec(tmp + v * LANES, acc[r][v]);
            memcpy(y + r * ldy, tmp, (size_t)cols * sizeof(float));
        }
    }
}

/* x [rows, in] float32 (row stride ldx), w cpu_qgemv.c's tiles of format (FORMAT_Q4: [ceil(out /
 * TILE), in / 32, Q4_BLOCK]; FORMAT_Q4_K: [ceil(out / TILE), in / 256, Q4K_BLOCK]), bias
 * [n_tiles * TILE] or NULL, y [rows, out] contiguous. Returns 0, or -1 for another format, when a
 * buffer can't be allocated, or when in is not a multiple of the format's block inputs. */
int tandem_q4a8_gemm(int format, const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                     float *y, int64_t rows, int64_t in, int64_t out, int threads) {
    if ((format != FORMAT_Q4 && format != FORMAT_Q4_K) || rows < 0) return -1;
    if (in % (format == FORMAT_Q4_K ? 8 * GROUP : GROUP)) return -1;
    if (rows == 0) return 0; /* no tile to repack for nothing */
    const int64_t groups = in / GROUP, n_tiles = (out + TILE - 1) / TILE;
    int8_t *q = malloc((size_t)(rows * in) + 64);
    float *ds = malloc((size_t)(2 * rows * groups + 1) * sizeof(float));
    if (!q || !ds) {
        free(q);
        free(ds);
        return -1;
    }
    float *d = ds, *s = ds + rows * groups;
    quantize_rows(x, ldx, rows, in, q, d, s, threads);
    int failed = 0;
    tile_claim *claims = tile_claims_new(n_tiles, threads); /* NULL: static ranges */
#pragma omp parallel num_threads(threads)
    {
        /* the panel, then its scales and offsets (tile_scales) */
        const int64_t scale_bytes = groups * 2 * TILE * (int64_t)sizeof(float);
        uint8_t *panel = malloc((size_t)(groups * PANEL_GROUP + scale_bytes));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        const int me = omp_get_thread_num();
        int64_t next, end;
        tile_range(n_tiles, omp_get_num_threads(), me, &next, &end);
        /* without its panel a thread takes no tile (the call fails) */
        for (int64_t t; panel && (t = tile_take(claims, threads, me, &next, end)) >= 0;) {
            const uint8_t *tile = w + t * tile_bytes(format, groups);
            const float *bt = bias ? bias + t * TILE : NULL;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            pack_tile(format, tile, groups, panel);
            float *sm = (float *)(panel + groups * PANEL_GROUP);
            tile_scales(format, tile, groups, sm);
            int64_t r = 0;
            for (; r + Q8_ROWS <= rows; r += Q8_ROWS)
                rows_tile(Q8_ROWS, panel, sm, groups, q + r * in, in, d + r * groups,
                          s + r * groups, bt, y + r * out + t * TILE, out, cols);
            for (; r < rows; r++)
                rows_tile(1, panel, sm, groups, q + r * in, in, d + r * groups,
                          s + r * groups, bt, y + r * out + t * TILE, out, cols);
        }
        free(panel);
    }
    free(claims);
    free(q);
    free(ds);
    return failed ? -1 : 0;
}

int tandem_q4a8_tile(void) { return TILE; }

/* Bytes of one (tile, block) unit of format, or -1 for another format. */
int64_t tandem_q4a8_block_bytes(int format) {
    return format == FORMAT_Q4 ? Q4_BLOCK : format == FORMAT_Q4_K ? Q4K_BLOCK : -1;
}

const char *tandem_q4a8_isa(void) { return TANDEM_ISA; }

/* 1 where the integer dots run as vpdpbusd (a VNNI build, or TANDEM_EMULATE_DPBUSD), else 0. */
int tandem_q4a8_dpbusd(void) { return A8_DPBUSD; }

/* ---- Decode rows (1 to a few) over int8 activations: tandem_a8_gemv ----------------------------
 *
 * The GEMM above repacks a whole tile into a panel once and runs every row over it; a decode step
 * has one row (or a few), so a repack would cost as much as the multiply. This kernel reads the
 * tiles of cpu_qgemv.c as they are (q8_0, q4, q5, q4_k, q5_k, q6_k). Their nibbles are stored in
 * vpmaddubsw's order (cpu_qgemv.c's step order: one load is a step's [output][4 inputs] bytes),
 * so a step is one load, split into the low and high nibbles (outputs 0..LANES-1 and
 * LANES..TILE-1; q8_0's rows are transposed in registers, vpermd + vpshufb), the 5- and 6-bit
 * formats' high bits or-ed in, and multiplied by the row's 4 int8 inputs broadcast (vpmaddubsw:
 * 2 products per 16-bit lane), summed in 16-bit lanes over as many 4-input steps as cannot
 * overflow (SAFE: 8 for 4-bit values, 4 for 5-bit, 2 for 6-bit, 1 for q8_0's signed bytes, which
 * take vpsignb / vpabsb: 2 * 128 * 127 < 2^15), then vpmaddwd widens to one int32 per output.
 * Per group of SUB inputs (32; q6_k 16) and output:
 *   y += (scale[o, g] * d[g]) * sum_j q[o, j] qx[j] + min[o, g] * (d[g] * sum_j qx[j])
 * exactly the rounded row times the weight, as the GEMM: the rows are rounded by the same
 * quantize_rows (d = max|x| / 127 per 32 inputs), and the offset takes the rounded inputs' sum.
 *
 * The 5- and 6-bit formats keep a group's high bits as one 32-bit word per output (bit j, or
 * bits 2j..2j+1, for input j). Their 4-input steps take strided inputs (q5: k, k + 8, k + 16,
 * k + 24; q6_k: k, k + 4, k + 8, k + 12 of a 16-input group, as their nibbles are stored), so each
 * step's high bits are one shift and one mask of the word; the rounded row is permuted to match
 * once per call (permute_rows).
 *
 * One row keeps everything in registers; more rows put each group's weights in that order once
 * into a scratch block and run every row over it. Both run the same chain per output (the integer
 * sums are exact in any order), so a row's result never depends on its batch mates or threads.
 * The team shares a call's tiles out by tile_claims.h (a contiguous range each, the tails taken
 * by whoever finishes first), so no thread waits long at the end for a slower one.
 */
#define A8_VEC_BYTES (4 * LANES) /* one ivec: 4 inputs x LANES outputs, or 4 rows of a tile's nibbles */

/* 4 rows of LANES bytes ([row][column]) -> [column][row], the order vpmaddubsw pairs them in
 * (q8_0: its int8 rows are stored input by input). */
static inline ivec panel4(ivec raw) {
#if defined(__AVX512F__)
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i shuf = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(perm, raw), shuf);
#elif defined(__AVX2__)
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(raw, perm), shuf);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    static const uint8_t order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    return (ivec)vqtbl1q_u8((uint8x16_t)raw, vld1q_u8(order));
#else
    uint8_t in[A8_VEC_BYTES], out[A8_VEC_BYTES];
    memcpy(in, &raw, sizeof in);
    for (int c = 0; c < LANES; c++)
        for (int r = 0; r < 4; r++) out[c * 4 + r] = in[r * LANES + c];
    ivec v;
    memcpy(&v, out, sizeof v);
    return v;
#endif
}

/* 4 rows of LANES bytes, row r at p + r * stride, as one vector [row][column]. */
static inline ivec rows4(const uint8_t *p, int64_t stride) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    int64_t r[4];
    for (int i = 0; i < 4; i++) memcpy(&r[i], p + i * stride, 8);
    return _mm256_setr_epi64x(r[0], r[1], r[2], r[3]);
#else
    uint8_t buf[A8_VEC_BYTES];
    for (int i = 0; i < 4; i++) memcpy(buf + i * LANES, p + i * stride, LANES);
    ivec v;
    memcpy(&v, buf, sizeof v);
    return v;
#endif
}

/* A panel vector's low and high nibbles: the values of outputs 0..LANES-1 and LANES..TILE-1. */
static inline void split_nibbles(ivec v, ivec *w) {
    w[0] = (ivec)((int_vec)v & 0x0F0F0F0F);
    w[1] = (ivec)(((int_vec)v >> 4) & 0x0F0F0F0F);
}

/* The decode loops' 4-bit steps (q4, q4_k: HIGH16 below) with x86 VNNI take a step's bytes as
 * they are, v = low + 16 x high, and the high nibbles where they sit, v & 0xF0 = 16 x high; after
 * the group's last step (a8_high_down) the high sum is divided by 16 and the low one is the first
 * minus the second, both exact (32-bit sums, every term of the second a multiple of 16): one
 * vector operation a step instead of three (a mask, a shift and a mask), the same integers. Not
 * without VNNI (vpmaddubsw's 16-bit pair sums would saturate at 2 x 255 x 127) nor on Arm (sdot's
 * bytes are signed; NEON shifts bytes in one instruction anyway). The panel keeps the values. */
#if A8_DPBUSD && !defined(__aarch64__)
#define A8_HIGH_SCALED 1
#else
#define A8_HIGH_SCALED 0
#endif
static inline void split_nibbles_high16(ivec v, ivec *w) {
    w[0] = v;
    w[1] = (ivec)((int_vec)v & (int32_t)0xF0F0F0F0);
}

/* Step k's two value vectors for the decode loops: NAME##_a8quad's, or split_nibbles_high16's. */
#define A8_DECODE_QUAD(NAME, block, g, k, raw, w)                                                 \
    do {                                                                                          \
        if (NAME##_A8HIGH16 && A8_HIGH_SCALED)                                                    \
            split_nibbles_high16(raw, w);                                                         \
        else                                                                                      \
            NAME##_a8quad(block, g, k, raw, w);                                                   \
    } while (0)

/* After a group's steps: the two sums of A8_DECODE_QUAD's vectors to the values' own. */
static inline void a8_high_down(int high16, int_vec *dot) {
    if (!high16 || !A8_HIGH_SCALED) return;
    dot[0] -= dot[1];
    dot[1] >>= 4;
}

/* Four steps of a group's nibbles (step order), steps k0..k0+3: one vector each, already in
 * vpmaddubsw's order ([column][4 inputs], low nibbles outputs 0..LANES-1, high ones the rest). */
static inline void steps_load(const uint8_t *nibbles, int k0, ivec *raw) {
    for (int i = 0; i < 4; i++) raw[i] = load_i(nibbles + 4 * (k0 + i) * LANES);
}

/* Signed weight bytes w times s as unsigned times signed: |w| and s with w's sign (vpabsb /
 * vpsignb), into *u and *t. */
static inline void signed_operands(ivec w, ivec s, ivec *u, ivec *t) {
#if defined(__AVX512F__)
    const __mmask64 negative = _mm512_movepi8_mask(w);
    *u = _mm512_abs_epi8(w);
    *t = _mm512_mask_sub_epi8(s, negative, _mm512_setzero_si512(), s);
#elif defined(__AVX2__)
    *u = _mm256_abs_epi8(w);
    *t = _mm256_sign_epi8(s, w);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    *u = (ivec)vabsq_s8((int8x16_t)w); /* |-128| wraps to the byte 128, as vpabsb's */
    *t = (ivec)vbslq_s8(vcltzq_s8((int8x16_t)w), vnegq_s8((int8x16_t)s), (int8x16_t)s);
#else
    int8_t a[A8_VEC_BYTES], b[A8_VEC_BYTES];
    memcpy(a, &w, sizeof a);
    memcpy(b, &s, sizeof b);
    for (int i = 0; i < A8_VEC_BYTES; i++) {
        b[i] = a[i] < 0 ? (int8_t)-b[i] : b[i];
        a[i] = (int8_t)(a[i] < 0 ? -a[i] : a[i]);
    }
    memcpy(u, a, sizeof *u);
    memcpy(t, b, sizeof *t);
#endif
}

/* Step k of one output vector's integer dot: the weight values w (signed bytes when sign: q8_0;
 * else unsigned) times the row's 4 inputs a broadcast, into dot (zero before step 0): by
 * vpdpbusd (A8_DPBUSD), or summed in the 16-bit lanes of part over safe steps, widened into dot
 * after every safe-th. Every decode path runs this one definition. */
static inline __attribute__((always_inline)) void a8_step(int_vec *dot, ivec *part, int k, int safe,
                                                          int sign, ivec w, ivec a) {
    ivec u = w, t = a;
    if (sign && !A8_SIGNED_DOT) signed_operands(w, a, &u, &t);
#if A8_DPBUSD
    (void)part, (void)k, (void)safe;
    *dot = dpbusd(*dot, u, t);
#else
    const ivec p = maddubs(u, t);
    *part = k % safe == 0 ? p : add_i16(*part, p);
    if (k % safe == safe - 1) *dot += widen_pairs(*part);
#endif
}

/* Per format: SUB inputs per scale, SAFE 4-input steps summed in 16 bits, STRIDE of a step's
 * inputs within a group (1: k*4..k*4+3; q5 8, q6_k 4: k, k + STRIDE, ...), OFFSET (whether it
 * has one), NAME##_a8rows(block, g, k0, raw): four steps of group g (steps_load; q8_0: none),
 * and NAME##_a8quad(block, g, k, raw, w): step k of group g as two panel vectors (outputs
 * 0..LANES-1, LANES..TILE-1) from its raw step. */
#define q8_A8SAFE 1
#define q4_A8SAFE 8
#define q4k_A8SAFE 8
#define q5_A8SAFE 4
#define q50_A8SAFE 4
#define q5k_A8SAFE 4
#define q6k_A8SAFE 2
#define q8_A8STRIDE 1
#define q4_A8STRIDE 1
#define q4k_A8STRIDE 1
#define q5_A8STRIDE 8
#define q50_A8STRIDE 8
#define q5k_A8STRIDE 8
#define q6k_A8STRIDE 4
#define q8_A8HIGH16 0
#define q4_A8HIGH16 1
#define q4k_A8HIGH16 1
#define q5_A8HIGH16 0
#define q50_A8HIGH16 0
#define q5k_A8HIGH16 0
#define q6k_A8HIGH16 0
#define q8_A8OFFSET 0
#define q4_A8OFFSET 1
#define q4k_A8OFFSET 1
#define q5_A8OFFSET 1
#define q50_A8OFFSET 1
#define q5k_A8OFFSET 1
#define q6k_A8OFFSET 1

static inline void q8_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    (void)block, (void)g, (void)k0, (void)raw;
}

static inline void q8_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    (void)g, (void)raw;
    const uint8_t *p = block + 4 * TILE + 4 * k * TILE;
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* rows 4k, 4k+1 and 4k+2, 4k+3 in two loads; their halves paired as rows (0, 2, 1, 3) */
    const __m256i a = _mm256_loadu_si256((const __m256i *)p);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 2 * TILE));
    w[0] = panel4(_mm256_unpacklo_epi64(a, b));
    w[1] = panel4(_mm256_unpackhi_epi64(a, b));
#else
    w[0] = panel4(rows4(p, TILE));
    w[1] = panel4(rows4(p + LANES, TILE));
#endif
}

static inline void q4_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    (void)g;
    steps_load(block + Q4_NIBBLES, k0, raw);
}

static inline void q4k_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    steps_load(block + Q4K_NIBBLES + g * GROUP * LANES, k0, raw);
}

static inline void q4_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    (void)block, (void)g, (void)k;
    split_nibbles(raw, w);
}
#define q4k_a8quad q4_a8quad

/* The 32-bit lanes of word moved so that bit `from` lands on bit `to` (then masked by the caller:
 * one shift, or none, where a shift right and one back left took two). */
static inline int_vec bits_to(int_vec word, int from, int to) {
    return from < to ? word << (to - from) : from > to ? word >> (from - to) : word;
}

/* Step k of a 32-input group: inputs k, k + 8, k + 16, k + 24, their fifth bits from the group's
 * word per output (input j at bit j): byte i of output c's 32-bit lane is input k + 8i, bit
 * k + 8i. */
static inline void five_bit_quad(const uint8_t *words, int k, ivec raw, ivec *w) {
    split_nibbles(raw, w);
    for (int v = 0; v < 2; v++) {
        const int_vec word = load_words(words + v * 4 * LANES);
        w[v] = (ivec)((int_vec)w[v] | (bits_to(word, k, 4) & 0x10101010));
    }
}

static inline void q5_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    (void)g;
    steps_load(block + Q5_NIBBLES, k0, raw);
}

static inline void q5_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    (void)g;
    five_bit_quad(block + Q5_HIGH, k, raw, w);
}

static inline void q50_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    (void)g;
    steps_load(block + Q50_NIBBLES, k0, raw);
}

static inline void q50_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    (void)g;
    five_bit_quad(block + Q50_HIGH, k, raw, w);
}

static inline void q5k_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    steps_load(block + Q5K_NIBBLES + g * GROUP * LANES, k0, raw);
}

static inline void q5k_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    five_bit_quad(block + 16 * TILE + g * 4 * TILE, k, raw, w);
}

/* Step k of a 16-input group: inputs k, k + 4, k + 8, k + 12, bits 4-5 from the group's word per
 * output (input j at bits 2j..2j+1): byte i of output c's lane is input k + 4i, bits 2k + 8i. */
static inline void q6k_a8rows(const uint8_t *block, int g, int k0, ivec *raw) {
    steps_load(block + Q6K_NIBBLES + g * 16 * LANES, k0, raw);
}

static inline void q6k_a8quad(const uint8_t *block, int g, int k, ivec raw, ivec *w) {
    split_nibbles(raw, w);
    const uint8_t *words = block + Q6K_HIGH + g * 4 * TILE;
    for (int v = 0; v < 2; v++) {
        const int_vec word = load_words(words + v * 4 * LANES);
        w[v] = (ivec)((int_vec)w[v] | (bits_to(word, 2 * k, 4) & 0x30303030));
    }
}

/* Where a group's inputs go in the permuted row: position 4k + i holds input k + stride * i
 * (q8_0 on AVX2: 4k + (0, 2, 1, 3)[i], the order its two loads pair the rows in). */
static inline int a8_source(int format, int stride, int p) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (format == FORMAT_Q8_0) return p / 4 * 4 + (p % 4 == 1 ? 2 : p % 4 == 2 ? 1 : p % 4);
#else
    (void)format;
#endif
    return stride == 1 ? p : p / 4 + stride * (p % 4);
}

/* One group's float step for one output vector, the one expression every path (a row in
 * registers, the panel's row blocks) runs, so they give the same bits. */
static inline __attribute__((always_inline)) vec a8_group_step(vec acc, int_vec dot, vec scale,
                                                               vec min, vec dr, vec sr, int offset) {
    const vec part = __builtin_convertvector(dot, vec) * (scale * dr);
    return acc + (offset ? part + min * sr : part);
}

/* R rows over one tile, accumulators in registers (R = 1, and R = A8_ROWS_IN_REGISTERS for a few
 * rows, whose blocks of that many run it: a weight step loaded and split once for them all; more
 * rows take NAME##_a8groups): the chain described above. q: [R][in] rounded rows (permuted for the
 * format), d: [R][in / 32] their scales, s: [R][in / SUB] d times each group's sum. */
#define DEFINE_A8ROWS(NAME, R)                                                                    \
    static void NAME##_a8rows_##R(const int8_t *q, int64_t in, const float *d, const float *s,    \
                                  const uint8_t *w, const float *bias, float *y, int64_t ldy,      \
                                  int64_t cols) {                                                 \
        const int64_t blocks = in / NAME##_SPAN, groups = in / GROUP, subs = in / NAME##_SUB;      \
        vec acc[R][VECS];                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) acc[r][c] = bias ? load_vec(bias + c * LANES) : splat(0.0f); \
        for (int64_t b = 0; b < blocks; b++) {                                                    \
            const uint8_t *block = w + b * NAME##_BLOCK;                                          \
            block_scales bs;                                                                      \
            NAME##_prep(block, &bs);                                                              \
            for (int g = 0; g < NAME##_SPAN / NAME##_SUB; g++) {                                  \
                prefetch_group(block, NAME##_BLOCK, NAME##_AHEAD, g, NAME##_SPAN / NAME##_SUB);  \
                const int64_t i0 = b * NAME##_SPAN + g * NAME##_SUB;                              \
                int_vec dot[R][VECS];                                                             \
                for (int r = 0; r < R; r++)                                                       \
                    for (int c = 0; c < VECS; c++) dot[r][c] = (int_vec){0};                      \
                ivec part[R][VECS], raw[4];                                                       \
                UNROLL(8) for (int k = 0; k < NAME##_SUB / 4; k++) {                              \
                    ivec wv[VECS];                                                                \
                    if (k % 4 == 0) NAME##_a8rows(block, g, k, raw);                              \
                    A8_DECODE_QUAD(NAME, block, g, k, raw[k % 4], wv);                            \
                    for (int r = 0; r < R; r++) {                                                 \
                        const ivec a = quad_i(q + r * in + i0 + 4 * k);                           \
                        for (int c = 0; c < VECS; c++)                                            \
                            a8_step(&dot[r][c], &part[r][c], k, NAME##_A8SAFE,                    \
                                    NAME##_A8SAFE == 1, wv[c], a);                                \
                    }                                                                             \
                }                                                                                 \
                for (int r = 0; r < R; r++) a8_high_down(NAME##_A8HIGH16, dot[r]);                \
                vec scale[VECS], min[VECS];                                                       \
                NAME##_scale(block, &bs, g, scale, min);                                          \
                for (int r = 0; r < R; r++) {                                                     \
                    const vec dr = splat(d[r * groups + i0 / GROUP]);                             \
                    const vec sr = splat(s[r * subs + i0 / NAME##_SUB]);                          \
                    for (int c = 0; c < VECS; c++)                                                \
                        acc[r][c] = a8_group_step(acc[r][c], dot[r][c], scale[c], min[c], dr, sr, \
                                                  NAME##_A8OFFSET);                               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) store_cols(y + r * ldy, acc[r], cols);                        \
    }

/* Many rows over one tile: each group's weights put in vpmaddubsw's order once, into a scratch
 * block (SUB / 4 steps x 2 vectors, in L1), then every row's integer dot over it and the same
 * float chain per output as NAME##_a8rows_1 (integer sums are exact in any order, and the float
 * steps are the same expressions), the rows' accumulators waiting in accm [rows][TILE]. */
#define DEFINE_A8GROUPS(NAME)                                                                     \
    static void NAME##_a8groups(const int8_t *q, int64_t in, const float *d, const float *s,      \
                                const uint8_t *w, const float *bias, float *y, int64_t ldy,        \
                                int64_t cols, int64_t rows, float *accm) {                        \
        const int64_t blocks = in / NAME##_SPAN, groups = in / GROUP, subs = in / NAME##_SUB;      \
        for (int64_t r = 0; r < rows; r++)                                                        \
            for (int c = 0; c < VECS; c++)                                                        \
                store_vec(accm + r * TILE + c * LANES, bias ? load_vec(bias + c * LANES) : splat(0.0f)); \
        for (int64_t b = 0; b < blocks; b++) {                                                    \
            const uint8_t *block = w + b * NAME##_BLOCK;                                          \
            prefetch_block(block, NAME##_BLOCK, NAME##_AHEAD);                                    \
            block_scales bs;                                                                      \
            NAME##_prep(block, &bs);                                                              \
            for (int g = 0; g < NAME##_SPAN / NAME##_SUB; g++) {                                  \
                const int64_t i0 = b * NAME##_SPAN + g * NAME##_SUB;                              \
                ivec values[NAME##_SUB / 4][VECS], raw[4];                                        \
                UNROLL(8) for (int k = 0; k < NAME##_SUB / 4; k++) {                              \
                    if (k % 4 == 0) NAME##_a8rows(block, g, k, raw);                              \
                    A8_DECODE_QUAD(NAME, block, g, k, raw[k % 4], values[k]);                     \
                }                                                                                 \
                vec scale[VECS], min[VECS];                                                       \
                NAME##_scale(block, &bs, g, scale, min);                                          \
                for (int64_t r = 0; r < rows; r++) {                                              \
                    int_vec dot[VECS] = {{0}};                                                    \
                    ivec part[VECS];                                                              \
                    UNROLL(8) for (int k = 0; k < NAME##_SUB / 4; k++) {                          \
                        const ivec a = quad_i(q + r * in + i0 + 4 * k);                          \
                        for (int c = 0; c < VECS; c++)                                            \
                            a8_step(&dot[c], &part[c], k, NAME##_A8SAFE, NAME##_A8SAFE == 1,      \
                                    values[k][c], a);                                             \
                    }                                                                             \
                    a8_high_down(NAME##_A8HIGH16, dot);                                           \
                    const vec dr = splat(d[r * groups + i0 / GROUP]);                             \
                    const vec sr = splat(s[r * subs + i0 / NAME##_SUB]);                          \
                    for (int c = 0; c < VECS; c++) {                                              \
                        vec acc = load_vec(accm + r * TILE + c * LANES);                          \
                        const vec part = __builtin_convertvector(dot[c], vec) * (scale[c] * dr);  \
                        acc += NAME##_A8OFFSET ? part + min[c] * sr : part;                       \
                        store_vec(accm + r * TILE + c * LANES, acc);                              \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            vec acc[VECS];                                                                        \
            for (int c = 0; c < VECS; c++) acc[c] = load_vec(accm + r * TILE + c * LANES);        \
            store_cols(y + r * ldy, acc, cols);                                                   \
        }                                                                                         \
    }

/* Many rows over one tile as a GEMM (any format the decode kernel reads): the tile's values, all
 * groups, put in vpmaddubsw's order once (the panel: [subs][SUB / 4 steps][VECS] vectors, with
 * each group's scales and offsets beside it, [subs][2][VECS]), then rows in register blocks of
 * A8_PANEL_ROWS whose accumulators stay in registers across every group. Per output the integer
 * sums and the float steps are NAME##_a8groups' own expressions in the same order, so a row gets
 * the same bits from either (tested): which runs is only a speed choice (A8_PANEL_MIN_ROWS). */
#define DEFINE_A8PANEL(NAME)                                                                      \
    static void NAME##_a8pack(const uint8_t *w, int64_t in, ivec *panel, vec *sm) {               \
        const int64_t blocks = in / NAME##_SPAN;                                                  \
        for (int64_t b = 0; b < blocks; b++) {                                                    \
            const uint8_t *block = w + b * NAME##_BLOCK;                                          \
            block_scales bs;                                                                      \
            NAME##_prep(block, &bs);                                                              \
            for (int g = 0; g < NAME##_SPAN / NAME##_SUB; g++) {                                  \
                const int64_t sg = b * (NAME##_SPAN / NAME##_SUB) + g;                            \
                ivec *values = panel + sg * (NAME##_SUB / 4) * VECS, raw[4];                      \
                UNROLL(8) for (int k = 0; k < NAME##_SUB / 4; k++) {                              \
                    if (k % 4 == 0) NAME##_a8rows(block, g, k, raw);                              \
                    NAME##_a8quad(block, g, k, raw[k % 4], values + k * VECS);                    \
                }                                                                                 \
                NAME##_scale(block, &bs, g, sm + sg * 2 * VECS, sm + sg * 2 * VECS + VECS);       \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static inline __attribute__((always_inline)) void NAME##_a8panel_rows(                        \
        int R, const ivec *panel, const vec *sm, const int8_t *q, int64_t in, const float *d,     \
        const float *s, const float *bias, float *y, int64_t ldy, int64_t cols) {                 \
        const int64_t groups = in / GROUP, subs = in / NAME##_SUB;                                \
        vec acc[A8_PANEL_ROWS][VECS];                                                             \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) acc[r][c] = bias ? load_vec(bias + c * LANES) : splat(0.0f); \
        for (int64_t sg = 0; sg < subs; sg++) {                                                   \
            const int64_t i0 = sg * NAME##_SUB;                                                   \
            const ivec *values = panel + sg * (NAME##_SUB / 4) * VECS;                            \
            int_vec dot[A8_PANEL_ROWS][VECS];                                                     \
            ivec part[A8_PANEL_ROWS][VECS];                                                       \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < VECS; c++) dot[r][c] = (int_vec){0};                          \
            UNROLL(8) for (int k = 0; k < NAME##_SUB / 4; k++) {                                  \
                for (int r = 0; r < R; r++) {                                                     \
                    const ivec a = quad_i(q + r * in + i0 + 4 * k);                               \
                    for (int c = 0; c < VECS; c++)                                                \
                        a8_step(&dot[r][c], &part[r][c], k, NAME##_A8SAFE, NAME##_A8SAFE == 1,    \
                                values[k * VECS + c], a);                                         \
                }                                                                                 \
            }                                                                                     \
            const vec *scale = sm + sg * 2 * VECS, *min = scale + VECS;                           \
            for (int r = 0; r < R; r++) {                                                         \
                const vec dr = splat(d[r * groups + i0 / GROUP]);                                 \
                const vec sr = splat(s[r * subs + i0 / NAME##_SUB]);                              \
                for (int c = 0; c < VECS; c++)                                                    \
                    acc[r][c] = a8_group_step(acc[r][c], dot[r][c], scale[c], min[c], dr, sr,     \
                                              NAME##_A8OFFSET);                                   \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) store_cols(y + r * ldy, acc[r], cols);                        \
    }                                                                                             \
    static void NAME##_a8panel(const ivec *panel, const vec *sm, const int8_t *q, int64_t in,     \
                               const float *d, const float *s, const float *bias, float *y,       \
                               int64_t ldy, int64_t cols, int64_t rows) {                         \
        const int64_t groups = in / GROUP, subs = in / NAME##_SUB;                                \
        int64_t r = 0;                                                                            \
        for (; r + A8_PANEL_ROWS <= rows; r += A8_PANEL_ROWS)                                     \
            NAME##_a8panel_rows(A8_PANEL_ROWS, panel, sm, q + r * in, in, d + r * groups,         \
                                s + r * subs, bias, y + r * ldy, ldy, cols);                      \
        for (; r < rows; r++)                                                                     \
            NAME##_a8panel_rows(1, panel, sm, q + r * in, in, d + r * groups, s + r * subs, bias, \
                                y + r * ldy, ldy, cols);                                          \
    }

#ifndef A8_PANEL_ROWS
#if defined(__AVX512F__)
#define A8_PANEL_ROWS 4 /* 32 registers: the GEMM's own block */
#else
#define A8_PANEL_ROWS 2 /* measured on Zen 1 (AVX2), Q6_K 2,048 x 8,192 at 512 rows: 2 rows 217 ms, 3 236, 4 241 */
#endif
#endif

#define DEFINE_A8ROWS_BLOCK(NAME, R) DEFINE_A8ROWS(NAME, R) /* R macro-expanded first */

#ifndef A8_ROWS_IN_REGISTERS
#define A8_ROWS_IN_REGISTERS 2 /* AVX2: 2 rows x 2 vectors x (part, dot, acc) + 2 weights + 1 row = 15 of 16 */
#endif
#ifndef A8_REGISTER_MAX_ROWS
/* rows up to which blocks of A8_ROWS_IN_REGISTERS run, not groups: measured on Zen 1 (AVX2), the
 * SmolLM2-135M Q4_1 layers and Q8_0 head, one thread: 2 rows 20.0 ms vs groups 25.3, 3 28.5 vs
 * 31.9, 4 34.7 vs 38.2, 6 49.8 vs 51.1, 8 65.5 vs 64.9 (no gain left); 3 rows in registers spill */
#define A8_REGISTER_MAX_ROWS 7
#endif
#define A8ROWS_R(NAME, R) A8ROWS_R_(NAME, R)
#define A8ROWS_R_(NAME, R) NAME##_a8rows_##R

#define DEFINE_A8FORMAT(NAME)                                                                     \
    DEFINE_A8ROWS(NAME, 1)                                                                        \
    DEFINE_A8ROWS_BLOCK(NAME, A8_ROWS_IN_REGISTERS)                                               \
    DEFINE_A8GROUPS(NAME) \
    DEFINE_A8PANEL(NAME)
DEFINE_A8FORMAT(q8)
DEFINE_A8FORMAT(q4)
DEFINE_A8FORMAT(q5)
DEFINE_A8FORMAT(q50)
DEFINE_A8FORMAT(q4k)
DEFINE_A8FORMAT(q5k)
DEFINE_A8FORMAT(q6k)

typedef void (*a8rows_fn)(const int8_t *, int64_t, const float *, const float *, const uint8_t *,
                          const float *, float *, int64_t, int64_t);
typedef a8rows_fn a8block_fn; /* A8_ROWS_IN_REGISTERS rows: a8rows_fn's arguments */
typedef void (*a8groups_fn)(const int8_t *, int64_t, const float *, const float *,
                            const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                            float *);
typedef void (*a8pack_fn)(const uint8_t *, int64_t, ivec *, vec *);
typedef void (*a8panel_fn)(const ivec *, const vec *, const int8_t *, int64_t, const float *,
                           const float *, const float *, float *, int64_t, int64_t, int64_t);
typedef struct {
    int64_t block, span, sub;
    int stride;
    a8rows_fn row;       /* one row, in registers */
    a8block_fn block_rows; /* A8_ROWS_IN_REGISTERS rows, in registers */
    a8groups_fn groups;  /* a few rows, group by group */
    a8pack_fn pack;      /* many rows: the tile's panel, then */
    a8panel_fn panel;    /* row blocks over it */
} a8format;
#define A8FORMAT_OF(NAME)                                                                         \
    {NAME##_BLOCK, NAME##_SPAN, NAME##_SUB, NAME##_A8STRIDE, NAME##_a8rows_1,                   \
     A8ROWS_R(NAME, A8_ROWS_IN_REGISTERS), NAME##_a8groups, NAME##_a8pack, NAME##_a8panel}
static const a8format A8FORMATS[N_FORMATS] = {
    [FORMAT_Q8_0] = A8FORMAT_OF(q8), [FORMAT_Q4] = A8FORMAT_OF(q4),
    [FORMAT_Q5] = A8FORMAT_OF(q5), [FORMAT_Q4_K] = A8FORMAT_OF(q4k),
    [FORMAT_Q5_K] = A8FORMAT_OF(q5k), [FORMAT_Q6_K] = A8FORMAT_OF(q6k),
    [FORMAT_Q5_0] = A8FORMAT_OF(q50),
};

static const a8format *a8format_of(int format) {
    return format >= 0 && format < N_FORMATS && A8FORMATS[format].row ? &A8FORMATS[format] : NULL;
}

/* Whether tandem_a8_gemv reads this format's tiles. */
int tandem_a8_gemv_reads(int format) { return a8format_of(format) != NULL; }

/* The rounded rows q [rows, in] put in the format's step order (a8_source) into out; returns q
 * itself where that order is the inputs' own. */
static const int8_t *permute_rows(const a8format *f, int format, const int8_t *q, int64_t rows,
                                  int64_t in, int8_t *out) {
    int source[GROUP], identity = 1;
    const int sub = (int)f->sub;
    for (int p = 0; p < sub; p++) {
        source[p] = a8_source(format, f->stride, p);
        identity &= source[p] == p;
    }
    if (identity) return q;
    /* q6_k's and the 5-bit formats' orders transpose a group's [4][sub / 4] bytes: one shuffle */
    typedef int8_t bytes16 __attribute__((vector_size(16)));
    typedef int8_t bytes32 __attribute__((vector_size(32)));
    typedef int8_t bytes16_u __attribute__((vector_size(16), aligned(1), may_alias));
    typedef int8_t bytes32_u __attribute__((vector_size(32), aligned(1), may_alias));
    int transpose = 1;
    for (int p = 0; p < sub; p++) transpose &= source[p] == p / 4 + sub / 4 * (p % 4);
    const int64_t n = rows * in;
    if (transpose && sub == 16) {
        const bytes16 order = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
        for (int64_t i = 0; i < n; i += 16)
            *(bytes16_u *)(out + i) = __builtin_shuffle(*(const bytes16_u *)(q + i), order);
    } else if (transpose && sub == 32) {
        const bytes32 order = {0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                               4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31};
        for (int64_t i = 0; i < n; i += 32)
            *(bytes32_u *)(out + i) = __builtin_shuffle(*(const bytes32_u *)(q + i), order);
    } else {
        for (int64_t i0 = 0; i0 < n; i0 += sub)
            for (int p = 0; p < sub; p++) out[i0 + p] = q[i0 + source[p]];
    }
    return out;
}

/* x [rows, in] float32 (row stride ldx) rounded to int8 per 32 inputs (quantize_rows), times w,
 * cpu_qgemv.c's tiles of format [ceil(out / TILE), in / span, block], + bias [n_tiles * TILE] or
 * NULL; y [rows, out] contiguous. Meant for decode rows (a few); any count works. Returns 0, or
 * -1 for a format it does not read, in not a multiple of its block inputs, or no memory. */
#ifndef A8_PANEL_MIN_ROWS
#define A8_PANEL_MIN_ROWS 16 /* from here the tile's panel and register row blocks (a GEMM) */
#endif
#ifndef A8_ROW_CHUNK
#define A8_ROW_CHUNK 32 /* rows per pass over a tile's groups: 32 x TILE accumulators in L1 */
#endif

int tandem_a8_gemv(int format, const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                   float *y, int64_t rows, int64_t in, int64_t out, int threads) {
    const a8format *f = a8format_of(format);
    if (!f || in % f->span || rows < 0) return -1;
    if (rows == 0) return 0;
    const int64_t groups = in / GROUP, subs = in / f->sub;
    const int64_t n_tiles = (out + TILE - 1) / TILE, tile_bytes = (in / f->span) * f->block;
    int8_t *q = malloc((size_t)(2 * rows * in) + 64);
    float *ds = malloc((size_t)(rows * (groups + groups + subs) + 1) * sizeof(float));
    if (!q || !ds) {
        free(q);
        free(ds);
        return -1;
    }
    float *d = ds, *s32 = ds + rows * groups, *s = s32 + rows * groups;
    quantize_rows(x, ldx, rows, in, q, d, s32, rows > 1 ? threads : 1);
    if (f->sub == GROUP) {
        memcpy(s, s32, (size_t)(rows * groups) * sizeof(float));
    } else { /* q6_k: d times each 16 inputs' sum */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < subs; g++) {
                int_vec sum = {0};
                for (int64_t j = 0; j < f->sub; j += LANES) sum += widen_s8(q + r * in + g * f->sub + j);
                s[r * subs + g] = d[r * groups + g * f->sub / GROUP] * (float)hsum_i(sum);
            }
    }
    const int8_t *qp = permute_rows(f, format, q, rows, in, q + rows * in);
    int failed = 0;
    const int use_panel = rows >= A8_PANEL_MIN_ROWS;
    const int in_registers = rows <= A8_REGISTER_MAX_ROWS;
    /* the panel's values, then its scales and offsets, 64-byte aligned (vector loads) */
    const size_t values_bytes = (size_t)(subs * (f->sub / 4) * VECS) * sizeof(ivec);
    const size_t panel_bytes = (values_bytes + (size_t)(subs * 2 * VECS) * sizeof(vec) + 63) / 64 * 64;
    tile_claim *claims = tile_claims_new(n_tiles, threads); /* NULL: static ranges */
#pragma omp parallel num_threads(threads)
    {
        const int grouped = rows > 1 && !use_panel && !in_registers;
        float *accm = grouped ? malloc((size_t)(rows * TILE) * sizeof(float)) : NULL;
        ivec *panel = use_panel ? aligned_alloc(64, panel_bytes) : NULL;
        if ((grouped && !accm) || (use_panel && !panel)) {
#pragma omp atomic write
            failed = 1;
        }
        const int me = omp_get_thread_num();
        int64_t next, end;
        tile_range(n_tiles, omp_get_num_threads(), me, &next, &end);
        for (int64_t t; (t = tile_take(claims, threads, me, &next, end)) >= 0;) {
            const uint8_t *wt = w + t * tile_bytes;
            const float *bt = bias ? bias + t * TILE : NULL;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            if (rows == 1) {
                f->row(qp, in, d, s, wt, bt, y + t * TILE, out, cols);
            } else if (in_registers && !use_panel) { /* blocks of rows, then single rows */
                int64_t r = 0;
                for (; r + A8_ROWS_IN_REGISTERS <= rows; r += A8_ROWS_IN_REGISTERS)
                    f->block_rows(qp + r * in, in, d + r * groups, s + r * subs, wt, bt,
                                  y + r * out + t * TILE, out, cols);
                for (; r < rows; r++)
                    f->row(qp + r * in, in, d + r * groups, s + r * subs, wt, bt,
                           y + r * out + t * TILE, out, cols);
            } else if (panel) {
                vec *sm = (vec *)((uint8_t *)panel + values_bytes);
                f->pack(wt, in, panel, sm);
                f->panel(panel, sm, qp, in, d, s, bt, y + t * TILE, out, cols, rows);
            } else if (accm) /* rows in chunks whose accumulators stay in L1; a row's chain is the same */
                for (int64_t r0 = 0; r0 < rows; r0 += A8_ROW_CHUNK)
                    f->groups(qp + r0 * in, in, d + r0 * groups, s + r0 * subs, wt, bt,
                              y + r0 * out + t * TILE, out, cols,
                              rows - r0 < A8_ROW_CHUNK ? rows - r0 : A8_ROW_CHUNK, accm);
        }
        free(accm);
        free(panel);
    }
    free(claims);
    free(q);
    free(ds);
    return failed ? -1 : 0;
}
