/* Weight-only y = x @ W^T (+ bias) for CPUs: 8-, 6-, 5- and 4-bit and 16-bit float weights,
 * float32 rows.
 *
 * Decode on CPU streams every weight once per token; reading 4- to 8-bit weights instead of
 * float32 ones cuts those bytes 4-7x (GGUF's Q8_0, Q6_K, Q5_0/Q5_1/Q5_K, Q4_0/Q4_1/Q4_K, kept as
 * llama.cpp serves them), bfloat16 / float16 weights 2x. The weights stay compact in memory and
 * become floats in registers right before the multiply-adds; activations stay float32 (no
 * activation quantization).
 *
 * Every format is a value per weight and a scale (and for some an offset) per group of SUB inputs
 * of one output feature: w[o, i] = q[o, i] * scale[o, g] + min[o, g]. Tiled like cpu_gemv.c, TILE
 * output features at a time, each (tile, block of SPAN inputs) one contiguous block; "nibbles"
 * below are [inputs][TILE / 2] bytes in "step order": per step of 4 inputs, [TILE / 2][4] bytes,
 * byte (c, i) holding input i of the step for column c in its low nibble and column c + TILE / 2
 * in its high one. A step's inputs are 4k..4k+3 of a group of 32 for q4 and q4_k; k, k + 8,
 * k + 16, k + 24 of 32 for q5 and q5_k; k, k + 4, k + 8, k + 12 of 16 for q6_k (their high bits'
 * words then give a step's bits with one shift). Why that order: a step's 4 bytes per column are
 * one 32-bit lane, exactly the operand order of vpmaddubsw (cpu_q4a8_gemm.c's int8 decode rows
 * load a step and multiply, with no transpose in the loop), and the float path takes input i of
 * a step as byte i of each lane (one shift):
 *
 *   q8_0: float scale[TILE], int8 q[32][TILE]                                   SPAN = SUB = 32
 *   q4:   f16 scale[TILE], f16 min[TILE], nibbles[32]                           SPAN = SUB = 32
 *   q5:   f16 scale[TILE], f16 min[TILE], uint32 high[TILE], nibbles[32]        SPAN = SUB = 32
 *         (bit 4 of each value: one word per column, input j's at bit j)
 *   q5_0: f16 scale[TILE], uint32 high[TILE], nibbles[32]    (q5 whose min is -16 * scale:
 *         Q5_0, 5.5 bits a weight as the file holds it)
 *   q6_k: f16 d[TILE], int8 sc[16][TILE], uint32 high[16][TILE], nibbles[256]   SPAN 256, SUB 16
 *         (bits 4-5 of each value, input j's at bits 2 (j % 16) of word j / 16; the value is
 *         (q - 32) * d * sc, llama.cpp's Q6_K super-block kept as it is: 6.5625 bits a weight)
 *   q4_k: f16 d[TILE], f16 dmin[TILE], uint8 scales[12][TILE], nibbles[256]
 *   q5_k: q4_k's scales, uint32 high[8][TILE] (as q5, per group of 32), nibbles[256]
 *         (q * d * sc - dmin * m: Q4_K / Q5_K super-blocks, each column's 8 six-bit scales sc and
 *         mins m packed in 12 bytes as llama.cpp packs them: 4.5 and 5.5 bits a weight)
 *
 * The super-block formats (SPAN 256) keep the file's f16 super-block scales and small integer
 * sub-block scales, and multiply them in the kernel once per group (exact in float32: an f16
 * times an integer below 2^7), so they hold the file's bytes, not a float32 per group.
 *
 * bfloat16 and float16 weights use (tile, group) blocks without scales: uint16 q[32][TILE],
 * each value widened to float32 exactly (bf16: a shift; f16: vcvtph2ps or its bit-exact emulation).
 *
 * The scale and offset are factored out of each group, as llama.cpp does:
 *   y[o] = bias[o] + sum_g (scale[o, g] * sum_j x[j] q[o, j] + min[o, g] * sum_j x[j])
 * so a weight costs its integer-to-float conversion and one multiply-add (not two), and the input
 * sums are computed once per row and group. Activations stay float32 (no activation quantization).
 *
 * A few rows (decode) convert each weight vector in registers and feed it to every row of the
 * block; a single row takes several tiles at a time (four with AVX2, two with AVX-512), for
 * enough independent accumulators. More rows than one register block (batched decode, prefill)
 * walk a tile group by group: each group's values
 * are converted once into a small float32 scratch block (SUB x TILE, in L1) that every row block
 * then reads, and the rows' accumulators wait in a per-thread buffer between groups. The
 * conversion is paid once per group and tile, not once per row block, and the tile's values, the
 * rows' group of inputs and the accumulators all stay in L1 while the row blocks run.
 * Both paths run the same multiply-add chain per output (DEFINE_QROWS, DEFINE_QGROUP): a row's
 * result is the same bits whatever its batch mates.
 */
#include <omp.h>
#include <stdlib.h>

#include "tandem_simd.h"

#define GROUP 32  /* inputs per group of q8_0, q4, q5 and the 16-bit formats */
#define SUPER 256 /* inputs per super-block of the K formats */

/* Per format NAME: NAME_BLOCK bytes per (tile, block), NAME_SPAN inputs per block, NAME_SUB inputs
 * per scale (one multiply-add chain per output, then the scale). */
#define q8_SPAN GROUP
#define q8_SUB GROUP
#define q8_BLOCK (4 * TILE + GROUP * TILE)
#define q4_SPAN GROUP
#define q4_SUB GROUP
#define Q4_NIBBLES (4 * TILE) /* offsets in a q4 block: the nibbles after f16 scales and mins */
#define q4_BLOCK (Q4_NIBBLES + GROUP * TILE / 2)
#define q5_SPAN GROUP
#define q5_SUB GROUP
#define Q5_HIGH (4 * TILE) /* offsets in a q5 block: the fifth bits' words, the nibbles */
#define Q5_NIBBLES (8 * TILE)
#define q5_BLOCK (Q5_NIBBLES + GROUP * TILE / 2)
/* q50: Q5_0 as the file holds it, 22 bytes per 32 weights: q5 without the offset, which Q5_0
 * defines as -16 times the scale (so the kernels derive it; a q5 tile stores it, 2 bytes more) */
#define q50_SPAN GROUP
#define q50_SUB GROUP
#define Q50_HIGH (2 * TILE)
#define Q50_NIBBLES (6 * TILE)
#define q50_BLOCK (Q50_NIBBLES + GROUP * TILE / 2)
#define Q6K_HIGH (18 * TILE)  /* offsets in a q6_k block: the high-bit words, the nibbles */
#define Q6K_NIBBLES (82 * TILE)
#define q6k_SPAN SUPER
#define q6k_SUB 16
#define q6k_BLOCK (Q6K_NIBBLES + SUPER * TILE / 2) /* 210 * TILE: Q6_K's 210 bytes per 256 */
#define Q4K_NIBBLES (16 * TILE)
#define q4k_SPAN SUPER
#define q4k_SUB GROUP
#define q4k_BLOCK (Q4K_NIBBLES + SUPER * TILE / 2) /* 144 * TILE: Q4_K's 144 bytes per 256 */
#define Q5K_NIBBLES (48 * TILE)
#define q5k_SPAN SUPER
#define q5k_SUB GROUP
#define q5k_BLOCK (Q5K_NIBBLES + SUPER * TILE / 2) /* 176 * TILE: Q5_K's 176 bytes per 256 */
#define HALF_BLOCK (2 * GROUP * TILE)
#define bf16_SPAN GROUP
#define bf16_SUB GROUP
#define bf16_BLOCK HALF_BLOCK
#define f16_SPAN GROUP
#define f16_SUB GROUP
#define f16_BLOCK HALF_BLOCK
/* The formats whose values come from a shift by the input's place (every nibble format: its byte
 * in a step's word; the 5- and 6-bit ones: their high bits too): their group's inputs fully
 * unrolled, so every shift count is a constant and a word is loaded once per group (left to the
 * compiler, a variable count and a branch per input measured 2-4x slower). The others: the
 * compiler's choice. */
#define PRAGMA(text) _Pragma(#text)
#define UNROLL(n) PRAGMA(GCC unroll n)
#define q5_UNROLL UNROLL(32)
#define q50_UNROLL UNROLL(32)
#define q5k_UNROLL UNROLL(32)
#define q6k_UNROLL UNROLL(16)
#define q8_UNROLL
#define q4_UNROLL UNROLL(32)
#define q4k_UNROLL UNROLL(32)
#define bf16_UNROLL
#define f16_UNROLL

enum {
    FORMAT_Q8_0 = 0, FORMAT_Q4 = 1, FORMAT_BF16 = 2, FORMAT_F16 = 3, FORMAT_Q5 = 4,
    FORMAT_Q6_K = 5, FORMAT_Q4_K = 6, FORMAT_Q5_K = 7, FORMAT_Q5_0 = 8, N_FORMATS = 9
};

/* unaligned, aliasing 32-bit words (a q5 / q6_k block's high bits) */
typedef int32_t qwords_u __attribute__((vector_size(LANES * 4), aligned(1), may_alias));

static inline int_vec load_words(const uint8_t *p) { return *(const qwords_u *)p; }

static inline vec int_to_vec(int_vec v) { return __builtin_convertvector(v, vec); }

/* Column bytes of place i of step k (nibbles in step order: one 32-bit word per column), each
 * zero-extended to its lane. */
static inline int_vec step_bytes(const uint8_t *nibbles, int k, int i) {
    return (load_words(nibbles + k * 4 * LANES) >> (8 * i)) & 255;
}

/* Input j of a group of nibbles in step order: 4j..4j+3 a step (q4, q4_k) or strided through the
 * group's `steps` steps (q5, q5_k, q6_k), zero-extended per column. */
static inline int_vec nibble_bytes(const uint8_t *group, int j, int steps) {
    return steps ? step_bytes(group, j % steps, j / steps) : step_bytes(group, j / 4, j % 4);
}

static inline void bytes_to_float(int_vec wide, vec *w) {
    w[0] = int_to_vec(wide & 15);
    w[1] = int_to_vec(wide >> 4);
}

/* Input j of one block: its integer values (no scale, no offset) as two float vectors
 * (columns 0..LANES-1 and LANES..TILE-1). Exact: every value is a small integer. */
static inline void q4_values(const uint8_t *block, int j, vec *w) {
    bytes_to_float(nibble_bytes(block + Q4_NIBBLES, j, 0), w);
}

static inline void q4k_values(const uint8_t *block, int j, vec *w) {
    bytes_to_float(nibble_bytes(block + Q4K_NIBBLES, j, 0), w);
}

static inline void q8_values(const uint8_t *block, int j, vec *w) {
    const int8_t *q = (const int8_t *)(block + 4 * TILE + j * TILE);
    w[0] = s8_to_float(q);
    w[1] = s8_to_float(q + LANES);
}

/* Bit 4 of 5-bit values from a word per column holding a group's 32 fifth bits, input j's at bit
 * j: one shift and one mask put it in place. */
static inline int_vec fifth_bit(int_vec word, int j) {
    return (j >= 4 ? word >> (j - 4) : word << (4 - j)) & 16;
}

/* Input j of a group's nibbles (step order, strided by 8) and the words of its fifth bits: 5-bit
 * values 0..31. */
static inline void five_bits(const uint8_t *group, const uint8_t *words, int j, vec *w) {
    const int_vec wide = nibble_bytes(group, j, GROUP / 4);
    w[0] = int_to_vec((wide & 15) | fifth_bit(load_words(words), j));
    w[1] = int_to_vec((wide >> 4) | fifth_bit(load_words(words + 4 * LANES), j));
}

static inline void q5_values(const uint8_t *block, int j, vec *w) {
    five_bits(block + Q5_NIBBLES, block + Q5_HIGH, j, w);
}

static inline void q50_values(const uint8_t *block, int j, vec *w) {
    five_bits(block + Q50_NIBBLES, block + Q50_HIGH, j, w);
}

static inline void q5k_values(const uint8_t *block, int j, vec *w) {
    five_bits(block + Q5K_NIBBLES + (j / GROUP) * GROUP * LANES,
              block + 16 * TILE + (j / GROUP) * 4 * TILE, j % GROUP, w);
}

/* Bits 4-5 of 6-bit values from a word per column holding 16 inputs' pairs, input k's at bits
 * 2k..2k+1: one shift and one mask put them in place. */
static inline int_vec high_pair(int_vec word, int k) {
    return (k >= 2 ? word >> (2 * k - 4) : word << (4 - 2 * k)) & 0x30;
}

/* q6_k: the unsigned values 0..63 (the offset of -32 is the group's min, -32 * scale). */
static inline void q6k_values(const uint8_t *block, int j, vec *w) {
    const int_vec wide = nibble_bytes(block + Q6K_NIBBLES + (j / 16) * 16 * LANES, j % 16, 4);
    const uint8_t *words = block + Q6K_HIGH + (j / 16) * 4 * TILE;
    w[0] = int_to_vec((wide & 15) | high_pair(load_words(words), j % 16));
    w[1] = int_to_vec((wide >> 4) | high_pair(load_words(words + 4 * LANES), j % 16));
}

/* 16-bit floats: the values themselves (no scale, no offset). */
static inline void bf16_values(const uint8_t *block, int j, vec *w) {
    const uint16_t *q = (const uint16_t *)block + j * TILE;
    w[0] = bf16_to_float(q);
    w[1] = bf16_to_float(q + LANES);
}

static inline void f16_values(const uint8_t *block, int j, vec *w) {
    const uint16_t *q = (const uint16_t *)block + j * TILE;
    w[0] = f16_to_float(q);
    w[1] = f16_to_float(q + LANES);
}

/* What NAME##_prep works out once per block rather than once per group: q6_k's f16 super-block
 * scale as floats (a vcvtph2ps per group and column vector was a fifth of a q6_k decode row's
 * time), q4_k's and q5_k's eight 6-bit scales and mins as bytes (k_scale_bytes: unpacked per group
 * and column vector they were a third of a q4_k decode row's instructions); the formats with a
 * float32 or f16 scale per group need none. */
typedef struct {
    vec d[VECS];
    vec neg_dmin[VECS];   /* q4_k, q5_k: -dmin */
    uint8_t k[16 * TILE]; /* q4_k, q5_k: [scales of groups 0..7, mins of groups 0..7][TILE] */
} block_scales;

static inline void none_prep(const uint8_t *block, block_scales *bs) { (void)block, (void)bs; }
#define q8_prep none_prep
#define q4_prep none_prep
#define q5_prep none_prep
#define q50_prep none_prep
#define bf16_prep none_prep
#define f16_prep none_prep

static inline void q6k_prep(const uint8_t *block, block_scales *bs) {
    for (int c = 0; c < VECS; c++) bs->d[c] = f16_to_float((const uint16_t *)block + c * LANES);
}

/* The 6-bit scales and mins of a q4_k / q5_k block's eight groups from the 12 bytes per column
 * p[12][TILE] (llama.cpp's get_scale_min_k4), as bytes out[16][TILE] (k_scale_bytes' order):
 * group s < 4: p[s] & 63, p[s + 4] & 63; s >= 4: the low nibble (scale) and high nibble (min) of
 * p[s + 4], their top two bits from p[s - 4] and p[s]. A row of TILE bytes a vector operation. */
typedef uint8_t k_row __attribute__((vector_size(TILE), aligned(1), may_alias));
static inline void k_scale_bytes(const uint8_t *p, uint8_t *out) {
    const k_row *in = (const k_row *)p;
    k_row *sc = (k_row *)out, *m = sc + 8;
    for (int s = 0; s < 4; s++) {
        sc[s] = in[s] & 63;
        m[s] = in[s + 4] & 63;
        sc[s + 4] = (in[s + 8] & 15) | ((in[s] >> 6) << 4);
        m[s + 4] = (in[s + 8] >> 4) | ((in[s + 4] >> 6) << 4);
    }
}

/* q4_k / q5_k: the scales unpacked, d and -dmin converted, once a block (in memory: held in four
 * registers, d and dmin pushed AVX2's one-row loop out of its 16, measured 30% slower). */
static inline void q4k_prep(const uint8_t *block, block_scales *bs) {
    const uint16_t *d = (const uint16_t *)block, *dmin = d + TILE;
    for (int c = 0; c < VECS; c++) {
        bs->d[c] = f16_to_float(d + c * LANES);
        bs->neg_dmin[c] = -f16_to_float(dmin + c * LANES);
    }
    k_scale_bytes(block + 4 * TILE, bs->k);
}
#define q5k_prep q4k_prep

/* The scale and offset of group s of a block, per column (two vectors each), bs its NAME##_prep.
 * Exact: a float32 scale as stored, or an f16 times an integer below 2^7 (and -32 times that for
 * q6_k). */
static inline void q8_scale(const uint8_t *block, const block_scales *bs, int s, vec *scale,
                            vec *min) {
    (void)s, (void)bs;
    for (int c = 0; c < VECS; c++)
        scale[c] = load_vec((const float *)block + c * LANES), min[c] = splat(0.0f);
}

/* q4 and q5: the file's f16 scale and offset (GGUF's Q4_0 / Q5_0 offset -8 d / -16 d, Q4_1 /
 * Q5_1's m: all exact in f16), widened per group: 4 bytes a group and column, as the file holds
 * them, not 8. */
static inline void q4_scale(const uint8_t *block, const block_scales *bs, int s, vec *scale,
                            vec *min) {
    (void)s, (void)bs;
    const uint16_t *f = (const uint16_t *)block;
    for (int c = 0; c < VECS; c++)
        scale[c] = f16_to_float(f + c * LANES), min[c] = f16_to_float(f + TILE + c * LANES);
}
#define q5_scale q4_scale

static inline void q50_scale(const uint8_t *block, const block_scales *bs, int s, vec *scale,
                             vec *min) {
    (void)s, (void)bs;
    const uint16_t *f = (const uint16_t *)block;
    for (int c = 0; c < VECS; c++)
        scale[c] = f16_to_float(f + c * LANES), min[c] = scale[c] * splat(-16.0f);
}

static inline void q6k_scale(const uint8_t *block, const block_scales *bs, int s, vec *scale,
                             vec *min) {
    const int8_t *sc = (const int8_t *)(block + 2 * TILE + s * TILE);
    for (int c = 0; c < VECS; c++) {
        scale[c] = bs->d[c] * s8_to_float(sc + c * LANES);
        min[c] = scale[c] * splat(-32.0f);
    }
}

static inline void q4k_scale(const uint8_t *block, const block_scales *bs, int s, vec *scale,
                             vec *min) {
    (void)block;
    for (int c = 0; c < VECS; c++) { /* -dmin x m is -(dmin x m) to the bit */
        scale[c] = bs->d[c] * int_to_vec(widen_u8(bs->k + s * TILE + c * LANES));
        min[c] = bs->neg_dmin[c] * int_to_vec(widen_u8(bs->k + (8 + s) * TILE + c * LANES));
    }
}
#define q5k_scale q4k_scale

/* The end of one group: acc += scale * part (+ min * sum of the group's inputs). */
#define DEFINE_FINISH(NAME)                                                                       \
    static inline void NAME##_finish(const uint8_t *block, const block_scales *bs, int s,         \
                                     const vec *part, float sum, vec *acc) {                      \
        vec scale[VECS], min[VECS];                                                               \
        NAME##_scale(block, bs, s, scale, min);                                                   \
        for (int c = 0; c < VECS; c++) {                                                          \
            acc[c] += part[c] * scale[c];                                                         \
            acc[c] += sum * min[c];                                                               \
        }                                                                                         \
    }
DEFINE_FINISH(q4)
DEFINE_FINISH(q5)
DEFINE_FINISH(q50)
DEFINE_FINISH(q6k)
DEFINE_FINISH(q4k)
DEFINE_FINISH(q5k)

static inline void q8_finish(const uint8_t *block, const block_scales *bs, int s, const vec *part,
                             float sum, vec *acc) {
    (void)s, (void)sum, (void)bs;
    const float *scale = (const float *)block;
    for (int c = 0; c < VECS; c++) acc[c] += part[c] * load_vec(scale + c * LANES);
}

static inline void half_finish(const uint8_t *block, const block_scales *bs, int s,
                               const vec *part, float sum, vec *acc) {
    (void)block, (void)bs, (void)s, (void)sum;
    for (int c = 0; c < VECS; c++) acc[c] += part[c];
}
#define bf16_finish half_finish
#define f16_finish half_finish

static inline void store_cols(float *y, const vec *acc, int64_t cols) {
    if (cols == TILE) { /* a whole tile: vector stores, not a library memcpy per row */
        for (int c = 0; c < VECS; c++) store_vec(y + c * LANES, acc[c]);
        return;
    }
    float tmp[TILE];
    memcpy(tmp, acc, sizeof tmp);
    memcpy(y, tmp, (size_t)cols * sizeof(float));
}

/* Sums of each row's groups of sub inputs (16 or 32), sums[r * (in / sub) + g], each one fixed
 * chain (vector adds in input order, then hsum's tree): the offset term is min * sum, once per
 * group. */
static void group_sums(const float *x, int64_t ldx, int64_t rows, int64_t in, int sub,
                       float *sums) {
    const int64_t groups = in / sub;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * ldx + g * sub;
            vec v = load_vec(xg);
            for (int k = LANES; k < sub; k += LANES) v += load_vec(xg + k);
            sums[r * groups + g] = hsum(v);
        }
}

/* A decode row streams each weight from memory once, a tile's blocks front to back; the
 * hardware prefetchers alone left a core's stream well below what memory gives two cores
 * (measured on Zen 3: an int8 q4_k row from DRAM 18-20 GB/s on 2 threads; prefetching the
 * block PREFETCH_AHEAD bytes on, 23-32 GB/s). How far ahead is the format's NAME_AHEAD: q4_k
 * rows (2,304-byte blocks, read in eight 32-input groups) want twice the distance of the others
 * (measured on Zen 3, AVX2, int8 rows from DRAM: 2 threads 19.2-20.7 GB/s at 8 KiB, 24.2-27.4
 * at 16 KiB; one thread 9.1-10.4 -> 13.3-14.5), which are no faster further ahead (q6_k slower:
 * its 49152 x 2048 head 21.6 -> 19.3 GB/s; measured again on Zen 3 once prefetch_block was
 * always inlined, 2 threads against none: q4_k 1.18-1.24x at 16 KiB, q6_k 1.17-1.25x and q5_0
 * 1.16-1.25x at 4-16 KiB, q8_0 within 2%). Those are the defaults; another CPU may want others, so
 * the distances are a table a process sets (tandem_set_prefetch_ahead: `tandem tune` measures them
 * on the machine, prefetch_tuning.py gives every kernel library the cached choice), read once per
 * block; 0 turns a format's prefetch off. A prefetch only moves data, never a result: any distance
 * gives the same bits. Prefetches never fault: past the weight's end they are dropped. */
#define PREFETCH_AHEAD 8192
static int64_t prefetch_ahead[N_FORMATS] = {
    [FORMAT_Q8_0] = PREFETCH_AHEAD, [FORMAT_Q4] = PREFETCH_AHEAD, [FORMAT_BF16] = PREFETCH_AHEAD,
    [FORMAT_F16] = PREFETCH_AHEAD, [FORMAT_Q5] = PREFETCH_AHEAD, [FORMAT_Q6_K] = PREFETCH_AHEAD,
    [FORMAT_Q4_K] = 2 * PREFETCH_AHEAD, [FORMAT_Q5_K] = PREFETCH_AHEAD,
    [FORMAT_Q5_0] = PREFETCH_AHEAD,
};
#define q8_AHEAD (prefetch_ahead[FORMAT_Q8_0])
#define q4_AHEAD (prefetch_ahead[FORMAT_Q4])
#define q5_AHEAD (prefetch_ahead[FORMAT_Q5])
#define q50_AHEAD (prefetch_ahead[FORMAT_Q5_0])
#define q4k_AHEAD (prefetch_ahead[FORMAT_Q4_K])
#define q5k_AHEAD (prefetch_ahead[FORMAT_Q5_K])
#define q6k_AHEAD (prefetch_ahead[FORMAT_Q6_K])
#define bf16_AHEAD (prefetch_ahead[FORMAT_BF16])
#define f16_AHEAD (prefetch_ahead[FORMAT_F16])
#define PREFETCH_AHEAD_MAX (1 << 20)

/* Set how far ahead format's rows prefetch (bytes, 0 = not at all, at most PREFETCH_AHEAD_MAX);
 * 0, or -1 for an unknown format or distance. Call it before the kernels run, not during. */
int tandem_set_prefetch_ahead(int format, int64_t bytes) {
    if (format < 0 || format >= N_FORMATS || bytes < 0 || bytes > PREFETCH_AHEAD_MAX) return -1;
    prefetch_ahead[format] = bytes;
    return 0;
}

/* How far ahead format's rows prefetch now, or -1 for an unknown format. */
int64_t tandem_prefetch_ahead(int format) {
    return format < 0 || format >= N_FORMATS ? -1 : prefetch_ahead[format];
}

/* Group g's share of a block's prefetches (of groups): lines [g * bytes / groups, (g + 1) * bytes /
 * groups) rounded down to a line, the last group's up to the block's end, so every line of the
 * block is prefetched once, as by prefetch_block, but spread over its groups instead of all at its
 * start: faster for q4_k and q6_k rows from memory, q5_0 and q8_0 within noise (paired rounds,
 * docs/benchmarks.md). always_inline, or there are no prefetches at all: a prefetch changes no
 * value, so GCC (12, -O2 and up) found a prefetch helper "looping const" when it was not inlined
 * early, and deleted every call to it as one whose result is unused (the decode kernels ran
 * without a single prefetch instruction); test_prefetch_tuning checks each built library has them. */
static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *block,
                                                                 int64_t bytes, int64_t ahead,
                                                                 int g, int groups) {
    if (!ahead) return;
    const int64_t from = (int64_t)g * bytes / groups / 64 * 64;
    const int64_t to = g == groups - 1 ? bytes : (int64_t)(g + 1) * bytes / groups / 64 * 64;
    for (int64_t l = from; l < to; l += 64) __builtin_prefetch(block + ahead + l, 0, 0);
}

/* A whole block's prefetches at once: group 0 of 1. */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *block,
                                                                 int64_t bytes, int64_t ahead) {
    prefetch_group(block, bytes, ahead, 0, 1);
}

/* R rows over one quantized tile, its values converted in registers. Per output and group, one
 * chain: part = sum_j x[j] * q[j] (fused multiply-adds in input order, from zero), then
 * acc += scale * part and acc += min * sum(x over the group); acc starts at the bias.
 * Factoring the scale and offset out of the group halves the vector work per weight compared
 * with dequantizing each weight first, and the chain is the same as DEFINE_QGROUP's (many rows),
 * so a row's result never depends on its batch mates. sums: [R][in / SUB]. */
#define DEFINE_QROWS(NAME, R)                                                                     \
    static void NAME##_rows_##R(const float *x, int64_t ldx, const float *sums, const uint8_t *w, \
                                int64_t in, const float *bias, float *y, int64_t ldy,             \
                                int64_t cols) {                                                   \
        const int64_t blocks = in / NAME##_SPAN, subs = in / NAME##_SUB;                          \
        vec acc[R][VECS];                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) acc[r][c] = bias ? load_vec(bias + c * LANES) : (vec){0}; \
        for (int64_t b = 0; b < blocks; b++) {                                                    \
            const uint8_t *block = w + b * NAME##_BLOCK;                                          \
            prefetch_block(block, NAME##_BLOCK, NAME##_AHEAD);                                    \
            block_scales bs;                                                                      \
            NAME##_prep(block, &bs);                                                              \
            for (int s = 0; s < NAME##_SPAN / NAME##_SUB; s++) {                                  \
                const int64_t i0 = b * NAME##_SPAN + s * NAME##_SUB;                              \
                vec part[R][VECS];                                                                \
                for (int r = 0; r < R; r++)                                                       \
                    for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                         \
                NAME##_UNROLL for (int j = 0; j < NAME##_SUB; j++) {                              \
                    vec wv[VECS];                                                                 \
                    NAME##_values(block, s * NAME##_SUB + j, wv);                                 \
                    for (int r = 0; r < R; r++) {                                                 \
                        const float xv = x[r * ldx + i0 + j];                                     \
                        for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                  \
                    }                                                                             \
                }                                                                                 \
                for (int r = 0; r < R; r++)                                                       \
                    NAME##_finish(block, &bs, s, part[r], sums[r * subs + i0 / NAME##_SUB],       \
                                  acc[r]);                                                        \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) store_cols(y + r * ldy, acc[r], cols);                        \
    }

/* One group of R rows over values converted once (float32 [SUB][TILE], the scratch block): the
 * same part chain as NAME##_rows_R, then the same finish into the rows' accumulators, which wait
 * in memory between groups (accm [R][TILE]). i0: the group's first input; s: its index in the
 * block; sums: [R][subs]. */
#define DEFINE_QGROUP(NAME, R)                                                                    \
    static void NAME##_group_##R(const float *x, int64_t ldx, const float *sums, int64_t subs,   \
                                 int64_t i0, const uint8_t *block, int s, const float *values,    \
                                 float *accm) {                                                   \
        vec part[R][VECS];                                                                        \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                                 \
        const float *xg = x + i0;                                                                 \
        block_scales bs;                                                                          \
        NAME##_prep(block, &bs);                                                                  \
        for (int j = 0; j < NAME##_SUB; j++) {                                                    \
            const vec wv[VECS] = {load_vec(values + j * TILE), load_vec(values + j * TILE + LANES)}; \
            for (int r = 0; r < R; r++) {                                                         \
                const float xv = xg[r * ldx + j];                                                 \
                for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                          \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) {                                                             \
            vec acc[VECS];                                                                        \
            for (int c = 0; c < VECS; c++) acc[c] = load_vec(accm + r * TILE + c * LANES);        \
            NAME##_finish(block, &bs, s, part[r], sums[r * subs + i0 / NAME##_SUB], acc);         \
            for (int c = 0; c < VECS; c++) store_vec(accm + r * TILE + c * LANES, acc[c]);        \
        }                                                                                         \
    }

/* Register blocks of 8, 4, 2 and 1 rows on every instruction set (8 rows' accumulators exceed
 * AVX2's 16 registers, but converting each weight vector once for 8 rows measured faster than
 * storing it there). Group blocks of GROUP_ROWS, 4, 2 and 1 rows: as many rows as keep their
 * group sums, the weight vectors and a broadcast input in registers (8 x 2 + 3 of AVX-512's 32,
 * 6 x 2 + 3 of AVX2's 16). */
#define REGISTER_ROWS 8
#if LANES == 16
#define GROUP_ROWS 8
#elif LANES == 8
#define GROUP_ROWS 6
#else
#define GROUP_ROWS 4
#endif
#define EXPAND(MACRO, ...) MACRO(__VA_ARGS__) /* GROUP_ROWS expanded before ## pastes it */
#if GROUP_ROWS > 4
#define DEFINE_QGROUP_WIDE(NAME) EXPAND(DEFINE_QGROUP, NAME, GROUP_ROWS)
#define GROUP_WIDE(NAME) EXPAND(GROUP_NAME, NAME, GROUP_ROWS)
#else
#define DEFINE_QGROUP_WIDE(NAME)
#define GROUP_WIDE(NAME) NAME##_group_4 /* listed twice: the 4-row entry comes next */
#endif
#define GROUP_NAME(NAME, R) NAME##_group_##R

/* One row over N consecutive tiles at once (tile n at w + n * tile bytes, its bias and outputs
 * TILE further along each): the same chain per output as NAME##_rows_1, with N times the
 * independent accumulators. A single row has only VECS of them per tile, too few to hide the
 * multiply-add latency; N tiles' worth keep the vector units busy. cols_last: the last tile's
 * width (the others are whole). */
#define DEFINE_QTILES(NAME, N)                                                                    \
    static void NAME##_tiles_##N(const float *x, const float *sums, const uint8_t *w, int64_t in, \
                                 const float *bias, float *y, int64_t cols_last) {                \
        const int64_t blocks = in / NAME##_SPAN, tile_bytes = blocks * NAME##_BLOCK;              \
        vec acc[N][VECS];                                                                         \
        for (int n = 0; n < N; n++)                                                               \
            for (int c = 0; c < VECS; c++)                                                        \
                acc[n][c] = bias ? load_vec(bias + n * TILE + c * LANES) : (vec){0};              \
        for (int64_t b = 0; b < blocks; b++) {                                                    \
            const uint8_t *block = w + b * NAME##_BLOCK;                                          \
            block_scales bs[N];                                                                   \
            for (int n = 0; n < N; n++) {                                                         \
                prefetch_block(block + n * tile_bytes, NAME##_BLOCK, NAME##_AHEAD);               \
                NAME##_prep(block + n * tile_bytes, &bs[n]);                                      \
            }                                                                                     \
            for (int s = 0; s < NAME##_SPAN / NAME##_SUB; s++) {                                  \
                const int64_t i0 = b * NAME##_SPAN + s * NAME##_SUB;                              \
                vec part[N][VECS];                                                                \
                for (int n = 0; n < N; n++)                                                       \
                    for (int c = 0; c < VECS; c++) part[n][c] = (vec){0};                         \
                NAME##_UNROLL for (int j = 0; j < NAME##_SUB; j++) {                              \
                    const float xv = x[i0 + j];                                                   \
                    for (int n = 0; n < N; n++) {                                                 \
                        vec wv[VECS];                                                             \
                        NAME##_values(block + n * tile_bytes, s * NAME##_SUB + j, wv);            \
                        for (int c = 0; c < VECS; c++) part[n][c] += xv * wv[c];                  \
                    }                                                                             \
                }                                                                                 \
                for (int n = 0; n < N; n++)                                                       \
                    NAME##_finish(block + n * tile_bytes, &bs[n], s, part[n],                     \
                                  sums[i0 / NAME##_SUB], acc[n]);                                 \
            }                                                                                     \
        }                                                                                         \
        for (int n = 0; n < N; n++) store_cols(y + n * TILE, acc[n], n < N - 1 ? TILE : cols_last); \
    }
/* Tiles per one-row call: 4 on AVX2 and the generic build (16 registers: 8 accumulators, the
 * converted weights and the broadcast input fit), 2 on AVX-512, whose wider vectors already
 * give 2 tiles x 2 vectors x 16 lanes in flight. The 5- and 6-bit formats take 2 everywhere:
 * each tile's high-bit words want registers too (4 tiles of q5 spilled to the stack ~400 times
 * per call's loop body on AVX2). */
#if LANES == 16
#define ONE_ROW_TILES 2
#else
#define ONE_ROW_TILES 4
#endif
#define q8_ROW_TILES ONE_ROW_TILES
#define q4_ROW_TILES ONE_ROW_TILES
#define q4k_ROW_TILES ONE_ROW_TILES
#define bf16_ROW_TILES ONE_ROW_TILES
#define f16_ROW_TILES ONE_ROW_TILES
#define q5_ROW_TILES 2
#define q50_ROW_TILES 2
#define q5k_ROW_TILES 2
#define q6k_ROW_TILES 2

#define DEFINE_FORMAT(NAME)                                                                       \
    DEFINE_QROWS(NAME, 1)                                                                         \
    DEFINE_QROWS(NAME, 2)                                                                         \
    DEFINE_QROWS(NAME, 4)                                                                         \
    DEFINE_QROWS(NAME, 8)                                                                         \
    DEFINE_QGROUP(NAME, 1)                                                                        \
    DEFINE_QGROUP(NAME, 2)                                                                        \
    DEFINE_QGROUP(NAME, 4)                                                                        \
    DEFINE_QGROUP_WIDE(NAME)                                                                      \
    DEFINE_QTILES(NAME, 2)                                                                        \
    DEFINE_QTILES(NAME, 4)
DEFINE_FORMAT(q8)
DEFINE_FORMAT(q4)
DEFINE_FORMAT(q5)
DEFINE_FORMAT(q50)
DEFINE_FORMAT(q6k)
DEFINE_FORMAT(q4k)
DEFINE_FORMAT(q5k)
DEFINE_FORMAT(bf16)
DEFINE_FORMAT(f16)

typedef void (*qrows_fn)(const float *, int64_t, const float *, const uint8_t *, int64_t,
                         const float *, float *, int64_t, int64_t);
typedef void (*qgroup_fn)(const float *, int64_t, const float *, int64_t, int64_t,
                          const uint8_t *, int, const float *, float *);
typedef void (*qtiles_fn)(const float *, const float *, const uint8_t *, int64_t, const float *,
                          float *, int64_t);
typedef void (*values_fn)(const uint8_t *, int, vec *);
typedef void (*scale_fn)(const uint8_t *, int, vec *, vec *);

/* Per format code: its block's bytes and inputs, inputs per scale, whether it has scales (not the
 * 16-bit floats) and offsets, and its functions: the register row blocks of 8, 4, 2, 1 rows, the
 * group blocks of GROUP_ROWS, 4, 2, 1 rows, the one-row calls over 4 and 2 tiles, the values of
 * one input and the scales of one group. */
typedef struct {
    int64_t block, span;
    int sub, scaled, offset, row_tiles;
    qrows_fn rows[4];
    qgroup_fn groups[4];
    qtiles_fn tiles[2];
    values_fn values;
    scale_fn scale;
} qformat;

/* The scales of one group on their own (NAME##_prep and NAME##_scale): the table's scale_fn. */
#define DEFINE_SCALE_AT(NAME)                                                                     \
    static void NAME##_scale_at(const uint8_t *block, int s, vec *scale, vec *min) {              \
        block_scales bs;                                                                          \
        NAME##_prep(block, &bs);                                                                  \
        NAME##_scale(block, &bs, s, scale, min);                                                  \
    }
DEFINE_SCALE_AT(q8)
DEFINE_SCALE_AT(q4)
DEFINE_SCALE_AT(q5)
DEFINE_SCALE_AT(q50)
DEFINE_SCALE_AT(q6k)
DEFINE_SCALE_AT(q4k)
DEFINE_SCALE_AT(q5k)

#define FORMAT_OF(NAME, SCALED, OFFSET, SCALE)                                                    \
    {NAME##_BLOCK, NAME##_SPAN, NAME##_SUB, SCALED, OFFSET, NAME##_ROW_TILES,                     \
     {NAME##_rows_8, NAME##_rows_4, NAME##_rows_2, NAME##_rows_1},                                \
     {GROUP_WIDE(NAME), NAME##_group_4, NAME##_group_2, NAME##_group_1},                          \
     {NAME##_tiles_4, NAME##_tiles_2}, NAME##_values, SCALE}
static const qformat FORMATS[N_FORMATS] = {
    [FORMAT_Q8_0] = FORMAT_OF(q8, 1, 0, q8_scale_at),
    [FORMAT_Q4] = FORMAT_OF(q4, 1, 1, q4_scale_at),
    [FORMAT_BF16] = FORMAT_OF(bf16, 0, 0, NULL),
    [FORMAT_F16] = FORMAT_OF(f16, 0, 0, NULL),
    [FORMAT_Q5] = FORMAT_OF(q5, 1, 1, q5_scale_at),
    [FORMAT_Q6_K] = FORMAT_OF(q6k, 1, 1, q6k_scale_at),
    [FORMAT_Q4_K] = FORMAT_OF(q4k, 1, 1, q4k_scale_at),
    [FORMAT_Q5_K] = FORMAT_OF(q5k, 1, 1, q5k_scale_at),
    [FORMAT_Q5_0] = FORMAT_OF(q50, 1, 1, q50_scale_at),
};

static const qformat *format_of(int format) {
    return format >= 0 && format < N_FORMATS ? &FORMATS[format] : NULL;
}

/* Bytes of one (tile, block) unit, or -1 for an unknown format. */
int64_t tandem_qgemv_block_bytes(int format) {
    const qformat *f = format_of(format);
    return f ? f->block : -1;
}

/* Inputs of one (tile, block) unit (32, or 256 for the K formats), or -1 for an unknown format. */
int64_t tandem_qgemv_block_inputs(int format) {
    const qformat *f = format_of(format);
    return f ? f->span : -1;
}

/* All rows over one tile, group by group (more rows than a register block): each group's values
 * converted once into values [SUB][TILE], every row block run over them, the rows'
 * accumulators (accm [rows][TILE], starting at the bias) kept between groups. */
static void tile_by_groups(const qformat *f, const float *x, int64_t ldx, const float *sums,
                           const uint8_t *w, int64_t in, const float *bias, float *y, int64_t ldy,
                           int64_t cols, int64_t rows, float *accm) {
    const int64_t blocks = in / f->span, subs = in / f->sub;
    const int64_t sizes[4] = {GROUP_ROWS, 4, 2, 1};
    float values[GROUP * TILE] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < VECS; c++)
            store_vec(accm + r * TILE + c * LANES, bias ? load_vec(bias + c * LANES) : (vec){0});
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * f->block;
        for (int s = 0; s < f->span / f->sub; s++) {
            const int64_t i0 = b * f->span + s * f->sub;
            for (int j = 0; j < f->sub; j++) {
                vec wv[VECS];
                f->values(block, s * f->sub + j, wv);
                for (int c = 0; c < VECS; c++) store_vec(values + j * TILE + c * LANES, wv[c]);
            }
            int64_t r = 0;
            for (int k = 0; k < 4; k++)
                for (const int64_t n = sizes[k]; r + n <= rows; r += n)
                    f->groups[k](x + r * ldx, ldx, sums + r * subs, subs, i0, block, s, values,
                                 accm + r * TILE);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        vec acc[VECS];
        for (int c = 0; c < VECS; c++) acc[c] = load_vec(accm + r * TILE + c * LANES);
        store_cols(y + r * ldy, acc, cols);
    }
}

/* Inputs j0..j0+n of one (tile, block) unit dequantized, dst[j * ld + column] for TILE columns:
 * w = q * scale (+ min), one fused multiply-add, exact for every GGUF format (the product is
 * exact, so only the offset's add rounds, as in gguf's reference; see quantized_weight.py);
 * 16-bit floats: their values. */
static void dequant_inputs(const qformat *f, const uint8_t *block, int j0, int n, float *dst,
                           int64_t ld) {
    vec scale[VECS], min[VECS];
    for (int j = j0; j < j0 + n; j++) {
        vec wv[VECS];
        f->values(block, j, wv);
        if (f->scaled) {
            if (j == j0 || j % f->sub == 0) f->scale(block, j / f->sub, scale, min);
            for (int c = 0; c < VECS; c++)
                wv[c] = f->offset ? wv[c] * scale[c] + min[c] : wv[c] * scale[c];
        }
        for (int c = 0; c < VECS; c++) store_vec(dst + (j - j0) * ld + c * LANES, wv[c]);
    }
}

/* The whole weight transposed to float32 wt [in, out] (row stride out), for a BLAS GEMM over many
 * rows: llama.cpp, too, hands prefill-sized batches to BLAS after dequantizing. Walked group of 32
 * inputs by group, every tile of a group before the next group: each thread fills whole rows of wt
 * (32 at a time, a region that stays in L2) while it reads each block's part once, front to back.
 * Returns 0, or -1 for an unknown format. */
int tandem_qdequant_t(int format, const uint8_t *w, int64_t in, int64_t out, float *wt,
                      int threads) {
    const qformat *f = format_of(format);
    if (!f || in % f->span) return -1;
    const int64_t n_tiles = (out + TILE - 1) / TILE, groups = in / GROUP, blocks = in / f->span;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b = g * GROUP / f->span;
        const int j0 = (int)(g * GROUP % f->span);
        for (int64_t t = 0; t < n_tiles; t++) {
            const uint8_t *block = w + (t * blocks + b) * f->block;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            float *dst = wt + g * GROUP * out + t * TILE;
            if (cols == TILE) { /* whole tiles: straight into wt, not through a copy */
                dequant_inputs(f, block, j0, GROUP, dst, out);
            } else {
                float part[GROUP * TILE];
                dequant_inputs(f, block, j0, GROUP, part, TILE);
                for (int j = 0; j < GROUP; j++)
                    memcpy(dst + j * out, part + j * TILE, (size_t)cols * sizeof(float));
            }
        }
    }
    return 0;
}

/* Rows index[0..n) of a tiled weight [out_features, in], dequantized into dst [n, in] (float32,
 * contiguous): an embedding lookup on a tied head's tiles, exactly the values tandem_qdequant_t
 * gives. q8_0 and the 16-bit floats read only the column of each block that holds the row;
 * the other formats dequantize a group of the tile at a time and keep the row's column. Returns 0,
 * or -1 for an unknown format or an index out of range. */
int tandem_qgather_rows(int format, const uint8_t *w, int64_t in, int64_t out_features,
                        const int64_t *index, int64_t n, float *dst) {
    const qformat *f = format_of(format);
    if (!f || in % f->span) return -1;
    const int64_t blocks = in / f->span;
    for (int64_t r = 0; r < n; r++)
        if (index[r] < 0 || index[r] >= out_features) return -1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t t = index[r] / TILE, c = index[r] % TILE;
        const uint8_t *tile = w + t * blocks * f->block;
        float *row = dst + r * in;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = tile + b * f->block;
            const float *scale = (const float *)block;
            float *out = row + b * f->span;
            if (format == FORMAT_Q8_0) {
                const int8_t *q = (const int8_t *)(block + 4 * TILE);
                for (int j = 0; j < GROUP; j++) out[j] = (float)q[j * TILE + c] * scale[c];
            } else if (!f->scaled) { /* 16-bit floats: gather the column, widen a vector at a time */
                const uint16_t *q = (const uint16_t *)block;
                uint16_t column[GROUP];
                for (int j = 0; j < GROUP; j++) column[j] = q[j * TILE + c];
                for (int j = 0; j < GROUP; j += LANES)
                    store_vec(out + j, format == FORMAT_BF16 ? bf16_to_float(column + j)
                                                             : f16_to_float(column + j));
            } else {
                for (int j0 = 0; j0 < f->span; j0 += GROUP) {
                    float part[GROUP * TILE];
                    dequant_inputs(f, block, j0, GROUP, part, TILE);
                    for (int j = 0; j < GROUP; j++) out[j0 + j] = part[j * TILE + c];
                }
            }
        }
    }
    return 0;
}

int tandem_qgemv_tile(void) { return TILE; }

const char *tandem_qgemv_isa(void) { return TANDEM_ISA; }

/* One row: the tiles split evenly over the threads, a pair at a time (a thread's share is whole
 * pairs); each thread walks its share row_tiles (4 or 2) tiles per call, then a pair, then the
 * last odd tile alone. */
static void one_row(const qformat *f, const float *x, const float *sums, const uint8_t *w,
                    const float *bias, float *y, int64_t in, int64_t out, int threads) {
    const int64_t tile_bytes = (in / f->span) * f->block;
    const int64_t n_tiles = (out + TILE - 1) / TILE, pairs = (n_tiles + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t last_pair = 2 * (pairs * (id + 1) / n);
        const int64_t end = last_pair < n_tiles ? last_pair : n_tiles;
        for (int64_t t = 2 * (pairs * id / n); t < end;) {
            const int64_t k = end - t >= f->row_tiles ? f->row_tiles : end - t >= 2 ? 2 : 1;
            const int64_t rest = out - (t + k - 1) * TILE, cols_last = rest < TILE ? rest : TILE;
            const float *bt = bias ? bias + t * TILE : NULL;
            if (k == 1)
                f->rows[3](x, in, sums, w + t * tile_bytes, in, bt, y + t * TILE, out, cols_last);
            else
                f->tiles[k == 4 ? 0 : 1](x, sums, w + t * tile_bytes, in, bt, y + t * TILE, cols_last);
            t += k;
        }
    }
}

/* x [rows, in] float32 (row stride ldx), w [n_tiles, in / span, block] as above, bias
 * [n_tiles * TILE] or NULL, y [rows, out] contiguous; in a multiple of the format's block inputs.
 * Returns 0, or -1 for an unknown format or when the rows' buffers can't be allocated. */
int tandem_qgemv(int format, const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                 float *y, int64_t rows, int64_t in, int64_t out, int threads) {
    const qformat *f = format_of(format);
    if (!f || in % f->span) return -1;
    const int64_t n_tiles = (out + TILE - 1) / TILE, tile_bytes = (in / f->span) * f->block;
    const int by_groups = rows > REGISTER_ROWS;
    const int64_t sizes[4] = {8, 4, 2, 1};
    const int64_t subs = in / f->sub;
    float small[8 * 64];
    float *sums = rows * subs <= (int64_t)(sizeof small / sizeof *small)
                      ? small
                      : malloc((size_t)(rows * subs) * sizeof(float));
    if (!sums) return -1;
    group_sums(x, ldx, rows, in, f->sub, sums);
    if (rows == 1) {
        one_row(f, x, sums, w, bias, y, in, out, threads);
        if (sums != small) free(sums);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *accm = by_groups ? malloc((size_t)rows * TILE * sizeof(float)) : NULL;
        if (by_groups && !accm) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tiles; t++) {
            const uint8_t *wt = w + t * tile_bytes;
            const float *bt = bias ? bias + t * TILE : NULL;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            float *yt = y + t * TILE;
            if (by_groups) {
                if (accm) tile_by_groups(f, x, ldx, sums, wt, in, bt, yt, out, cols, rows, accm);
                continue;
            }
            int64_t r = 0;
            for (int k = 0; k < 4; k++)
                for (const int64_t n = sizes[k]; r + n <= rows; r += n)
                    f->rows[k](x + r * ldx, ldx, sums + r * subs, wt, in, bt, yt + r * out, out, cols);
        }
        free(accm);
    }
    if (sums != small) free(sums);
    return failed ? -1 : 0;
}
