/* Float32 y = x @ W^T (+ bias) for a few rows, over a tiled weight, for CPU decode and prefill.
 *
 * Batch-1 decode reads every weight once per token and does two flops per float read, so its
 * speed is the speed the weights stream from memory. BLAS GEMV kernels reach about half of the
 * read bandwidth for LLM-sized matrices; this kernel streams close to it by reading W as one
 * contiguous run per tile of TILE output features:
 *
 *     w[t, i, j] = W[t * TILE + j, i]        shape [n_tiles, in_features, TILE]
 *
 * Each thread takes whole tiles (OpenMP, the runtime PyTorch itself uses, so no second pool), keeps
 * TILE accumulators per row in vector registers, and walks its tiles front to back. Rows come in
 * blocks of up to ROW_BLOCK so one load of W feeds that many rows (tandem_simd.h sizes both to the
 * instruction set's register file). Every output is the same fixed multiply-add chain whatever the
 * batch (tandem_tile_rows.h), so a row's result does not depend on its batch mates.
 *
 * Built at run time by services/engine/core/kernels/native_build.py, once per instruction set.
 */
#include "tandem_tile_rows.h"

int tandem_gemv_tile(void) { return TILE; }

const char *tandem_gemv_isa(void) { return TANDEM_ISA; }

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
        tile_all_rows(x, ldx, wt, in, bt, y + t * TILE, out, cols, rows);
    }
}
