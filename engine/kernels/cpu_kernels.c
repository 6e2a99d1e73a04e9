/* CPU kernels of the engine, called through ctypes (engine/kernels/cpu.py builds this file).
 *
 * 1. paged_attention: causal attention of each request's new query rows to its whole context,
 *    read straight from the paged KV cache (no gather copy). One work item is (request, KV head,
 *    tile of query rows); the query heads that share a KV head are served by one pass over K and
 *    V, so the cache is read once per item.
 * 2. q4_1_linear / q8_0_linear: y = x W^T with W kept in GGUF's Q4_1 / Q8_0 block formats
 *    (32 weights per block: w = d * q + m for Q4_1, w = d * q for Q8_0). A decode step with few
 *    rows is bound by the bytes of weights it streams; these read 0.75 / 1.125 bytes per weight
 *    instead of bf16's 2 and compute exactly the dequantized model's products.
 *
 * Tensors are plain arrays. dtype codes: 0 = float32, 1 = bfloat16. Accumulation is float32.
 * Built with -O3 -march=native -fopenmp; the AVX-512 paths are used when the compiler targets it
 * and portable loops otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#define _mm_prefetch(p, hint) __builtin_prefetch((p))
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* Load n values of dtype dt starting at element offset off of base into float32 dst. */
static inline void load_row(const void *base, int dt, int64_t off, int n, float *dst) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void *base, int dt, int64_t off, int n, const float *src) {
    if (dt == DT_F32) {
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

static inline float dot_f32(const float *a, const float *b, int n) {
    float s = 0.f;
#ifdef __AVX512F__
    if ((n & 15) == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float *y, float alpha, const float *x, int n) {
#ifdef __AVX512F__
    if ((n & 15) == 0) {
        __m512 a = _mm512_set1_ps(alpha);
        for (int i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
        return;
    }
#endif
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

#define ROW_TILE 4   /* query rows (positions) per work item */
#define MAX_QUERIES 32 /* ROW_TILE * heads per KV head must fit */

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

/* Scores of nq queries (qbuf, float32, [nq, d]) against 16 positions whose cache rows start at
 * element offsets rows[i] (valid lanes in mask), written to out[q * stride + 0..15]. The 16
 * positions are lanes: one gather per element of d (a pair of elements for bf16, multiplied with
 * vdpbf16ps), so no horizontal sum is needed. */
static inline void scores16(const void *cache, int dt, __m512i rows, __mmask16 mask, int head_dim,
                            const float *qbuf, const uint32_t *qpairs, int nq, float scale,
                            float *out, int64_t stride) {
    __m512 acc[MAX_QUERIES];
    for (int q = 0; q < nq; q++) acc[q] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (dt == DT_BF16) {
        const int *base = (const int *)cache; /* rows[] are in bf16 elements: halve to pairs */
        __m512i pair_rows = _mm512_srli_epi32(rows, 1);
        for (int e = 0; e < head_dim / 2; e++) {
            __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, pair_rows, base + e, 4);
            for (int q = 0; q < nq; q++)
                acc[q] = _mm512_dpbf16_ps(acc[q], (__m512bh)g,
                                          (__m512bh)_mm512_set1_epi32((int)qpairs[q * (head_dim / 2) + e]));
        }
    } else
#endif
    {
        (void)qpairs;
        const float *base = (const float *)cache;
        for (int e = 0; e < head_dim; e++) {
            __m512 g = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, rows, base + e, 4);
            for (int q = 0; q < nq; q++)
                acc[q] = _mm512_fmadd_ps(g, _mm512_set1_ps(qbuf[q * head_dim + e]), acc[q]);
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int q = 0; q < nq; q++) _mm512_mask_storeu_ps(out + q * stride, mask, _mm512_mul_ps(acc[q], sc));
}
#endif

/*
 * query:  [T, heads, d] (dtype dt), row stride q_stride_t elements, head stride q_stride_h
 * cache:  [2, num_blocks, block_size, kv_heads, d] (dtype dt), contiguous
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
                    void *out, int num_threads) {
    const int group = heads / kv_heads;
    if (group * ROW_TILE > MAX_QUERIES || head_dim > 256) return -1;
    /* Work items: (request, kv head, row tile); offsets of each request's first item. */
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    if (!item_start) return -1;
    item_start[0] = 0;
    int max_seq = 0;
    for (int r = 0; r < num_reqs; r++) {
        int q_len = query_start[r + 1] - query_start[r];
        int tiles = (q_len + ROW_TILE - 1) / ROW_TILE;
        item_start[r + 1] = item_start[r] + (int64_t)tiles * kv_heads;
        if (seq_lens[r] > max_seq) max_seq = seq_lens[r];
    }
    const int64_t total = item_start[num_reqs];
    const int64_t half = num_blocks * (int64_t)block_size * kv_heads * head_dim; /* K -> V */
    int failed = 0;
    /* Positions read in all: small steps stay on one thread (waking another costs more). */
    int64_t work = 0;
    for (int r = 0; r < num_reqs; r++) work += (item_start[r + 1] - item_start[r]) * (int64_t)seq_lens[r];

#pragma omp parallel num_threads(num_threads) if (work >= 8192)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)max_seq);
        float *qbuf = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)head_dim);
        float *obuf = (float *)malloc(sizeof(float) * (size_t)MAX_QUERIES * (size_t)head_dim);
        float *kv = (float *)malloc(sizeof(float) * (size_t)head_dim);
        if (!scores || !qbuf || !obuf || !kv) {
#pragma omp atomic write
            failed = 1;
        }
        int r = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < total; item++) {
            if (failed) continue;
            while (item >= item_start[r + 1]) r++;
            while (item < item_start[r]) r--;
            const int64_t local = item - item_start[r];
            const int kvh = (int)(local % kv_heads);
            const int tile = (int)(local / kv_heads);
            const int q_len = query_start[r + 1] - query_start[r];
            const int seq_len = seq_lens[r];
            const int row0 = tile * ROW_TILE;
            const int rows = q_len - row0 < ROW_TILE ? q_len - row0 : ROW_TILE;
            const int nq = rows * group;
            /* Context the last row of this tile sees; earlier rows see less (causal). */
            const int ctx_end = seq_len - q_len + row0 + rows;
            const int32_t *table = tables + (int64_t)r * max_blocks;
            for (int i = 0; i < rows; i++) {
                int64_t t = query_start[r] + row0 + i;
                for (int g = 0; g < group; g++) {
                    int h = kvh * group + g;
                    load_row(query, dt, t * q_stride_t + h * q_stride_h, head_dim,
                             qbuf + (int64_t)(i * group + g) * head_dim);
                }
            }
            /* Pass 1: scores of every query of the tile against positions 0..ctx_end-1. */
#ifdef __AVX512F__
            /* Gathers take 32-bit element offsets: the vector path needs the K half of the
             * cache to hold fewer than 2^31 elements. */
            const int fast = (head_dim % 32) == 0 && half < ((int64_t)1 << 31);
#else
            const int fast = 0;
#endif
            if (fast) {
#ifdef __AVX512F__
                uint32_t qpairs[MAX_QUERIES * 128];
                if (dt == DT_BF16) {
                    for (int q = 0; q < nq; q++) {
                        int i = q / group, g = q % group;
                        int64_t t = query_start[r] + row0 + i;
                        memcpy(qpairs + q * (head_dim / 2),
                               (const uint16_t *)query + t * q_stride_t + (kvh * group + g) * q_stride_h,
                               (size_t)head_dim * 2);
                    }
                }
                for (int p0 = 0; p0 < ctx_end; p0 += 16) {
                    int valid = ctx_end - p0 < 16 ? ctx_end - p0 : 16;
                    __mmask16 mask = (__mmask16)((1u << valid) - 1u);
                    int32_t rows_at[16];
                    int blk = p0 / block_size, off = p0 % block_size; /* walk, no division */
                    for (int i = 0; i < 16; i++) {
                        int64_t slot = (int64_t)table[blk] * block_size + off;
                        rows_at[i] = (int32_t)((slot * kv_heads + kvh) * head_dim);
                        if (i + 1 < valid && ++off == block_size) {
                            off = 0;
                            blk++;
                        }
                    }
                    scores16(cache, dt, _mm512_loadu_si512(rows_at), mask, head_dim, qbuf, qpairs, nq,
                             scale, scores + p0, max_seq);
                }
#endif
            } else {
                for (int p = 0; p < ctx_end; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    load_row(cache, dt, (slot * kv_heads + kvh) * head_dim, head_dim, kv);
                    for (int q = 0; q < nq; q++)
                        scores[(int64_t)q * max_seq + p] = dot_f32(qbuf + (int64_t)q * head_dim, kv, head_dim) * scale;
                }
            }
            /* Softmax per query over the positions it may see. */
            for (int q = 0; q < nq; q++) {
                int limit = seq_len - q_len + row0 + q / group + 1;
                float *s = scores + (int64_t)q * max_seq;
                float mx = -INFINITY;
                for (int p = 0; p < limit; p++) mx = s[p] > mx ? s[p] : mx;
                float sum = 0.f;
                int p = 0;
#ifdef __AVX512F__
                __m512 vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
                for (; p + 16 <= limit; p += 16) {
                    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), vmx));
                    _mm512_storeu_ps(s + p, e);
                    vsum = _mm512_add_ps(vsum, e);
                }
                sum = _mm512_reduce_add_ps(vsum);
#endif
                for (; p < limit; p++) {
                    s[p] = expf(s[p] - mx);
                    sum += s[p];
                }
                float inv = 1.f / sum;
                for (p = 0; p < limit; p++) s[p] *= inv;
                for (p = limit; p < ctx_end; p++) s[p] = 0.f;
            }
            /* Pass 2: out = P V, block by block (no division per position). */
#ifdef __AVX512F__
            if (fast) {
                for (int d0 = 0; d0 < head_dim; d0 += 64) {
                    const int dn = (head_dim - d0 < 64 ? head_dim - d0 : 64) / 16;
                    for (int q0 = 0; q0 < nq; q0 += 4) {
                        const int nqq = nq - q0 < 4 ? nq - q0 : 4;
                        __m512 o[4][4];
                        for (int a = 0; a < 4; a++)
                            for (int z = 0; z < 4; z++) o[a][z] = _mm512_setzero_ps();
                        for (int p = 0, blk = 0; p < ctx_end; blk++) {
                            const int64_t first = (int64_t)table[blk] * block_size;
                            const int stop = ctx_end - p < block_size ? ctx_end - p : block_size;
                            for (int off = 0; off < stop; off++, p++) {
                                const int64_t at = half + ((first + off) * kv_heads + kvh) * head_dim + d0;
                                __m512 v[4];
                                for (int z = 0; z < dn; z++) {
                                    if (dt == DT_BF16)
                                        v[z] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at + z * 16))), 16));
                                    else
                                        v[z] = _mm512_loadu_ps((const float *)cache + at + z * 16);
                                }
                                for (int a = 0; a < nqq; a++) {
                                    __m512 w = _mm512_set1_ps(scores[(int64_t)(q0 + a) * max_seq + p]);
                                    for (int z = 0; z < dn; z++) o[a][z] = _mm512_fmadd_ps(w, v[z], o[a][z]);
                                }
                            }
                        }
                        for (int a = 0; a < nqq; a++)
                            for (int z = 0; z < dn; z++)
                                _mm512_storeu_ps(obuf + (int64_t)(q0 + a) * head_dim + d0 + z * 16, o[a][z]);
                    }
                }
            } else
#endif
            {
                memset(obuf, 0, sizeof(float) * (size_t)nq * (size_t)head_dim);
                for (int p = 0; p < ctx_end; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    load_row(cache, dt, half + (slot * kv_heads + kvh) * head_dim, head_dim, kv);
                    for (int q = 0; q < nq; q++) {
                        float w = scores[(int64_t)q * max_seq + p];
                        if (w != 0.f) axpy_f32(obuf + (int64_t)q * head_dim, w, kv, head_dim);
                    }
                }
            }
            for (int i = 0; i < rows; i++) {
                int64_t t = query_start[r] + row0 + i;
                for (int g = 0; g < group; g++) {
                    int h = kvh * group + g;
                    store_row(out, dt, (t * heads + h) * head_dim, head_dim,
                              obuf + (int64_t)(i * group + g) * head_dim);
                }
            }
        }
        free(scores);
        free(qbuf);
        free(obuf);
        free(kv);
    }
    free(item_start);
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ quantized linear layers */

#define TILE_OUT 4 /* weight rows per tile: independent accumulators hide the FMA latency */
#define TILE_IN 4  /* x rows per tile: each unpacked weight block serves all of them */
#define PREFETCH_TILES 16
enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

/* Sum of a[i] * b[i] for any n (masked tail). */
static inline float dot_any(const float *a, const float *b, int n) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 mask = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

/* x [m, k] (dtype dt) -> float32 copy, and per-32-block sums (the Q4_1 minimum's factor). */
static float *prepare_x(const void *x, int dt, int m, int k, float **sums_out) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)m * (size_t)k);
    float *sums = (float *)malloc(sizeof(float) * (size_t)m * (size_t)(k / 32));
    if (!xf || !sums) {
        free(xf);
        free(sums);
        return NULL;
    }
    for (int i = 0; i < m; i++) {
        load_row(x, dt, (int64_t)i * k, k, xf + (int64_t)i * k);
        for (int b = 0; b < k / 32; b++) {
            float s = 0.f;
            for (int j = 0; j < 32; j++) s += xf[(int64_t)i * k + b * 32 + j];
            sums[(int64_t)i * (k / 32) + b] = s;
        }
    }
    *sums_out = sums;
    return xf;
}

typedef struct {
    int kind, k, nb, n;
    const uint8_t *qs; /* Q4_1: [n, k/2]; Q8_0: [n, k] (int8) */
    const float *d;    /* [n, nb] */
} Weights;

static inline const uint8_t *block_ptr(const Weights *w, int row, int b) {
    return w->qs + (int64_t)row * (w->kind == KIND_Q4_1 ? w->k / 2 : w->k) + (int64_t)b * (w->kind == KIND_Q4_1 ? 16 : 32);
}

/* One tile: rows o0.. of the weights (rows past n repeat the last one; their results are
 * dropped) times ri x rows from r0, into res[j][i] (float32, scales applied, minimums not). */
static inline __attribute__((always_inline)) void tile_dot(const Weights *w, int o0, const float *xf, const void *xraw, int dt,
                            int r0, int ri, float res[TILE_OUT][TILE_IN]) {
    int rows[TILE_OUT];
    for (int j = 0; j < TILE_OUT; j++) rows[j] = o0 + j < w->n ? o0 + j : w->n - 1;
    const int k = w->k;
#ifdef __AVX512F__
    __m512 acc[TILE_OUT][TILE_IN];
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < TILE_IN; i++) acc[j][i] = _mm512_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0f);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (dt == DT_BF16) {
        const uint16_t *xb = (const uint16_t *)xraw;
        static const uint16_t nibble_bf16[32] = {
            0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
            0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
            0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
            0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
        const __m512i lut = _mm512_loadu_si512(nibble_bf16);
        for (int b = 0; b < w->nb; b++) {
            __m512bh xv[TILE_IN];
            for (int i = 0; i < ri; i++)
                xv[i] = (__m512bh)_mm512_loadu_si512(xb + (int64_t)(r0 + i) * k + b * 32);
            for (int j = 0; j < TILE_OUT; j++) {
                const uint8_t *blk = block_ptr(w, rows[j], b);
                __m512bh wv;
                if (w->kind == KIND_Q4_1) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)blk);
                    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4),
                                                   _mm_and_si128(raw, low4));
                    wv = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nib), lut);
                } else {
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk)));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
                    wv = _mm512_cvtne2ps_pbh(hi, lo); /* int8 values are exact in bf16 */
                }
                __m512 scale = _mm512_set1_ps(w->d[(int64_t)rows[j] * w->nb + b]);
                for (int i = 0; i < ri; i++)
                    acc[j][i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wv, xv[i]), scale, acc[j][i]);
            }
        }
    } else
#endif
    {
        for (int b = 0; b < w->nb; b++) {
            for (int j = 0; j < TILE_OUT; j++) {
                const uint8_t *blk = block_ptr(w, rows[j], b);
                __m512 lo, hi;
                if (w->kind == KIND_Q4_1) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)blk);
                    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                } else {
                    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk)));
                    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
                }
                __m512 scale = _mm512_set1_ps(w->d[(int64_t)rows[j] * w->nb + b]);
                for (int i = 0; i < ri; i++) {
                    const float *xr = xf + (int64_t)(r0 + i) * k + b * 32;
                    __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xr));
                    t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), t);
                    acc[j][i] = _mm512_fmadd_ps(t, scale, acc[j][i]);
                }
            }
        }
    }
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < ri; i++) res[j][i] = _mm512_reduce_add_ps(acc[j][i]);
#else
    (void)xraw;
    (void)dt;
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < ri; i++) res[j][i] = 0.f;
    for (int b = 0; b < w->nb; b++) {
        for (int j = 0; j < TILE_OUT; j++) {
            const uint8_t *blk = block_ptr(w, rows[j], b);
            float wv[32];
            for (int t = 0; t < 32; t++) {
                if (w->kind == KIND_Q4_1)
                    wv[t] = (float)(t < 16 ? (blk[t] & 0x0f) : (blk[t - 16] >> 4));
                else
                    wv[t] = (float)((const int8_t *)blk)[t];
            }
            float scale = w->d[(int64_t)rows[j] * w->nb + b];
            for (int i = 0; i < ri; i++) {
                const float *xr = xf + (int64_t)(r0 + i) * k + b * 32;
                float t = 0.f;
                for (int q = 0; q < 32; q++) t += wv[q] * xr[q];
                res[j][i] += t * scale;
            }
        }
    }
#endif
}

static int block_linear(int kind, const void *x, int m, int k, const uint8_t *qs, const float *d,
                        const float *mins, const float *bias, int n, int dt, void *y,
                        int num_threads) {
    if (k % 32) return -1;
    float *sums = NULL;
    float *xf = prepare_x(x, dt, m, k, &sums);
    if (!xf) return -1;
    const Weights w = {kind, k, k / 32, n, qs, d};
    const int tiles = (n + TILE_OUT - 1) / TILE_OUT;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)n * k * m >= (1 << 17))
    for (int t = 0; t < tiles; t++) {
        const int o0 = t * TILE_OUT;
        float res[TILE_OUT][TILE_IN];
        /* Weights stream from memory once: ask for a later tile's bytes while this one runs. */
        if (t + PREFETCH_TILES < tiles) {
            const int ahead = o0 + PREFETCH_TILES * TILE_OUT;
            const int64_t row_bytes = kind == KIND_Q4_1 ? k / 2 : k;
            const char *q = (const char *)block_ptr(&w, ahead, 0);
            for (int64_t off = 0; off < TILE_OUT * row_bytes; off += 64) _mm_prefetch(q + off, _MM_HINT_T0);
            const char *dd = (const char *)(d + (int64_t)ahead * w.nb);
            for (int64_t off = 0; off < TILE_OUT * w.nb * 4; off += 64) _mm_prefetch(dd + off, _MM_HINT_T0);
            if (mins) {
                const char *mm = (const char *)(mins + (int64_t)ahead * w.nb);
                for (int64_t off = 0; off < TILE_OUT * w.nb * 4; off += 64) _mm_prefetch(mm + off, _MM_HINT_T0);
            }
        }
        for (int r0 = 0; r0 < m; r0 += TILE_IN) {
            const int ri = m - r0 < TILE_IN ? m - r0 : TILE_IN;
            /* Literal row counts let the compiler keep every accumulator in a register. */
            switch (ri) {
            case 1: tile_dot(&w, o0, xf, x, dt, r0, 1, res); break;
            case 2: tile_dot(&w, o0, xf, x, dt, r0, 2, res); break;
            case 3: tile_dot(&w, o0, xf, x, dt, r0, 3, res); break;
            default: tile_dot(&w, o0, xf, x, dt, r0, 4, res); break;
            }
            for (int j = 0; j < TILE_OUT && o0 + j < n; j++) {
                const int o = o0 + j;
                for (int i = 0; i < ri; i++) {
                    float v = res[j][i];
                    if (mins) v += dot_any(mins + (int64_t)o * w.nb, sums + (int64_t)(r0 + i) * w.nb, w.nb);
                    if (bias) v += bias[o];
                    int64_t at = (int64_t)(r0 + i) * n + o;
                    if (dt == DT_F32)
                        ((float *)y)[at] = v;
                    else
                        ((uint16_t *)y)[at] = f32_to_bf16(v);
                }
            }
        }
    }
    free(xf);
    free(sums);
    return 0;
}

/*
 * Q4_1: qs [n, k/2] uint8 (per 32-weight block 16 bytes: low nibbles are weights 0..15, high
 * nibbles 16..31), d and mn [n, k/32] float32; w = d * q + mn. y [m, n] (dtype dt) =
 * x [m, k] W^T (+ bias [n] float32 when not NULL). k must be a multiple of 32. With bf16
 * activations the products run in bf16 (exact) with float32 sums. Returns 0, or -1.
 */
int q4_1_linear(const void *x, int m, int k, const uint8_t *qs, const float *d, const float *mn,
                const float *bias, int n, int dt, void *y, int num_threads) {
    return block_linear(KIND_Q4_1, x, m, k, qs, d, mn, bias, n, dt, y, num_threads);
}

/* Q8_0: qs [n, k] int8, d [n, k/32] float32; w = d * q. Otherwise as q4_1_linear. */
int q8_0_linear(const void *x, int m, int k, const int8_t *qs, const float *d, const float *bias,
                int n, int dt, void *y, int num_threads) {
    return block_linear(KIND_Q8_0, x, m, k, (const uint8_t *)qs, d, NULL, bias, n, dt, y, num_threads);
}

/* ------------------------------------------------------------------ norms and rotary */

/*
 * x [rows, hidden] (dtype dt), updated in place to x + delta when delta is not NULL (rounded to
 * dt, as a PyTorch add in that dtype); out [rows, hidden] = weight * round(x * rsqrt(mean(x^2) +
 * eps)), the normalization in float32 and rounded to dt before the weight, as Hugging Face's
 * Llama RMSNorm does. weight [hidden] in dt.
 */
void add_rms_norm(void *x, const void *delta, const void *weight, float eps, void *out, int rows,
                  int hidden, int dt, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        float buf[8192];
        float wbuf[8192];
        int n = hidden > 8192 ? 8192 : hidden; /* callers keep hidden <= 8192 */
        load_row(x, dt, (int64_t)r * hidden, n, buf);
        if (delta) {
            float dbuf[8192];
            load_row(delta, dt, (int64_t)r * hidden, n, dbuf);
            for (int i = 0; i < n; i++) buf[i] += dbuf[i];
            store_row(x, dt, (int64_t)r * hidden, n, buf);
            if (dt == DT_BF16) load_row(x, dt, (int64_t)r * hidden, n, buf); /* the rounded sum */
        }
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += buf[i] * buf[i];
        float inv = 1.f / sqrtf(ss / (float)n + eps);
        load_row(weight, dt, 0, n, wbuf);
        for (int i = 0; i < n; i++) {
            float v = buf[i] * inv;
            if (dt == DT_BF16) v = bf16_to_f32(f32_to_bf16(v));
            buf[i] = wbuf[i] * v;
        }
        store_row(out, dt, (int64_t)r * hidden, n, buf);
    }
}

/*
 * RoPE (rotate-half layout) on the first rot_heads heads of each row of qkv [rows, row_stride]
 * (dtype dt), in place, with float32 tables cos/sin [max_pos, head_dim / 2] at positions[r];
 * then the rows' K heads (kv_heads heads starting at head q_heads) and V heads (the kv_heads
 * after them) are copied into the cache [2, num_blocks, block_size, kv_heads, head_dim] at
 * slots[r]. rot_heads = q_heads + kv_heads.
 */
void rope_write_kv(void *qkv, int rows, int64_t row_stride, int q_heads, int kv_heads,
                   int head_dim, const float *cos_t, const float *sin_t, const int64_t *positions,
                   void *cache, int64_t num_blocks, int block_size, const int64_t *slots, int dt,
                   int num_threads) {
    const int half_d = head_dim / 2;
    const int rot_heads = q_heads + kv_heads;
    const int64_t half = num_blocks * (int64_t)block_size * kv_heads * head_dim;
    const size_t esize = dt == DT_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        float a[256], b[256];
        const float *c = cos_t + positions[r] * half_d;
        const float *s = sin_t + positions[r] * half_d;
        for (int h = 0; h < rot_heads; h++) {
            int64_t base = (int64_t)r * row_stride + (int64_t)h * head_dim;
            load_row(qkv, dt, base, half_d, a);
            load_row(qkv, dt, base + half_d, half_d, b);
            float o1[256], o2[256];
            for (int i = 0; i < half_d; i++) {
                float p1 = a[i] * c[i], p2 = b[i] * s[i], p3 = b[i] * c[i], p4 = a[i] * s[i];
                o1[i] = p1 - p2;
                o2[i] = p3 + p4;
            }
            store_row(qkv, dt, base, half_d, o1);
            store_row(qkv, dt, base + half_d, half_d, o2);
        }
        if (cache) {
            const char *row = (const char *)qkv + ((int64_t)r * row_stride + (int64_t)q_heads * head_dim) * esize;
            char *k_dst = (char *)cache + (slots[r] * kv_heads * head_dim) * esize;
            char *v_dst = (char *)cache + (half + slots[r] * kv_heads * head_dim) * esize;
            memcpy(k_dst, row, (size_t)kv_heads * head_dim * esize);
            memcpy(v_dst, row + (size_t)kv_heads * head_dim * esize, (size_t)kv_heads * head_dim * esize);
        }
    }
}
