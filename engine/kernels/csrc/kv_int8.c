/* Attention's two passes over the 8-bit KV cache (--kv-cache-dtype int8; row layout in common.h).
 * Each position's K (then V) row of a KV head is widened to float32 once, its scale folded in,
 * and serves every query sharing that KV head: the cache is read at half bf16's bytes per row
 * (plus 4 for the scale), which is what a decode step at large batch is bound by. Items may span
 * several KV heads (decode_items_all_heads): queries are ordered by KV head, then row, then head.
 */
#include "paged_attention.h"

/* Byte offset of position p's row (K half) of KV head kvh, walking the item's block table. */
static inline int64_t row_at(const Attn *a, const Item *it, int blk, int off, int kvh) {
    const int64_t slot = (int64_t)it->table[blk] * a->block_size + off;
    return (slot * a->kv_heads + kvh) * int8_row_bytes(a->head_dim);
}

void scores_int8(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv) {
    const int d = a->head_dim;
    const int8_t *cache = (const int8_t *)a->cache;
    for (int p = 0, blk = 0, off = 0; p < it->ctx_end; p++) {
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            const int8_t *row = cache + row_at(a, it, blk, off, it->kvh + kvl);
            dequantize_row_int8(row, d, int8_row_scale(row, d) * a->scale, kv);
            for (int q = kvl * it->per_kv; q < (kvl + 1) * it->per_kv; q++)
                scores[(int64_t)q * a->max_seq + p] = dot_f32(qbuf + (int64_t)q * d, kv, d);
        }
        if (++off == a->block_size) {
            off = 0;
            blk++;
        }
    }
}

void pv_int8(const Attn *a, const Item *it, const float *scores, float *obuf, float *kv) {
    const int d = a->head_dim;
    const int8_t *cache = (const int8_t *)a->cache + a->half;
    memset(obuf, 0, sizeof(float) * (size_t)it->nq * (size_t)d);
    for (int p = 0, blk = 0, off = 0; p < it->ctx_end; p++) {
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            const int8_t *row = cache + row_at(a, it, blk, off, it->kvh + kvl);
            dequantize_row_int8(row, d, int8_row_scale(row, d), kv);
            for (int q = kvl * it->per_kv; q < (kvl + 1) * it->per_kv; q++) {
                const float w = scores[(int64_t)q * a->max_seq + p];
                if (w != 0.f) axpy_f32(obuf + (int64_t)q * d, w, kv, d);
            }
        }
        if (++off == a->block_size) {
            off = 0;
            blk++;
        }
    }
}
