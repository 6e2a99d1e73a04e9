/* The team synchronization the fused steps share (decode_step.c, the bfloat16 + int8 one, and
 * panel_step.c, the float32 panel one): a barrier that spins briefly and then sleeps on a futex,
 * and a prefetcher that lets waiting threads fetch the next weights into the caches. Neither
 * changes a result: they only decide when a thread runs.
 */
#ifndef PORTICO_STEP_SYNC_H
#define PORTICO_STEP_SYNC_H
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#define SPIN_LIMIT 2000 /* pauses (tens of microseconds) before a waiting thread sleeps */

typedef struct {
    atomic_int arrived;
    atomic_int generation;
    atomic_int sleepers;
    int threads;
} Barrier;

static inline void futex(atomic_int *word, int op, int value) {
    syscall(SYS_futex, (int *)word, op, value, NULL, NULL, 0);
}

/* The step's weights in the order the stages read them, fetched ahead into the caches by
 * threads that would otherwise wait: at one stream the linears stream weights from memory at
 * near its bandwidth, but between them (a thread's serial part, attention, which is bound by
 * latency, a thread that finished its share) memory would sit idle. Waiting threads prefetch
 * the next PF_UNIT bytes of the stream, at most PF_WINDOW past the start of the linear stage
 * running now (L2 holds 1 MB a core, L3 more), so the next linears find part of their weights
 * in cache. Only timing changes: no result depends on it. Units never straddle two regions:
 * each region starts on a unit boundary of the stream's offsets. */
#define PF_UNIT 4096
#ifndef PF_WINDOW
#define PF_WINDOW (2 << 20)
#endif

typedef struct {
    const uint8_t *base;
    int64_t start, bytes; /* offset in the stream (a multiple of PF_UNIT), length */
} Region;

typedef struct {
    Region *regions;
    int count;
    int64_t total;
    atomic_llong next;     /* the next unit to fetch */
    atomic_llong consumed; /* where the running linear stage's weights start */
} Prefetcher;

static _Thread_local int pf_hint; /* the region this thread fetched from last */

/* Fetch one unit ahead, if the window allows; 0 when there is nothing to fetch now. */
static inline int prefetch_some(Prefetcher *pf) {
    if (!pf || !pf->count) return 0;
    const int64_t lo = atomic_load_explicit(&pf->consumed, memory_order_relaxed);
    int64_t at = atomic_load_explicit(&pf->next, memory_order_relaxed);
    if (at < lo) {
        atomic_compare_exchange_strong(&pf->next, &at, lo);
        at = lo > at ? lo : at;
    }
    if (at >= pf->total || at >= lo + PF_WINDOW) return 0;
    at = atomic_fetch_add_explicit(&pf->next, PF_UNIT, memory_order_relaxed);
    if (at >= pf->total) return 0;
    int r = pf_hint < pf->count ? pf_hint : 0;
    while (r + 1 < pf->count && pf->regions[r + 1].start <= at) r++;
    while (r > 0 && pf->regions[r].start > at) r--;
    pf_hint = r;
    const Region *g = &pf->regions[r];
    const int64_t end = at - g->start + PF_UNIT < g->bytes ? at - g->start + PF_UNIT : g->bytes;
    for (int64_t off = at - g->start; off < end; off += 64) _mm_prefetch((const char *)g->base + off, _MM_HINT_T1);
    return 1;
}

/* Sequentially consistent atomics: either the last arriver sees a sleeper and wakes it, or the
 * sleeper's FUTEX_WAIT sees the new generation and returns at once. A waiting thread fetches
 * weights ahead (pf, may be NULL) before it pauses. */
static inline void barrier_wait(Barrier *b, Prefetcher *pf) {
    if (b->threads == 1) return;
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == b->threads - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers)) futex(&b->generation, FUTEX_WAKE_PRIVATE, INT_MAX);
        return;
    }
    for (int spin = 0; spin < SPIN_LIMIT; spin++) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return;
        if (!prefetch_some(pf)) _mm_pause();
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == gen) futex(&b->generation, FUTEX_WAIT_PRIVATE, gen);
    atomic_fetch_sub(&b->sleepers, 1);
}

#endif /* PORTICO_STEP_SYNC_H */
