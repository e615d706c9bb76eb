/* Weight-only quantized y = x @ W^T (+ bias) for CPUs: 8-bit and 4-bit weights, float32 rows.
 *
 * Decode on CPU streams every weight once per token; reading 4- or 8-bit weights instead of
 * float32 ones cuts those bytes 4-6x (GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K, as llama.cpp serves
 * them). The weights stay quantized in memory and become floats in registers right before the
 * multiply-adds; activations stay float32 (no activation quantization).
 *
 * Both formats keep GGUF's groups of 32 inputs with one scale (and for 4-bit one offset) per
 * output feature and group: w[o, i] = q[o, i] * scale[o, g] + min[o, g], g = i / 32, computed as
 * one fused multiply-add, which is exact for every GGUF format (see quantized_weight.py), so the
 * floats are bit for bit gguf's dequantization. Tiled like cpu_gemv.c, TILE output features at a
 * time, each (tile, group) one contiguous block:
 *
 *   q4:   float scale[TILE], float min[TILE], uint8 q[32][TILE / 2]   byte c of an input row holds
 *         column c in its low nibble and column c + TILE / 2 in its high nibble
 *   q8_0: float scale[TILE], int8 q[32][TILE]
 *
 * A few rows (decode) dequantize each weight vector in registers and feed it to every row of the
 * block; a single row takes two tiles at a time, for enough independent accumulators. More rows than one register block (batched decode, prefill) dequantize a tile once into
 * a per-thread float32 scratch tile and run cpu_gemv's micro-kernel over all rows, so the
 * conversion is paid once per tile, not once per row block. Both paths run the same multiply-add
 * chain as tandem_tile_rows.h: a row's result is the same bits whatever its batch mates, and the
 * same bits as the float32 kernel over the dequantized weight.
 */
#include <stdlib.h>

#include "tandem_tile_rows.h"

#define GROUP 32
#define Q4_BLOCK (8 * TILE + GROUP * TILE / 2)
#define Q8_BLOCK (4 * TILE + GROUP * TILE)

enum { FORMAT_Q8_0 = 0, FORMAT_Q4 = 1 };

/* Input j of one group block as two float vectors (columns 0..LANES-1 and LANES..TILE-1). */
static inline void dequant_q4(const uint8_t *block, int j, vec *w) {
    const float *scale = (const float *)block, *min = scale + TILE;
    vec low, high;
    nibbles_to_float(block + 8 * TILE + j * LANES, &low, &high);
    w[0] = low * load_vec(scale) + load_vec(min);
    w[1] = high * load_vec(scale + LANES) + load_vec(min + LANES);
}

static inline void dequant_q8(const uint8_t *block, int j, vec *w) {
    const float *scale = (const float *)block;
    const int8_t *q = (const int8_t *)(block + 4 * TILE + j * TILE);
    w[0] = s8_to_float(q) * load_vec(scale);
    w[1] = s8_to_float(q + LANES) * load_vec(scale + LANES);
}

static inline void store_cols(float *y, const vec *acc, int64_t cols) {
    float tmp[TILE];
    memcpy(tmp, acc, sizeof tmp);
    memcpy(y, tmp, (size_t)cols * sizeof(float));
}

/* R rows over one quantized tile, dequantizing in registers (the chain of tandem_tile_rows.h). */
#define DEFINE_QTILE_ROWS(NAME, BLOCK, DEQUANT, R)                                                \
    static void NAME##_rows_##R(const float *x, int64_t ldx, const uint8_t *w, int64_t in,       \
                                const float *bias, float *y, int64_t ldy, int64_t cols) {        \
        vec acc[R][VECS];                                                                         \
        for (int r = 0; r < R; r++)                                                               \
            for (int c = 0; c < VECS; c++) acc[r][c] = bias ? load_vec(bias + c * LANES) : (vec){0}; \
        for (int64_t i0 = 0; i0 < in; i0 += KBLOCK) {                                             \
            const int64_t i1 = i0 + KBLOCK < in ? i0 + KBLOCK : in;                               \
            vec part[R][VECS];                                                                    \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                             \
            for (int64_t g = i0 / GROUP; g < i1 / GROUP; g++) {                                   \
                const uint8_t *block = w + g * BLOCK;                                             \
                for (int j = 0; j < GROUP; j++) {                                                 \
                    vec wv[VECS];                                                                 \
                    DEQUANT(block, j, wv);                                                        \
                    for (int r = 0; r < R; r++) {                                                 \
                        const float xv = x[r * ldx + g * GROUP + j];                              \
                        for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                  \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int r = 0; r < R; r++)                                                           \
                for (int c = 0; c < VECS; c++) acc[r][c] += part[r][c];                           \
        }                                                                                         \
        for (int r = 0; r < R; r++) store_cols(y + r * ldy, acc[r], cols);                        \
    }

DEFINE_QTILE_ROWS(q4, Q4_BLOCK, dequant_q4, 1)
DEFINE_QTILE_ROWS(q4, Q4_BLOCK, dequant_q4, 2)
DEFINE_QTILE_ROWS(q4, Q4_BLOCK, dequant_q4, 4)
DEFINE_QTILE_ROWS(q8, Q8_BLOCK, dequant_q8, 1)
DEFINE_QTILE_ROWS(q8, Q8_BLOCK, dequant_q8, 2)
DEFINE_QTILE_ROWS(q8, Q8_BLOCK, dequant_q8, 4)
#if ROW_BLOCK == 8
DEFINE_QTILE_ROWS(q4, Q4_BLOCK, dequant_q4, 8)
DEFINE_QTILE_ROWS(q8, Q8_BLOCK, dequant_q8, 8)
#endif

/* One row over two tiles at once: the same chain per output as NAME##_rows_1, with twice the
 * independent accumulators. A single row has only VECS of them per tile, too few to hide the
 * multiply-add latency (AVX2 waits on it); two tiles' worth keep the vector units busy. */
#define DEFINE_QTILE_PAIR(NAME, BLOCK, DEQUANT)                                                   \
    static void NAME##_pair_1(const float *x, const uint8_t *w0, const uint8_t *w1, int64_t in,  \
                              const float *b0, const float *b1, float *y0, float *y1,            \
                              int64_t cols1) {                                                    \
        vec acc[2][VECS];                                                                         \
        for (int c = 0; c < VECS; c++) {                                                          \
            acc[0][c] = b0 ? load_vec(b0 + c * LANES) : (vec){0};                                 \
            acc[1][c] = b1 ? load_vec(b1 + c * LANES) : (vec){0};                                 \
        }                                                                                         \
        for (int64_t i0 = 0; i0 < in; i0 += KBLOCK) {                                             \
            const int64_t i1 = i0 + KBLOCK < in ? i0 + KBLOCK : in;                               \
            vec part[2][VECS];                                                                    \
            for (int c = 0; c < VECS; c++) part[0][c] = part[1][c] = (vec){0};                    \
            for (int64_t g = i0 / GROUP; g < i1 / GROUP; g++) {                                   \
                const uint8_t *block0 = w0 + g * BLOCK, *block1 = w1 + g * BLOCK;                 \
                for (int j = 0; j < GROUP; j++) {                                                 \
                    vec wv0[VECS], wv1[VECS];                                                     \
                    DEQUANT(block0, j, wv0);                                                      \
                    DEQUANT(block1, j, wv1);                                                      \
                    const float xv = x[g * GROUP + j];                                            \
                    for (int c = 0; c < VECS; c++) {                                              \
                        part[0][c] += xv * wv0[c];                                                \
                        part[1][c] += xv * wv1[c];                                                \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int c = 0; c < VECS; c++) {                                                      \
                acc[0][c] += part[0][c];                                                          \
                acc[1][c] += part[1][c];                                                          \
            }                                                                                     \
        }                                                                                         \
        store_cols(y0, acc[0], TILE);                                                             \
        store_cols(y1, acc[1], cols1);                                                            \
    }

DEFINE_QTILE_PAIR(q4, Q4_BLOCK, dequant_q4)
DEFINE_QTILE_PAIR(q8, Q8_BLOCK, dequant_q8)

typedef void (*qrows_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, float *,
                         int64_t, int64_t);

/* Input i of a whole tile (every group block) as two float vectors. */
static inline void dequant_input(int format, const uint8_t *tile, int64_t i, vec *w) {
    if (format == FORMAT_Q4)
        dequant_q4(tile + i / GROUP * Q4_BLOCK, (int)(i % GROUP), w);
    else
        dequant_q8(tile + i / GROUP * Q8_BLOCK, (int)(i % GROUP), w);
}

/* The whole tile as float32 [in, TILE] (the scratch path). */
static void dequant_tile(int format, const uint8_t *w, int64_t in, float *out) {
    for (int64_t i = 0; i < in; i++) {
        vec wv[VECS];
        dequant_input(format, w, i, wv);
        store_vec(out + i * TILE, wv[0]);
        store_vec(out + i * TILE + LANES, wv[1]);
    }
}

/* Bytes of one (tile, group) block, or -1 for an unknown format. */
int64_t tandem_qgemv_block_bytes(int format) {
    return format == FORMAT_Q4 ? Q4_BLOCK : format == FORMAT_Q8_0 ? Q8_BLOCK : -1;
}

/* The whole weight transposed to float32 wt [in, out] (row stride out), for a BLAS GEMM over many
 * rows: llama.cpp, too, hands prefill-sized batches to BLAS after dequantizing. Returns 0, or -1
 * for an unknown format. */
int tandem_qdequant_t(int format, const uint8_t *w, int64_t in, int64_t out, float *wt,
                      int threads) {
    const int64_t block = tandem_qgemv_block_bytes(format), n_tiles = (out + TILE - 1) / TILE;
    if (block < 0 || in % GROUP) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n_tiles; t++) {
        const uint8_t *wt_tile = w + t * (in / GROUP) * block;
        const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
        for (int64_t i = 0; i < in; i++) {
            vec wv[VECS];
            dequant_input(format, wt_tile, i, wv);
            store_cols(wt + i * out + t * TILE, wv, cols);
        }
    }
    return 0;
}

int tandem_qgemv_tile(void) { return TILE; }

const char *tandem_qgemv_isa(void) { return TANDEM_ISA; }

/* x [rows, in] float32 (row stride ldx), w [n_tiles, in / 32, block] as above, bias
 * [n_tiles * TILE] or NULL, y [rows, out] contiguous; in a multiple of 32. Returns 0, or -1 for an
 * unknown format or when a scratch tile can't be allocated. */
int tandem_qgemv(int format, const float *x, int64_t ldx, const uint8_t *w, const float *bias,
                 float *y, int64_t rows, int64_t in, int64_t out, int threads) {
    const int64_t block = tandem_qgemv_block_bytes(format), n_tiles = (out + TILE - 1) / TILE;
    if (block < 0 || in % GROUP) return -1;
    const int q4 = format == FORMAT_Q4;
    const qrows_fn fns[4] = {q4 ? q4_rows_1 : q8_rows_1, q4 ? q4_rows_2 : q8_rows_2,
                             q4 ? q4_rows_4 : q8_rows_4,
#if ROW_BLOCK == 8
                             q4 ? q4_rows_8 : q8_rows_8
#else
                             NULL
#endif
    };
    const int scratch = rows > ROW_BLOCK;
    const int64_t step = rows == 1 ? 2 : 1; /* one row: tiles in pairs (q4_pair_1, q8_pair_1) */
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *tile = scratch ? malloc((size_t)in * TILE * sizeof(float)) : NULL;
        if (scratch && !tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tiles; t += step) {
            const uint8_t *wt = w + t * (in / GROUP) * block;
            const float *bt = bias ? bias + t * TILE : NULL;
            const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
            float *yt = y + t * TILE;
            if (rows == 1 && t + 1 < n_tiles) { /* a tile pair: this one is whole */
                const int64_t cols1 = out - (t + 1) * TILE < TILE ? out - (t + 1) * TILE : TILE;
                (q4 ? q4_pair_1 : q8_pair_1)(x, wt, wt + (in / GROUP) * block, in, bt,
                                             bias ? bt + TILE : NULL, yt, yt + TILE, cols1);
                continue;
            }
            if (scratch) {
                if (!tile) continue;
                dequant_tile(format, wt, in, tile);
                tile_all_rows(x, ldx, tile, in, bt, yt, out, cols, rows);
                continue;
            }
            int64_t r = 0;
            for (int k = 3; k >= 0; k--)
                for (const int64_t n = 1 << k; fns[k] && r + n <= rows; r += n)
                    fns[k](x + r * ldx, ldx, wt, in, bt, yt + r * out, out, cols);
        }
        free(tile);
    }
    return failed ? -1 : 0;
}
