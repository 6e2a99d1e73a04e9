/* Attention's two passes over the 8-bit KV cache (--kv-cache-dtype int8; row layout in common.h).
 * The cache is read at half bf16's bytes per row (plus 4 for the scale), which is what a decode
 * step at large batch is bound by. Items may span several KV heads (decode_items_all_heads):
 * queries are ordered by KV head, then row, then head.
 *
 * AVX-512 (head_dim a multiple of 32): pass 1 widens 16 positions' K rows to bf16 (exact: int8
 * values are integers below 2^8) and runs paged_attention.c's bf16 score tile on them, scaling
 * each position's 16 lanes by its row's scale after; pass 2 widens V rows to float32 in
 * registers and folds each row's scale into the softmax weight, in tiles like pv_fast's.
 * Elsewhere (AVX2, portable, float32 queries for pass 1) each row is widened once to float32
 * and serves every query sharing its KV head through dot_f32 / axpy_f32.
 */
#include "paged_attention.h"

/* Byte offset of position p's row (K half) of KV head kvh, walking the item's block table. */
static inline int64_t row_at(const Attn *a, const Item *it, int blk, int off, int kvh) {
    const int64_t slot = (int64_t)it->table[blk] * a->block_size + off;
    return (slot * a->kv_heads + kvh) * int8_row_bytes(a->head_dim);
}

static void scores_generic(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv) {
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

static void pv_generic(const Attn *a, const Item *it, const float *scores, float *obuf, float *kv) {
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

#if defined(__AVX512BF16__)
/* n (a multiple of 32) int8 values as bf16: exact, as every int8 is a float with 8 bits. */
static inline void widen_row_bf16(const int8_t *row, int n, uint16_t *dst) {
    for (int i = 0; i < n; i += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + i + 16))));
        _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Pass 1 for bf16 queries: 16 positions at a time through the bf16 score tile. */
static void scores_bf16(const Attn *a, const Item *it, float *scores) {
    const int d = a->head_dim;
    uint32_t qpairs[MAX_QUERIES * 128] __attribute__((aligned(64)));
    uint16_t wide[16 * 256] __attribute__((aligned(64)));
    for (int q = 0; q < it->nq; q++) {
        const int row = (q % it->per_kv) / a->group, head = (it->kvh + q / it->per_kv) * a->group + q % a->group;
        const int64_t t = a->query_start[it->r] + it->row0 + row;
        memcpy(qpairs + q * (d / 2), (const uint16_t *)a->query + t * a->q_stride_t + head * a->q_stride_h,
               (size_t)d * 2);
    }
    const int8_t *cache = (const int8_t *)a->cache;
    for (int p0 = 0; p0 < it->ctx_end; p0 += 16) {
        const int valid = it->ctx_end - p0 < 16 ? it->ctx_end - p0 : 16;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            const uint16_t *rows[16];
            float row_scale[16];
            for (int i = 0; i < 16; i++) {
                const int p = p0 + (i < valid ? i : valid - 1); /* past the end: repeat a valid row */
                const int8_t *row = cache + row_at(a, it, p / a->block_size, p % a->block_size, it->kvh + kvl);
                widen_row_bf16(row, d, wide + i * d);
                rows[i] = wide + i * d;
                row_scale[i] = int8_row_scale(row, d);
            }
            const int q0 = kvl * it->per_kv;
            float *out = scores + (int64_t)q0 * a->max_seq + p0;
            scores16_rows(rows, mask, d, (const __m512bh *)qpairs + (int64_t)q0 * (d / 32), it->per_kv, a->scale,
                          out, a->max_seq);
            const __m512 vs = _mm512_loadu_ps(row_scale);
            for (int q = 0; q < it->per_kv; q++)
                _mm512_mask_storeu_ps(out + (int64_t)q * a->max_seq, mask,
                                      _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, out + (int64_t)q * a->max_seq), vs));
        }
    }
}
#endif

#ifdef __AVX512F__
/* Pass 2 for queries q0..q0+NQ-1 and head dims d0..d0+16*DN-1 of KV head kvh (NQ, DN literals at
 * every call: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void pv_tile_int8(const Attn *a, const Item *it, const float *scores,
                                                               float *obuf, int kvh, int d0, int q0, const int NQ,
                                                               const int DN) {
    const int d = a->head_dim;
    const int8_t *cache = (const int8_t *)a->cache + a->half;
    __m512 o[4][4];
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < DN; z++) o[x][z] = _mm512_setzero_ps();
    for (int p = 0, blk = 0; p < it->ctx_end; blk++) {
        const int stop = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
        for (int off = 0; off < stop; off++, p++) {
            const int8_t *row = cache + row_at(a, it, blk, off, kvh);
            const float vs = int8_row_scale(row, d);
            __m512 v[4];
            for (int z = 0; z < DN; z++)
                v[z] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d0 + z * 16))));
            for (int x = 0; x < NQ; x++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)(q0 + x) * a->max_seq + p] * vs);
                for (int z = 0; z < DN; z++) o[x][z] = _mm512_fmadd_ps(w, v[z], o[x][z]);
            }
        }
    }
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < DN; z++) _mm512_storeu_ps(obuf + (int64_t)(q0 + x) * d + d0 + z * 16, o[x][z]);
}

static void pv_fast_int8(const Attn *a, const Item *it, const float *scores, float *obuf) {
    for (int kvl = 0; kvl < it->nkv; kvl++) {
        const int end = (kvl + 1) * it->per_kv, kvh = it->kvh + kvl;
        for (int d0 = 0; d0 < a->head_dim; d0 += 64) {
            const int wide = a->head_dim - d0 >= 64;
            for (int q0 = kvl * it->per_kv; q0 < end; q0 += 4) {
                const int nq = end - q0 < 4 ? end - q0 : 4;
#define PV_NQ(DN)                                                                                                     \
    switch (nq) {                                                                                                     \
    case 1: pv_tile_int8(a, it, scores, obuf, kvh, d0, q0, 1, DN); break;                                             \
    case 2: pv_tile_int8(a, it, scores, obuf, kvh, d0, q0, 2, DN); break;                                             \
    case 3: pv_tile_int8(a, it, scores, obuf, kvh, d0, q0, 3, DN); break;                                             \
    default: pv_tile_int8(a, it, scores, obuf, kvh, d0, q0, 4, DN); break;                                            \
    }
                if (wide) {
                    PV_NQ(4)
                } else {
                    PV_NQ(2)
                }
#undef PV_NQ
            }
        }
    }
}
#endif

void scores_int8(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv) {
#if defined(__AVX512BF16__)
    if (a->dt == DT_BF16 && a->head_dim % 32 == 0 && a->head_dim <= 256) {
        scores_bf16(a, it, scores);
        return;
    }
#endif
    scores_generic(a, it, qbuf, scores, kv);
}

void pv_int8(const Attn *a, const Item *it, const float *scores, float *obuf, float *kv) {
#ifdef __AVX512F__
    if (a->head_dim % 32 == 0) {
        pv_fast_int8(a, it, scores, obuf);
        return;
    }
#endif
    pv_generic(a, it, scores, obuf, kv);
}
