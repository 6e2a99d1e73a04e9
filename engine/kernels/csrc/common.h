/* Shared by the engine's native CPU kernels (engine/kernels/csrc/ .c files, built together by
 * engine/kernels/cpu.py into one library): dtype codes, bf16 rounding as torch does it, and the
 * row loads, stores and dot products every kernel uses.
 *
 * Tensors are plain arrays. dtype codes: 0 = float32, 1 = bfloat16, 2 = float16 (KV caches only:
 * --kv-cache-dtype float16). Accumulation is float32.
 * Built with -O3 -march=native -fopenmp: the AVX-512 paths are compiled in when the build CPU
 * has them (cpu.py checks the running CPU reports every feature the library was built with),
 * AVX2 ones on CPUs with AVX2 and FMA but not AVX-512, and portable loops otherwise.
 */
#ifndef PORTICO_COMMON_H
#define PORTICO_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#define _mm_prefetch(p, hint) __builtin_prefetch((p))
#define _mm_pause() ((void)0)
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* What a KV cache holds, as the kernels' kv_kind arguments say: the step's dtype, int8 rows with
 * their scales (kv_int8.c), or IEEE float16 (--kv-cache-dtype float16 under float32). */
enum { KV_SAME = 0, KV_INT8 = 1, KV_F16 = 2 };

/* The element type of a cache of kv_kind (not KV_INT8) in a step of dtype dt. */
static inline int kv_cache_dt(int kv_kind, int dt) { return kv_kind == KV_F16 ? DT_F16 : dt; }

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

/* IEEE float16 to float32: exact (every float16 is a float32). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    float f;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13); /* inf, NaN */
    } else if (e) {
        u = sign | ((e + 112) << 23) | (m << 13); /* normal */
    } else {
        f = (float)m * 0x1p-24f; /* subnormal: exact */
        return sign ? -f : f;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* float32 to IEEE float16, rounded to nearest even as torch's .to(torch.float16) does: beyond the
 * largest finite (65504) by half a step or more, inf; below 2^-14, a subnormal; NaN stays NaN. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to inf */
    if (ax < 0x38800000u) {                                  /* a subnormal (or zero) float16 */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint16_t)rintf(a * 0x1p24f)); /* exact scaling, then RNE */
    }
    uint32_t r = ax - 0x38000000u; /* rebias the exponent, then round 13 bits off, to even */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (uint16_t)(r >> 13));
}

/* Load n values of dtype dt starting at element offset off of base into float32 dst. */
static inline void load_row(const void *base, int dt, int64_t off, int n, float *dst) {
    if (dt == DT_F32) {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    } else if (dt == DT_F16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]);
    } else {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void *base, int dt, int64_t off, int n, const float *src) {
    if (dt == DT_F32) {
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    } else if (dt == DT_F16) {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
    } else {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

#ifdef __AVX__
/* Sum and maximum of 8 float lanes (the AVX2 paths' horizontal reductions, in one fixed order). */
static inline float hsum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* e^x for 8 floats, x clamped to [-87, 88] so 2^n fits the exponent bits (e^-87 is 1.6e-38: next
 * to a softmax row's largest term, 1, it is 0 in any float sum): 2^n * p(r), r = x - n ln2 in two
 * steps, p the degree-6 Taylor polynomial (relative error below 2e-7). A NaN lane comes out as
 * e^-87. The one AVX2 exp: silu_mul (norm_rope.c) and the softmax (paged_attention.c) share it,
 * so both keep the same bits whatever file calls it. */
static inline __m256 exp8_clamped(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

static inline float dot_f32(const float *a, const float *b, int n) {
    float s = 0.f;
#ifdef __AVX512F__
    if ((n & 15) == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if ((n & 7) == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum8(acc);
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
#elif defined(__AVX2__) && defined(__FMA__)
    if ((n & 7) == 0) {
        const __m256 a = _mm256_set1_ps(alpha);
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

/* The 8-bit KV cache (--kv-cache-dtype int8): each (token, KV head) row is head_dim int8 values
 * followed by its float32 scale (4 bytes, unaligned-safe through memcpy), value = q * scale,
 * scale = max|x| / 127. The scale travels inside the row, so every copy of a block (swap, a
 * tensor-parallel shard, a shared prefix) carries its scales with it. */
static inline int64_t int8_row_bytes(int head_dim) { return (int64_t)head_dim + 4; }

/* Quantize n float32 values into dst (n int8 values, then the scale). Rounds x / scale to the
 * nearest, ties to even, as torch.round does: the reference writes the same bytes. */
static inline void quantize_row_int8(const float *x, int n, int8_t *dst) {
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / 127.f;
    for (int i = 0; i < n; i++) {
        float q = scale > 0.f ? nearbyintf(x[i] / scale) : 0.f;
        q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
        dst[i] = (int8_t)q;
    }
    memcpy(dst + n, &scale, sizeof(float));
}

static inline float int8_row_scale(const int8_t *row, int n) {
    float scale;
    memcpy(&scale, row + n, sizeof(float));
    return scale;
}

/* dst[i] = row[i] * mul for n int8 values (the row's scale, times whatever the caller folds in). */
static inline void dequantize_row_int8(const int8_t *row, int n, float mul, float *dst) {
#ifdef __AVX512F__
    if ((n & 15) == 0) {
        const __m512 m = _mm512_set1_ps(mul);
        for (int i = 0; i < n; i += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(row + i));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), m));
        }
        return;
    }
#elif defined(__AVX2__)
    if ((n & 7) == 0) {
        const __m256 m = _mm256_set1_ps(mul);
        for (int i = 0; i < n; i += 8) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(row + i));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), m));
        }
        return;
    }
#endif
    for (int i = 0; i < n; i++) dst[i] = (float)row[i] * mul;
}

#ifdef __AVX512F__
/* r[0..15]: 16 rows of 16 dwords; t[j]: dword j of each row, lane i from row i. Four rounds of
 * lane moves (pairs, quads, 128-bit chunks twice): the float32 attention scores (paged_attention.c)
 * and the int8 cache's dot products (kv_int8.c) read positions' rows through it. */
static inline void transpose16x16(const __m512i r[16], __m512i t[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) { /* b[4m + c], 128-bit lane L: rows 4m..4m+3, dword 4L + c */
        b[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
        b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
        b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i v2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i v3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        t[c] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0));
        t[8 + c] = _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1));
        t[4 + c] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + c] = _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

#endif /* PORTICO_COMMON_H */
