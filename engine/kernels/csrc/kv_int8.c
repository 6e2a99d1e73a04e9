/* Attention's two passes over the 8-bit KV cache (--kv-cache-dtype int8; row layout in common.h).
 * The cache is read at half bf16's bytes per row (plus 4 for the scale), which is what a decode
 * step at large batch is bound by. Items may span several KV heads (decode_items_all_heads):
 * queries are ordered by KV head, then row, then head.
 *
 * AVX-512 (head_dim a multiple of 32): pass 1 rounds the item's bf16 queries to int16 and widens 16
 * positions' K rows to int16 (one instruction per 32 values), sums the products exactly in int32
 * (VNNI's vpdpwssd, or vpmaddwd) and scales each position's lane by its row's scale after;
 * pass 2 widens V rows to float32 in registers and folds each row's scale into the softmax
 * weight, in tiles like pv_fast's. Elsewhere (AVX2, portable) each row is widened once to
 * float32 and serves every query sharing its KV head through dot_f32 / axpy_f32.
 */
#include "paged_attention.h"

/* Byte offset of position p's row (K half) of KV head kvh, walking the item's block table. */
static inline int64_t row_at(const Attn *a, const Item *it, int blk, int off, int kvh) {
    const int64_t slot = (int64_t)it->table[blk] * a->block_size + off;
    return (slot * a->kv_heads + kvh) * int8_row_bytes(a->head_dim);
}

/* Prefetch the rows (span bytes from each, from KV head kvh's) of positions p..p+n-1 of the
 * item that lie in block blk, in the half starting at byte `half`: rows are strided by the other
 * heads' rows and scattered by the block table, which the hardware prefetcher does not follow. */
static inline void prefetch_rows(const Attn *a, const Item *it, int64_t half, int blk, int off, int n, int kvh,
                                 int64_t span) {
    const char *base = (const char *)a->cache + half;
    for (int i = 0; i < n && off + i < a->block_size; i++) {
        const char *row = base + row_at(a, it, blk, off + i, kvh);
        for (int64_t at = 0; at < span; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
    }
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* One int16 row (chunks x 32) dotted with one int16 query, left in 16 int32 lanes, as floats. */
static inline __m512 row_dot_i16(const int16_t *k, const int16_t *q, int chunks) {
    __m512i acc = _mm512_setzero_si512();
    for (int z = 0; z < chunks; z++) {
        const __m512i kv = _mm512_loadu_si512(k + z * 32), qv = _mm512_loadu_si512(q + z * 32);
#ifdef __AVX512VNNI__
        acc = _mm512_dpwssd_epi32(acc, kv, qv);
#else
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(kv, qv));
#endif
    }
    return _mm512_cvtepi32_ps(acc);
}

/* The item's queries rounded to int16 (scale max|q| / 32767 each: 15 bits, finer than the bf16
 * they come from), so pass 1 multiplies integers: the int8 K rows widen to int16 in one
 * instruction per 32 values, and the products sum exactly in int32. */
static void queries_i16(const Attn *a, const Item *it, const float *qbuf, int16_t *qi, float *qscale) {
    const int d = a->head_dim;
    for (int q = 0; q < it->nq; q++) {
        const float *x = qbuf + (int64_t)q * d;
        float amax = 0.f;
        for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float s = amax / 32767.f;
        for (int i = 0; i < d; i++) qi[q * d + i] = s > 0.f ? (int16_t)nearbyintf(x[i] / s) : 0;
        qscale[q] = s;
    }
}

/* Pass 1: 16 positions at a time, each K row widened to int16 once for all its queries. */
static void scores_i16(const Attn *a, const Item *it, const float *qbuf, float *scores) {
    const int d = a->head_dim, chunks = d / 32;
    int16_t qi[MAX_QUERIES * 256] __attribute__((aligned(64)));
    int16_t wide[16 * 256] __attribute__((aligned(64)));
    float qscale[MAX_QUERIES];
    queries_i16(a, it, qbuf, qi, qscale);
    const int8_t *cache = (const int8_t *)a->cache;
    const int64_t span = it->nkv * int8_row_bytes(d); /* the item's heads' rows are adjacent */
    for (int p0 = 0; p0 < it->ctx_end; p0 += 16) {
        const int valid = it->ctx_end - p0 < 16 ? it->ctx_end - p0 : 16;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        int64_t at[16];
        for (int i = 0, blk = p0 / a->block_size, off = p0 % a->block_size; i < 16; i++) {
            at[i] = row_at(a, it, blk, off, it->kvh); /* past the end: repeat the last valid row */
            if (i + 1 < valid && ++off == a->block_size) {
                off = 0;
                blk++;
            }
        }
        const int ahead = p0 + 32; /* two groups ahead */
        if (ahead < it->ctx_end) {
            const int n = it->ctx_end - ahead < 16 ? it->ctx_end - ahead : 16;
            const int blk = ahead / a->block_size, off = ahead % a->block_size;
            prefetch_rows(a, it, 0, blk, off, n, it->kvh, span);
            if (off + n > a->block_size) prefetch_rows(a, it, 0, blk + 1, 0, off + n - a->block_size, it->kvh, span);
        }
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            float row_scale[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *row = cache + at[i] + (int64_t)kvl * int8_row_bytes(d);
                for (int z = 0; z < chunks; z++)
                    _mm512_storeu_si512(wide + i * d + z * 32,
                                        _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + z * 32))));
                row_scale[i] = int8_row_scale(row, d);
            }
            const __m512 vs = _mm512_mul_ps(_mm512_loadu_ps(row_scale), _mm512_set1_ps(a->scale));
            for (int q = kvl * it->per_kv; q < (kvl + 1) * it->per_kv; q++) {
                const int16_t *qq = qi + q * d;
                __m512 c[4];
                for (int g = 0; g < 4; g++)
                    c[g] = sum4_chunks(row_dot_i16(wide + (4 * g) * d, qq, chunks),
                                       row_dot_i16(wide + (4 * g + 1) * d, qq, chunks),
                                       row_dot_i16(wide + (4 * g + 2) * d, qq, chunks),
                                       row_dot_i16(wide + (4 * g + 3) * d, qq, chunks));
                const __m512 sc = _mm512_mul_ps(vs, _mm512_set1_ps(qscale[q]));
                _mm512_mask_storeu_ps(scores + (int64_t)q * a->max_seq + p0, mask,
                                      _mm512_mul_ps(sum16(c[0], c[1], c[2], c[3]), sc));
            }
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
    const int ahead = a->block_size >= 32 ? 1 : 32 / a->block_size; /* blocks fetched ahead */
    for (int p = 0, blk = 0; p < it->ctx_end; blk++) {
        const int stop = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
        const int next = p + ahead * a->block_size;
        if (next < it->ctx_end)
            prefetch_rows(a, it, a->half, blk + ahead, 0, it->ctx_end - next, kvh, int8_row_bytes(d));
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* bf16 queries only: their own 8-bit mantissas are coarser than the int16 rounding; float32
     * queries keep float32 products */
    if (a->dt == DT_BF16 && a->head_dim % 32 == 0 && a->head_dim <= 256) {
        scores_i16(a, it, qbuf, scores);
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
