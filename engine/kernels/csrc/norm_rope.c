/* add_rms_norm (the residual add fused with the next RMSNorm) and rope_write_kv (RoPE on the
 * query and key heads in place, and K/V into the paged cache), one call per layer each.
 */
#include "common.h"


/*
 * x [rows, hidden] (dtype dt), updated in place to x + delta when delta is not NULL (rounded to
 * dt, as a PyTorch add in that dtype); out [rows, hidden] = weight * round(x * rsqrt(mean(x^2) +
 * eps)), the normalization in float32 and rounded to dt before the weight, as Hugging Face's
 * Llama RMSNorm does. weight [hidden] in dt.
 */
static void add_rms_norm_row(void *x, const void *delta, const void *weight, float eps, void *out, int r,
                             int hidden, int dt) {
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

void add_rms_norm(void *x, const void *delta, const void *weight, float eps, void *out, int rows,
                  int hidden, int dt, int num_threads) {
    if (num_threads <= 1 || rows <= 8) { /* no parallel region (the fused steps call from inside theirs) */
        for (int r = 0; r < rows; r++) add_rms_norm_row(x, delta, weight, eps, out, r, hidden, dt);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++) add_rms_norm_row(x, delta, weight, eps, out, r, hidden, dt);
}

/*
 * RoPE (rotate-half layout) on the first rot_heads heads of each row of qkv [rows, row_stride]
 * (dtype dt), in place, with float32 tables cos/sin [max_pos, head_dim / 2] at positions[r];
 * then the rows' K heads (kv_heads heads starting at head q_heads) and V heads (the kv_heads
 * after them) are copied into the cache [2, num_blocks, block_size, kv_heads, head_dim] at
 * slots[r]. rot_heads = q_heads + kv_heads. kv_kind (common.h): KV_INT8, the cache is int8
 * [2, num_blocks, block_size, kv_heads, head_dim + 4] and each head's row is quantized into it
 * (quantize_row_int8, common.h); KV_F16, the cache is float16 and each value is rounded to it
 * (f32_to_f16: to nearest even, as torch rounds).
 */
static void rope_write_kv_row(void *qkv, int r, int64_t row_stride, int q_heads, int kv_heads, int head_dim,
                              const float *cos_t, const float *sin_t, const int64_t *positions, void *cache,
                              int64_t num_blocks, int block_size, const int64_t *slots, int dt, int kv_kind) {
    const int half_d = head_dim / 2;
    const int rot_heads = q_heads + kv_heads;
    const int64_t half = num_blocks * (int64_t)block_size * kv_heads * head_dim;
    const int64_t half_int8 = num_blocks * (int64_t)block_size * kv_heads * int8_row_bytes(head_dim);
    const size_t esize = dt == DT_F32 ? 4 : 2;
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
    if (cache && kv_kind == KV_INT8) {
        float buf[512];
        int8_t *k_dst = (int8_t *)cache + slots[r] * kv_heads * int8_row_bytes(head_dim);
        for (int h = 0; h < 2 * kv_heads; h++) { /* K heads, then V heads */
            load_row(qkv, dt, (int64_t)r * row_stride + (int64_t)(q_heads + h) * head_dim, head_dim, buf);
            const int64_t at = (h < kv_heads ? 0 : half_int8) + (h % kv_heads) * int8_row_bytes(head_dim);
            quantize_row_int8(buf, head_dim, k_dst + at);
        }
    } else if (cache && kv_kind == KV_F16) {
        float buf[512];
        for (int h = 0; h < 2 * kv_heads; h++) { /* K heads, then V heads */
            load_row(qkv, dt, (int64_t)r * row_stride + (int64_t)(q_heads + h) * head_dim, head_dim, buf);
            const int64_t at = (h < kv_heads ? 0 : half) + (slots[r] * kv_heads + h % kv_heads) * head_dim;
            store_row(cache, DT_F16, at, head_dim, buf);
        }
    } else if (cache) {
        const char *row = (const char *)qkv + ((int64_t)r * row_stride + (int64_t)q_heads * head_dim) * esize;
        char *k_dst = (char *)cache + (slots[r] * kv_heads * head_dim) * esize;
        char *v_dst = (char *)cache + (half + slots[r] * kv_heads * head_dim) * esize;
        memcpy(k_dst, row, (size_t)kv_heads * head_dim * esize);
        memcpy(v_dst, row + (size_t)kv_heads * head_dim * esize, (size_t)kv_heads * head_dim * esize);
    }
}

void rope_write_kv(void *qkv, int rows, int64_t row_stride, int q_heads, int kv_heads,
                   int head_dim, const float *cos_t, const float *sin_t, const int64_t *positions,
                   void *cache, int64_t num_blocks, int block_size, const int64_t *slots, int dt,
                   int kv_kind, int num_threads) {
    if (num_threads <= 1 || rows <= 8) { /* as add_rms_norm */
        for (int r = 0; r < rows; r++)
            rope_write_kv_row(qkv, r, row_stride, q_heads, kv_heads, head_dim, cos_t, sin_t, positions, cache,
                              num_blocks, block_size, slots, dt, kv_kind);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++)
        rope_write_kv_row(qkv, r, row_stride, q_heads, kv_heads, head_dim, cos_t, sin_t, positions, cache, num_blocks,
                          block_size, slots, dt, kv_kind);
}

#if defined(__AVX2__) && defined(__FMA__)
/* silu(g) * u = g / (1 + e^-g) * u for 8 values. */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

/* silu_mul's values i0..i1-1 of row r (i0 a multiple of 8): 8 values at a time, each lane by
 * itself, so any split of a row into such spans (the fused step's, panel_step.c) gives the
 * bits of the whole row. */
void silu_mul_span(const void *gate_up, int r, int inter, int i0, int i1, int dt, void *out) {
    float g[8], u[8], o[8];
#if defined(__AVX2__) && defined(__FMA__)
    if (dt == DT_F32) { /* whole vectors straight from the rows (the same lanes, no copies) */
        const float *gr = (const float *)gate_up + (int64_t)r * 2 * inter, *ur = gr + inter;
        float *orow = (float *)out + (int64_t)r * inter;
        for (; i0 + 8 <= i1; i0 += 8)
            _mm256_storeu_ps(orow + i0, silu_mul8(_mm256_loadu_ps(gr + i0), _mm256_loadu_ps(ur + i0)));
    }
#endif
    for (; i0 < i1; i0 += 8) {
        const int n = i1 - i0 < 8 ? i1 - i0 : 8;
        for (int i = n; i < 8; i++) g[i] = u[i] = 0.f;
        load_row(gate_up, dt, (int64_t)r * 2 * inter + i0, n, g);
        load_row(gate_up, dt, (int64_t)r * 2 * inter + inter + i0, n, u);
#if defined(__AVX2__) && defined(__FMA__)
        _mm256_storeu_ps(o, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
#else
        for (int i = 0; i < 8; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
#endif
        store_row(out, dt, (int64_t)r * inter + i0, n, o);
    }
}

/*
 * SwiGLU's activation: out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] (gate
 * first), dtype dt, float32 arithmetic. Every element goes through the same code wherever it
 * sits (a row's last partial vector is padded through a buffer), and threads split whole rows:
 * an element's value depends on nothing but its gate and up (PyTorch's silu takes a scalar path
 * for the elements at the edges of its threads' chunks, which rounds differently).
 */
void silu_mul(const void *gate_up, int rows, int inter, int dt, void *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)rows * inter >= 65536)
    for (int r = 0; r < rows; r++) silu_mul_span(gate_up, r, inter, 0, inter, dt, out);
}
