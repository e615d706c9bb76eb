/* The float32 tile-times-rows micro-kernel of cpu_gemv.c.
 *
 * tile_rows(x, w, ...) computes y[r, 0:cols] = bias + sum_i x[r, i] * w[i, 0:TILE] for a block of
 * rows over one weight tile w [in, TILE] (float32, contiguous). Each output is one fixed chain:
 * fused multiply-adds in input order within blocks of KBLOCK inputs, block sums added in order;
 * the same chain whatever the row block, so a row's result never depends on its batch mates.
 */
#ifndef TANDEM_TILE_ROWS_H
#define TANDEM_TILE_ROWS_H

#include "tandem_simd.h"

#ifndef KBLOCK
#define KBLOCK 64
#endif

/* One tile for R rows: y[r, 0:cols] = bias[0:cols] + sum_i x[r, i] * w[i, 0:cols]. */
#define DEFINE_TILE_ROWS(R)                                                                     \
    static void tile_rows_##R(const float *x, int64_t ldx, const float *w, int64_t in,         \
                              const float *bias, float *y, int64_t ldy, int64_t cols) {         \
        vec acc[R][VECS];                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int c = 0; c < VECS; c++)                                                       \
                acc[r][c] = bias ? load_vec(bias + c * LANES) : (vec){0};                        \
        for (int64_t i0 = 0; i0 < in; i0 += KBLOCK) {                                            \
            const int64_t i1 = i0 + KBLOCK < in ? i0 + KBLOCK : in;                              \
            vec part[R][VECS];                                                                   \
            for (int r = 0; r < R; r++)                                                          \
                for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                            \
            for (int64_t i = i0; i < i1; i++) {                                                  \
                const float *wi = w + i * TILE;                                                  \
                vec wv[VECS];                                                                    \
                for (int c = 0; c < VECS; c++) wv[c] = load_vec(wi + c * LANES);                 \
                for (int r = 0; r < R; r++) {                                                    \
                    const float xv = x[r * ldx + i];                                             \
                    for (int c = 0; c < VECS; c++) part[r][c] += xv * wv[c];                     \
                }                                                                                \
            }                                                                                    \
            for (int r = 0; r < R; r++)                                                          \
                for (int c = 0; c < VECS; c++) acc[r][c] += part[r][c];                          \
        }                                                                                        \
        for (int r = 0; r < R; r++) {                                                            \
            if (cols == TILE) {                                                                  \
                memcpy(y + r * ldy, acc[r], sizeof acc[r]);                                      \
            } else {                                                                             \
                float tmp[TILE];                                                                 \
                memcpy(tmp, acc[r], sizeof tmp);                                                 \
                memcpy(y + r * ldy, tmp, (size_t)cols * sizeof(float));                         \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_TILE_ROWS(1)
DEFINE_TILE_ROWS(2)
DEFINE_TILE_ROWS(4)
#if ROW_BLOCK == 8
DEFINE_TILE_ROWS(8)
#define TILE_ROWS_WIDE tile_rows_8
#elif ROW_BLOCK == 6
DEFINE_TILE_ROWS(6)
#define TILE_ROWS_WIDE tile_rows_6
#endif

/* All rows of x over one tile, in row blocks of ROW_BLOCK, 4, 2 and 1. */
static void tile_all_rows(const float *x, int64_t ldx, const float *w, int64_t in,
                          const float *bias, float *y, int64_t ldy, int64_t cols, int64_t rows) {
    int64_t r = 0;
#if ROW_BLOCK > 4
    for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK)
        TILE_ROWS_WIDE(x + r * ldx, ldx, w, in, bias, y + r * ldy, ldy, cols);
#endif
    for (; r + 4 <= rows; r += 4) tile_rows_4(x + r * ldx, ldx, w, in, bias, y + r * ldy, ldy, cols);
    for (; r + 2 <= rows; r += 2) tile_rows_2(x + r * ldx, ldx, w, in, bias, y + r * ldy, ldy, cols);
    for (; r < rows; r++) tile_rows_1(x + r * ldx, ldx, w, in, bias, y + r * ldy, ldy, cols);
}

#endif
