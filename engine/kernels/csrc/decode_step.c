/* decode_step: a whole forward pass of a Llama-family model for a step of a few tokens (one
 * stream decoding, a few streams, a short speculative check) in one native call.
 *
 * Why: at one row a layer's work is ~10 small kernels of 10-100 us each. Called from Python,
 * every one pays the interpreter, a tensor allocation and an OpenMP team wake-up (tens of us
 * under OMP_WAIT_POLICY=PASSIVE), which added up to as much as the arithmetic. Here the threads
 * are woken once per step, stay in one parallel region for every layer, and meet at a barrier
 * between the stages of a layer that spins briefly (the usual wait: the other thread finishing
 * its last chunk) and then sleeps on a futex, so a thread whose peer was descheduled on a busy
 * machine gives its core back instead of spinning through the peer's time slice. Work
 * inside a stage is handed out in chunks from a shared counter; each output is still computed
 * by one thread in a fixed order, so results never depend on the schedule or thread count.
 *
 * The stages are the engine's own kernels: add_rms_norm and rope_write_kv (norm_rope.c), the
 * paged attention work items (paged_attention.c), and the int8-activation block linears
 * (quantized_int8.c). bfloat16 activations only, linears in GGUF Q4_1/Q8_0 blocks.
 */
#define _GNU_SOURCE /* syscall() */
#include <omp.h>

#include "paged_attention.h"
#include "quantized_int8.h"
#include "step_sync.h"

void add_rms_norm(void *x, const void *delta, const void *weight, float eps, void *out, int rows,
                  int hidden, int dt, int num_threads);
void rope_write_kv(void *qkv, int rows, int64_t row_stride, int q_heads, int kv_heads,
                   int head_dim, const float *cos_t, const float *sin_t, const int64_t *positions,
                   void *cache, int64_t num_blocks, int block_size, const int64_t *slots, int dt,
                   int kv_kind, int num_threads);

/* A layer's row of the table the model passes: norm weights, then four linears of five fields
 * each (kind, weights packed by q8_pack, two unused, bias float32; pointers as int64, 0 for
 * none). */
enum { LF_IN_NORM = 0, LF_POST_NORM = 1, LF_QKV = 2, LF_O = 7, LF_GATE_UP = 12, LF_DOWN = 17, LF_FIELDS = 22 };
/* The model's sizes, in the dims array. */
enum { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_LAYERS, D_FIELDS };

#ifndef LINEAR_CHUNK_BYTES
#define LINEAR_CHUNK_BYTES 65536 /* weight bytes a thread takes at a time (at least 8 tiles) */
#endif
#define STAGES 6         /* stages per layer that hand out work (one counter each) */

/* Everything one step shares between its threads. */
typedef struct {
    const int64_t *table;
    const int *dims;
    int m;
    float eps;
    const float *cos_t, *sin_t;
    const int64_t *positions, *slots;
    const int64_t *caches;
    int64_t num_blocks;
    int block_size, kv_kind;
    Attn attn; /* per layer: cache and nothing else change */
    const int64_t *item_start;
    int num_reqs;
    /* activations, bf16 */
    uint16_t *x, *h, *qkv, *att, *delta, *gu, *act, *pending, *out;
    Q8Rows rows; /* the quantized input of the next linear */
    void *rows_scratch;
    atomic_int *counters; /* one per stage that hands out work */
    Barrier barrier;
    Prefetcher pf;
} Step;

static Q8Weights weights_at(const int64_t *f, int n, int k) {
    const Q8Weights w = {(int)f[0], n, k, k / 32, (const uint8_t *)(intptr_t)f[1]};
    return w;
}

/* Stage: y = rows W^T (+ bias), tiles handed out in chunks. */
static void linear_stage(Step *st, int stage, int region, const int64_t *f, int n, int k, uint16_t *y) {
    const Q8Weights w = weights_at(f, n, k);
    if (region < st->pf.count) atomic_store_explicit(&st->pf.consumed, st->pf.regions[region].start, memory_order_relaxed);
    const float *bias = (const float *)(intptr_t)f[4];
    const int tiles = q8_num_tiles(&w);
    const int per_tile = q8_tile_bytes(&w), chunk = LINEAR_CHUNK_BYTES / per_tile > 8 ? LINEAR_CHUNK_BYTES / per_tile : 8;
    for (;;) {
        const int t = atomic_fetch_add_explicit(&st->counters[stage], chunk, memory_order_relaxed);
        if (t >= tiles) break;
        q8_linear_range(&w, &st->rows, bias, DT_BF16, y, n, t, t + chunk < tiles ? t + chunk : tiles);
    }
}

/* Stage: attention work items, one at a time. */
static void attention_stage(Step *st, int stage, const Attn *a, Scratch *s) {
    const int64_t total = st->item_start[st->num_reqs];
    int r = 0;
    for (;;) {
        const int64_t item = atomic_fetch_add_explicit(&st->counters[stage], 1, memory_order_relaxed);
        if (item >= total) break;
        while (item >= st->item_start[r + 1]) r++;
        const Item it = resolve_item(a, r, item - st->item_start[r]);
        attend_item(a, &it, s);
    }
}

/* act = round(silu(gate)) * up for values i0..i1-1 of row r, each rounded to bf16 as PyTorch's
 * bf16 ops do. */
static void silu_mul(const uint16_t *gu, uint16_t *act, int r, int inter, int i0, int i1) {
    const uint16_t *g = gu + (int64_t)r * 2 * inter, *u = g + inter;
    for (int i = i0; i < i1; i++) {
        const float gv = bf16_to_f32(g[i]);
        const float s = bf16_to_f32(f32_to_bf16(gv / (1.f + expf(-gv))));
        act[(int64_t)r * inter + i] = f32_to_bf16(s * bf16_to_f32(u[i]));
    }
}

#define SILU_CHUNK 8 /* blocks of 32 values a thread takes at a time in the activation stage */

/* Stage: act = silu(gate) * up, quantized for the down projection, in chunks of SILU_CHUNK
 * blocks of one row (each block's values and scale depend on that block alone). */
static void silu_stage(Step *st, int stage, int kind) {
    const int inter = st->dims[D_INTER], nb = inter / 32, per_row = (nb + SILU_CHUNK - 1) / SILU_CHUNK;
    Q8Rows rows;
    q8_rows_init(&rows, kind, st->m, inter, st->rows_scratch);
    for (;;) {
        const int unit = atomic_fetch_add_explicit(&st->counters[stage], 1, memory_order_relaxed);
        if (unit >= st->m * per_row) break;
        const int r = unit / per_row, b0 = (unit % per_row) * SILU_CHUNK;
        const int b1 = b0 + SILU_CHUNK < nb ? b0 + SILU_CHUNK : nb;
        silu_mul(st->gu, st->act, r, inter, b0 * 32, b1 * 32);
        quantize_blocks_q8(&rows, st->act, DT_BF16, r, r + 1, b0, b1);
    }
}

/* One decoder layer, run by every thread of the team (tid 0 does the serial parts). */
static void run_layer(Step *st, int layer, int tid, Scratch *s) {
    const int *d = st->dims;
    const int hidden = d[D_HIDDEN], heads = d[D_HEADS], kvh = d[D_KV_HEADS], hd = d[D_HEAD_DIM];
    const int inter = d[D_INTER], m = st->m;
    const int qkv_n = (heads + 2 * kvh) * hd;
    const int64_t *f = st->table + (int64_t)layer * LF_FIELDS;
    if (tid == 0) {
        add_rms_norm(st->x, layer ? st->pending : NULL, (const void *)(intptr_t)f[LF_IN_NORM], st->eps, st->h, m,
                     hidden, DT_BF16, 1);
        q8_rows_init(&st->rows, (int)f[LF_QKV], m, hidden, st->rows_scratch);
        quantize_rows_q8(&st->rows, st->h, DT_BF16);
    }
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, layer * STAGES + 0, layer * 4 + 0, f + LF_QKV, qkv_n, hidden, st->qkv);
    barrier_wait(&st->barrier, &st->pf);
    void *cache = (void *)(intptr_t)st->caches[layer];
    if (tid == 0)
        rope_write_kv(st->qkv, m, qkv_n, heads, kvh, hd, st->cos_t, st->sin_t, st->positions, cache, st->num_blocks,
                      st->block_size, st->slots, DT_BF16, st->kv_kind, 1);
    barrier_wait(&st->barrier, &st->pf);
    Attn a = st->attn;
    a.cache = cache;
    attention_stage(st, layer * STAGES + 1, &a, s);
    barrier_wait(&st->barrier, &st->pf);
    if (tid == 0) {
        q8_rows_init(&st->rows, (int)f[LF_O], m, heads * hd, st->rows_scratch);
        quantize_rows_q8(&st->rows, st->att, DT_BF16);
    }
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, layer * STAGES + 2, layer * 4 + 1, f + LF_O, hidden, heads * hd, st->delta);
    barrier_wait(&st->barrier, &st->pf);
    if (tid == 0) {
        add_rms_norm(st->x, st->delta, (const void *)(intptr_t)f[LF_POST_NORM], st->eps, st->h, m, hidden, DT_BF16, 1);
        q8_rows_init(&st->rows, (int)f[LF_GATE_UP], m, hidden, st->rows_scratch);
        quantize_rows_q8(&st->rows, st->h, DT_BF16);
    }
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, layer * STAGES + 3, layer * 4 + 2, f + LF_GATE_UP, 2 * inter, hidden, st->gu);
    barrier_wait(&st->barrier, &st->pf);
    /* (the rows of gate_up are read by nobody now: this stage overwrites their scratch) */
    if (tid == 0) q8_rows_init(&st->rows, (int)f[LF_DOWN], m, inter, st->rows_scratch);
    silu_stage(st, layer * STAGES + 5, (int)f[LF_DOWN]);
    barrier_wait(&st->barrier, &st->pf);
    linear_stage(st, layer * STAGES + 4, layer * 4 + 3, f + LF_DOWN, hidden, inter, st->pending);
    barrier_wait(&st->barrier, &st->pf);
}

/* The LM head on the sampled rows of the final hidden states (after every layer, the last
 * counter): logits [num_sample, vocab] bf16, as the head's int8 block linear called alone gives
 * them. */
static void run_head(Step *st, const int64_t *head, const int32_t *sample_rows, int num_sample, uint16_t *logits,
                     int tid) {
    const int hidden = st->dims[D_HIDDEN], vocab = (int)head[2];
    if (tid == 0) { /* the sampled rows side by side in h, quantized */
        for (int i = 0; i < num_sample; i++)
            memcpy(st->h + (int64_t)i * hidden, st->out + (int64_t)sample_rows[i] * hidden, sizeof(uint16_t) * hidden);
        q8_rows_init(&st->rows, (int)head[0], num_sample, hidden, st->rows_scratch);
        quantize_rows_q8(&st->rows, st->h, DT_BF16);
    }
    barrier_wait(&st->barrier, &st->pf);
    const int64_t fields[5] = {head[0], head[1], 0, 0, 0};
    linear_stage(st, st->dims[D_LAYERS] * STAGES, st->dims[D_LAYERS] * 4, fields, vocab, hidden, logits);
}

/* The prefetcher's regions: every layer's four linears, then the head (if any), in use order. */
static void plan_prefetch(Step *st, const int64_t *head) {
    const int *d = st->dims;
    const int hidden = d[D_HIDDEN], inter = d[D_INTER], qkv_n = (d[D_HEADS] + 2 * d[D_KV_HEADS]) * d[D_HEAD_DIM];
    const int o_k = d[D_HEADS] * d[D_HEAD_DIM];
    int64_t at = 0;
    int count = 0;
    for (int layer = 0; layer < d[D_LAYERS]; layer++) {
        const int64_t *f = st->table + (int64_t)layer * LF_FIELDS;
        const int64_t *fields[4] = {f + LF_QKV, f + LF_O, f + LF_GATE_UP, f + LF_DOWN};
        const int n[4] = {qkv_n, hidden, 2 * inter, hidden}, k[4] = {hidden, o_k, hidden, inter};
        for (int i = 0; i < 4; i++) {
            Region *g = &st->pf.regions[count++];
            g->base = (const uint8_t *)(intptr_t)fields[i][1];
            g->bytes = (int64_t)q8_packed_bytes((int)fields[i][0], n[i], k[i]);
            g->start = at;
            at += (g->bytes + PF_UNIT - 1) / PF_UNIT * PF_UNIT;
        }
    }
    if (head) {
        Region *g = &st->pf.regions[count++];
        g->base = (const uint8_t *)(intptr_t)head[1];
        g->bytes = (int64_t)q8_packed_bytes((int)head[0], (int)head[2], hidden);
        g->start = at;
        at += (g->bytes + PF_UNIT - 1) / PF_UNIT * PF_UNIT;
    }
    st->pf.count = count;
    st->pf.total = at;
    atomic_init(&st->pf.next, 0);
    atomic_init(&st->pf.consumed, 0);
}

/* Whether the fused step serves a model of these sizes (the int8 path, attention limits). */
int decode_step_supported(const int *dims) {
    const int hidden = dims[D_HIDDEN], heads = dims[D_HEADS], kvh = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
    if (kvh <= 0 || heads % kvh || (heads / kvh) * ROW_TILE > MAX_QUERIES || hd > 256 || hd % 32) return 0;
    return q8_supported(hidden) && q8_supported(heads * hd) && q8_supported(dims[D_INTER]);
}

static void step_buffers(Step *st, uint16_t *arena) {
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

static size_t arena_elements(const int *d, int m) {
    const int64_t qkv_n = (int64_t)(d[D_HEADS] + 2 * d[D_KV_HEADS]) * d[D_HEAD_DIM];
    return (size_t)m * (size_t)(3 * d[D_HIDDEN] + qkv_n + d[D_HEADS] * d[D_HEAD_DIM] + 3 * d[D_INTER]);
}

/*
 * table [layers, LF_FIELDS] int64 (see LF_*), dims [D_FIELDS] int (see D_*), final_norm [hidden]
 * bf16. x [m, hidden] bf16: the step's token embeddings in, the residual stream after the last
 * layer out; out [m, hidden] bf16: the final norm of it (the hidden states to sample from).
 * Positions, slots, cos/sin tables, block tables, query_start, seq_lens as rope_write_kv and
 * paged_attention take them; caches [layers] pointers to each layer's bf16 cache
 * [2, num_blocks, block_size, kv_heads, head_dim], or with kv_kind KV_INT8 (common.h) its int8
 * cache (rows of head_dim + 4 bytes). head: NULL, or the LM head as [kind, weights
 * packed by q8_pack, vocab] (int64), whose bf16 logits [num_sample, vocab] of rows sample_rows
 * of out are then written to logits in the same call. Returns 0; -2 when these sizes are not
 * served (decode_step_supported); -1 out of memory.
 */
int decode_step(const int64_t *table, const int *dims, const void *final_norm, float eps, float scale, void *x,
                void *out, int m, const float *cos_t, const float *sin_t, const int64_t *positions,
                const int64_t *slots, const int64_t *caches, int kv_kind, int64_t num_blocks,
                int block_size, const int32_t *tables, int max_blocks, const int32_t *query_start, const int32_t *seq_lens,
                int num_reqs, const int64_t *head, const int32_t *sample_rows, int num_sample, void *logits,
                int num_threads) {
    if (!decode_step_supported(dims) || m <= 0) return -2;
    if (head && (num_sample <= 0 || num_sample > m || !q8_supported(dims[D_HIDDEN]))) return -2;
    const int layers = dims[D_LAYERS];
    Step st = {0};
    st.table = table;
    st.dims = dims;
    st.m = m;
    st.eps = eps;
    st.cos_t = cos_t;
    st.sin_t = sin_t;
    st.positions = positions;
    st.slots = slots;
    st.caches = caches;
    st.num_blocks = num_blocks;
    st.block_size = block_size;
    st.kv_kind = kv_kind;
    st.num_reqs = num_reqs;
    st.x = (uint16_t *)x;
    st.out = (uint16_t *)out;
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    uint16_t *arena = (uint16_t *)malloc(sizeof(uint16_t) * arena_elements(dims, m));
    int widest = dims[D_INTER] > dims[D_HIDDEN] ? dims[D_INTER] : dims[D_HIDDEN];
    if (dims[D_HEADS] * dims[D_HEAD_DIM] > widest) widest = dims[D_HEADS] * dims[D_HEAD_DIM];
    st.rows_scratch = aligned_alloc(64, q8_rows_bytes(m, widest));
    st.counters = (atomic_int *)calloc((size_t)layers * STAGES + 1, sizeof(atomic_int)); /* + the head */
    st.pf.regions = (Region *)malloc(sizeof(Region) * (size_t)(layers * 4 + 1));
    int failed = !item_start || !arena || !st.rows_scratch || !st.counters || !st.pf.regions;
    if (!failed) plan_prefetch(&st, head);
    if (!failed) {
        int max_seq = 0;
        const int64_t row = kv_kind == KV_INT8 ? int8_row_bytes(dims[D_HEAD_DIM]) : dims[D_HEAD_DIM];
        const int64_t half = num_blocks * (int64_t)block_size * dims[D_KV_HEADS] * row;
        const int all_heads =
            decode_items_all_heads(num_reqs, dims[D_HEADS], dims[D_HEAD_DIM], kv_cache_dt(kv_kind, DT_BF16), half);
        plan_items(query_start, seq_lens, num_reqs, dims[D_KV_HEADS], all_heads, item_start, &max_seq);
        st.item_start = item_start;
        step_buffers(&st, arena);
        const int heads = dims[D_HEADS], kvh = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
        const Attn a = {
            .query = st.qkv, .q_stride_t = (int64_t)(heads + 2 * kvh) * hd, .q_stride_h = hd, .cache = NULL,
            .block_size = block_size, .kv_heads = kvh, .head_dim = hd, .heads = heads, .group = heads / kvh,
            .max_blocks = max_blocks, .dt = DT_BF16, .max_seq = max_seq,
            .half = half, .decode_all_heads = all_heads, .kv_kind = kv_kind, .tables = tables, .query_start = query_start,
            .seq_lens = seq_lens, .scale = scale, .out = st.att,
        };
        st.attn = a;
#pragma omp parallel num_threads(num_threads)
        {
            const int tid = omp_get_thread_num();
#pragma omp single
            st.barrier.threads = omp_get_num_threads();
            /* (the single's implicit barrier publishes the team size) */
            Scratch s;
            const int ok = scratch_alloc(&s, max_seq, hd) == 0;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            if (!failed) {
                for (int layer = 0; layer < layers; layer++) run_layer(&st, layer, tid, &s);
                if (tid == 0) add_rms_norm(st.x, st.pending, final_norm, eps, st.out, m, dims[D_HIDDEN], DT_BF16, 1);
                if (head) run_head(&st, head, sample_rows, num_sample, (uint16_t *)logits, tid);
            }
            scratch_free(&s);
        }
    }
    free(item_start);
    free(arena);
    free(st.rows_scratch);
    free(st.counters);
    free(st.pf.regions);
    return failed ? -1 : 0;
}
