/* Small fused float32 ops for CPU decode and prefill: residual add + RMSNorm, SwiGLU's
 * silu(gate) * up and GeGLU's gelu_tanh(gate) * up, the rotary embedding, and Qwen3's / Gemma 3's
 * per-head q/k RMSNorm with the rotary, each one pass over its rows instead of 3-12 PyTorch ops.
 *
 * At batch-1 decode a layer's element-wise work is a few thousand floats, so its cost is the
 * number of ops, not the arithmetic: each PyTorch op costs microseconds of dispatch whatever its
 * size, and a small model's decode step is ~30% such overhead. A prompt's rows are many, and
 * there the cost is memory traffic: one pass instead of 3-6 (each PyTorch op reads and writes the
 * whole [rows, n] tensor). Batches of PARALLEL_ROWS rows or more split their rows between the
 * OpenMP threads (PyTorch's own runtime and thread count); a decode batch runs on the calling
 * thread (and inside cpu_decode_layers.c's one-call steps).
 * Arithmetic follows the PyTorch reference (float32, same formulas); sums run in a different
 * order, so results match it to float32 rounding, not bit for bit. A row's result never depends
 * on the other rows or on the thread count.
 */
#include <math.h>

#include "tandem_simd.h"

#define PARALLEL_ROWS 64

/* for (int64_t r = 0; r < rows; r++) BODY: on the OpenMP team when there are PARALLEL_ROWS rows
 * or more, else a plain loop on this thread. An `if (rows >= PARALLEL_ROWS)` clause would keep
 * a decode batch on one thread too, but libgomp still starts a team of one for the region
 * (~0.3 us warm, more once a step's streamed weights have evicted its state), and a batch-1 step
 * runs about a hundred of these loops. */
#define FOR_ROWS(r, rows, ...)                                   \
    do {                                                         \
        if ((rows) >= PARALLEL_ROWS) {                           \
            _Pragma("omp parallel for schedule(static)")         \
            for (int64_t r = 0; r < (rows); r++) { __VA_ARGS__ } \
        } else {                                                 \
            for (int64_t r = 0; r < (rows); r++) { __VA_ARGS__ } \
        }                                                        \
    } while (0)

/* One row of tandem_add_rmsnorm (below); y may be x when h is NULL (each y[i] is written after
 * the whole row is read). */
static inline void rmsnorm_row(const float *xr, const float *hr, float *sr, const float *w,
                               float *yr, int64_t n, float eps) {
    vec acc = {0};
    int64_t i = 0;
    if (hr) {
        for (; i + LANES <= n; i += LANES) {
            const vec v = load_vec(xr + i) + load_vec(hr + i);
            store_vec(sr + i, v);
            acc += v * v;
        }
        for (int64_t j = i; j < n; j++) sr[j] = xr[j] + hr[j];
        xr = sr;
    } else {
        for (; i + LANES <= n; i += LANES) {
            const vec v = load_vec(xr + i);
            acc += v * v;
        }
    }
    float sum = hsum(acc);
    for (; i < n; i++) sum += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
    for (; i + LANES <= n; i += LANES)
        store_vec(yr + i, load_vec(w + i) * (load_vec(xr + i) * inv));
    for (; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
}

/* With h: s = x + h (the residual stream; s may be x), else s = x. Then
 * y = w * (s * 1/sqrt(mean(s^2) + eps)). x, h, s, y: [rows, n] contiguous; w: [n] (Gemma's
 * norms pass their 1 + w). Without h, y may be x (in place). */
void tandem_add_rmsnorm(const float *x, const float *h, float *s, const float *w, float *y,
                        int64_t rows, int64_t n, float eps) {
    FOR_ROWS(r, rows, rmsnorm_row(x + r * n, h ? h + r * n : NULL, h ? s + r * n : NULL, w,
                                  y + r * n, n, eps););
}

/* y[r, :] = silu(gu[r, :n]) * gu[r, n:2n]; gu [rows, 2n], y [rows, n], both contiguous.
 * silu(g) = g / (1 + exp(-g)) with the vector exp (exp(-g) clamped at exp(88): g / huge is the
 * same -0 that expf's inf gives). */
void tandem_silu_mul(const float *gu, float *y, int64_t rows, int64_t n) {
    FOR_ROWS(r, rows, {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *yr = y + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vec gv = load_vec(g + i);
            const vec e = vexp(vmin(-gv, splat(88.0f)));
            store_vec(yr + i, gv / (splat(1.0f) + e) * load_vec(u + i));
        }
        for (; i < n; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    });
}

/* y[r, :] = gelu_tanh(gu[r, :n]) * gu[r, n:2n] (Gemma's GeGLU), shapes as tandem_silu_mul.
 * gelu_tanh(g) = g/2 * (1 + tanh(u)), u = sqrt(2/pi) * (g + 0.044715 g^3), computed as the equal
 * g / (1 + exp(-2u)) with silu's vector exp and clamp. */
void tandem_gelu_tanh_mul(const float *gu, float *y, int64_t rows, int64_t n) {
    const float k2 = 2.0f * 0.7978845608028654f, c = 0.044715f;
    FOR_ROWS(r, rows, {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *yr = y + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vec gv = load_vec(g + i);
            const vec t = splat(-k2) * (gv + splat(c) * gv * gv * gv);
            const vec e = vexp(vmin(t, splat(88.0f)));
            store_vec(yr + i, gv / (splat(1.0f) + e) * load_vec(u + i));
        }
        for (; i < n; i++) {
            const float t = -k2 * (g[i] + c * g[i] * g[i] * g[i]);
            yr[i] = g[i] / (1.0f + expf(t < 88.0f ? t : 88.0f)) * u[i];
        }
    });
}

/* One row of tandem_rope (below): heads [heads, d] contiguous, cos / sin [d]. */
static inline void rope_row(float *x, const float *c, const float *s, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        float *v = x + hd * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] + b * s[i];
            v[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

/* In place on x [rows, heads, d] (row stride ldx, head stride d): x = x * cos + roll(x, d/2) * sin
 * with cos/sin [rows, d] (sin holds rotate_half's sign, as rope.py stores it). */
void tandem_rope(float *x, int64_t ldx, const float *cos, const float *sin, int64_t rows,
                 int64_t heads, int64_t d) {
    FOR_ROWS(r, rows, rope_row(x + r * ldx, cos + r * d, sin + r * d, heads, d););
}

/* Qwen3's and Gemma 3's attention input, in place on a fused projection's rows x [rows, ldx]
 * (q heads, then k heads, each d wide): each q head RMSNorm'd with qw [d], each k head with kw
 * [d], then both rotated as tandem_rope does (one pass per row instead of ~12 PyTorch ops). */
void tandem_qk_norm_rope(float *x, int64_t ldx, const float *qw, const float *kw,
                         const float *cos, const float *sin, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t d, float eps) {
    FOR_ROWS(r, rows, {
        float *row = x + r * ldx;
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            float *v = row + hd * d;
            rmsnorm_row(v, NULL, NULL, hd < heads ? qw : kw, v, d, eps);
        }
        rope_row(row, cos + r * d, sin + r * d, heads + kv_heads, d);
    });
}

/* out[r] = the index of the first largest value of row r (x[r * ldx + 0 .. n - 1]), or of the
 * row's first NaN when it has one: torch.argmax's rule, for greedy sampling. PyTorch's argmax
 * over a batch of vocabulary-wide rows runs one scalar loop per row (1.5 ms for 32 x 49,152 on
 * 2 cores here); each vector lane here keeps its own first maximum (only a strictly larger value
 * replaces it), then the lanes merge, the lowest index winning a tie. */
void tandem_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out) {
    int32_t lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = l;
    int_vec first;
    memcpy(&first, lanes, sizeof first);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float best = xr[0];
        int64_t at = 0, i = 0;
        int nan = best != best;
        if (n >= LANES) {
            int_vec index = first, idx = first;
            vec m = load_vec(xr);
            int_vec seen_nan = m != m;
            for (i = LANES; i + LANES <= n; i += LANES) {
                const vec v = load_vec(xr + i);
                index += LANES;
                const int_vec gt = v > m;
                seen_nan |= v != v;
                m = vselect(gt, v, m);
                idx = iselect(gt, index, idx);
            }
            float ms[LANES];
            int32_t is[LANES], ns[LANES];
            memcpy(ms, &m, sizeof ms);
            memcpy(is, &idx, sizeof is);
            memcpy(ns, &seen_nan, sizeof ns);
            best = ms[0];
            at = is[0];
            for (int l = 0; l < LANES; l++) {
                nan |= ns[l] != 0;
                if (ms[l] > best || (ms[l] == best && is[l] < at)) best = ms[l], at = is[l];
            }
        }
        for (; i < n; i++) {
            nan |= xr[i] != xr[i];
            if (xr[i] > best) best = xr[i], at = i;
        }
        if (nan)
            for (at = 0; xr[at] == xr[at]; at++) {} /* the first NaN */
        out[r] = at;
    }
}
