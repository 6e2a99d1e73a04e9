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

/* The K rows of positions p0..p0+15 (``at``: their offsets; past the end the last valid row
   repeats) and a prefetch of the group two ahead. Returns how many positions are valid. */
static inline int key_group(const Attn *a, const Item *it, int p0, int64_t span, int64_t at[16]) {
    const int valid = it->ctx_end - p0 < 16 ? it->ctx_end - p0 : 16;
    for (int i = 0, blk = p0 / a->block_size, off = p0 % a->block_size; i < 16; i++) {
        at[i] = row_at(a, it, blk, off, it->kvh);
        if (i + 1 < valid && ++off == a->block_size) {
            off = 0;
            blk++;
        }
    }
    const int ahead = p0 + 32;
    if (ahead < it->ctx_end) {
        const int n = it->ctx_end - ahead < 16 ? it->ctx_end - ahead : 16;
        const int blk = ahead / a->block_size, off = ahead % a->block_size;
        prefetch_rows(a, it, 0, blk, off, n, it->kvh, span);
        if (off + n > a->block_size) prefetch_rows(a, it, 0, blk + 1, 0, off + n - a->block_size, it->kvh, span);
    }
    return valid;
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
/* One int16 row (chunks x 32) dotted with one int16 query, left in 16 int32 lanes. */
static inline __m512i row_dot_i16(const int16_t *k, const int16_t *q, int chunks) {
    __m512i acc = _mm512_setzero_si512();
    for (int z = 0; z < chunks; z++) {
        const __m512i kv = _mm512_loadu_si512(k + z * 32), qv = _mm512_loadu_si512(q + z * 32);
#ifdef __AVX512VNNI__
        acc = _mm512_dpwssd_epi32(acc, kv, qv);
#else
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(kv, qv));
#endif
    }
    return acc;
}

/* sum4_chunks and sum16 (paged_attention.h) on int32 lanes: the 16 rows' dot products are summed
 * exactly and converted to float once per 16 positions, not once per row. */
static inline __m512i sum4_chunks_i32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(b01, b23), _mm512_unpackhi_epi64(b01, b23));
}

static inline __m512i sum16_i32(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
    const __m512i e01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i e23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c2, c3, _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(c2, c3, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
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
        int64_t at[16];
        const int valid = key_group(a, it, p0, span, at);
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
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
                __m512i c[4];
                for (int g = 0; g < 4; g++)
                    c[g] = sum4_chunks_i32(row_dot_i16(wide + (4 * g) * d, qq, chunks),
                                           row_dot_i16(wide + (4 * g + 1) * d, qq, chunks),
                                           row_dot_i16(wide + (4 * g + 2) * d, qq, chunks),
                                           row_dot_i16(wide + (4 * g + 3) * d, qq, chunks));
                const __m512 sc = _mm512_mul_ps(vs, _mm512_set1_ps(qscale[q]));
                const __m512 dots = _mm512_cvtepi32_ps(sum16_i32(c[0], c[1], c[2], c[3]));
                _mm512_mask_storeu_ps(scores + (int64_t)q * a->max_seq + p0, mask, _mm512_mul_ps(dots, sc));
            }
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Pass 1 with positions as lanes (VNNI, head_dim a multiple of 64). 16 positions' K rows are
 * read as 16 x 16 dwords (4 int8 values each) per 64 head dims and transposed (64 shuffles), so
 * dword j of every lane holds head dims 4j..4j+3 of that lane's position; one vpdpbusd with
 * query dword j broadcast then adds 4 products to all 16 positions' scores at once, and no
 * horizontal sum is left at the end. vpdpbusd multiplies unsigned by signed bytes: K is read
 * as k + 128 (its sign bit flipped) and each query, rounded to int16 (scale max|q| / 32639)
 * as in scores_i16, is split into two signed bytes, q = 256 hi + lo, so
 * q.k = 256 (sum (k+128) hi - 128 sum hi) + (sum (k+128) lo - 128 sum lo), exact in int32
 * (|each part| <= 255 * 128 * head_dim). */
#define Q_SPLIT_MAX 32639.f /* 127 * 257: hi and lo both fit a signed byte */

typedef struct {
    int8_t hi[MAX_QUERIES * 256], lo[MAX_QUERIES * 256];
    int32_t corr_hi[MAX_QUERIES], corr_lo[MAX_QUERIES]; /* 128 * sum of each part */
    float scale[MAX_QUERIES];
} SplitQueries;

static void queries_split(const Attn *a, const Item *it, const float *qbuf, SplitQueries *sq) {
    const int d = a->head_dim;
    for (int q = 0; q < it->nq; q++) {
        const float *x = qbuf + (int64_t)q * d;
        float amax = 0.f;
        for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float s = amax / Q_SPLIT_MAX;
        int32_t sum_hi = 0, sum_lo = 0;
        for (int i = 0; i < d; i++) {
            const int v = s > 0.f ? (int)nearbyintf(x[i] / s) : 0; /* |v| <= 32639 */
            const int lo = (int)(int8_t)(uint8_t)(v & 0xff);
            const int hi = (v - lo) / 256;
            sq->hi[q * d + i] = (int8_t)hi;
            sq->lo[q * d + i] = (int8_t)lo;
            sum_hi += hi;
            sum_lo += lo;
        }
        sq->corr_hi[q] = 128 * sum_hi;
        sq->corr_lo[q] = 128 * sum_lo;
        sq->scale[q] = s;
    }
}

static inline __m512i bcast_dword(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static void scores_lanes(const Attn *a, const Item *it, const float *qbuf, float *scores) {
    const int d = a->head_dim;
    SplitQueries sq;
    queries_split(a, it, qbuf, &sq);
    const int8_t *cache = (const int8_t *)a->cache;
    const int64_t span = it->nkv * int8_row_bytes(d);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc_hi[MAX_QUERIES], acc_lo[MAX_QUERIES];
    for (int p0 = 0; p0 < it->ctx_end; p0 += 16) {
        int64_t at[16];
        const int valid = key_group(a, it, p0, span, at);
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int kvl = 0; kvl < it->nkv; kvl++) {
            const int q0 = kvl * it->per_kv, q1 = q0 + it->per_kv;
            const int64_t shift = (int64_t)kvl * int8_row_bytes(d);
            float row_scale[16];
            for (int i = 0; i < 16; i++) row_scale[i] = int8_row_scale(cache + at[i] + shift, d);
            for (int c = 0; c < d; c += 64) {
                __m512i r[16], t[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_xor_si512(_mm512_loadu_si512(cache + at[i] + shift + c), flip);
                transpose16x16(r, t);
                for (int q = q0; q < q1; q++) {
                    const int8_t *hi = sq.hi + q * d + c, *lo = sq.lo + q * d + c;
                    __m512i h = c ? acc_hi[q] : _mm512_setzero_si512(), l = c ? acc_lo[q] : _mm512_setzero_si512();
                    for (int j = 0; j < 16; j++) {
                        h = _mm512_dpbusd_epi32(h, t[j], bcast_dword(hi + 4 * j));
                        l = _mm512_dpbusd_epi32(l, t[j], bcast_dword(lo + 4 * j));
                    }
                    acc_hi[q] = h;
                    acc_lo[q] = l;
                }
            }
            const __m512 vs = _mm512_mul_ps(_mm512_loadu_ps(row_scale), _mm512_set1_ps(a->scale));
            for (int q = q0; q < q1; q++) {
                const __m512i h = _mm512_sub_epi32(acc_hi[q], _mm512_set1_epi32(sq.corr_hi[q]));
                const __m512i l = _mm512_sub_epi32(acc_lo[q], _mm512_set1_epi32(sq.corr_lo[q]));
                const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l));
                _mm512_mask_storeu_ps(scores + (int64_t)q * a->max_seq + p0, mask,
                                      _mm512_mul_ps(dots, _mm512_mul_ps(vs, _mm512_set1_ps(sq.scale[q]))));
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Pass 2 on integers (bf16 outputs). Each query's weight of position p, w[p] = P[p] * (V row p's
 * scale), is rounded to int16 with one scale per query, and V rows are widened to int16 and
 * interleaved two positions to a 32-bit lane, so one vpdpwssd does 32 multiply-adds (two
 * positions x 16 head dims) where the float path's FMA does 16, with no int-to-float conversion
 * per value. The sums are exact in int32 while 127 * sum(w) stays below 2^31: the weight scale
 * is the larger of max(w) / 32767 and sum(w) / W16_SUM (so sum(w_int16) <= W16_SUM + n / 2).
 * Rounding a weight moves the output by at most (max w) / 65534 of a V row, far below the bf16
 * rounding of the output (2^-9). */
#define W16_SUM 16000000.f
#define W16_MAX_CTX (1 << 20) /* 127 * (W16_SUM + n / 2) < 2^31 with a wide margin */

/* vscale[p] = the scale of V row p of KV head kvh, p < ctx_end; the walk also prefetches the
 * next block's V rows (every head of the item from its first KV head: they are adjacent). */
static void v_scales(const Attn *a, const Item *it, int kvh, float *vscale) {
    const int8_t *cache = (const int8_t *)a->cache + a->half;
    const int64_t span = (kvh == it->kvh ? it->nkv : 1) * int8_row_bytes(a->head_dim);
    for (int p = 0, blk = 0; p < it->ctx_end; blk++) {
        const int stop = it->ctx_end - p < a->block_size ? it->ctx_end - p : a->block_size;
        if (p + a->block_size < it->ctx_end)
            prefetch_rows(a, it, a->half, blk + 1, 0, it->ctx_end - p - a->block_size, kvh, span);
        for (int off = 0; off < stop; off++, p++)
            vscale[p] = int8_row_scale(cache + row_at(a, it, blk, off, kvh), a->head_dim);
    }
}

/* Query q's softmax row (scores + q * max_seq) times vscale, rounded to int16 in place (int16 p
 * overwrites bytes of float p / 2 <= p, already read), plus a 0 at ctx_end (the partner of an
 * odd last position); returns the weights' scale. */
static float weights_i16(const Attn *a, const Item *it, float *scores, int q, const float *vscale) {
    float *s = scores + (int64_t)q * a->max_seq;
    const int n = it->ctx_end;
    __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
    int p = 0;
    for (; p + 16 <= n; p += 16) {
        const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(s + p), _mm512_loadu_ps(vscale + p));
        _mm512_storeu_ps(s + p, w);
        vmax = _mm512_max_ps(vmax, w);
        vsum = _mm512_add_ps(vsum, w);
    }
    float wmax = _mm512_reduce_max_ps(vmax), wsum = _mm512_reduce_add_ps(vsum);
    for (; p < n; p++) {
        s[p] *= vscale[p];
        wmax = s[p] > wmax ? s[p] : wmax;
        wsum += s[p];
    }
    const float ws = fmaxf(wmax / 32767.f, wsum / W16_SUM);
    const float inv = ws > 0.f ? 1.f / ws : 0.f;
    int16_t *w = (int16_t *)s;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (p = 0; p + 16 <= n; p += 16)
        _mm256_storeu_si256((__m256i *)(w + p),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s + p), vinv))));
    for (; p < n; p++) w[p] = (int16_t)nearbyintf(s[p] * inv);
    w[n] = 0;
    return ws;
}

/* Queries q0..q0+NQ-1 (weights w[x], scales ws[x]) times V rows of KV head kvh, head dims
 * d0..d0+32*DN-1 (NQ, DN literals at every call: accumulators in registers). Lane j of 128-bit
 * group g of the unpacked pair holds head dim 8g+j (lo) or 8g+4+j (hi) of the 32-wide chunk,
 * put back in order at the end. */
static inline __attribute__((always_inline)) void pv_tile_i16(const Attn *a, const Item *it,
                                                              const int16_t *const *w, const float *ws,
                                                              float *obuf, int kvh, int d0, int q0,
                                                              const int NQ, const int DN) {
    const int d = a->head_dim, n = it->ctx_end;
    const int8_t *cache = (const int8_t *)a->cache + a->half;
    const int64_t stride = (int64_t)a->kv_heads * int8_row_bytes(d); /* next position, same block */
    __m512i lo[4][2], hi[4][2];
    for (int x = 0; x < NQ; x++)
        for (int z = 0; z < DN; z++) lo[x][z] = hi[x][z] = _mm512_setzero_si512();
    for (int p = 0, blk = 0, off = 0; p < n; p += 2) {
        const int8_t *r0 = cache + row_at(a, it, blk, off, kvh) + d0, *r1 = r0;
        if (++off == a->block_size) {
            off = 0;
            blk++;
        }
        if (p + 1 < n) { /* else r1 repeats r0: its weight is the 0 at ctx_end */
            r1 = off ? r0 + stride : cache + row_at(a, it, blk, 0, kvh) + d0;
            if (++off == a->block_size) {
                off = 0;
                blk++;
            }
        }
        __m512i vl[2], vh[2];
        for (int z = 0; z < DN; z++) {
            const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + z * 32)));
            const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + z * 32)));
            vl[z] = _mm512_unpacklo_epi16(v0, v1);
            vh[z] = _mm512_unpackhi_epi16(v0, v1);
        }
        for (int x = 0; x < NQ; x++) {
            int32_t pair;
            memcpy(&pair, w[x] + p, sizeof pair);
            const __m512i wp = _mm512_set1_epi32(pair);
            for (int z = 0; z < DN; z++) {
#ifdef __AVX512VNNI__
                lo[x][z] = _mm512_dpwssd_epi32(lo[x][z], vl[z], wp);
                hi[x][z] = _mm512_dpwssd_epi32(hi[x][z], vh[z], wp);
#else
                lo[x][z] = _mm512_add_epi32(lo[x][z], _mm512_madd_epi16(vl[z], wp));
                hi[x][z] = _mm512_add_epi32(hi[x][z], _mm512_madd_epi16(vh[z], wp));
#endif
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int x = 0; x < NQ; x++) {
        const __m512 sc = _mm512_set1_ps(ws[x]);
        for (int z = 0; z < DN; z++) {
            const __m512 fl = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[x][z]), sc);
            const __m512 fh = _mm512_mul_ps(_mm512_cvtepi32_ps(hi[x][z]), sc);
            float *o = obuf + (int64_t)(q0 + x) * d + d0 + z * 32;
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(fl, first, fh));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(fl, second, fh));
        }
    }
}

static void pv_i16(const Attn *a, const Item *it, float *scores, float *obuf, float *vscale) {
    for (int kvl = 0; kvl < it->nkv; kvl++) {
        const int kvh = it->kvh + kvl, end = (kvl + 1) * it->per_kv;
        v_scales(a, it, kvh, vscale);
        for (int q0 = kvl * it->per_kv; q0 < end; q0 += 4) {
            const int nq = end - q0 < 4 ? end - q0 : 4;
            const int16_t *w[4];
            float ws[4];
            for (int x = 0; x < nq; x++) {
                ws[x] = weights_i16(a, it, scores, q0 + x, vscale);
                w[x] = (const int16_t *)(scores + (int64_t)(q0 + x) * a->max_seq);
            }
            for (int d0 = 0; d0 < a->head_dim; d0 += 64) {
#define PV_NQ(DN)                                                                                                     \
    switch (nq) {                                                                                                     \
    case 1: pv_tile_i16(a, it, w, ws, obuf, kvh, d0, q0, 1, DN); break;                                               \
    case 2: pv_tile_i16(a, it, w, ws, obuf, kvh, d0, q0, 2, DN); break;                                               \
    case 3: pv_tile_i16(a, it, w, ws, obuf, kvh, d0, q0, 3, DN); break;                                               \
    default: pv_tile_i16(a, it, w, ws, obuf, kvh, d0, q0, 4, DN); break;                                              \
    }
                if (a->head_dim - d0 >= 64) {
                    PV_NQ(2)
                } else {
                    PV_NQ(1)
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
#ifdef __AVX512VNNI__
    if (a->dt == DT_BF16 && a->head_dim % 64 == 0 && a->head_dim <= 256) {
        scores_lanes(a, it, qbuf, scores);
        return;
    }
#endif
    if (a->dt == DT_BF16 && a->head_dim % 32 == 0 && a->head_dim <= 256) {
        scores_i16(a, it, qbuf, scores);
        return;
    }
#endif
    scores_generic(a, it, qbuf, scores, kv);
}

void pv_int8(const Attn *a, const Item *it, float *scores, float *obuf, Scratch *s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* bf16 outputs only (float32 ones keep float32 weights), as in pass 1 */
    if (a->dt == DT_BF16 && a->head_dim % 32 == 0 && it->ctx_end < W16_MAX_CTX) {
        pv_i16(a, it, scores, obuf, s->vscale);
        return;
    }
#endif
#ifdef __AVX512F__
    if (a->head_dim % 32 == 0) {
        pv_fast_int8(a, it, scores, obuf);
        return;
    }
#endif
    pv_generic(a, it, scores, obuf, s->kv);
}
