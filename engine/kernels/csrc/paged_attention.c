/* paged_attention: causal attention of each request's new query rows to its whole context, read
 * straight from the paged KV cache (no gather copy). One work item is (request, KV head, tile of
 * query rows); the query heads that share a KV head are served by one pass over K and V, so the
 * cache is read once per item. Called through ctypes (engine/kernels/cpu.py).
 */
#include "paged_attention.h"

/* The cache's element type and size: dt's, or float16 (int8 caches: kv_int8.c). */
static inline int cache_dt(const Attn *a) { return kv_cache_dt(a->kv_kind, a->dt); }
static inline int64_t cache_elt(const Attn *a) { return cache_dt(a) == DT_F32 ? 4 : 2; }

/* Query q of an item: its row (of the item's rows) and its head. Queries are ordered by KV head
 * of the item, then row, then the heads sharing that KV head. */
static inline int q_row(const Attn *a, const Item *it, int q) { return (q % it->per_kv) / a->group; }
static inline int q_head(const Attn *a, const Item *it, int q) {
    return (it->kvh + q / it->per_kv) * a->group + q % a->group;
}

#ifdef __AVX512F__
/* e^x for 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6 Taylor
 * polynomial (relative error below 2e-7); very negative x gives 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* v[j] = column j of the 16 x 16 block whose row i is r[i]: lane i of v[j] is r[i][j] (common.h's
 * transpose16x16 on the bits; exact, the values only move). */
static inline void transpose16(const __m512 r[16], __m512 v[16]) {
    __m512i ri[16], vi[16];
    for (int i = 0; i < 16; i++) ri[i] = _mm512_castps_si512(r[i]);
    transpose16x16(ri, vi);
    for (int j = 0; j < 16; j++) v[j] = _mm512_castsi512_ps(vi[j]);
}

/* Scores of nq float32 queries (qbuf, [nq, d]) against 16 positions whose cache rows are
 * rows[0..15] (rows past the valid ones repeat a valid row; mask stores only the valid lanes),
 * written to out[q * stride + 0..15]. The 16 positions are lanes: each 16 x 16 block of the rows
 * is read with plain loads and transposed, so v[j] holds element e0 + j of every position (what
 * a gather per element would read, at a few shuffles instead), and each score is one chain of
 * FMAs over e = 0..d-1, no horizontal sum. */
static inline __attribute__((always_inline)) void scores16(const void *const rows[16], __mmask16 mask, int head_dim,
                                                           const float *qbuf, int nq, float scale, float *out,
                                                           int64_t stride, const int F16) {
    __m512 acc[MAX_QUERIES];
    for (int q = 0; q < nq; q++) acc[q] = _mm512_setzero_ps();
    for (int e0 = 0; e0 < head_dim; e0 += 16) {
        __m512 r[16], v[16];
        for (int i = 0; i < 16; i++) /* a float16 row widened by vcvtph2ps: exact */
            r[i] = F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)rows[i] + e0)))
                       : _mm512_loadu_ps((const float *)rows[i] + e0);
        transpose16(r, v);
        for (int q = 0; q < nq; q++) {
            const float *qe = qbuf + q * head_dim + e0;
            __m512 s = acc[q];
            for (int j = 0; j < 16; j++) s = _mm512_fmadd_ps(v[j], _mm512_set1_ps(qe[j]), s);
            acc[q] = s;
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int q = 0; q < nq; q++) _mm512_mask_storeu_ps(out + q * stride, mask, _mm512_mul_ps(acc[q], sc));
}

/* Bytes to prefetch from each cache row an item reads: every head's row of the position from
 * the item of KV head 0 (the other heads' items run next and find theirs in cache), else its own. */
static inline int64_t prefetch_span(const Attn *a, const Item *it) {
    return (it->kvh == 0 ? a->kv_heads : 1) * (int64_t)a->head_dim * cache_elt(a);
}

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
}

/* Cache-row offsets (elements, K half) of the item's positions p0..p0+15; rows past the context
 * repeat the last one. Returns how many are valid. */
static inline int group_rows(const Attn *a, const Item *it, int p0, int32_t rows_at[16]) {
    const int valid = it->ctx_end - p0 < 16 ? it->ctx_end - p0 : 16;
    int blk = p0 / a->block_size, off = p0 % a->block_size; /* walk, no division */
    for (int i = 0; i < 16; i++) {
        const int64_t slot = (int64_t)it->table[blk] * a->block_size + off;
        rows_at[i] = (int32_t)((slot * a->kv_heads + it->kvh) * a->head_dim);
        if (i + 1 < valid && ++off == a->block_size) {
            off = 0;
            blk++;
        }
    }
    return valid;
}

/* Prefetch the rows (span bytes from each K row) of positions p0..p0+15 of the item, if any. */
static inline void prefetch_group(const Attn *a, const Item *it, int p0, int64_t span, int64_t elt) {
    if (p0 >= it->ctx_end) return;
    int32_t at[16];
    const int n = group_rows(a, it, p0, at);
    for (int i = 0; i < n; i++) prefetch_row((const char *)a->cache + (int64_t)at[i] * elt, span);
}

/* Pass 1, vectorized: scores of every query of the item against positions pb..pe-1 (pb a
 * multiple of 16; pe the context's end or a multiple of 16). Each score is computed alone, so
 * any split of the positions gives the same bits. */
static void scores_fast(const Attn *a, const Item *it, const float *qbuf, float *scores, int pb, int pe) {
    const int64_t elt = cache_elt(a);
    const int64_t span = prefetch_span(a, it);
    const int f16 = cache_dt(a) == DT_F16;
    uint32_t qpairs[MAX_QUERIES * 128] __attribute__((aligned(64)));
    if (a->dt == DT_BF16) {
        for (int q = 0; q < it->nq; q++) {
            const int64_t t = a->query_start[it->r] + it->row0 + q_row(a, it, q);
            memcpy(qpairs + q * (a->head_dim / 2),
                   (const uint16_t *)a->query + t * a->q_stride_t + q_head(a, it, q) * a->q_stride_h,
                   (size_t)a->head_dim * 2);
        }
    }
    /* Rows are fetched AHEAD groups of 16 positions before they are used: they are strided by
     * the other KV heads' rows, which the hardware prefetcher does not follow. The item of KV
     * head 0 fetches every head's row of a position (whole cache lines, in address order), so
     * the items of the other heads, which run next, find theirs in cache. */
    enum { AHEAD = 4 };
    for (int g = 0; g < AHEAD; g++) prefetch_group(a, it, pb + g * 16, span, elt);
    for (int p0 = pb; p0 < pe; p0 += 16) {
        int32_t rows_at[16];
        const int valid = group_rows(a, it, p0, rows_at);
        prefetch_group(a, it, p0 + AHEAD * 16, span, elt);
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int kvl = 0; kvl < it->nkv; kvl++) { /* the item's KV heads: rows in cache by now */
            const int q0 = kvl * it->per_kv, shift = kvl * a->head_dim;
#if defined(__AVX512BF16__)
            if (a->dt == DT_BF16) {
                const uint16_t *rows[16];
                for (int i = 0; i < 16; i++) rows[i] = (const uint16_t *)a->cache + rows_at[i] + shift;
                scores16_rows(rows, mask, a->head_dim, (const __m512bh *)qpairs + (int64_t)q0 * (a->head_dim / 32),
                              it->per_kv, a->scale, scores + (int64_t)q0 * a->max_seq + p0, a->max_seq);
            } else
#endif
            {
                const void *rows[16];
                for (int i = 0; i < 16; i++) rows[i] = (const char *)a->cache + (rows_at[i] + shift) * elt;
                const float *qb = qbuf + (int64_t)q0 * a->head_dim;
                float *out = scores + (int64_t)q0 * a->max_seq + p0;
                if (f16) scores16(rows, mask, a->head_dim, qb, it->per_kv, a->scale, out, a->max_seq, 1);
                else scores16(rows, mask, a->head_dim, qb, it->per_kv, a->scale, out, a->max_seq, 0);
            }
        }
    }
}

/* Prefetch the V rows of block blk of the item (its first position p), if any: every head's
 * row from the item of KV head 0, as in pass 1. */
static inline void prefetch_block(const Attn *a, const Item *it, int blk, int p) {
    if (p >= it->ctx_end) return;
    const int64_t elt = cache_elt(a);
    const int64_t span = prefetch_span(a, it);
    const int n = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
    const int64_t first = (int64_t)it->table[blk] * a->block_size;
    for (int off = 0; off < n; off++)
        prefetch_row((const char *)a->cache + (a->half + ((first + off) * a->kv_heads + it->kvh) * a->head_dim) * elt,
                     span);
}

/* Pass 2 for queries q0..q0+NQ-1 and head dims d0..d0+16*DN-1: NQ, DN and KIND (the cache's
 * element: 0 float32, 1 bf16, 2 float16) are literals at every call, so the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void pv_tile(const Attn *a, const Item *it, const float *scores,
                                                          float *obuf, int kvh, int first, int d0, int q0,
                                                          const int NQ, const int DN, const int KIND) {
    const int head_dim = a->head_dim;
    __m512 o[4][4];
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < DN; z++) o[x][z] = _mm512_setzero_ps();
    const int ahead_blocks = a->block_size >= 64 ? 1 : 64 / a->block_size;
    if (first)
        for (int b = 0; b < ahead_blocks; b++) prefetch_block(a, it, b, b * a->block_size);
    for (int p = 0, blk = 0; p < it->ctx_end; blk++) {
        const int64_t base = (int64_t)it->table[blk] * a->block_size;
        const int stop = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
        if (first) /* (as in pass 1) */
            prefetch_block(a, it, blk + ahead_blocks, p + ahead_blocks * a->block_size);
        for (int off = 0; off < stop; off++, p++) {
            const int64_t at = a->half + ((base + off) * a->kv_heads + kvh) * head_dim + d0;
            __m512 v[4];
            for (int z = 0; z < DN; z++) {
                if (KIND == 1)
                    v[z] = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a->cache + at + z * 16))),
                        16));
                else if (KIND == 2)
                    v[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a->cache + at + z * 16)));
                else
                    v[z] = _mm512_loadu_ps((const float *)a->cache + at + z * 16);
            }
            for (int x = 0; x < NQ; x++) {
                const __m512 w = _mm512_set1_ps(scores[(int64_t)(q0 + x) * a->max_seq + p]);
                for (int z = 0; z < DN; z++) o[x][z] = _mm512_fmadd_ps(w, v[z], o[x][z]);
            }
        }
    }
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < DN; z++) _mm512_storeu_ps(obuf + (int64_t)(q0 + x) * head_dim + d0 + z * 16, o[x][z]);
}

/* pv_tile's KIND for the call's cache. */
static inline int pv_kind(const Attn *a) { return a->dt == DT_BF16 ? 1 : cache_dt(a) == DT_F16 ? 2 : 0; }

/* Pass 2, vectorized: obuf = P V, block by block (no division per position), in tiles of up to
 * 4 queries x 64 head dims (head_dim is a multiple of 32, so a tile is 32 or 64 wide). */
static void pv_fast(const Attn *a, const Item *it, const float *scores, float *obuf) {
    const int kind = pv_kind(a);
    for (int kvl = 0; kvl < it->nkv; kvl++) {
        for (int d0 = 0; d0 < a->head_dim; d0 += 64) {
            const int wide = a->head_dim - d0 >= 64;
            for (int q0 = kvl * it->per_kv; q0 < (kvl + 1) * it->per_kv; q0 += 4) {
                const int nq = (kvl + 1) * it->per_kv - q0 < 4 ? (kvl + 1) * it->per_kv - q0 : 4;
                const int kvh = it->kvh + kvl, first = kvl == 0 && d0 == 0 && q0 == 0;
#define PV_NQ(DN, BF)                                                                                    \
    switch (nq) {                                                                                        \
    case 1: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 1, DN, BF); break;                          \
    case 2: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 2, DN, BF); break;                          \
    case 3: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 3, DN, BF); break;                          \
    default: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 4, DN, BF); break;                         \
    }
                if (kind == 1 && wide) {
                    PV_NQ(4, 1)
                } else if (kind == 1) {
                    PV_NQ(2, 1)
                } else if (kind == 2 && wide) {
                    PV_NQ(4, 2)
                } else if (kind == 2) {
                    PV_NQ(2, 2)
                } else if (wide) {
                    PV_NQ(4, 0)
                } else {
                    PV_NQ(2, 0)
                }
#undef PV_NQ
            }
        }
    }
}

/* Pass 2 for KV head kvl of the item and head dims d0..d0+31 only, every query of that head:
 * the same lanes, each accumulated over the positions in the same order, as pv_fast's. */
static void pv_unit(const Attn *a, const Item *it, const float *scores, float *obuf, int kvl, int d0) {
    const int kind = pv_kind(a), kvh = it->kvh + kvl;
    for (int q0 = kvl * it->per_kv; q0 < (kvl + 1) * it->per_kv; q0 += 4) {
        const int nq = (kvl + 1) * it->per_kv - q0 < 4 ? (kvl + 1) * it->per_kv - q0 : 4;
        const int first = d0 == 0 && q0 == kvl * it->per_kv;
#define PV_NQ(BF)                                                                                        \
    switch (nq) {                                                                                        \
    case 1: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 1, 2, BF); break;                           \
    case 2: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 2, 2, BF); break;                           \
    case 3: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 3, 2, BF); break;                           \
    default: pv_tile(a, it, scores, obuf, kvh, first, d0, q0, 4, 2, BF); break;                          \
    }
        if (kind == 1) {
            PV_NQ(1)
        } else if (kind == 2) {
            PV_NQ(2)
        } else {
            PV_NQ(0)
        }
#undef PV_NQ
    }
}

/* Whether the vector passes read a cache of element type dt. Pass 1 keeps its row offsets in 32
 * bits (group_rows): the K half of the cache must hold fewer than 2^31 elements. */
static inline int vector_path_serves(int dt, int head_dim, int64_t half) {
#ifndef __AVX512BF16__
    if (dt == DT_BF16) return 0; /* its bf16 scores need vdpbf16ps */
#else
    (void)dt; /* float32, bf16 and float16 caches alike */
#endif
    return (head_dim % 32) == 0 && half < ((int64_t)1 << 31);
}
static inline int use_vector_path(const Attn *a) { return vector_path_serves(cache_dt(a), a->head_dim, a->half); }
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 passes: 8 lanes along the head dims (no gathers: rows are read whole). Scores take 4
 * positions by up to 3 queries per tile, summed across lanes once per tile; P V takes up to 3
 * queries by 32 head dims, accumulators in registers. Float32, bf16 or float16 caches (KIND 0,
 * 1, 2: bf16 widened by a shift, float16 by vcvtph2ps; both exact). */
static inline __m256 kv8(const Attn *a, int64_t at, const int KIND) {
    if (KIND == 1)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)a->cache + at))), 16));
    if (KIND == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a->cache + at)));
    return _mm256_loadu_ps((const float *)a->cache + at);
}

/* kv8's KIND for the call's cache. */
static inline int kv8_kind(const Attn *a) { return a->kv_kind == KV_F16 ? 2 : a->dt == DT_BF16; }

/* Scores of queries q0..q0+NQ-1 against the 4 cache rows at rows[] (n valid; the others repeat
 * a valid one), into out[x * max_seq + 0..n-1]. */
static inline __attribute__((always_inline)) void scores_tile(const Attn *a, const int64_t rows[4], int n,
                                                              const float *qbuf, int q0, const int NQ, float *out,
                                                              const int KIND) {
    __m256 acc[3][4];
    for (int x = 0; x < NQ; x++)
        for (int r = 0; r < 4; r++) acc[x][r] = _mm256_setzero_ps();
    for (int c = 0; c < a->head_dim; c += 8) {
        __m256 qv[3];
        for (int x = 0; x < NQ; x++) qv[x] = _mm256_loadu_ps(qbuf + (int64_t)(q0 + x) * a->head_dim + c);
        for (int r = 0; r < 4; r++) {
            const __m256 k = kv8(a, rows[r] + c, KIND);
            for (int x = 0; x < NQ; x++) acc[x][r] = _mm256_fmadd_ps(k, qv[x], acc[x][r]);
        }
    }
    const __m128 sc = _mm_set1_ps(a->scale);
    for (int x = 0; x < NQ; x++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[x][0], acc[x][1]), _mm256_hadd_ps(acc[x][2], acc[x][3]));
        const __m128 four = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), sc);
        float *dst = out + (int64_t)(q0 + x) * a->max_seq;
        if (n == 4) {
            _mm_storeu_ps(dst, four);
        } else {
            float tmp[4];
            _mm_storeu_ps(tmp, four);
            for (int r = 0; r < n; r++) dst[r] = tmp[r];
        }
    }
}

/* A walk over an item's positions in order, block by block without a division per position:
 * the element offset of position p's row of KV head kvh is (slot * kv_heads + kvh) * head_dim. */
typedef struct {
    int blk, off;
} Walk;

static inline Walk walk_at(const Attn *a, int p) { return (Walk){p / a->block_size, p % a->block_size}; }
static inline int64_t walk_slot(const Attn *a, const Item *it, Walk w) {
    return (int64_t)it->table[w.blk] * a->block_size + w.off;
}
static inline void walk_next(const Attn *a, Walk *w) {
    if (++w->off == a->block_size) w->off = 0, w->blk++;
}

#ifndef ATTN_AHEAD
#define ATTN_AHEAD 8 /* positions the AVX2 passes prefetch ahead */
#endif
#ifndef PF_V
/* 1: pass 1 also fetches each position's V rows into L2 (T1) as it fetches its K rows, so that
 * P V, which walks the positions once per KV head and 32 head dims and is bound by latency,
 * finds them in cache (a decode step at 1,000 positions 0.94-0.98x the time; at 300, no
 * difference). Only timing: no value changes. */
#define PF_V 1
#endif

/* Prefetch the bytes [from, from + bytes) of a position's cache row (the item's first KV head's
 * row; its other heads' rows follow it in memory). */
static inline void prefetch_bytes(const char *from, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(from + at, _MM_HINT_T0);
}

/* Prefetch the item's K rows at the position w reaches (span bytes) into L1 and, with PF_V,
 * its V rows into L2. */
static inline void prefetch_position(const Attn *a, const Item *it, Walk w, int64_t span, int64_t elt) {
    const char *krow = (const char *)a->cache + (walk_slot(a, it, w) * a->kv_heads + it->kvh) * a->head_dim * elt;
    prefetch_bytes(krow, span);
#if PF_V
    for (int64_t at = 0; at < span; at += 64) _mm_prefetch(krow + a->half * elt + at, _MM_HINT_T1);
#endif
}

/* Pass 1: scores of every query of the item against positions pb..pe-1 (pb a multiple of 4;
 * pe the context's end or a multiple of 4): each score alone, so any split gives the same bits.
 * Positions are the outer loop: a position's rows of the item's KV heads lie side by side, so
 * the pass reads the cache forward, prefetching ATTN_AHEAD positions ahead (a block's rows are
 * contiguous, but the hardware prefetcher does not follow the block table). */
static void scores_fast(const Attn *a, const Item *it, const float *qbuf, float *scores, int pb, int pe) {
    const int kind = kv8_kind(a);
    const int64_t elt = cache_elt(a), span = (int64_t)it->nkv * a->head_dim * elt;
    Walk w = walk_at(a, pb), ahead = w;
    int pa = pb; /* the next position to prefetch */
    for (; pa < pb + ATTN_AHEAD && pa < pe; pa++, walk_next(a, &ahead)) prefetch_position(a, it, ahead, span, elt);
    for (int p0 = pb; p0 < pe; p0 += 4) {
        const int n = it->ctx_end - p0 < 4 ? it->ctx_end - p0 : 4;
        int64_t base[4];
        for (int r = 0; r < 4; r++) {
            base[r] = (walk_slot(a, it, w) * a->kv_heads + it->kvh) * a->head_dim;
            if (r + 1 < n) walk_next(a, &w);
        }
        walk_next(a, &w); /* to position p0 + 4 */
        for (const int stop = p0 + 4 + ATTN_AHEAD; pa < stop && pa < pe; pa++, walk_next(a, &ahead))
            prefetch_position(a, it, ahead, span, elt);
        float *out = scores + p0;
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            const int64_t rows[4] = {base[0] + kvl * a->head_dim, base[1] + kvl * a->head_dim,
                                     base[2] + kvl * a->head_dim, base[3] + kvl * a->head_dim};
            for (int q0 = kvl * it->per_kv; q0 < (kvl + 1) * it->per_kv; q0 += 3) {
                const int nq = (kvl + 1) * it->per_kv - q0 < 3 ? (kvl + 1) * it->per_kv - q0 : 3;
#define SC_NQ(BF)                                                                                        \
    switch (nq) {                                                                                        \
    case 1: scores_tile(a, rows, n, qbuf, q0, 1, out, BF); break;                                        \
    case 2: scores_tile(a, rows, n, qbuf, q0, 2, out, BF); break;                                        \
    default: scores_tile(a, rows, n, qbuf, q0, 3, out, BF); break;                                       \
    }
                if (kind == 2) {
                    SC_NQ(2)
                } else if (kind == 1) {
                    SC_NQ(1)
                } else {
                    SC_NQ(0)
                }
#undef SC_NQ
            }
        }
    }
}

/* Pass 2 for queries q0..q0+NQ-1 and head dims d0..d0+31 of KV head kvh. */
static inline __attribute__((always_inline)) void pv_tile(const Attn *a, const Item *it, const float *scores,
                                                          float *obuf, int kvh, int d0, int q0, const int NQ,
                                                          const int KIND) {
    __m256 o[3][4];
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < 4; z++) o[x][z] = _mm256_setzero_ps();
    /* This tile's 32 dims of each position's V row, prefetched ATTN_AHEAD positions ahead. */
    const int64_t elt = KIND ? 2 : 4;
    const char *vbase = (const char *)a->cache + (a->half + kvh * a->head_dim + d0) * elt;
    Walk ahead = walk_at(a, 0);
    int pa = 0;
    for (; pa < ATTN_AHEAD && pa < it->ctx_end; pa++, walk_next(a, &ahead))
        prefetch_bytes(vbase + walk_slot(a, it, ahead) * a->kv_heads * a->head_dim * elt, 32 * elt);
    for (int p = 0, blk = 0; p < it->ctx_end; blk++) {
        const int64_t base = (int64_t)it->table[blk] * a->block_size;
        const int stop = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
        for (int off = 0; off < stop; off++, p++) {
            if (pa < it->ctx_end) {
                prefetch_bytes(vbase + walk_slot(a, it, ahead) * a->kv_heads * a->head_dim * elt, 32 * elt);
                pa++, walk_next(a, &ahead);
            }
            const int64_t at = a->half + ((base + off) * a->kv_heads + kvh) * a->head_dim + d0;
            __m256 w[3];
            for (int x = 0; x < NQ; x++) w[x] = _mm256_broadcast_ss(scores + (int64_t)(q0 + x) * a->max_seq + p);
            for (int z = 0; z < 4; z++) {
                const __m256 v = kv8(a, at + z * 8, KIND);
                for (int x = 0; x < NQ; x++) o[x][z] = _mm256_fmadd_ps(w[x], v, o[x][z]);
            }
        }
    }
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < 4; z++) _mm256_storeu_ps(obuf + (int64_t)(q0 + x) * a->head_dim + d0 + z * 8, o[x][z]);
}

/* Pass 2 for KV head kvl of the item and head dims d0..d0+31: tiles of up to 3 queries. */
static void pv_unit(const Attn *a, const Item *it, const float *scores, float *obuf, int kvl, int d0) {
    const int kind = kv8_kind(a), kvh = it->kvh + kvl;
    for (int q0 = kvl * it->per_kv; q0 < (kvl + 1) * it->per_kv; q0 += 3) {
        const int nq = (kvl + 1) * it->per_kv - q0 < 3 ? (kvl + 1) * it->per_kv - q0 : 3;
#define PV_NQ(BF)                                                                                        \
    switch (nq) {                                                                                        \
    case 1: pv_tile(a, it, scores, obuf, kvh, d0, q0, 1, BF); break;                                     \
    case 2: pv_tile(a, it, scores, obuf, kvh, d0, q0, 2, BF); break;                                     \
    default: pv_tile(a, it, scores, obuf, kvh, d0, q0, 3, BF); break;                                    \
    }
        if (kind == 2) {
            PV_NQ(2)
        } else if (kind == 1) {
            PV_NQ(1)
        } else {
            PV_NQ(0)
        }
#undef PV_NQ
    }
}

/* Pass 2: obuf = P V, KV head by KV head, 32 head dims at a time. */
static void pv_fast(const Attn *a, const Item *it, const float *scores, float *obuf) {
    for (int kvl = 0; kvl < it->nkv; kvl++)
        for (int d0 = 0; d0 < a->head_dim; d0 += 32) pv_unit(a, it, scores, obuf, kvl, d0);
}

static inline int vector_path_serves(int dt, int head_dim, int64_t half) {
    (void)dt, (void)half; /* every cache type; 64-bit offsets: no limit on the cache's size */
    return (head_dim % 32) == 0;
}
static inline int use_vector_path(const Attn *a) { return vector_path_serves(cache_dt(a), a->head_dim, a->half); }
#else
static inline int vector_path_serves(int dt, int head_dim, int64_t half) {
    (void)dt, (void)head_dim, (void)half;
    return 0;
}
static inline int use_vector_path(const Attn *a) {
    (void)a;
    return 0;
}
#define scores_fast(a, it, qbuf, scores, pb, pe) ((void)(scores), (void)(pb), (void)(pe))
#define pv_fast(a, it, scores, obuf) ((void)0)
#define pv_unit(a, it, scores, obuf, kvl, d0) ((void)(it), (void)(scores))
#endif

/* Pass 1, portable: one cache row at a time. */
static void scores_portable(const Attn *a, const Item *it, const float *qbuf, float *scores, float *kv) {
    for (int p = 0; p < it->ctx_end; p++) {
        int64_t slot = (int64_t)it->table[p / a->block_size] * a->block_size + p % a->block_size;
        load_row(a->cache, cache_dt(a), (slot * a->kv_heads + it->kvh) * a->head_dim, a->head_dim, kv);
        for (int q = 0; q < it->nq; q++)
            scores[(int64_t)q * a->max_seq + p] = dot_f32(qbuf + (int64_t)q * a->head_dim, kv, a->head_dim) * a->scale;
    }
}

/* Pass 2, portable. */
static void pv_portable(const Attn *a, const Item *it, const float *scores, float *obuf, float *kv) {
    memset(obuf, 0, sizeof(float) * (size_t)it->nq * (size_t)a->head_dim);
    for (int p = 0; p < it->ctx_end; p++) {
        int64_t slot = (int64_t)it->table[p / a->block_size] * a->block_size + p % a->block_size;
        load_row(a->cache, cache_dt(a), a->half + (slot * a->kv_heads + it->kvh) * a->head_dim, a->head_dim, kv);
        for (int q = 0; q < it->nq; q++) {
            float w = scores[(int64_t)q * a->max_seq + p];
            if (w != 0.f) axpy_f32(obuf + (int64_t)q * a->head_dim, w, kv, a->head_dim);
        }
    }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SOFTMAX_AVX2 1
#endif

/* Softmax of one query's scores s[0..limit-1] in place; s[limit..ctx_end-1] (positions this
 * query may not see, causal) become 0. */
static void softmax_row(float *s, int limit, int ctx_end) {
    float mx = -INFINITY;
    int p = 0;
#ifdef __AVX512F__
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; p + 16 <= limit; p += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + p));
    mx = _mm512_reduce_max_ps(vmx);
#elif defined(SOFTMAX_AVX2)
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; p + 8 <= limit; p += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + p));
    mx = hmax8(vmx);
#endif
    for (; p < limit; p++) mx = s[p] > mx ? s[p] : mx;
    float sum = 0.f;
    p = 0;
#ifdef __AVX512F__
    vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (; p + 16 <= limit; p += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), vmx));
        _mm512_storeu_ps(s + p, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#elif defined(SOFTMAX_AVX2)
    vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (; p + 8 <= limit; p += 8) {
        __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
        _mm256_storeu_ps(s + p, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum8(vsum);
#endif
    for (; p < limit; p++) {
        s[p] = expf(s[p] - mx);
        sum += s[p];
    }
    const float inv = 1.f / sum;
    p = 0;
#ifdef __AVX512F__
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; p + 16 <= limit; p += 16) _mm512_storeu_ps(s + p, _mm512_mul_ps(_mm512_loadu_ps(s + p), vinv));
#elif defined(SOFTMAX_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; p + 8 <= limit; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_loadu_ps(s + p), vinv));
#endif
    for (; p < limit; p++) s[p] *= inv;
    for (p = limit; p < ctx_end; p++) s[p] = 0.f;
}

/* Copy (load) or write back (store) the item's query / output rows, query by query. */
static void load_queries(const Attn *a, const Item *it, float *qbuf) {
    for (int q = 0; q < it->nq; q++) {
        const int64_t t = a->query_start[it->r] + it->row0 + q_row(a, it, q);
        load_row(a->query, a->dt, t * a->q_stride_t + q_head(a, it, q) * a->q_stride_h, a->head_dim,
                 qbuf + (int64_t)q * a->head_dim);
    }
}

static void store_outputs(const Attn *a, const Item *it, const float *obuf) {
    for (int q = 0; q < it->nq; q++) {
        const int64_t t = a->query_start[it->r] + it->row0 + q_row(a, it, q);
        store_row(a->out, a->dt, (t * a->heads + q_head(a, it, q)) * a->head_dim, a->head_dim,
                  obuf + (int64_t)q * a->head_dim);
    }
}

/* Item `local` of request r: a decode row of a call whose decodes take every KV head at once
 * (a->decode_all_heads) is one item; otherwise the items of a request are its KV heads times its
 * tiles of rows. */
Item resolve_item(const Attn *a, int r, int64_t local) {
    Item it;
    it.r = r;
    it.q_len = a->query_start[r + 1] - a->query_start[r];
    it.seq_len = a->seq_lens[r];
    int tile;
    if (a->decode_all_heads && it.q_len == 1) {
        it.kvh = 0;
        it.nkv = a->kv_heads;
        tile = 0;
    } else {
        it.kvh = (int)(local % a->kv_heads);
        it.nkv = 1;
        tile = (int)(local / a->kv_heads);
    }
    it.row0 = tile * ROW_TILE;
    it.rows = it.q_len - it.row0 < ROW_TILE ? it.q_len - it.row0 : ROW_TILE;
    it.per_kv = it.rows * a->group;
    it.nq = it.per_kv * it.nkv;
    /* Context the last row of this tile sees; earlier rows see less (causal). */
    it.ctx_end = it.seq_len - it.q_len + it.row0 + it.rows;
    it.table = a->tables + (int64_t)r * a->max_blocks;
    return it;
}

void attend_item(const Attn *a, const Item *it, Scratch *s) {
    load_queries(a, it, s->qbuf);
    const int int8 = a->kv_kind == KV_INT8, fast = !int8 && use_vector_path(a);
    if (int8) scores_int8(a, it, s->qbuf, s->scores, s->kv);
    else if (fast) scores_fast(a, it, s->qbuf, s->scores, 0, it->ctx_end);
    else scores_portable(a, it, s->qbuf, s->scores, s->kv);
    for (int q = 0; q < it->nq; q++) {
        int limit = it->seq_len - it->q_len + it->row0 + q_row(a, it, q) + 1;
        softmax_row(s->scores + (int64_t)q * a->max_seq, limit, it->ctx_end);
    }
    if (int8) pv_int8(a, it, s->scores, s->obuf, s);
    else if (fast) pv_fast(a, it, s->scores, s->obuf);
    else pv_portable(a, it, s->scores, s->obuf, s->kv);
    store_outputs(a, it, s->obuf);
}

/* Offsets of each request's first work item into item_start[0..num_reqs]; returns the
 * positions read in all (the work), and the longest context in *max_seq. */
int64_t plan_items(const int32_t *query_start, const int32_t *seq_lens, int num_reqs, int kv_heads,
                   int decode_all_heads, int64_t *item_start, int *max_seq) {
    item_start[0] = 0;
    *max_seq = 0;
    int64_t work = 0;
    for (int r = 0; r < num_reqs; r++) {
        int q_len = query_start[r + 1] - query_start[r];
        int tiles = (q_len + ROW_TILE - 1) / ROW_TILE;
        item_start[r + 1] = item_start[r] + (decode_all_heads && q_len == 1 ? 1 : (int64_t)tiles * kv_heads);
        if (seq_lens[r] > *max_seq) *max_seq = seq_lens[r];
        work += (int64_t)tiles * kv_heads * (int64_t)seq_lens[r];
    }
    return work;
}

/* Whether a call's decode rows take every KV head in one item: one thread then reads each
 * position's K and V rows of all heads, contiguous in the cache, instead of three threads
 * reading every third row (1.3x slower at 64 decodes here).
 * Only where there are enough requests to share out, the vector path serves, and a row's
 * queries fit an item. The grouping never changes a result: each query is computed alone. */
int decode_items_all_heads(int num_reqs, int heads, int head_dim, int cache_dt, int64_t half) {
#ifdef __AVX512F__
    return num_reqs >= 4 && heads <= MAX_QUERIES && vector_path_serves(cache_dt, head_dim, half);
#else
    (void)num_reqs, (void)heads, (void)head_dim, (void)cache_dt, (void)half; /* measured on AVX-512 only */
    return 0;
#endif
}

/* A decode row's one item over every KV head (resolve_item's with decode_all_heads). */
static Item decode_item(const Attn *a, int r) {
    Item it;
    it.r = r;
    it.q_len = 1;
    it.seq_len = a->seq_lens[r];
    it.kvh = 0;
    it.nkv = a->kv_heads;
    it.row0 = 0;
    it.rows = 1;
    it.per_kv = a->group;
    it.nq = a->heads;
    it.ctx_end = it.seq_len;
    it.table = a->tables + (int64_t)r * a->max_blocks;
    return it;
}

int decode_split_serves(const Attn *a, int num_reqs) {
    if (a->kv_kind == KV_INT8 || !use_vector_path(a) || a->heads > MAX_QUERIES || a->head_dim % 32) return 0;
    for (int r = 0; r < num_reqs; r++)
        if (a->query_start[r + 1] - a->query_start[r] != 1) return 0;
    return 1;
}

void decode_split_scores(const Attn *a, int r, int pb, int pe, Scratch *s, float *scores) {
    const Item it = decode_item(a, r);
    load_queries(a, &it, s->qbuf);
    scores_fast(a, &it, s->qbuf, scores, pb, pe);
}

void decode_split_softmax(const Attn *a, int r, int q, float *scores) {
    softmax_row(scores + (int64_t)q * a->max_seq, a->seq_lens[r], a->seq_lens[r]);
}

void decode_split_pv(const Attn *a, int r, int kvh, int d0, Scratch *s, const float *scores) {
    const Item it = decode_item(a, r);
    pv_unit(a, &it, scores, s->obuf, kvh, d0);
    const int64_t t = a->query_start[r];
    for (int q = kvh * a->group; q < (kvh + 1) * a->group; q++)
        store_row(a->out, a->dt, (t * a->heads + q) * a->head_dim + d0, DECODE_SPLIT_DIMS,
                  s->obuf + (int64_t)q * a->head_dim + d0);
}

int scratch_alloc(Scratch *s, int max_seq, int head_dim) {
    s->scores = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)max_seq);
    s->qbuf = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)head_dim);
    s->obuf = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)head_dim);
    s->kv = (float *)malloc(sizeof(float) * (size_t)head_dim);
    s->vscale = (float *)malloc(sizeof(float) * (size_t)max_seq + sizeof(float));
    return s->scores && s->qbuf && s->obuf && s->kv && s->vscale ? 0 : -1;
}

void scratch_free(Scratch *s) {
    free(s->scores);
    free(s->qbuf);
    free(s->obuf);
    free(s->kv);
    free(s->vscale);
}

static int run_items(const Attn *a, const int64_t *item_start, int num_reqs, int64_t work,
                     int num_threads) {
    const int64_t total = item_start[num_reqs];
    int failed = 0;
    /* Small steps stay on one thread (waking another costs more). */
#pragma omp parallel num_threads(num_threads) if (work >= 8192)
    {
        Scratch s;
        if (scratch_alloc(&s, a->max_seq, a->head_dim)) {
#pragma omp atomic write
            failed = 1;
        }
        int r = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < total; item++) {
            if (failed) continue;
            while (item >= item_start[r + 1]) r++;
            while (item < item_start[r]) r--;
            const Item it = resolve_item(a, r, item - item_start[r]);
            attend_item(a, &it, &s);
        }
        scratch_free(&s);
    }
    return failed ? -1 : 0;
}

/*
 * query:  [T, heads, d] (dtype dt), row stride q_stride_t elements, head stride q_stride_h
 * cache:  [2, num_blocks, block_size, kv_heads, d] (dtype dt), contiguous; kv_kind (common.h)
 *         KV_INT8: int8 [2, num_blocks, block_size, kv_heads, d + 4], each row's values, then its
 *         float32 scale; KV_F16 (dt float32): float16
 * tables: [num_reqs, max_blocks] int32; query_start: [num_reqs + 1] int32; seq_lens [num_reqs]
 * out:    [T, heads, d] (dtype dt), contiguous
 * Request r's rows query_start[r]..query_start[r+1]-1 are its last positions: row j of q_len
 * sits at position seq_len - q_len + j and sees positions 0..that position.
 * Returns 0, or -1 when a shape limit is exceeded (the caller falls back to PyTorch).
 */
int paged_attention(const void *query, int64_t q_stride_t, int64_t q_stride_h, const void *cache,
                    int64_t num_blocks, int block_size, int kv_heads, int head_dim,
                    const int32_t *tables, int max_blocks, const int32_t *query_start,
                    const int32_t *seq_lens, int num_reqs, int heads, float scale, int dt,
                    int kv_kind, void *out, int num_threads) {
    const int group = heads / kv_heads;
    if (group * ROW_TILE > MAX_QUERIES || head_dim > 256) return -1;
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    if (!item_start) return -1;
    int max_seq = 0;
    const int64_t row = kv_kind == KV_INT8 ? int8_row_bytes(head_dim) : head_dim;
    const int64_t half = num_blocks * (int64_t)block_size * kv_heads * row;
    const int all_heads = decode_items_all_heads(num_reqs, heads, head_dim, kv_cache_dt(kv_kind, dt), half);
    const int64_t work = plan_items(query_start, seq_lens, num_reqs, kv_heads, all_heads, item_start, &max_seq);
    const Attn a = {
        .query = query, .q_stride_t = q_stride_t, .q_stride_h = q_stride_h, .cache = cache,
        .block_size = block_size, .kv_heads = kv_heads, .head_dim = head_dim, .heads = heads,
        .group = group, .max_blocks = max_blocks, .dt = dt, .max_seq = max_seq,
        .half = half, .decode_all_heads = all_heads, .kv_kind = kv_kind,
        .tables = tables, .query_start = query_start, .seq_lens = seq_lens, .scale = scale,
        .out = out,
    };
    const int status = run_items(&a, item_start, num_reqs, work, num_threads);
    free(item_start);
    return status;
}
