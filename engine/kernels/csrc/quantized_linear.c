/* q4_1_linear / q8_0_linear: y = x W^T with W kept in GGUF's Q4_1 / Q8_0 block formats (32
 * weights per block: w = d * q + m for Q4_1, w = d * q for Q8_0). A decode step with few rows is
 * bound by the bytes of weights it streams; these read 0.75 / 1.125 bytes per weight instead of
 * bf16's 2 and compute exactly the dequantized model's products. With AVX512-BF16 the products of
 * bf16 activations run in vdpbf16ps (exact: the weights' small integers are exact in bf16).
 */
#include "common.h"

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
    const float *mins; /* Q4_1: [n, nb]; Q8_0: NULL */
} Weights;

static inline const uint8_t *block_ptr(const Weights *w, int row, int b) {
    return w->qs + (int64_t)row * (w->kind == KIND_Q4_1 ? w->k / 2 : w->k) + (int64_t)b * (w->kind == KIND_Q4_1 ? 16 : 32);
}

#define INLINE static inline __attribute__((always_inline))

#ifdef __AVX512F__
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The weights of one block as 32 bf16 values (nibbles through a lookup, int8 through float). */
INLINE __m512bh block_bf16(const Weights *w, const uint8_t *blk, __m512i lut, __m128i low4) {
    if (w->kind == KIND_Q4_1) {
        __m128i raw = _mm_loadu_si128((const __m128i *)blk);
        __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
        return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nib), lut);
    }
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo); /* int8 values are exact in bf16 */
}

/* Tile of bf16 activations: bf16 products (exact), float32 sums. */
INLINE void tile_bf16(const Weights *w, const int rows[TILE_OUT], const uint16_t *xb, int r0, int ri,
                      __m512 acc[TILE_OUT][TILE_IN]) {
    static const uint16_t nibble_bf16[32] = {
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i lut = _mm512_loadu_si512(nibble_bf16);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int b = 0; b < w->nb; b++) {
        __m512bh xv[TILE_IN];
        for (int i = 0; i < ri; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xb + (int64_t)(r0 + i) * w->k + b * 32);
        for (int j = 0; j < TILE_OUT; j++) {
            __m512bh wv = block_bf16(w, block_ptr(w, rows[j], b), lut, low4);
            __m512 scale = _mm512_set1_ps(w->d[(int64_t)rows[j] * w->nb + b]);
            for (int i = 0; i < ri; i++)
                acc[j][i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wv, xv[i]), scale, acc[j][i]);
        }
    }
}
#endif

/* Tile of float32 activations (or bf16 ones without AVX512-BF16, widened by prepare_x). */
INLINE void tile_f32(const Weights *w, const int rows[TILE_OUT], const float *xf, int r0, int ri,
                     __m512 acc[TILE_OUT][TILE_IN]) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
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
                const float *xr = xf + (int64_t)(r0 + i) * w->k + b * 32;
                __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xr));
                t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), t);
                acc[j][i] = _mm512_fmadd_ps(t, scale, acc[j][i]);
            }
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The float32 tile on 256-bit vectors: a block's 32 weights as four vectors of 8. */
INLINE void tile_avx2(const Weights *w, const int rows[TILE_OUT], const float *xf, int r0, int ri,
                      __m256 acc[TILE_OUT][TILE_IN]) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int b = 0; b < w->nb; b++) {
        for (int j = 0; j < TILE_OUT; j++) {
            const uint8_t *blk = block_ptr(w, rows[j], b);
            __m256 wv[4];
            if (w->kind == KIND_Q4_1) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
                const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                wv[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                wv[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                wv[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                wv[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            } else {
                for (int q = 0; q < 4; q++)
                    wv[q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * q))));
            }
            const __m256 scale = _mm256_set1_ps(w->d[(int64_t)rows[j] * w->nb + b]);
            for (int i = 0; i < ri; i++) {
                const float *xr = xf + (int64_t)(r0 + i) * w->k + b * 32;
                __m256 t = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xr));
                for (int q = 1; q < 4; q++) t = _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(xr + 8 * q), t);
                acc[j][i] = _mm256_fmadd_ps(t, scale, acc[j][i]);
            }
        }
    }
}
#else
/* Portable tile: the same sums without vector units. */
INLINE void tile_portable(const Weights *w, const int rows[TILE_OUT], const float *xf, int r0, int ri,
                          float res[TILE_OUT][TILE_IN]) {
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
                const float *xr = xf + (int64_t)(r0 + i) * w->k + b * 32;
                float t = 0.f;
                for (int q = 0; q < 32; q++) t += wv[q] * xr[q];
                res[j][i] += t * scale;
            }
        }
    }
}
#endif

/* One tile: rows o0.. of the weights (rows past n repeat the last one; their results are
 * dropped) times ri x rows from r0, into res[j][i] (float32, scales applied, minimums not). */
INLINE void tile_dot(const Weights *w, int o0, const float *xf, const void *xraw, int dt, int r0, int ri,
                     float res[TILE_OUT][TILE_IN]) {
    int rows[TILE_OUT];
    for (int j = 0; j < TILE_OUT; j++) rows[j] = o0 + j < w->n ? o0 + j : w->n - 1;
#ifdef __AVX512F__
    __m512 acc[TILE_OUT][TILE_IN];
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < TILE_IN; i++) acc[j][i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (dt == DT_BF16) tile_bf16(w, rows, (const uint16_t *)xraw, r0, ri, acc);
    else
#endif
        tile_f32(w, rows, xf, r0, ri, acc);
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < ri; i++) res[j][i] = _mm512_reduce_add_ps(acc[j][i]);
#elif defined(__AVX2__) && defined(__FMA__)
    (void)xraw;
    (void)dt;
    __m256 acc[TILE_OUT][TILE_IN];
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < TILE_IN; i++) acc[j][i] = _mm256_setzero_ps();
    tile_avx2(w, rows, xf, r0, ri, acc);
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < ri; i++) res[j][i] = hsum8(acc[j][i]);
#else
    (void)xraw;
    (void)dt;
    tile_portable(w, rows, xf, r0, ri, res);
#endif
}

/* Ask for a later tile's weight bytes while this one runs: they stream from memory once. */
static inline void prefetch_tile(const Weights *w, int ahead) {
    const int64_t row_bytes = w->kind == KIND_Q4_1 ? w->k / 2 : w->k;
    const char *q = (const char *)block_ptr(w, ahead, 0);
    for (int64_t off = 0; off < TILE_OUT * row_bytes; off += 64) _mm_prefetch(q + off, _MM_HINT_T0);
    const char *dd = (const char *)(w->d + (int64_t)ahead * w->nb);
    for (int64_t off = 0; off < TILE_OUT * w->nb * 4; off += 64) _mm_prefetch(dd + off, _MM_HINT_T0);
    if (w->mins) {
        const char *mm = (const char *)(w->mins + (int64_t)ahead * w->nb);
        for (int64_t off = 0; off < TILE_OUT * w->nb * 4; off += 64) _mm_prefetch(mm + off, _MM_HINT_T0);
    }
}

/* Add the minimums' term and the bias to a tile's sums and store them in y [m, n]. */
static inline void store_tile(const Weights *w, int o0, int r0, int ri, const float res[TILE_OUT][TILE_IN],
                              const float *sums, const float *bias, int dt, void *y) {
    for (int j = 0; j < TILE_OUT && o0 + j < w->n; j++) {
        const int o = o0 + j;
        for (int i = 0; i < ri; i++) {
            float v = res[j][i];
            if (w->mins) v += dot_any(w->mins + (int64_t)o * w->nb, sums + (int64_t)(r0 + i) * w->nb, w->nb);
            if (bias) v += bias[o];
            int64_t at = (int64_t)(r0 + i) * w->n + o;
            if (dt == DT_F32)
                ((float *)y)[at] = v;
            else
                ((uint16_t *)y)[at] = f32_to_bf16(v);
        }
    }
}

static int block_linear(int kind, const void *x, int m, int k, const uint8_t *qs, const float *d,
                        const float *mins, const float *bias, int n, int dt, void *y,
                        int num_threads) {
    if (k % 32) return -1;
    float *sums = NULL;
    float *xf = prepare_x(x, dt, m, k, &sums);
    if (!xf) return -1;
    const Weights w = {kind, k, k / 32, n, qs, d, mins};
    const int tiles = (n + TILE_OUT - 1) / TILE_OUT;
    /* Dynamic chunks of 8 tiles: on cores shared with other work a descheduled thread's
     * static half no longer holds the whole call up; each output is still computed by one
     * thread, so results do not depend on the schedule. */
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads) if ((int64_t)n * k * m >= (1 << 17))
    for (int t = 0; t < tiles; t++) {
        const int o0 = t * TILE_OUT;
        float res[TILE_OUT][TILE_IN];
        if (t + PREFETCH_TILES < tiles) prefetch_tile(&w, o0 + PREFETCH_TILES * TILE_OUT);
        for (int r0 = 0; r0 < m; r0 += TILE_IN) {
            const int ri = m - r0 < TILE_IN ? m - r0 : TILE_IN;
            /* Literal row counts let the compiler keep every accumulator in a register. */
            switch (ri) {
            case 1: tile_dot(&w, o0, xf, x, dt, r0, 1, res); break;
            case 2: tile_dot(&w, o0, xf, x, dt, r0, 2, res); break;
            case 3: tile_dot(&w, o0, xf, x, dt, r0, 3, res); break;
            default: tile_dot(&w, o0, xf, x, dt, r0, 4, res); break;
            }
            store_tile(&w, o0, r0, ri, res, sums, bias, dt, y);
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
