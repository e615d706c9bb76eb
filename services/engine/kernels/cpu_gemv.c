/* Float32 y = x @ W^T (+ bias) for a few rows, over a tiled weight, for memory-bound CPU decode.
 *
 * Batch-1 decode reads every weight once per token and does two flops per float read, so its
 * speed is the speed the weights stream from memory. BLAS GEMV kernels reach about half of this
 * machine's read bandwidth for LLM-sized matrices; this kernel streams close to it by reading W
 * as one contiguous run per tile of TILE output features:
 *
 *     w[t, i, j] = W[t * TILE + j, i]        shape [n_tiles, in_features, TILE]
 *
 * Each thread takes whole tiles (OpenMP, the runtime PyTorch itself uses, so no second pool), keeps
 * TILE accumulators per row in vector registers, and walks its tiles front to back. Rows come in
 * blocks of up to 4 so one load of W feeds 4 rows. Every output is the same in-order fused
 * multiply-add chain over the input features whatever the batch, so a row's result does not
 * depend on its batch mates.
 *
 * Built at run time by services/engine/kernels/native_build.py with -O3 -march=native; the vector
 * type is GCC/Clang's generic vector extension, which the compiler lowers to AVX-512, AVX2 or
 * NEON as the host allows.
 */
#include <stdint.h>
#include <string.h>

#ifndef TILE
#define TILE 32
#endif
#ifndef KBLOCK
#define KBLOCK 64
#endif
#define LANES 16
#define VECS (TILE / LANES)

typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One tile for R rows: y[r, 0:cols] = bias[0:cols] + sum_i x[r, i] * w[i, 0:cols]. */
#define DEFINE_TILE_ROWS(R)                                                                     \
    static void tile_rows_##R(const float *x, int64_t ldx, const float *w, int64_t in,         \
                              const float *bias, float *y, int64_t ldy, int64_t cols) {         \
        vec acc[R][VECS];                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int c = 0; c < VECS; c++)                                                       \
                acc[r][c] = bias ? load(bias + c * LANES) : (vec){0};                            \
        for (int64_t i0 = 0; i0 < in; i0 += KBLOCK) {                                            \
            const int64_t i1 = i0 + KBLOCK < in ? i0 + KBLOCK : in;                              \
            vec part[R][VECS];                                                                   \
            for (int r = 0; r < R; r++)                                                          \
                for (int c = 0; c < VECS; c++) part[r][c] = (vec){0};                            \
            for (int64_t i = i0; i < i1; i++) {                                                  \
                const float *wi = w + i * TILE;                                                  \
                vec wv[VECS];                                                                    \
                for (int c = 0; c < VECS; c++) wv[c] = load(wi + c * LANES);                     \
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

int tandem_gemv_tile(void) { return TILE; }

/* x [rows, in] (row stride ldx), w [n_tiles, in, TILE], bias [n_tiles * TILE] or NULL,
 * y [rows, out] contiguous. The last tile may be padded: only out - t * TILE columns are written. */
void tandem_gemv(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                 int64_t rows, int64_t in, int64_t out, int threads) {
    const int64_t n_tiles = (out + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n_tiles; t++) {
        const float *wt = w + t * in * TILE;
        const float *bt = bias ? bias + t * TILE : NULL;
        const int64_t cols = out - t * TILE < TILE ? out - t * TILE : TILE;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4)
            tile_rows_4(x + r * ldx, ldx, wt, in, bt, y + r * out + t * TILE, out, cols);
        for (; r + 2 <= rows; r += 2)
            tile_rows_2(x + r * ldx, ldx, wt, in, bt, y + r * out + t * TILE, out, cols);
        for (; r < rows; r++)
            tile_rows_1(x + r * ldx, ldx, wt, in, bt, y + r * out + t * TILE, out, cols);
    }
}
