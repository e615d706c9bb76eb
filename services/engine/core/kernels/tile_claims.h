/* The tiles of one matmul, shared by an OpenMP team: a contiguous range per thread whose tail
 * the others take once their own range is done.
 *
 * A decode matmul streams its weights from memory, and the hardware prefetchers serve a thread
 * best while it walks one contiguous run of tiles: OpenMP's static schedule. A dynamic schedule
 * interleaves the threads' tiles and reads slower; but the static ranges end at different times
 * (a core interrupted, or just slower that moment), and the whole team waits at the join for the
 * last one. Here each thread starts on its static range, from the front, and a thread whose range
 * is empty takes tiles one at a time from the back of the range with the most left, until none
 * is. Every tile is computed exactly once, by the same code whichever thread takes it, so the
 * result never depends on who did.
 *
 * A range is one 64-bit word (next tile in the low half, end in the high half) on its own cache
 * line, claimed by compare-and-swap: the owner's claims stay in its core's cache until a thief
 * comes for the tail. A thread the runtime did not start (a team smaller than asked for) leaves
 * its range to the others.
 */
#ifndef TANDEM_TILE_CLAIMS_H
#define TANDEM_TILE_CLAIMS_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    _Alignas(64) _Atomic uint64_t range; /* next tile | end << 32 */
} tile_claim;

/* Thread i's static range of n tiles over `threads` (OpenMP's split: the first n % threads one
 * longer). */
static inline void tile_range(int64_t n, int threads, int i, int64_t *start, int64_t *end) {
    const int64_t base = n / threads, extra = n % threads;
    *start = i * base + (i < extra ? i : extra);
    *end = *start + base + (i < extra);
}

/* A claim table for n tiles (< 2^32) over `threads`, or NULL when it can't be allocated: then
 * each thread walks its static range alone (tile_range). Free it with free(). */
static tile_claim *tile_claims_new(int64_t n, int threads) {
    if (n >= ((int64_t)1 << 32)) return NULL;
    tile_claim *claims = aligned_alloc(64, sizeof(tile_claim) * (size_t)threads);
    if (!claims) return NULL;
    for (int i = 0; i < threads; i++) {
        int64_t start, end;
        tile_range(n, threads, i, &start, &end);
        atomic_init(&claims[i].range, (uint64_t)start | ((uint64_t)end << 32));
    }
    return claims;
}

/* The next tile for thread `me` of `threads`: the front of its own range, else the back of the
 * fullest other one; -1 when every range is empty. */
static inline int64_t tile_claim_next(tile_claim *claims, int threads, int me) {
    uint64_t cur = atomic_load_explicit(&claims[me].range, memory_order_relaxed);
    while ((uint32_t)cur < (uint32_t)(cur >> 32))
        if (atomic_compare_exchange_weak_explicit(&claims[me].range, &cur, cur + 1,
                                                  memory_order_relaxed, memory_order_relaxed))
            return (uint32_t)cur;
    for (;;) {
        int victim = -1;
        uint32_t most = 0;
        for (int i = 0; i < threads; i++) {
            const uint64_t r = atomic_load_explicit(&claims[i].range, memory_order_relaxed);
            const uint32_t next = (uint32_t)r, end = (uint32_t)(r >> 32);
            if (end > next && end - next > most) most = end - next, victim = i;
        }
        if (victim < 0) return -1;
        cur = atomic_load_explicit(&claims[victim].range, memory_order_relaxed);
        const uint32_t next = (uint32_t)cur, end = (uint32_t)(cur >> 32);
        if (next >= end) continue; /* emptied meanwhile: look again */
        const uint64_t shorter = (uint64_t)next | ((uint64_t)(end - 1) << 32);
        if (atomic_compare_exchange_weak_explicit(&claims[victim].range, &cur, shorter,
                                                  memory_order_relaxed, memory_order_relaxed))
            return end - 1;
    }
}

/* The next tile for thread `me`: from the claim table, or without one (NULL) the next of its
 * static range next .. end - 1 (tile_range); -1 when it has none left. */
static inline int64_t tile_take(tile_claim *claims, int threads, int me, int64_t *next, int64_t end) {
    if (claims) return tile_claim_next(claims, threads, me);
    return *next < end ? (*next)++ : -1;
}

#endif /* TANDEM_TILE_CLAIMS_H */
