/* Decode attention over the paged cache with the prefill's per-row arithmetic, and the exported
 * tandem_paged_decode_attention: part of cpu_paged_attention.c's kernel library (included at its
 * end, after the prefill kernel whose score_keys / softmax_tile / value helpers it shares). A
 * header, not a .c file: native_build.py builds every .c beside it as a library of its own. */
#ifndef TANDEM_PAGED_DECODE_ROWS_H
#define TANDEM_PAGED_DECODE_ROWS_H

/* ---- decode rows, with the prefill's arithmetic ------------------------------------------------
 *
 * A position's attention must give the same bits whether its token is a prompt token (the prefill
 * kernel above) or a generated one (a decode step), so that the KV and the greedy text of a
 * request never depend on the path it took (a prefix-cache hit, a chunked prefill, a recomputed
 * sequence, a batch). So a decode row runs exactly the prefill's per-row chain: key tiles of
 * KEY_TILE absolute positions, the same scores (score_keys, reading the cache's key rows as
 * stored, widened as loaded), the same online-softmax step per tile (softmax_tile) and the same
 * value accumulation (value_block), one query vector per head of the group. Widening is exact, so
 * reading a 16-bit or q8_0 row in place gives the values the prefill's widened copy holds. The
 * older per-block decode chain (decode_task) remains for head sizes that are not whole vectors,
 * which the prefill kernel does not take either.
 */

/* value vectors of D per pass of value_rows when a block has at most ATTN_ROWS / 2 query vectors
 * (a single decode row's group: SmolLM2's 3): the same ATTN_ROWS x VECS accumulators' worth of
 * registers, so each of them takes one multiply-add per slot as in a full block. With VECS a
 * pass, 3 vectors held 6 accumulators, fewer chains than cover the multiply-add's latency.
 * Measured on AVX2 (16 registers) only; other sets keep VECS until a machine with them times it. */
#if LANES == 8
#define WIDE_VECS (2 * VECS)
#else
#define WIDE_VECS VECS
#endif

/* value_block over n query vectors (n <= ATTN_ROWS, nv <= VECS; or n <= ATTN_ROWS / 2, nv <=
 * WIDE_VECS; p and o rows KEY_TILE and head_dim apart) and NV vectors of D from column d, the
 * values read in place from a cache of type kv (vi[s]: element index of row s): o = o * rescale
 * + sum_s p[s] * V[s], per vector the same operations in the same order as value_block over
 * widened rows (widening is exact), each value vector loaded once for the n query vectors. */
static inline __attribute__((always_inline)) void value_rows(
    float *o, int64_t head_dim, const float *p, const float *rescale, const void *v,
    const int64_t *vi, int64_t slots, int64_t d, const int n, const int nv, const int kv) {
    vec acc[ATTN_ROWS][WIDE_VECS];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = load_vec(o + r * head_dim + d + c * LANES) * rescale[r];
    for (int64_t s = 0; s < slots; s++) {
        if (nv > VECS) { /* few query vectors: their weights held, one value vector at a time */
            vec ps[ATTN_ROWS];
            for (int r = 0; r < n; r++) ps[r] = splat(p[r * KEY_TILE + s]);
            for (int c = 0; c < nv; c++) {
                const vec vv = load_kv(v, vi[s], d + c * LANES, head_dim, kv);
                for (int r = 0; r < n; r++) acc[r][c] = fused_madd(ps[r], vv, acc[r][c]);
            }
        } else { /* the value vectors held, one query vector's weight at a time */
            vec vv[VECS];
            for (int c = 0; c < nv; c++) vv[c] = load_kv(v, vi[s], d + c * LANES, head_dim, kv);
            for (int r = 0; r < n; r++) {
                const vec ps = splat(p[r * KEY_TILE + s]);
                for (int c = 0; c < nv; c++) acc[r][c] = fused_madd(ps, vv[c], acc[r][c]);
            }
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

/* CALL(N) for n (1 .. ATTN_ROWS / 2) query vectors, N a constant as in WITH_ROWS. */
#define WITH_HALF_ROWS(n, CALL)                                     \
    switch (n) {                                                    \
    case 1: CALL(1 < ATTN_ROWS / 2 ? 1 : ATTN_ROWS / 2); break;     \
    case 2: CALL(2 < ATTN_ROWS / 2 ? 2 : ATTN_ROWS / 2); break;     \
    case 3: CALL(3 < ATTN_ROWS / 2 ? 3 : ATTN_ROWS / 2); break;     \
    case 4: CALL(4 < ATTN_ROWS / 2 ? 4 : ATTN_ROWS / 2); break;     \
    case 5: CALL(5 < ATTN_ROWS / 2 ? 5 : ATTN_ROWS / 2); break;     \
    default: CALL(ATTN_ROWS / 2); break;                            \
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

/* Read one word of every cache line of a key tile's K and V rows (slot s: k_bytes >= 8 from
 * element ki[s], v_bytes >= 8 from vi[s]) before any arithmetic on them: a batched decode step's tiles come from
 * memory (each layer's KV is evicted by the other layers'), in 16-slot blocks scattered over the
 * pool. Left to the arithmetic, the scores and value sums meet those misses one dependent chain at
 * a time, a strided third of each slot's lines per head, and a call ran at a fraction of both the
 * memory's rate and its own in-cache rate; these loads have no dependents, so the core keeps many
 * misses in flight and the tile (64 slots: tens of KiB) is in L2 when the arithmetic starts.
 * Software prefetches of the next tile did not do this on an AVX2 Zen 3 (tried three times; see
 * docs/benchmarks.md). Reads only: no result changes. */
static inline __attribute__((always_inline)) uint64_t touch_row(const char *row, int64_t bytes) {
    uint64_t seen = 0, word;
    /* each word inside the row: a q8_0 row's bytes need not be a multiple of 8 */
    for (int64_t l = 0; l < bytes; l += 64)
        memcpy(&word, row + (l + 8 <= bytes ? l : bytes - 8), 8), seen |= word;
    return seen;
}

static inline __attribute__((always_inline)) void touch_rows(
    const void *k, const int64_t *ki, int64_t k_bytes, const void *v, const int64_t *vi,
    int64_t v_bytes, int64_t slots, const int kv) {
    uint64_t seen = 0;
    for (int64_t s = 0; s < slots; s++)
        seen |= touch_row(kv_at((void *)k, ki[s], kv), k_bytes) |
                touch_row(kv_at((void *)v, vi[s], kv), v_bytes);
    __asm__ volatile("" : : "r"(seen));
}

/* Element index of position at's row (KV head offset head_offset) in a cache of block stride sb
 * and slot stride ss: the one mapping a tile's touches and prefetches and its arithmetic read. */
static inline int64_t slot_row(const int64_t *table, int64_t at, int64_t block_size, int64_t sb,
                               int64_t ss, int64_t head_offset) {
    return table[at / block_size] * sb + at % block_size * ss + head_offset;
}

/* Prefetch the next key tile's K and V lines into L2 (prefetcht1) while this tile's arithmetic
 * runs: the touches above wait for their tile before any of its arithmetic, so without this each
 * tile's misses and arithmetic take turns. On a Zen 4 (AVX-512 build) a batch-1 layer's attention
 * over 200-1000 slots of a float16 cache ran 1.16-1.3x faster from memory, batches of 2-8 rows
 * 1.03-1.18x (no slower anywhere measured). Not in the AVX2 builds: on the same Zen 4 the AVX2
 * build lost 5% at batch 8, and on a Zen 3 next-tile prefetches (into L1, or non-temporal) never
 * helped. A prefetch moves no value. */
#if defined(__AVX512F__)
#define NEXT_TILE_PREFETCH 1
#else
#define NEXT_TILE_PREFETCH 0
#endif
static inline __attribute__((always_inline)) void prefetch_tile(
    const void *k, int64_t k_sb, int64_t k_ss, int64_t k_bytes, const void *v, int64_t v_sb,
    int64_t v_ss, int64_t v_bytes, const int64_t *table, int64_t from, int64_t slots,
    int64_t block_size, int64_t head_offset_k, int64_t head_offset_v, const int kv) {
    for (int64_t at = from; at < from + slots; at++) {
        const char *kr =
            kv_at((void *)k, slot_row(table, at, block_size, k_sb, k_ss, head_offset_k), kv);
        const char *vr =
            kv_at((void *)v, slot_row(table, at, block_size, v_sb, v_ss, head_offset_v), kv);
        for (int64_t l = 0; l < k_bytes; l += 64) __builtin_prefetch(kr + l, 0, 2);
        for (int64_t l = 0; l < v_bytes; l += 64) __builtin_prefetch(vr + l, 0, 2);
    }
}

/* The query heads of KV heads kh0 .. kh0 + nkh - 1 (query heads kh * group + g) of `rows`
 * consecutive rows of one sequence, at positions pos0 .. pos0 + rows - 1 (its block table row
 * `table`, which maps every position they read), each row over the cache as the prefill kernel
 * attends a row (see above): q and out are the first row's [heads, D] (q's heads q_sh apart, rows
 * q_sb apart; out's rows heads * D apart); head_dim whole vectors.
 *
 * Why rows together: a speculative step's verify rows (a sequence's last token and its drafts,
 * ``model_runner.py``) are decode rows of one table at consecutive positions. Alone, each row
 * reads the whole context's keys and values for just `group` query vectors; together, each key
 * row is loaded once per register block of every row's vectors, and each value row once per
 * block. A vector's arithmetic is still its row's alone: a row takes
 * part only in the tiles it reads (its window's first tile through its own position's), with its
 * own softmax bounds, and its values are accumulated over exactly its own slots of the tile
 * (rows that see the same slots share a block), so every row has the bits it has computed alone
 * (rows = 1), which are the prefill's.
 *
 * Why several KV heads: a slot stores its KV heads' rows side by side (k_sh apart), so one head
 * alone reads a head_dim run out of every slot's kv_heads * head_dim, strided runs from cache
 * blocks scattered over memory, which a batched decode step waits on (latency, not bandwidth).
 * Walking a tile's heads one after another reads each slot's rows whole, a block's K and V as
 * runs the hardware prefetcher follows. Each head's chain is the one it has alone (the same
 * scores, softmax steps and value blocks, in the same order), so the bits do not depend on nkh. */
static inline __attribute__((always_inline)) void rows_task(
    const float *q, int64_t q_sb, int64_t q_sh,
    void *k, int64_t k_sb, int64_t k_ss, int64_t k_sh,
    void *v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
    const int64_t *table, int64_t pos0, int64_t rows, float *out,
    int64_t kh0, int64_t nkh, int64_t group, int64_t heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float softcap, const int kv) {
    /* vector h * nq + r * group + g: KV head kh0 + h, row r, its query head g */
    const int64_t nq = rows * group, all = nkh * nq, last = pos0 + rows - 1;
    float qs[all * head_dim], o[all * head_dim], p[all * KEY_TILE];
    float running_max[all], total[all], rescale[all];
    int64_t ki[KEY_TILE], vi[KEY_TILE]; /* element index of each slot's key and value row, head kh0 */
    for (int64_t h = 0; h < nkh; h++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < group; g++)
                memcpy(qs + (h * nq + r * group + g) * head_dim,
                       q + r * q_sb + ((kh0 + h) * group + g) * q_sh, sizeof(float) * (size_t)head_dim);
    memset(o, 0, sizeof(float) * (size_t)(all * head_dim));
    for (int64_t x = 0; x < all; x++) running_max[x] = -INFINITY, total[x] = 0.f;
    int64_t r_end = 0; /* rows r_begin .. r_end - 1 read the tile at ks (contiguous: positions ascend) */
    for (int64_t ks = first_tile(pos0, window); ks <= last; ks += KEY_TILE) {
        const int64_t r_begin = ks > pos0 ? ks - pos0 : 0; /* the earlier rows end before ks */
        while (r_end < rows && first_tile(pos0 + r_end, window) <= ks) r_end++;
        const int64_t top = pos0 + r_end - 1; /* the last key any of them reads */
        const int64_t slots = seen_slots(top, ks);
        for (int64_t s = 0; s < slots; s++) {
            ki[s] = slot_row(table, ks + s, block_size, k_sb, k_ss, kh0 * k_sh);
            vi[s] = slot_row(table, ks + s, block_size, v_sb, v_ss, kh0 * v_sh);
        }
        touch_rows(k, ki, nkh * k_sh * kv_bytes(kv), v, vi, nkh * v_sh * kv_bytes(kv), slots, kv);
        if (NEXT_TILE_PREFETCH && ks + KEY_TILE <= last) {
            const int64_t next = ks + KEY_TILE;
            prefetch_tile(k, k_sb, k_ss, nkh * k_sh * kv_bytes(kv), v, v_sb, v_ss,
                          nkh * v_sh * kv_bytes(kv), table, next,
                          last + 1 - next < KEY_TILE ? last + 1 - next : KEY_TILE, block_size,
                          kh0 * k_sh, kh0 * v_sh, kv);
        }
        for (int64_t h = 0; h < nkh; h++) { /* head kh0 + h: its rows k_sh / v_sh further on */
            const void *kh_k = kv_at(k, h * k_sh, kv), *kh_v = kv_at(v, h * v_sh, kv);
            const int64_t hx = h * nq; /* its first vector */
            const int64_t x_begin = hx + r_begin * group, x_end = hx + r_end * group;
            /* keys past a row: scored, then given no weight */
            score_keys(qs + x_begin * head_dim, x_end - x_begin, head_dim, kh_k, ki, slots,
                       p + x_begin * KEY_TILE, scale, kv);
            for (int64_t ra = r_begin, rb; ra < r_end; ra = rb) {
                /* rows ra .. rb - 1 see the same slots of the tile: their values form one block */
                const int64_t seen = seen_slots(pos0 + ra, ks);
                for (rb = ra; rb < r_end && seen_slots(pos0 + rb, ks) == seen; rb++) {
                    int64_t lo = window > 0 ? pos0 + rb - window + 1 - ks : 0;
                    lo = lo > 0 ? lo : 0;
                    for (int64_t x = hx + rb * group; x < hx + (rb + 1) * group; x++)
                        rescale[x] = softmax_tile(p + x * KEY_TILE, lo, seen, running_max + x, total + x,
                                                  softcap);
                }
                const int64_t xb_end = hx + rb * group;
                for (int64_t x = hx + ra * group; x < xb_end; x += ATTN_ROWS) {
                    const int n = xb_end - x < ATTN_ROWS ? (int)(xb_end - x) : ATTN_ROWS;
                    int64_t d = 0;
#define VALUES(N) value_rows(o + x * head_dim, head_dim, p + x * KEY_TILE, rescale + x, kh_v, vi, \
                             seen, d, N, NV, kv)
                    if (WIDE_VECS > VECS && 2 * n <= ATTN_ROWS)
                        for (; d + WIDE_VECS * LANES <= head_dim; d += WIDE_VECS * LANES) {
#define NV WIDE_VECS
                            WITH_HALF_ROWS(n, VALUES)
#undef NV
                        }
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
    }
    for (int64_t h = 0; h < nkh; h++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < group; g++) {
                const int64_t x = h * nq + r * group + g;
                float *og = out + r * heads * head_dim + ((kh0 + h) * group + g) * head_dim;
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

/* The single rows' tasks (a batch with no runs): row b's KV heads in chunks walked by one task
 * each (rows_task's kh0, nkh). A row is cut into ceil(threads / batch) chunks, so that every
 * thread has a task, or into its share of the threads (its keys' share of the step's, to the
 * nearest) where that is more: a long context among short ones would otherwise keep one thread
 * busy after the rest are done. At most its KV heads, each chunk at most `most` heads
 * (RUN_VECTORS query vectors); no row is cut further, since a chunk of one head reads each slot's rows as strided
 * runs. Task t is row task[3t], heads task[3t + 1] .. + task[3t + 2] - 1; returns the count (at
 * most batch * kv_heads). */
static int64_t plan_heads(const int64_t *lens, int64_t batch, int64_t kv_heads, int64_t most,
                          int threads, int64_t *task) {
    int64_t keys = 0, n = 0;
    for (int64_t b = 0; b < batch; b++) keys += lens[b];
    const int64_t even = (threads + batch - 1) / batch; /* a task per thread at least */
    for (int64_t b = 0; b < batch; b++) {
        /* the row's share of the threads, to the nearest */
        const int64_t share = keys > 0 ? (2 * threads * lens[b] + keys) / (2 * keys) : 1;
        int64_t chunks = share > even ? share : even;
        chunks = chunks < kv_heads ? chunks : kv_heads;
        int64_t walk = (kv_heads + chunks - 1) / chunks;
        walk = walk < most ? walk : most;
        for (int64_t kh = 0; kh < kv_heads; kh += walk, n++)
            task[3 * n] = b, task[3 * n + 1] = kh,
            task[3 * n + 2] = kv_heads - kh < walk ? kv_heads - kh : walk;
    }
    return n;
}

/* q [B, H, D] (strides q_sb, q_sh), caches [NB, BS, KVH, D] of type kv_dtype (strides *_sb,
 * *_ss, *_sh in elements; D contiguous), tables [B, *] (row stride t_sb) and lens [B] as int64,
 * out [B, H, D] contiguous; window and softcap as above (0: off). When new_k is not NULL, the
 * step's new K and V rows (new_k, new_v [B, KVH, D] float32, strides nk_* and nv_*; D
 * contiguous) are first written into slot (slot_blocks[b], slot_offsets[b]): the step's store and
 * attention in one call. Rows of one sequence at consecutive positions (a verify step) attend
 * together (rows_task), after every row's K/V is stored; otherwise each task stores its own row's
 * K/V for its KV heads and attends (plan_heads). */
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
    /* a task's rows (a run's) or KV heads (a single row's): RUN_VECTORS query vectors at most */
    const int64_t max_rows = group < RUN_VECTORS ? RUN_VECTORS / group : 1;
    const int64_t units = first ? plan_units(tables, t_sb, lens, batch, block_size, kv_heads, max_rows,
                                             threads, first, first + batch)
                                : 0;
    const int64_t *count = first ? first + batch : NULL;
    /* single rows (no runs, head_dim whole vectors): tasks of several KV heads (plan_heads) */
    int64_t *plan = NULL;
    if (!units && head_dim % LANES == 0) plan = malloc(sizeof(int64_t) * 3 * (size_t)(batch * kv_heads));
    const int64_t tasks = units ? units * kv_heads
                          : plan ? plan_heads(lens, batch, kv_heads, max_rows, threads, plan)
                                 : batch * kv_heads;
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
            const int64_t kh = plan ? plan[3 * task + 1] : task % kv_heads;
            const int64_t nkh = plan ? plan[3 * task + 2] : 1;
            const int64_t b = plan ? plan[3 * task] : units ? first[task / kv_heads] : task / kv_heads;
            const int64_t rows = units ? count[task / kv_heads] : 1;
            if (new_k && !units)
                for (int64_t h = kh; h < kh + nkh; h++) STORE(b, h);
            const int64_t *table = tables + (b + rows - 1) * t_sb; /* the last row's: maps them all */
#define DECODE_TASK(KV)                                                                          \
    if (head_dim % LANES == 0)                                                                    \
        rows_task(q + b * q_sb, q_sb, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh, table,      \
                  lens[b] - 1, rows, out + b * heads * head_dim, kh, nkh, group, heads, head_dim, \
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
    free(plan);
}

#endif /* TANDEM_PAGED_DECODE_ROWS_H */
