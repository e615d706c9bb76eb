/* Weight-only y = x @ W^T (+ bias) for CPUs: 8-bit, 4-bit and 16-bit float weights, float32 rows.
 *
 * Decode on CPU streams every weight once per token; reading 4- or 8-bit weights instead of
 * float32 ones cuts those bytes 4-6x (GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K, as llama.cpp serves
 * them), bfloat16 / float16 weights 2x. The weights stay compact in memory and become floats in
 * registers right before the multiply-adds; activations stay float32 (no activation quantization).
 *
 * Both formats keep GGUF's groups of 32 inputs with one scale (and for 4-bit one offset) per
 * output feature and group: w[o, i] = q[o, i] * scale[o, g] + min[o, g], g = i / 32. Tiled like
 * cpu_gemv.c, TILE output features at a time, each (tile, group) one contiguous block:
 *
 *   q4:   float scale[TILE], float min[TILE], uint8 q[32][TILE / 2]   byte c of an input row holds
 *         column c in its low nibble and column c + TILE / 2 in its high nibble
 *   q8_0: float scale[TILE], int8 q[32][TILE]
 *
 * bfloat16 and float16 weights use the same (tile, group) blocks without scales: uint16 q[32][TILE],
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
 * are converted once into a small float32 scratch block (GROUP x TILE, in L1) that every row block
 * then reads, and the rows' accumulators wait in a per-thread buffer between groups. The
 * conversion is paid once per group and tile, not once per row block, and the tile's values, the
 * rows' group of inputs and the accumulators all stay in L1 while the row blocks run.
 * Both paths run the same multiply-add chain per output (DEFINE_QROWS, DEFINE_QGROUP): a row's
 * result is the same bits whatever its batch mates.
 */
#include <omp.h>
#include <stdlib.h>

#include "tandem_simd.h"

#define GROUP 32
#define Q4_BLOCK (8 * TILE + GROUP * TILE / 2)
#define Q8_BLOCK (4 * TILE + GROUP * TILE)
#define HALF_BLOCK (2 * GROUP * TILE)

enum { FORMAT_Q8_0 = 0, FORMAT_Q4 = 1, FORMAT_BF16 = 2, FORMAT_F16 = 3, N_FORMATS = 4 };

/* Input j of one group block: its integer values (no scale, no offset) as two float vectors
 * (columns 0..LANES-1 and LANES..TILE-1). Exact: every value is a small integer. */
static inline void q4_values(const uint8_t *block, int j, vec *w) {
    nibbles_to_float(block + 8 * TILE + j * LANES, &w[0], &w[1]);
}

static inline void q8_values(const uint8_t *block, int j, vec *w) {
    const int8_t *q = (const int8_t *)(block + 4 * TILE + j * TILE);
    w[0] = s8_to_float(q);
    w[1] = s8_to_float(q + LANES);
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

/* The end of one group: acc += scale * part (+ min * sum of the group's inputs, for 4-bit). */
static inline void q4_finish(const uint8_t *block, const vec *part, float sum, vec *acc) {
    const float *scale = (const float *)block, *min = scale + TILE;
    for (int c = 0; c < VECS; c++) {
        acc[c] += part[c] * load_vec(scale + c * LANES);
        acc[c] += sum * load_vec(min + c * LANES);
    }
}

static inline void q8_finish(const uint8_t *block, const vec *part, float sum, vec *acc) {
    (void)sum;
    const float *scale = (const float *)block;
    for (int c = 0; c < VECS; c++) acc[c] += part[c] * load_vec(scale + c * LANES);
}

static inline void half_finish(const uint8_t *block, const vec *part, float sum, vec *acc) {
    (void)block, (void)sum;
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

/* Sums of each row's groups of 32 inputs, sums[r * groups + g], each one fixed chain (vector adds
 * in input order, then hsum's tree): the 4-bit offset term is min * sum, once per group. */
static void group_sums(const float *x, int64_t ldx, int64_t rows, int64_t in, float *sums) {
    const int64_t groups = in / GROUP;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * ldx + g * GROUP;
            vec v = load_vec(xg);
            for (int k = LANES; k < GROUP; k += LANES) v += load_vec(xg + k);
            sums[r * groups + g] = hsum(v);
        }
}

/* R rows over one quantized tile, its values converted in registers. Per output and group, one
 * chain: part = sum_j x[j] * q[j] (fused multiply-adds in input order, from zero), then
 * acc += scale * part and, for 4-bit, acc += min * sum(x over the group); acc starts at the bias.
 * Factoring the scale and offset out of the group halves the vector work per weight compared
 * with dequantizing each weight first, and the chain is the same as DEFINE_QGROUP's (many rows),
 * so a row's result never depends on its batch mates. */
#define DEFINE_QROWS(NAME, BLOCK, R)                                                              \
    static void NAME##_rows_##R(const float *x, int64_t ldx, const float *sums, const uint8_t *w, \
                                int64_t in, const float *bias, float *y, int64_t ldy,             \
                                int64_t cols) {                                                   \
        const int64_t groups = in / GROUP;                                                        \
        vec acc[R][VECS];                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) acc[r][c] = bias ? load_vec(bias + c * LANES) : (vec){0}; \
        for (int64_t g = 0; g < groups; g++) {                                                    \
            const uint8_t *block = w + g * BLOCK;                                                 \
            vec part[R][VECS];                                                                    \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                             \
            for (int j = 0; j < GROUP; j++) {                                                     \
                vec wv[VECS];                                                                     \
                NAME##_values(block, j, wv);                                                      \
                for (int r = 0; r < R; r++) {                                                     \
                    const float xv = x[r * ldx + g * GROUP + j];                                  \
                    for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                      \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < R; r++)                                                           \
                NAME##_finish(block, part[r], sums[r * groups + g], acc[r]);                      \
        }                                                                                         \
        for (int r = 0; r < R; r++) store_cols(y + r * ldy, acc[r], cols);                        \
    }

/* One group of R rows over values converted once (float32 [GROUP][TILE], the scratch block):
 * the same part chain as NAME##_rows_R, then the same finish into the rows' accumulators, which
 * wait in memory between groups (accm [R][TILE]). */
#define DEFINE_QGROUP(NAME, R)                                                                    \
    static void NAME##_group_##R(const float *x, int64_t ldx, const float *sums,                 \
                                 int64_t groups, int64_t g, const uint8_t *block,                 \
                                 const float *values, float *accm) {                              \
        vec part[R][VECS];                                                                        \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                                 \
        const float *xg = x + g * GROUP;                                                          \
        for (int j = 0; j < GROUP; j++) {                                                         \
            const vec wv[VECS] = {load_vec(values + j * TILE), load_vec(values + j * TILE + LANES)}; \
            for (int r = 0; r < R; r++) {                                                         \
                const float xv = xg[r * ldx + j];                                                 \
                for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                          \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < R; r++) {                                                             \
            vec acc[VECS];                                                                        \
            for (int c = 0; c < VECS; c++) acc[c] = load_vec(accm + r * TILE + c * LANES);        \
            NAME##_finish(block, part[r], sums[r * groups + g], acc);                             \
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
#define DEFINE_QBLOCKS(NAME, BLOCK)                                                               \
    DEFINE_QROWS(NAME, BLOCK, 1)                                                                  \
    DEFINE_QROWS(NAME, BLOCK, 2)                                                                  \
    DEFINE_QROWS(NAME, BLOCK, 4)                                                                  \
    DEFINE_QROWS(NAME, BLOCK, 8)                                                                  \
    DEFINE_QGROUP(NAME, 1)                                                                        \
    DEFINE_QGROUP(NAME, 2)                                                                        \
    DEFINE_QGROUP(NAME, 4)                                                                        \
    DEFINE_QGROUP_WIDE(NAME)
DEFINE_QBLOCKS(q4, Q4_BLOCK)
DEFINE_QBLOCKS(q8, Q8_BLOCK)
DEFINE_QBLOCKS(bf16, HALF_BLOCK)
DEFINE_QBLOCKS(f16, HALF_BLOCK)

/* One row over N consecutive tiles at once (tile n at w + n * groups * BLOCK, its bias and
 * outputs TILE further along each): the same chain per output as NAME##_rows_1, with N times the
 * independent accumulators. A single row has only VECS of them per tile, too few to hide the
 * multiply-add latency; N tiles' worth keep the vector units busy. cols_last: the last tile's
 * width (the others are whole). */
#define DEFINE_QTILES(NAME, BLOCK, N)                                                             \
    static void NAME##_tiles_##N(const float *x, const float *sums, const uint8_t *w, int64_t in, \
                                 const float *bias, float *y, int64_t cols_last) {                \
        const int64_t groups = in / GROUP, tile_bytes = groups * BLOCK;                           \
        vec acc[N][VECS];                                                                         \
        for (int n = 0; n < N; n++)                                                               \
            for (int c = 0; c < VECS; c++)                                                        \
                acc[n][c] = bias ? load_vec(bias + n * TILE + c * LANES) : (vec){0};              \
        for (int64_t g = 0; g < groups; g++) {                                                    \
            const uint8_t *block = w + g * BLOCK;                                                 \
            vec part[N][VECS];                                                                    \
            for (int n = 0; n < N; n++)                                                           \
                for (int c = 0; c < VECS; c++) part[n][c] = (vec){0};                             \
            for (int j = 0; j < GROUP; j++) {                                                     \
                const float xv = x[g * GROUP + j];                                                \
                for (int n = 0; n < N; n++) {                                                     \
                    vec wv[VECS];                                                                 \
                    NAME##_values(block + n * tile_bytes, j, wv);                                 \
                    for (int c = 0; c < VECS; c++) part[n][c] += xv * wv[c];                      \
                }                                                                                 \
            }                                                                                     \
            for (int n = 0; n < N; n++)                                                           \
                NAME##_finish(block + n * tile_bytes, part[n], sums[g], acc[n]);                  \
        }                                                                                         \
        for (int n = 0; n < N; n++) store_cols(y + n * TILE, acc[n], n < N - 1 ? TILE : cols_last); \
    }
/* Tiles per one-row call: 4 on AVX2 and the generic build (16 registers: 8 accumulators, the
 * converted weights and the broadcast input fit), 2 on AVX-512, whose wider vectors already
 * give 2 tiles x 2 vectors x 16 lanes in flight. */
#if LANES == 16
#define ONE_ROW_TILES 2
#else
#define ONE_ROW_TILES 4
#endif
#define DEFINE_QTILE_SETS(NAME, BLOCK)                                                            \
    DEFINE_QTILES(NAME, BLOCK, 2)                                                                 \
    DEFINE_QTILES(NAME, BLOCK, 4)

DEFINE_QTILE_SETS(q4, Q4_BLOCK)
DEFINE_QTILE_SETS(q8, Q8_BLOCK)
DEFINE_QTILE_SETS(bf16, HALF_BLOCK)
DEFINE_QTILE_SETS(f16, HALF_BLOCK)

typedef void (*qrows_fn)(const float *, int64_t, const float *, const uint8_t *, int64_t,
                         const float *, float *, int64_t, int64_t);
typedef void (*qgroup_fn)(const float *, int64_t, const float *, int64_t, int64_t, const uint8_t *,
                          const float *, float *);
typedef void (*qtiles_fn)(const float *, const float *, const uint8_t *, int64_t, const float *,
                          float *, int64_t);

/* Per format code: the register row blocks of 8, 4, 2, 1 rows, the group blocks of GROUP_ROWS,
 * 4, 2, 1 rows and the one-row calls over 4 and 2 tiles. */
static const qrows_fn REGISTER_FNS[N_FORMATS][4] = {
    [FORMAT_Q8_0] = {q8_rows_8, q8_rows_4, q8_rows_2, q8_rows_1},
    [FORMAT_Q4] = {q4_rows_8, q4_rows_4, q4_rows_2, q4_rows_1},
    [FORMAT_BF16] = {bf16_rows_8, bf16_rows_4, bf16_rows_2, bf16_rows_1},
    [FORMAT_F16] = {f16_rows_8, f16_rows_4, f16_rows_2, f16_rows_1},
};
#define GROUP_FNS_OF(NAME) {GROUP_WIDE(NAME), NAME##_group_4, NAME##_group_2, NAME##_group_1}
static const qgroup_fn GROUP_FNS[N_FORMATS][4] = {
    [FORMAT_Q8_0] = GROUP_FNS_OF(q8), [FORMAT_Q4] = GROUP_FNS_OF(q4),
    [FORMAT_BF16] = GROUP_FNS_OF(bf16), [FORMAT_F16] = GROUP_FNS_OF(f16),
};
static const qtiles_fn TILES_FNS[N_FORMATS][2] = {
    [FORMAT_Q8_0] = {q8_tiles_4, q8_tiles_2}, [FORMAT_Q4] = {q4_tiles_4, q4_tiles_2},
    [FORMAT_BF16] = {bf16_tiles_4, bf16_tiles_2}, [FORMAT_F16] = {f16_tiles_4, f16_tiles_2},
};

/* Bytes of one (tile, group) block, or -1 for an unknown format. */
int64_t tandem_qgemv_block_bytes(int format) {
    switch (format) {
    case FORMAT_Q8_0: return Q8_BLOCK;
    case FORMAT_Q4: return Q4_BLOCK;
    case FORMAT_BF16: case FORMAT_F16: return HALF_BLOCK;
    default: return -1;
    }
}

/* Input j of one (tile, group) block as two float vectors: the integer values, or with scaled
 * (and offset), GGUF's dequantization (w = q * scale + min, one fused multiply-add, exact for
 * every GGUF format: see quantized_weight.py); 16-bit floats: their values either way. */
static inline void input_values(int format, const uint8_t *block, int j, int scaled, vec *w) {
    const float *scale = (const float *)block;
    if (format == FORMAT_BF16) {
        bf16_values(block, j, w);
    } else if (format == FORMAT_F16) {
        f16_values(block, j, w);
    } else if (format == FORMAT_Q4) {
        q4_values(block, j, w);
        if (scaled)
            for (int c = 0; c < VECS; c++)
                w[c] = w[c] * load_vec(scale + c * LANES) + load_vec(scale + TILE + c * LANES);
    } else {
        q8_values(block, j, w);
        if (scaled)
            for (int c = 0; c < VECS; c++) w[c] = w[c] * load_vec(scale + c * LANES);
    }
}

/* All rows over one tile, group by group (more rows than a register block): each group's values
 * converted once into values [GROUP][TILE], every row block run over them, the rows'
 * accumulators (accm [rows][TILE], starting at the bias) kept between groups. */
static void tile_by_groups(int format, const float *x, int64_t ldx, const float *sums,
                           const uint8_t *w, int64_t in, const float *bias, float *y, int64_t ldy,
                           int64_t cols, int64_t rows, float *accm) {
    const int64_t block = tandem_qgemv_block_bytes(format), groups = in / GROUP;
    const int64_t sizes[4] = {GROUP_ROWS, 4, 2, 1};
    const qgroup_fn *fns = GROUP_FNS[format];
    float values[GROUP * TILE] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < VECS; c++)
            store_vec(accm + r * TILE + c * LANES, bias ? load_vec(bias + c * LANES) : (vec){0});
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_block = w + g * block;
        for (int j = 0; j < GROUP; j++) {
            vec wv[VECS];
            input_values(format, group_block, j, 0, wv);
            for (int c = 0; c < VECS; c++) store_vec(values + j * TILE + c * LANES, wv[c]);
        }
        int64_t r = 0;
        for (int k = 0; k < 4; k++)
            for (const int64_t n = sizes[k]; r + n <= rows; r += n)
                fns[k](x + r * ldx, ldx, sums + r * groups, groups, g, group_block, values,
                       accm + r * TILE);
    }
    for (int64_t r = 0; r < rows; r++) {
        vec acc[VECS];
        for (int c = 0; c < VECS; c++) acc[c] = load_vec(accm + r * TILE + c * LANES);
        store_cols(y + r * ldy, acc, cols);
    }
}

/* The whole weight transposed to float32 wt [in, out] (row stride out), for a BLAS GEMM over many
 * rows: llama.cpp, too, hands prefill-sized batches to BLAS after dequantizing. Walked group by
 * group, every tile of a group before the next group: each thread fills whole rows of wt (32 at
 * a time, a region that stays in L2) while it reads each (tile, group) block once, front to back.
 * Returns 0, or -1 for an unknown format. */
int tandem_qdequant_t(int format, const uint8_t *w, int64_t in, int64_t out, float *wt,
                      int threads) {
    const int64_t block = tandem_qgemv_block_bytes(format), n_tiles = (out + TILE - 1) / TILE;
    if (block < 0 || in % GROUP) return -1;
    const int64_t groups = in / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t t = 0; t < n_tiles; t++) {
            const uint8_t *group_block = w + (t * groups + g) * block;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            for (int j = 0; j < GROUP; j++) {
                vec wv[VECS];
                input_values(format, group_block, j, 1, wv);
                float *dst = wt + (g * GROUP + j) * out + t * TILE;
                if (cols == TILE) { /* whole tiles: two vector stores, not a memcpy call */
                    store_vec(dst, wv[0]);
                    store_vec(dst + LANES, wv[1]);
                } else {
                    store_cols(dst, wv, cols);
                }
            }
        }
    }
    return 0;
}

/* Rows index[0..n) of a tiled weight [out_features, in], dequantized into dst [n, in] (float32,
 * contiguous): an embedding lookup on a tied head's tiles, exactly the values tandem_qdequant_t
 * gives (each q * scale is exact in float32, so only the offset's add rounds). Only the column of
 * each (tile, group) block that holds the row is read. Returns 0, or -1 for an unknown format or
 * an index out of range. */
int tandem_qgather_rows(int format, const uint8_t *w, int64_t in, int64_t out_features,
                        const int64_t *index, int64_t n, float *dst) {
    const int64_t block = tandem_qgemv_block_bytes(format), groups = in / GROUP;
    if (block < 0 || in % GROUP) return -1;
    for (int64_t r = 0; r < n; r++)
        if (index[r] < 0 || index[r] >= out_features) return -1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t t = index[r] / TILE, c = index[r] % TILE;
        const uint8_t *tile = w + t * groups * block;
        float *row = dst + r * in;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = tile + g * block;
            const float *scale = (const float *)b;
            float *out = row + g * GROUP;
            if (format == FORMAT_Q8_0) {
                const int8_t *q = (const int8_t *)(b + 4 * TILE);
                for (int j = 0; j < GROUP; j++) out[j] = (float)q[j * TILE + c] * scale[c];
            } else if (format == FORMAT_Q4) {
                const uint8_t *q = b + 8 * TILE;
                const int64_t half = TILE / 2, shift = c < half ? 0 : 4;
                for (int j = 0; j < GROUP; j++) {
                    const int value = (q[j * half + c % half] >> shift) & 15;
                    out[j] = (float)value * scale[c] + scale[TILE + c];
                }
            } else { /* 16-bit floats: gather the column, widen a vector at a time */
                const uint16_t *q = (const uint16_t *)b;
                uint16_t column[GROUP];
                for (int j = 0; j < GROUP; j++) column[j] = q[j * TILE + c];
                for (int j = 0; j < GROUP; j += LANES)
                    store_vec(out + j, format == FORMAT_BF16 ? bf16_to_float(column + j)
                                                             : f16_to_float(column + j));
            }
        }
    }
    return 0;
}

int tandem_qgemv_tile(void) { return TILE; }

const char *tandem_qgemv_isa(void) { return TANDEM_ISA; }

/* One row: the tiles split evenly over the threads, a pair at a time (a thread's share is whole
 * pairs); each thread walks its share ONE_ROW_TILES tiles per call, then a pair, then the last
 * odd tile alone. */
static void one_row(int format, const float *x, const float *sums, const uint8_t *w,
                    const float *bias, float *y, int64_t in, int64_t out, int threads) {
    const int64_t tile_bytes = (in / GROUP) * tandem_qgemv_block_bytes(format);
    const int64_t n_tiles = (out + TILE - 1) / TILE, pairs = (n_tiles + 1) / 2;
    const qtiles_fn *tiles = TILES_FNS[format];
    const qrows_fn single = REGISTER_FNS[format][3];
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t last_pair = 2 * (pairs * (id + 1) / n);
        const int64_t end = last_pair < n_tiles ? last_pair : n_tiles;
        for (int64_t t = 2 * (pairs * id / n); t < end;) {
            const int64_t k = end - t >= ONE_ROW_TILES ? ONE_ROW_TILES : end - t >= 2 ? 2 : 1;
            const int64_t rest = out - (t + k - 1) * TILE, cols_last = rest < TILE ? rest : TILE;
            const float *bt = bias ? bias + t * TILE : NULL;
            if (k == 1)
                single(x, in, sums, w + t * tile_bytes, in, bt, y + t * TILE, out, cols_last);
            else
                tiles[k == 4 ? 0 : 1](x, sums, w + t * tile_bytes, in, bt, y + t * TILE, cols_last);
            t += k;
        }
    }
}

/* x [rows, in] float32 (row stride ldx), w [n_tiles, in / 32, block] as above, bias
 * [n_tiles * TILE] or NULL, y [rows, out] contiguous; in a multiple of 32. Returns 0, or -1 for an
 * unknown format or when the rows' accumulator buffer can't be allocated. */
int tandem_qgemv(int format, const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                 float *y, int64_t rows, int64_t in, int64_t out, int threads) {
    const int64_t block = tandem_qgemv_block_bytes(format), n_tiles = (out + TILE - 1) / TILE;
    if (block < 0 || in % GROUP) return -1;
    const int by_groups = rows > REGISTER_ROWS;
    const int64_t sizes[4] = {8, 4, 2, 1};
    const qrows_fn *fns = REGISTER_FNS[format];
    const int64_t groups = in / GROUP;
    float small[8 * 64];
    float *sums = rows * groups <= (int64_t)(sizeof small / sizeof *small)
                      ? small
                      : malloc((size_t)(rows * groups) * sizeof(float));
    if (!sums) return -1;
    group_sums(x, ldx, rows, in, sums);
    if (rows == 1) {
        one_row(format, x, sums, w, bias, y, in, out, threads);
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
            const uint8_t *wt = w + t * groups * block;
            const float *bt = bias ? bias + t * TILE : NULL;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            float *yt = y + t * TILE;
            if (by_groups) {
                if (accm) tile_by_groups(format, x, ldx, sums, wt, in, bt, yt, out, cols, rows, accm);
                continue;
            }
            int64_t r = 0;
            for (int k = 0; k < 4; k++)
                for (const int64_t n = sizes[k]; r + n <= rows; r += n)
                    fns[k](x + r * ldx, ldx, sums + r * groups, wt, in, bt, yt + r * out, out, cols);
        }
        free(accm);
    }
    if (sums != small) free(sums);
    return failed ? -1 : 0;
}
