/* panel_step: a whole forward pass of the batch invariant float32 path (--dtype auto on a GGUF
 * model: every linear on csrc/panel_linear.c) for a step of a few tokens, in one native call.
 *
 * Why: one stream decoding runs ~10 small kernels per layer; called one by one from Python each
 * pays the interpreter, a tensor allocation and an OpenMP team wake-up, about as much as the
 * arithmetic at one row. Here the threads are woken once per step and stay in one parallel
 * region for every layer, meeting at step_sync.h's barrier between a layer's stages, as
 * decode_step.c does for the bfloat16 + int8 path.
 *
 * Bit for bit the Python path: every stage calls the very function the Python path calls for
 * that op, on the same float32 rows: add_rms_norm and rope_write_kv (norm_rope.c, by one
 * thread), the paged attention work items (paged_attention.c; a step of decode rows splits each
 * request's attention into spans of positions, queries and head dims instead, every query still
 * on attend_item's chain), silu_mul's spans (norm_rope.c)
 * and the panel linears' tasks (panel_linear.c: panel_quantize_row, then panel_linear_panels on
 * chunks of panels handed out from a shared counter). Each output element is computed whole by
 * one thread with the same chain of operations as in the Python path, so neither the schedule
 * nor the thread count changes a bit (tests/engine/test_panel_step.py checks it).
 */
#define _GNU_SOURCE /* syscall() */
#include <omp.h>

#include "paged_attention.h"
#include "panel_linear.h"
#include "step_sync.h"

void add_rms_norm(void *x, const void *delta, const void *weight, float eps, void *out, int rows,
                  int hidden, int dt, int num_threads);
void rope_write_kv(void *qkv, int rows, int64_t row_stride, int q_heads, int kv_heads,
                   int head_dim, const float *cos_t, const float *sin_t, const int64_t *positions,
                   void *cache, int64_t num_blocks, int block_size, const int64_t *slots, int dt,
                   int kv_kind, int num_threads);
void silu_mul_span(const void *gate_up, int r, int inter, int i0, int i1, int dt, void *out);

/* A layer's row of the table the model passes: the two norm weights (float32), then four linears
 * of three fields each: kind (0 Q4_1, 1 Q8_0), the panel records, bias float32 (0 for none).
 * Pointers as int64. The head: the same three fields with the vocabulary size in place of the
 * bias. */
enum { PF_IN_NORM = 0, PF_POST_NORM = 1, PF_QKV = 2, PF_O = 5, PF_GATE_UP = 8, PF_DOWN = 11, PF_FIELDS = 14 };
enum { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_LAYERS, D_FIELDS };

#define MAX_STEP_ROWS 8   /* the most rows a step takes */
#ifndef CHUNK_PANELS
#define CHUNK_PANELS 4 /* the fewest panels a thread takes at a time */
#endif
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 2 /* a linear's panels in about this many chunks per thread */
#endif
#define SILU_SPAN 256     /* values of a row a thread takes at a time in the activation stage */
#define STAGES 8          /* stages per layer that hand out work (one counter each) */

typedef struct {
    const int64_t *table;
    const int *dims;
    int m;
    float eps;
    const float *cos_t, *sin_t;
    const int64_t *positions, *slots, *caches;
    int64_t num_blocks;
    int block_size, kv_kind, num_reqs;
    Attn attn;
    const int64_t *item_start;
    int split;                 /* decode rows only: attention split by positions, queries, dims */
    int64_t *span_start;       /* with split: request r's first unit of scores */
    float *scores;             /* with split: [num_reqs, heads, max_seq], shared by the team */
    float *x, *h, *qkv, *att, *delta, *gu, *act, *pending, *out;
    atomic_int *counters;
    int64_t *linear_start; /* per linear, where its weights start in the prefetch stream */
    Barrier barrier;
    Prefetcher pf;
} PanelStep;

/* Stage: y [m, n] = x [m, k] W^T (+ f's bias, unless head), chunks of panels handed out; xs:
 * this thread's scratch for x in integers (every thread quantizes the rows itself: a few
 * hundred instructions a row, cheaper than a barrier). */
static void linear_stage(PanelStep *st, int stage, int region, const int64_t *f, int head, int m, int n, int k,
                         const float *x, float *y, void *xs) {
    atomic_store_explicit(&st->pf.consumed, st->linear_start[region], memory_order_relaxed);
    const int kind = (int)f[0];
    PanelRows rows;
    panel_rows_init(&rows, m, k, xs);
    for (int r = 0; r < m; r++) panel_quantize_row(x + (int64_t)r * k, &rows, r);
    const int panels = (n + 15) / 16;
    /* Long chunks: each thread reads a few long runs of records, which the hardware prefetcher
     * follows, instead of 4-panel pieces interleaved with the other thread's (one decode row at
     * 300 positions: 0.88x the step time of fixed 4-panel chunks; at 1,500: 0.90x). Still more
     * chunks than threads, so the others take a descheduled thread's share. */
    const int per = st->barrier.threads * CHUNKS_PER_THREAD;
    const int chunk = (panels + per - 1) / per < CHUNK_PANELS ? CHUNK_PANELS : (panels + per - 1) / per;
    for (;;) {
        const int p = atomic_fetch_add_explicit(&st->counters[stage], chunk, memory_order_relaxed);
        if (p >= panels) break;
        panel_linear_panels(kind, &rows, (const uint8_t *)(intptr_t)f[1], head ? NULL : (const float *)(intptr_t)f[2],
                            n, y, p, p + chunk < panels ? p + chunk : panels);
    }
}

/* A step of decode rows: its attention in three passes over units the team hands out (see
 * paged_attention.h), so that both threads read the cache even for one request: a request has
 * as many KV heads as items, fewer than threads x 2 for small models. */
static void split_attention_stage(PanelStep *st, int stage, const Attn *a, Scratch *s) {
    const int64_t per_req = (int64_t)a->heads * a->max_seq;
    const int64_t spans = st->span_start[st->num_reqs];
    for (int r = 0;;) {
        const int64_t u = atomic_fetch_add_explicit(&st->counters[stage + 1], 1, memory_order_relaxed);
        if (u >= spans) break;
        while (u >= st->span_start[r + 1]) r++;
        const int pb = (int)(u - st->span_start[r]) * DECODE_SPLIT_SPAN;
        const int pe = pb + DECODE_SPLIT_SPAN < a->seq_lens[r] ? pb + DECODE_SPLIT_SPAN : a->seq_lens[r];
        decode_split_scores(a, r, pb, pe, s, st->scores + r * per_req);
    }
    barrier_wait(&st->barrier, &st->pf);
    for (;;) {
        const int u = atomic_fetch_add_explicit(&st->counters[stage + 6], 1, memory_order_relaxed);
        if (u >= st->num_reqs * a->heads) break;
        decode_split_softmax(a, u / a->heads, u % a->heads, st->scores + (u / a->heads) * per_req);
    }
    barrier_wait(&st->barrier, &st->pf);
    const int tiles = a->head_dim / DECODE_SPLIT_DIMS, per = a->kv_heads * tiles;
    for (;;) {
        const int u = atomic_fetch_add_explicit(&st->counters[stage + 7], 1, memory_order_relaxed);
        if (u >= st->num_reqs * per) break;
        const int r = u / per, kvh = (u % per) / tiles, d0 = (u % tiles) * DECODE_SPLIT_DIMS;
        decode_split_pv(a, r, kvh, d0, s, st->scores + r * per_req);
    }
}

static void attention_stage(PanelStep *st, int stage, const Attn *a, Scratch *s) {
    if (st->split) {
        split_attention_stage(st, stage, a, s);
        return;
    }
    const int64_t total = st->item_start[st->num_reqs];
    int r = 0;
    for (;;) {
        const int64_t item = atomic_fetch_add_explicit(&st->counters[stage + 1], 1, memory_order_relaxed);
        if (item >= total) break;
        while (item >= st->item_start[r + 1]) r++;
        const Item it = resolve_item(a, r, item - st->item_start[r]);
        attend_item(a, &it, s);
    }
}

static void silu_stage(PanelStep *st, int stage) {
    const int inter = st->dims[D_INTER], per_row = (inter + SILU_SPAN - 1) / SILU_SPAN;
    for (;;) {
        const int unit = atomic_fetch_add_explicit(&st->counters[stage], 1, memory_order_relaxed);
        if (unit >= st->m * per_row) break;
        const int r = unit / per_row, i0 = (unit % per_row) * SILU_SPAN;
        silu_mul_span(st->gu, r, inter, i0, i0 + SILU_SPAN < inter ? i0 + SILU_SPAN : inter, DT_F32, st->act);
    }
}

/* One decoder layer, run by every thread of the team (tid 0 does the serial parts). */
static void run_layer(PanelStep *st, int layer, int tid, Scratch *s, void *xs) {
    const int *d = st->dims;
    const int hidden = d[D_HIDDEN], heads = d[D_HEADS], kvh = d[D_KV_HEADS], hd = d[D_HEAD_DIM];
    const int inter = d[D_INTER], m = st->m, qkv_n = (heads + 2 * kvh) * hd;
    const int64_t *f = st->table + (int64_t)layer * PF_FIELDS;
    const int stage = layer * STAGES, region = layer * 4;
    if (tid == 0)
        add_rms_norm(st->x, layer ? st->pending : NULL, (const void *)(intptr_t)f[PF_IN_NORM], st->eps, st->h, m,
                     hidden, DT_F32, 1);
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, stage, region, f + PF_QKV, 0, m, qkv_n, hidden, st->h, st->qkv, xs);
    barrier_wait(&st->barrier, &st->pf);
    void *cache = (void *)(intptr_t)st->caches[layer];
    if (tid == 0)
        rope_write_kv(st->qkv, m, qkv_n, heads, kvh, hd, st->cos_t, st->sin_t, st->positions, cache, st->num_blocks,
                      st->block_size, st->slots, DT_F32, st->kv_kind, 1);
    barrier_wait(&st->barrier, &st->pf);
    Attn a = st->attn;
    a.cache = cache;
    attention_stage(st, stage, &a, s);
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, stage + 2, region + 1, f + PF_O, 0, m, hidden, heads * hd, st->att, st->delta, xs);
    barrier_wait(&st->barrier, &st->pf);
    if (tid == 0)
        add_rms_norm(st->x, st->delta, (const void *)(intptr_t)f[PF_POST_NORM], st->eps, st->h, m, hidden, DT_F32, 1);
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, stage + 3, region + 2, f + PF_GATE_UP, 0, m, 2 * inter, hidden, st->h, st->gu, xs);
    barrier_wait(&st->barrier, &st->pf);
    silu_stage(st, stage + 4);
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, stage + 5, region + 3, f + PF_DOWN, 0, m, hidden, inter, st->act, st->pending, xs);
    barrier_wait(&st->barrier, &st->pf);
}

/* The final norm, then the LM head on the sampled rows of it: logits [num_sample, vocab]
 * float32, as the head's panel linear called on those rows alone gives them. */
static void run_tail(PanelStep *st, const void *final_norm, const int64_t *head, const int32_t *sample_rows,
                     int num_sample, float *logits, int tid, void *xs) {
    const int hidden = st->dims[D_HIDDEN];
    if (tid == 0) {
        add_rms_norm(st->x, st->pending, final_norm, st->eps, st->out, st->m, hidden, DT_F32, 1);
        for (int i = 0; head && i < num_sample; i++) /* the sampled rows side by side in h */
            memcpy(st->h + (int64_t)i * hidden, st->out + (int64_t)sample_rows[i] * hidden, sizeof(float) * hidden);
    }
    if (!head) return;
    barrier_wait(&st->barrier, &st->pf);
    const int layers = st->dims[D_LAYERS];
    linear_stage(st, layers * STAGES, layers * 4, head, 1, num_sample, (int)head[2], hidden, st->h, logits, xs);
}

static int64_t add_region(PanelStep *st, int64_t at, const void *base, int64_t bytes) {
    if (!base || bytes <= 0) return at;
    Region *g = &st->pf.regions[st->pf.count++];
    g->base = (const uint8_t *)base;
    g->bytes = bytes;
    g->start = at;
    return at + (bytes + PF_UNIT - 1) / PF_UNIT * PF_UNIT;
}

/* The prefetcher's regions: each linear's panel records, layer by layer, then the head's, in
 * use order; linear_start[4 * layer + i] is where linear i's begin (linear_stage marks it
 * consumed when it starts). */
static void plan_prefetch(PanelStep *st, const int64_t *head) {
    const int *d = st->dims;
    const int hidden = d[D_HIDDEN], inter = d[D_INTER], qkv_n = (d[D_HEADS] + 2 * d[D_KV_HEADS]) * d[D_HEAD_DIM];
    const int o_k = d[D_HEADS] * d[D_HEAD_DIM], layers = d[D_LAYERS];
    const int n[4] = {qkv_n, hidden, 2 * inter, hidden}, k[4] = {hidden, o_k, hidden, inter};
    int64_t at = 0;
    st->pf.count = 0;
    for (int j = 0; j < 4 * layers + (head ? 1 : 0); j++) {
        const int in_layer = j < 4 * layers, i = j % 4;
        const int64_t *f = in_layer ? st->table + (int64_t)(j / 4) * PF_FIELDS + PF_QKV + 3 * i : head;
        const int rows = in_layer ? n[i] : (int)head[2], cols = in_layer ? k[i] : hidden;
        st->linear_start[j] = at;
        at = add_region(st, at, (const void *)(intptr_t)f[1], panel_bytes((int)f[0], rows, cols));
    }
    st->pf.total = at;
    atomic_init(&st->pf.next, 0);
    atomic_init(&st->pf.consumed, 0);
}

/* Whether the fused step serves a model of these sizes (the panels' and attention's limits). */
int panel_step_supported(const int *dims) {
    const int hidden = dims[D_HIDDEN], heads = dims[D_HEADS], kvh = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
    if (kvh <= 0 || heads % kvh || (heads / kvh) * ROW_TILE > MAX_QUERIES || hd > 256 || hd % 2) return 0;
    return hidden % 32 == 0 && hidden <= 8192 && (heads * hd) % 32 == 0 && dims[D_INTER] % 32 == 0;
}

static void step_buffers(PanelStep *st, float *arena) {
    const int *d = st->dims;
    const int64_t m = st->m, hidden = d[D_HIDDEN], inter = d[D_INTER];
    const int64_t qkv_n = (int64_t)(d[D_HEADS] + 2 * d[D_KV_HEADS]) * d[D_HEAD_DIM];
    st->h = arena;
    st->qkv = st->h + m * hidden;
    st->att = st->qkv + m * qkv_n;
    st->delta = st->att + m * d[D_HEADS] * d[D_HEAD_DIM];
    st->gu = st->delta + m * hidden;
    st->act = st->gu + m * 2 * inter;
    st->pending = st->act + m * inter;
}

static size_t arena_floats(const int *d, int m) {
    const int64_t qkv_n = (int64_t)(d[D_HEADS] + 2 * d[D_KV_HEADS]) * d[D_HEAD_DIM];
    return (size_t)m * (size_t)(3 * d[D_HIDDEN] + qkv_n + d[D_HEADS] * d[D_HEAD_DIM] + 3 * d[D_INTER]);
}

/* The team's part: every layer, the final norm and the head; returns nonzero when a thread's
 * scratch could not be allocated (nothing run then). */
static int run_team(PanelStep *st, const void *final_norm, const int64_t *head, const int32_t *sample_rows,
                    int num_sample, float *logits, int num_threads) {
    const int *d = st->dims;
    int widest = d[D_INTER] > d[D_HIDDEN] ? d[D_INTER] : d[D_HIDDEN];
    if (d[D_HEADS] * d[D_HEAD_DIM] > widest) widest = d[D_HEADS] * d[D_HEAD_DIM];
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num();
#pragma omp single
        st->barrier.threads = omp_get_num_threads();
        /* (the single's implicit barrier publishes the team size) */
        Scratch s;
        void *xs = aligned_alloc(64, (panel_rows_bytes(st->m, widest) + 63) & ~(size_t)63);
        if (scratch_alloc(&s, st->attn.max_seq, d[D_HEAD_DIM]) != 0 || !xs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int layer = 0; layer < d[D_LAYERS]; layer++) run_layer(st, layer, tid, &s, xs);
            run_tail(st, final_norm, head, sample_rows, num_sample, logits, tid, xs);
        }
        free(xs);
        scratch_free(&s);
    }
    return failed;
}

/*
 * table [layers, PF_FIELDS] int64 (see PF_*), dims [D_FIELDS] int, final_norm [hidden] float32.
 * x [m, hidden] float32: the step's token embeddings in, the residual stream after the last
 * layer out; out [m, hidden]: its final norm (the hidden states to sample from). Positions,
 * slots, cos/sin tables, block tables, query_start, seq_lens as rope_write_kv and
 * paged_attention take them; caches [layers] pointers to each layer's float32 cache
 * [2, num_blocks, block_size, kv_heads, head_dim], or per kv_kind (common.h) its int8 cache
 * (KV_INT8) or float16 cache (KV_F16). head: NULL,
 * or the LM head's three fields (vocab last), whose float32 logits [num_sample, vocab] of rows
 * sample_rows of out are then written to logits. Returns 0; -2 when these sizes or this many
 * rows are not served; -1 out of memory.
 */
int panel_step(const int64_t *table, const int *dims, const void *final_norm, float eps, float scale, float *x,
               float *out, int m, const float *cos_t, const float *sin_t, const int64_t *positions,
               const int64_t *slots, const int64_t *caches, int kv_kind, int64_t num_blocks, int block_size,
               const int32_t *tables, int max_blocks, const int32_t *query_start, const int32_t *seq_lens,
               int num_reqs, const int64_t *head, const int32_t *sample_rows, int num_sample, float *logits,
               int num_threads) {
    if (!panel_step_supported(dims) || m <= 0 || m > MAX_STEP_ROWS) return -2;
    if (head && (num_sample <= 0 || num_sample > m)) return -2;
    const int layers = dims[D_LAYERS], heads = dims[D_HEADS], kvh = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
    PanelStep st = {.table = table, .dims = dims, .m = m, .eps = eps, .cos_t = cos_t, .sin_t = sin_t,
                    .positions = positions, .slots = slots, .caches = caches, .num_blocks = num_blocks,
                    .block_size = block_size, .kv_kind = kv_kind, .num_reqs = num_reqs, .x = x, .out = out};
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    float *arena = (float *)malloc(sizeof(float) * arena_floats(dims, m));
    st.counters = (atomic_int *)calloc((size_t)layers * STAGES + 1, sizeof(atomic_int)); /* + the head */
    st.pf.regions = (Region *)malloc(sizeof(Region) * (size_t)(layers * 4 + 1));
    st.linear_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(layers * 4 + 1));
    int failed = !item_start || !arena || !st.counters || !st.pf.regions || !st.linear_start;
    if (!failed) {
        plan_prefetch(&st, head);
        int max_seq = 0;
        const int64_t row = kv_kind == KV_INT8 ? int8_row_bytes(hd) : hd;
        const int64_t half = num_blocks * (int64_t)block_size * kvh * row;
        const int all_heads = decode_items_all_heads(num_reqs, heads, hd, kv_cache_dt(kv_kind, DT_F32), half);
        plan_items(query_start, seq_lens, num_reqs, kvh, all_heads, item_start, &max_seq);
        st.item_start = item_start;
        step_buffers(&st, arena);
        const Attn a = {
            .query = st.qkv, .q_stride_t = (int64_t)(heads + 2 * kvh) * hd, .q_stride_h = hd, .cache = NULL,
            .block_size = block_size, .kv_heads = kvh, .head_dim = hd, .heads = heads, .group = heads / kvh,
            .max_blocks = max_blocks, .dt = DT_F32, .max_seq = max_seq, .half = half,
            .decode_all_heads = all_heads, .kv_kind = kv_kind, .tables = tables, .query_start = query_start,
            .seq_lens = seq_lens, .scale = scale, .out = st.att,
        };
        st.attn = a;
        st.split = decode_split_serves(&st.attn, num_reqs);
        if (st.split) {
            st.span_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
            st.scores = (float *)malloc(sizeof(float) * (size_t)num_reqs * (size_t)heads * (size_t)max_seq);
            failed = !st.span_start || !st.scores;
            if (!failed) st.span_start[0] = 0;
            for (int r = 0; !failed && r < num_reqs; r++)
                st.span_start[r + 1] = st.span_start[r] + (seq_lens[r] + DECODE_SPLIT_SPAN - 1) / DECODE_SPLIT_SPAN;
        }
        if (!failed) failed = run_team(&st, final_norm, head, sample_rows, num_sample, logits, num_threads);
    }
    free(st.span_start);
    free(st.scores);
    free(item_start);
    free(arena);
    free(st.counters);
    free(st.pf.regions);
    free(st.linear_start);
    return failed ? -1 : 0;
}
