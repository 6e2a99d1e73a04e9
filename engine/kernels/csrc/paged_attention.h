/* The parts of paged_attention.c that the fused decode step (decode_step.c) drives inside its
 * own parallel region: the call's arguments, its work items, per-thread scratch.
 */
#ifndef PORTICO_PAGED_ATTENTION_H
#define PORTICO_PAGED_ATTENTION_H
#include "common.h"

#define ROW_TILE 4     /* query rows (positions) per work item */
#define MAX_QUERIES 32 /* ROW_TILE * heads per KV head must fit */

#ifdef __AVX512F__
/* The score tiles' lane sums (paged_attention.c's pass 1 and kv_int8.c's). */
/* Four vectors' lane sums per 128-bit chunk: lanes 4c..4c+3 of the result hold the partial sums
 * of a0..a3 over chunk c of each (two unpack-and-add levels). */
static inline __m512 sum4_chunks(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d p01 = _mm512_castps_pd(b01), p23 = _mm512_castps_pd(b23);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p01, p23)), _mm512_castpd_ps(_mm512_unpackhi_pd(p01, p23)));
}

/* Lane i of the result: the sum of the 16 lanes of vector i, from four sum4_chunks results. */
static inline __m512 sum16(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c2, c3, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(c2, c3, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif

#if defined(__AVX512BF16__)
/* One cache row (bf16, chunks x 32 elements) dotted with one query's pairs, left in 16 lanes. */
static inline __m512 row_dot(const uint16_t *k, const __m512bh *qv, int chunks) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qv[0]);
    for (int z = 1; z < chunks; z++) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + z * 32), qv[z]);
    return acc;
}

/* Scores of nq bf16 queries against 16 positions whose cache rows are rows[0..15] (rows past the
 * valid ones repeat a valid row; mask stores only the valid lanes). Each row is read with plain
 * loads, dotted with a query in 16 lanes and the 16 rows' lanes summed by a transpose tree: a
 * few shuffles per row instead of a gather per pair of elements, which costs more than the
 * arithmetic on CPUs with slow gathers. Rows stay in L1 between the queries. */
static inline void scores16_rows(const uint16_t *const rows[16], __mmask16 mask, int head_dim,
                                 const __m512bh *qv, int nq, float scale, float *out, int64_t stride) {
    const int chunks = head_dim / 32;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int q = 0; q < nq; q++) {
        const __m512bh *qq = qv + q * chunks;
        __m512 c[4];
        for (int g = 0; g < 4; g++)
            c[g] = sum4_chunks(row_dot(rows[4 * g], qq, chunks), row_dot(rows[4 * g + 1], qq, chunks),
                               row_dot(rows[4 * g + 2], qq, chunks), row_dot(rows[4 * g + 3], qq, chunks));
        _mm512_mask_storeu_ps(out + q * stride, mask, _mm512_mul_ps(sum16(c[0], c[1], c[2], c[3]), sc));
    }
}
#endif

/* The arguments of one call, shared read-only by every work item. */
typedef struct {
    const void *query;
    int64_t q_stride_t, q_stride_h;
    const void *cache;
    int block_size, kv_heads, head_dim, heads, group, max_blocks, dt, max_seq;
    int64_t half; /* elements from K to V in the cache */
    int decode_all_heads; /* decode rows take every KV head in one item (decode_items_all_heads) */
    int kv_kind; /* what the cache holds (common.h): dt's values, int8 rows with their scales, or
                  * float16 (KV_SAME, KV_INT8, KV_F16) */
    const int32_t *tables, *query_start, *seq_lens;
    float scale;
    void *out;
} Attn;

/* One work item, resolved: the request's rows row0..row0+rows-1 against KV heads kvh..kvh+nkv-1
 * (per_kv queries each: rows times the heads that share a KV head; nq in all). */
typedef struct {
    int r, kvh, nkv, q_len, seq_len, row0, rows, per_kv, nq, ctx_end;
    const int32_t *table;
} Item;

/* Per-thread scratch (vscale: one float per context position, kv_int8.c's pass 2). */
typedef struct {
    float *scores, *qbuf, *obuf, *kv, *vscale;
} Scratch;

/* Offsets of each request's first work item into item_start[0..num_reqs]; returns the
 * positions read in all (the work), and the longest context in *max_seq. */
int64_t plan_items(const int32_t *query_start, const int32_t *seq_lens, int num_reqs, int kv_heads,
                   int decode_all_heads, int64_t *item_start, int *max_seq);
/* Whether a call's decode rows take every KV head in one item (see paged_attention.c). */
int decode_items_all_heads(int num_reqs, int heads, int head_dim, int cache_dt, int64_t half);
/* Item `local` of request r (see paged_attention.c). */
Item resolve_item(const Attn *a, int r, int64_t local);
/* Attend one work item: its queries' rows of the output. */
void attend_item(const Attn *a, const Item *it, Scratch *s);
/* The two passes over an int8 cache (kv_int8.c): scores of the item's queries, then P V (which
 * may overwrite the scores); kv is head_dim floats of scratch. */
void scores_int8(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv);
void pv_int8(const Attn *a, const Item *it, float *scores, float *obuf, Scratch *s);
/* A step of decode rows only, its attention split across a team without changing a bit: each
 * score alone (positions pb..pe-1, pb a multiple of DECODE_SPLIT_SPAN, of every head of request
 * r), then each query's softmax, then P V by KV head and DECODE_SPLIT_DIMS head dims; scores is
 * the request's [heads, max_seq] buffer, shared by the team. Each query's chain is attend_item's. */
#define DECODE_SPLIT_SPAN 64
#define DECODE_SPLIT_DIMS 32
int decode_split_serves(const Attn *a, int num_reqs);
void decode_split_scores(const Attn *a, int r, int pb, int pe, Scratch *s, float *scores);
void decode_split_softmax(const Attn *a, int r, int q, float *scores);
void decode_split_pv(const Attn *a, int r, int kvh, int d0, Scratch *s, const float *scores);
/* Per-thread scratch for contexts up to max_seq; 0, or -1 out of memory (free it either way). */
int scratch_alloc(Scratch *s, int max_seq, int head_dim);
void scratch_free(Scratch *s);
#endif /* PORTICO_PAGED_ATTENTION_H */
