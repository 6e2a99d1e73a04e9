/* The parts of paged_attention.c that the fused decode step (decode_step.c) drives inside its
 * own parallel region: the call's arguments, its work items, per-thread scratch.
 */
#ifndef PORTICO_PAGED_ATTENTION_H
#define PORTICO_PAGED_ATTENTION_H
#include "common.h"

#define ROW_TILE 4     /* query rows (positions) per work item */
#define MAX_QUERIES 32 /* ROW_TILE * heads per KV head must fit */

/* The arguments of one call, shared read-only by every work item. */
typedef struct {
    const void *query;
    int64_t q_stride_t, q_stride_h;
    const void *cache;
    int block_size, kv_heads, head_dim, heads, group, max_blocks, dt, max_seq;
    int64_t half; /* elements from K to V in the cache */
    int decode_all_heads; /* decode rows take every KV head in one item (decode_items_all_heads) */
    int kv_int8; /* the cache holds int8 rows with their scales (common.h), not dtype dt */
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

/* Per-thread scratch. */
typedef struct {
    float *scores, *qbuf, *obuf, *kv;
} Scratch;

/* Offsets of each request's first work item into item_start[0..num_reqs]; returns the
 * positions read in all (the work), and the longest context in *max_seq. */
int64_t plan_items(const int32_t *query_start, const int32_t *seq_lens, int num_reqs, int kv_heads,
                   int decode_all_heads, int64_t *item_start, int *max_seq);
/* Whether a call's decode rows take every KV head in one item (see paged_attention.c). */
int decode_items_all_heads(int num_reqs, int heads, int head_dim, int dt, int64_t half);
/* Item `local` of request r (see paged_attention.c). */
Item resolve_item(const Attn *a, int r, int64_t local);
/* Attend one work item: its queries' rows of the output. */
void attend_item(const Attn *a, const Item *it, Scratch *s);
/* The two passes over an int8 cache (kv_int8.c): scores of the item's queries, then P V; kv is
 * head_dim floats of scratch. */
void scores_int8(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv);
void pv_int8(const Attn *a, const Item *it, const float *scores, float *obuf, float *kv);
/* Per-thread scratch for contexts up to max_seq; 0, or -1 out of memory (free it either way). */
int scratch_alloc(Scratch *s, int max_seq, int head_dim);
void scratch_free(Scratch *s);
#endif /* PORTICO_PAGED_ATTENTION_H */
