/* q4_1_linear_q8 / q8_0_linear_q8: the GGUF block linears with the activations quantized to
 * int8 per block of 32 values, as llama.cpp does (its Q8_1 / Q8_0 activations). The products run
 * in AVX512-VNNI's vpdpbusd (unsigned 8-bit x signed 8-bit, 64 multiply-adds per instruction)
 * with int32 sums per block, then one float multiply-add per pair of blocks with both scales:
 * about half the instructions of the exact bf16 path (quantized_linear.c), which is bound by
 * unpacking and converting the weights, not by memory.
 *
 * Not exact: each activation block is rounded to 8 bits (relative error up to 1/254 of the
 * block's largest value). The engine uses this path only where asked (docs/engine-benchmark.md
 * gives the measured effect on outputs); float32 models never do.
 *
 * Q4_1's nibbles are unsigned (0..15), so they meet the signed activations directly. Q8_0's
 * weights are signed, so they are offset by 128 (w ^ 0x80) and 128 * sum(x) of each block is
 * taken back out with the block's scale.
 *
 * On CPUs with AVX2 but no AVX-512 the same records and activations go through vpmaddubsw and
 * vpmaddwd on 256-bit vectors instead (Q8_ISA 256, below).
 */
#include "quantized_int8.h"

#define TILE_OUT 4 /* weight rows per tile */
#define TILE_IN 4  /* activation rows per tile */
#ifndef Q8_AHEAD
#define Q8_AHEAD 8 /* records fetched ahead of use */
#endif
#ifndef Q8_AHEAD2
#define Q8_AHEAD2 64 /* ... and into L2, further ahead */
#endif

/* Two builds of the same kernel, on what the building CPU has: AVX512-VNNI's vpdpbusd on 512-bit
 * vectors, or AVX2's vpmaddubsw + vpmaddwd on 256-bit ones (FMA and F16C for the float work).
 * Both read the same packed records and the same quantized activations. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define Q8_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_ISA 256
#else
#define Q8_ISA 0
#endif
#define HAVE_Q8 (Q8_ISA != 0)

int q8_supported(int k) { return HAVE_Q8 && k > 0 && k % 64 == 0; }

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t q8_rows_bytes(int m, int k) {
    const size_t nb = (size_t)k / 32;
    return align64((size_t)m * k) + 2 * align64((size_t)m * nb / 2 * 16 * sizeof(float));
}

void q8_rows_init(Q8Rows *rows, int kind, int m, int k, void *scratch) {
    const size_t nb = (size_t)k / 32;
    char *p = (char *)scratch;
    rows->kind = kind;
    rows->m = m;
    rows->k = k;
    rows->nb = (int)nb;
    rows->q = (int8_t *)p;
    p += align64((size_t)m * k);
    rows->dpat = (float *)p;
    p += align64((size_t)m * nb / 2 * 16 * sizeof(float));
    rows->xspat = (float *)p;
}

/* Where value j (0..31) of block b lands in a row: Q8_0 keeps the natural order; Q4_1 puts each
 * pair of blocks A, B as [A 0-15, B 0-15, A 16-31, B 16-31], the order its unpacked nibbles
 * take in a 512-bit register. */
static inline int q8_slot(int kind, int b, int j) {
    if (kind == Q8_KIND_Q8_0) return b * 32 + j;
    return (b / 2) * 64 + (j < 16 ? 0 : 32) + (b % 2) * 16 + (j & 15);
}

/* Block b of row r: its 32 values quantized into q (slots of `kind`), its scale and per-block
 * term on its lanes of dpat / xspat. */
static inline void put_block(Q8Rows *rows, int r, int b, float d, int sum) {
    /* Lanes of a pair's int32 products: Q4_1 [A x4, B x4] for each of two weight rows side by
     * side, Q8_0 [A x8, B x8] for one row. The per-block term (Q4_1: + min * d sum(q); Q8_0:
     * - 128 * scale * d sum(q), the weights' offset taken back out) is spread over a row's
     * lanes of the block: / 4 and / 8 are exact. */
    const int64_t at = ((int64_t)r * (rows->nb / 2) + b / 2) * 16;
    const float term = rows->kind == Q8_KIND_Q4_1 ? d * (float)sum / 4.f : -128.f * d * (float)sum / 8.f;
    for (int lane = 0; lane < 16; lane++) {
        const int block_of_lane = rows->kind == Q8_KIND_Q4_1 ? (lane / 4) % 2 : lane / 8;
        if (block_of_lane != b % 2) continue;
        rows->dpat[at + lane] = d;
        rows->xspat[at + lane] = term;
    }
}

#if Q8_ISA == 512
static inline __m512 load16_f32(const void *x, int dt, int64_t off) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)x + off);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off))), 16));
}
#elif Q8_ISA == 256
static inline __m256 load8_f32(const void *x, int dt, int64_t off) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)x + off);
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + off))), 16));
}

/* 16 int32 values in -127..127 (a then b) as 16 int8, in order. */
static inline __m128i pack16_i8(__m256i a, __m256i b) {
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* [a0-7 | b0-7] as int16 */
    return _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}
#endif

void quantize_blocks_q8(Q8Rows *rows, const void *x, int dt, int r_begin, int r_end, int b_begin, int b_end) {
    const int k = rows->k;
    for (int r = r_begin; r < r_end; r++) {
        for (int b = b_begin; b < b_end; b++) {
            int8_t *q = rows->q + (int64_t)r * k;
#if Q8_ISA == 512
            /* The scalar loop's arithmetic, 16 lanes at a time: the same max, the same product
             * and cvtps's round-to-nearest-even (MXCSR's default, as nearbyintf). */
            const __m512 v0 = load16_f32(x, dt, (int64_t)r * k + b * 32), v1 = load16_f32(x, dt, (int64_t)r * k + b * 32 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.f;
            const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
            const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
            const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), hi), lo);
            const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)), hi), lo);
            _mm_storeu_si128((__m128i *)(q + q8_slot(rows->kind, b, 0)), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + q8_slot(rows->kind, b, 16)), _mm512_cvtepi32_epi8(q1));
            put_block(rows, r, b, d, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
#elif Q8_ISA == 256
            /* The same, 8 lanes at a time. */
            const int64_t at = (int64_t)r * k + b * 32;
            const __m256 sign = _mm256_set1_ps(-0.f);
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = load8_f32(x, dt, at + 8 * i);
            const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            const float amax = hmax8(m8);
            const float d = amax / 127.f;
            const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
            const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
            __m256i qv[4];
            for (int i = 0; i < 4; i++)
                qv[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), hi), lo);
            _mm_storeu_si128((__m128i *)(q + q8_slot(rows->kind, b, 0)), pack16_i8(qv[0], qv[1]));
            _mm_storeu_si128((__m128i *)(q + q8_slot(rows->kind, b, 16)), pack16_i8(qv[2], qv[3]));
            const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qv[0], qv[1]), _mm256_add_epi32(qv[2], qv[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            put_block(rows, r, b, d, _mm_cvtsi128_si32(s4));
#else
            float v[32];
            load_row(x, dt, (int64_t)r * k + b * 32, 32, v);
            float amax = 0.f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
            const float d = amax / 127.f;
            const float id = d != 0.f ? 1.f / d : 0.f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int qj = (int)nearbyintf(v[j] * id); /* ties to even, as torch.round */
                qj = qj > 127 ? 127 : (qj < -127 ? -127 : qj);
                q[q8_slot(rows->kind, b, j)] = (int8_t)qj;
                sum += qj;
            }
            put_block(rows, r, b, d, sum);
#endif
        }
    }
}

void quantize_rows_q8(Q8Rows *rows, const void *x, int dt) { quantize_blocks_q8(rows, x, dt, 0, rows->m, 0, rows->nb); }

/* Packed weights: for each tile of 4 output rows and each pair of blocks, one record holding
 * the 4 rows' quants of the pair, then their 2 scales each, then (Q4_1) their 2 minimums each,
 * the scales in float16 as GGUF stores them: Q4_1 4 x 32 + 4 x 4 + 4 x 4 = 160 bytes, Q8_0
 * 4 x 64 + 4 x 4 = 272 bytes per 256 weights, the same bytes per weight as the GGUF file (the
 * kernel is bound by reading them). A thread's work is then one forward stream of memory, which
 * the hardware prefetcher follows (the GGUF layout is 12 interleaved streams for 4 rows, and
 * stalled on their loads). Rows past n repeat the last row; their results are never stored. */
static int record_bytes(int kind) { return kind == Q8_KIND_Q4_1 ? 160 : 272; }
static int quant_bytes(int kind) { return kind == Q8_KIND_Q4_1 ? 32 : 64; }

size_t q8_packed_bytes(int kind, int n, int k) {
    const size_t tiles = (size_t)(n + TILE_OUT - 1) / TILE_OUT;
    return tiles * (size_t)(k / 64) * (size_t)record_bytes(kind);
}

/* f as float16 bits in *h, if float16 holds it exactly (1), else 0. */
static int half_exact(float f, uint16_t *h) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t exp = (u >> 23) & 0xff, man = u & 0x7fffff;
    const int e = (int)exp - 127;
    if (exp == 0 && man == 0) {
        *h = sign;
        return 1;
    }
    if (exp == 0 || exp == 0xff || e > 15 || e < -24) return 0;
    if (e >= -14) { /* normal */
        if (man & 0x1fff) return 0;
        *h = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | man >> 13);
        return 1;
    }
    const uint32_t full = man | 0x800000, shift = (uint32_t)(-(e + 1)); /* subnormal: full * 2^(e+1) */
    if (full & ((1u << shift) - 1)) return 0;
    *h = (uint16_t)(sign | full >> shift);
    return 1;
}

int q8_pack(int kind, int n, int k, const uint8_t *qs, const float *d, const float *mins, uint8_t *out) {
    if (k % 64) return -2;
    const int nb = k / 32, pairs = k / 64, qb = quant_bytes(kind);
    const int64_t row_bytes = kind == Q8_KIND_Q4_1 ? k / 2 : k;
    const int tiles = (n + TILE_OUT - 1) / TILE_OUT;
    for (int t = 0; t < tiles; t++) {
        for (int p = 0; p < pairs; p++) {
            uint8_t *rec = out + ((int64_t)t * pairs + p) * record_bytes(kind);
            uint16_t *scales = (uint16_t *)(rec + TILE_OUT * qb);
            for (int j = 0; j < TILE_OUT; j++) {
                const int row = t * TILE_OUT + j < n ? t * TILE_OUT + j : n - 1;
                memcpy(rec + j * qb, qs + row * row_bytes + (int64_t)p * qb, (size_t)qb);
                for (int i = 0; i < 2; i++) {
                    if (!half_exact(d[(int64_t)row * nb + 2 * p + i], scales + j * 2 + i)) return -3;
                    if (kind == Q8_KIND_Q4_1 && !half_exact(mins[(int64_t)row * nb + 2 * p + i], scales + TILE_OUT * 2 + j * 2 + i))
                        return -3;
                }
            }
        }
    }
    return 0;
}

#if Q8_ISA == 512
/* The Q8_0 tile (records from rec on): 4 weight rows, one per vector, times activation rows
 * r0..r0+ri-1, with the scales and the per-block term applied; lanes [A x8, B x8]. ri is a
 * literal at every call, so each specialization keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void q80_tile(const Q8Weights *w, const uint8_t *rec, const Q8Rows *x,
                                                           int r0, const int ri, __m512 acc[TILE_OUT][TILE_IN]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i pat = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int pairs = w->nb / 2, rb = record_bytes(Q8_KIND_Q8_0);
    for (int p = 0; p < pairs; p++, rec += rb) {
        for (int off = 0; off < rb; off += 64) {
            _mm_prefetch((const char *)rec + Q8_AHEAD * rb + off, _MM_HINT_T0);
            if (Q8_AHEAD2) _mm_prefetch((const char *)rec + Q8_AHEAD2 * rb + off, _MM_HINT_T1);
        }
        __m512 dx[TILE_IN], term[TILE_IN];
        __m512i xv[TILE_IN];
        for (int i = 0; i < ri; i++) {
            const int64_t at = ((int64_t)(r0 + i) * pairs + p) * 16;
            xv[i] = _mm512_loadu_si512(x->q + (int64_t)(r0 + i) * w->k + p * 64);
            dx[i] = _mm512_loadu_ps(x->dpat + at);
            term[i] = _mm512_loadu_ps(x->xspat + at);
        }
        /* The 4 rows' 8 scales, float16 to float32 once per record; each row's pair then goes
         * to the lanes of its blocks' products by one permute. */
        const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + TILE_OUT * 64))));
        for (int j = 0; j < TILE_OUT; j++) {
            const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(rec + j * 64), flip);
            /* the scales twice: the products' factor and the offset's */
            const __m512 dw = _mm512_permutexvar_ps(_mm512_add_epi32(pat, _mm512_set1_epi32(2 * j)), d8);
            for (int i = 0; i < ri; i++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[i]);
                acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[i]), acc[j][i]);
                acc[j][i] = _mm512_fmadd_ps(dw, term[i], acc[j][i]);
            }
        }
    }
}

/* The Q4_1 tile, two weight rows per vector: one 512-bit load holds rows j and j+1's 32 bytes
 * of nibbles; their low nibbles (values 0-15 of blocks A and B) and high nibbles (values 16-31)
 * meet the activations' matching halves, broadcast to both rows, in two vpdpbusd into the same
 * lanes, so each lane's integer sum covers 8 values of one block of one row: [A x4, B x4] for
 * row j, then for row j+1. Half the instructions per weight of one row per vector. */
static inline __attribute__((always_inline)) void q41_tile(const Q8Weights *w, const uint8_t *rec, const Q8Rows *x,
                                                           int r0, const int ri, float sums[TILE_OUT][TILE_IN]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i pat0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i pat1 = _mm512_add_epi32(pat0, _mm512_set1_epi32(4));
    const int pairs = w->nb / 2, rb = record_bytes(Q8_KIND_Q4_1);
    __m512 acc[2][TILE_IN];
    for (int jp = 0; jp < 2; jp++)
        for (int i = 0; i < ri; i++) acc[jp][i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++, rec += rb) {
        for (int off = 0; off < rb; off += 64) {
            _mm_prefetch((const char *)rec + Q8_AHEAD * rb + off, _MM_HINT_T0);
            if (Q8_AHEAD2) _mm_prefetch((const char *)rec + Q8_AHEAD2 * rb + off, _MM_HINT_T1);
        }
        __m512i xlo[TILE_IN], xhi[TILE_IN];
        __m512 dx[TILE_IN], term[TILE_IN];
        for (int i = 0; i < ri; i++) {
            const int8_t *xq = x->q + (int64_t)(r0 + i) * w->k + p * 64; /* [A 0-15, B 0-15, A 16-31, B 16-31] */
            const int64_t at = ((int64_t)(r0 + i) * pairs + p) * 16;
            xlo[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));
            xhi[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 32)));
            dx[i] = _mm512_loadu_ps(x->dpat + at);
            term[i] = _mm512_loadu_ps(x->xspat + at);
        }
        const uint16_t *scales = (const uint16_t *)(rec + TILE_OUT * 32);
        const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales)));
        const __m512 m8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 8))));
        for (int jp = 0; jp < 2; jp++) {
            const __m512i raw = _mm512_loadu_si512(rec + jp * 64);
            const __m512i lo = _mm512_and_si512(raw, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            const __m512 dw = _mm512_permutexvar_ps(jp ? pat1 : pat0, d8);
            const __m512 mw = _mm512_permutexvar_ps(jp ? pat1 : pat0, m8);
            for (int i = 0; i < ri; i++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[i]), hi, xhi[i]);
                acc[jp][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[i]), acc[jp][i]);
                acc[jp][i] = _mm512_fmadd_ps(mw, term[i], acc[jp][i]);
            }
        }
    }
    for (int jp = 0; jp < 2; jp++)
        for (int i = 0; i < ri; i++) {
            sums[2 * jp][i] = hsum8(_mm512_castps512_ps256(acc[jp][i]));
            sums[2 * jp + 1][i] = hsum8(_mm512_extractf32x8_ps(acc[jp][i], 1));
        }
}
#elif Q8_ISA == 256
/* AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes and adds pairs into
 * int16, vpmaddwd by ones adds pairs of those into int32, so each int32 lane again covers 4
 * values of one block. No int16 sum can saturate: Q4_1's nibbles make at most 2 x 15 x 127 per
 * pair (two such sums are added before widening), Q8_0 at most 2 x 128 x 127. With 16 vector
 * registers, a pass covers weight rows j0..j0+jn-1 of the tile (jn 4 for up to 2 activation
 * rows, else 2 and two passes over the tile's records, which are in L1 by then). */

/* [a x4, b x4] for row j's scales a, b in v = [row 0 a, b, row 1 a, b, ...]: in-lane shuffles
 * (vpermps crosses lanes, several micro-ops on some AVX2 cores). */
static inline __m256 pair_lanes(__m256 v, int j) {
    const __m128 half = j < 2 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1);
    const __m128 a = (j & 1) ? _mm_permute_ps(half, 0xaa) : _mm_permute_ps(half, 0x00);
    const __m128 b = (j & 1) ? _mm_permute_ps(half, 0xff) : _mm_permute_ps(half, 0x55);
    return _mm256_set_m128(b, a);
}

/* Lane k of v (0..7) in every lane. */
static inline __m256 lane_all(__m256 v, int k) {
    const __m128 half = k < 4 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1);
    switch (k & 3) {
    case 0: return _mm256_broadcastss_ps(half);
    case 1: return _mm256_broadcastss_ps(_mm_permute_ps(half, 0x55));
    case 2: return _mm256_broadcastss_ps(_mm_permute_ps(half, 0xaa));
    default: return _mm256_broadcastss_ps(_mm_permute_ps(half, 0xff));
    }
}

/* Q4_1: one 256-bit load is one row's 64 nibbles of a pair of blocks A, B: low nibbles A 0-15
 * and B 0-15, high nibbles A 16-31 and B 16-31, the two halves of the activations' slots. Lanes
 * [A x4, B x4], as the first half of a 512-bit pair's lanes (the same dpat / xspat values). */
static inline __attribute__((always_inline)) void q41_tile(const Q8Weights *w, const uint8_t *rec, const Q8Rows *x,
                                                           int r0, const int ri, const int j0, const int jn,
                                                           float sums[TILE_OUT][TILE_IN]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    /* the minimums' term of both blocks of a pair, [A, B] x4: lanes 0 and 4 of xspat, x 4 */
    const __m256i ab = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    const __m256 four = _mm256_set1_ps(4.f);
    const int pairs = w->nb / 2, rb = record_bytes(Q8_KIND_Q4_1);
    __m256 acc[TILE_OUT][TILE_IN], accm[TILE_IN];
    for (int j = 0; j < jn; j++)
        for (int i = 0; i < ri; i++) acc[j][i] = _mm256_setzero_ps();
    for (int i = 0; i < ri; i++) accm[i] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++, rec += rb) {
        if (j0 == 0)
            for (int off = 0; off < rb; off += 64) {
                _mm_prefetch((const char *)rec + Q8_AHEAD * rb + off, _MM_HINT_T0);
                if (Q8_AHEAD2) _mm_prefetch((const char *)rec + Q8_AHEAD2 * rb + off, _MM_HINT_T1);
            }
        const uint16_t *scales = (const uint16_t *)(rec + TILE_OUT * 32);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
        /* The minimums' term of all 4 rows in one FMA per activation row: lanes [row 0 A, B,
         * row 1 A, B, ...], summed per row at the end (not once per row and pair). */
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 8)));
        for (int i = 0; i < ri; i++) {
            const int64_t at = ((int64_t)(r0 + i) * pairs + p) * 16;
            const __m256 t = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(x->xspat + at), ab), four);
            accm[i] = _mm256_fmadd_ps(m8, t, accm[i]);
        }
        for (int jj = 0; jj < jn; jj++) {
            const int j = j0 + jj;
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + j * 32));
            const __m256i lo = _mm256_and_si256(raw, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            const __m256 dw = pair_lanes(d8, j);
            for (int i = 0; i < ri; i++) {
                const int8_t *xq = x->q + (int64_t)(r0 + i) * w->k + p * 64;
                const int64_t at = ((int64_t)(r0 + i) * pairs + p) * 16;
                const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                acc[jj][i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_loadu_ps(x->dpat + at)), acc[jj][i]);
            }
        }
    }
    for (int i = 0; i < ri; i++) {
        float m[8];
        _mm256_storeu_ps(m, accm[i]);
        for (int jj = 0; jj < jn; jj++) sums[j0 + jj][i] = hsum8(acc[jj][i]) + (m[2 * (j0 + jj)] + m[2 * (j0 + jj) + 1]);
    }
}

/* Q8_0: a row's pair is two 256-bit loads, block A then B. The weights are signed, so the sign
 * moves onto the activations (|w| x sign(x, w), llama.cpp's way): the products are exact and
 * the 512-bit path's offset term is not needed. */
static inline __attribute__((always_inline)) void q80_tile(const Q8Weights *w, const uint8_t *rec, const Q8Rows *x,
                                                           int r0, const int ri, const int j0, const int jn,
                                                           float sums[TILE_OUT][TILE_IN]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int pairs = w->nb / 2, rb = record_bytes(Q8_KIND_Q8_0);
    __m256 acc[TILE_OUT][TILE_IN];
    for (int j = 0; j < jn; j++)
        for (int i = 0; i < ri; i++) acc[j][i] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++, rec += rb) {
        if (j0 == 0)
            for (int off = 0; off < rb; off += 64) {
                _mm_prefetch((const char *)rec + Q8_AHEAD * rb + off, _MM_HINT_T0);
                if (Q8_AHEAD2) _mm_prefetch((const char *)rec + Q8_AHEAD2 * rb + off, _MM_HINT_T1);
            }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + TILE_OUT * 64)));
        for (int jj = 0; jj < jn; jj++) {
            const int j = j0 + jj;
            const __m256i wa = _mm256_loadu_si256((const __m256i *)(rec + j * 64));
            const __m256i wb = _mm256_loadu_si256((const __m256i *)(rec + j * 64 + 32));
            const __m256i ua = _mm256_abs_epi8(wa), ub = _mm256_abs_epi8(wb);
            const __m256 da = lane_all(d8, 2 * j), db = lane_all(d8, 2 * j + 1);
            for (int i = 0; i < ri; i++) {
                const int8_t *xq = x->q + (int64_t)(r0 + i) * w->k + p * 64;
                const int64_t at = ((int64_t)(r0 + i) * pairs + p) * 16; /* lanes [A x8, B x8] */
                const __m256i sa = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ua, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), wa)), ones);
                const __m256i sb = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ub, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32)), wb)), ones);
                acc[jj][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_mul_ps(da, _mm256_loadu_ps(x->dpat + at)), acc[jj][i]);
                acc[jj][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_mul_ps(db, _mm256_loadu_ps(x->dpat + at + 8)), acc[jj][i]);
            }
        }
    }
    for (int jj = 0; jj < jn; jj++)
        for (int i = 0; i < ri; i++) sums[j0 + jj][i] = hsum8(acc[jj][i]);
}
#endif

#if HAVE_Q8
/* A tile's sums plus the bias, stored. */
static inline void q8_store(const Q8Weights *w, int o0, int r0, int ri, float sums[TILE_OUT][TILE_IN],
                            const float *bias, int dt, void *y, int64_t ldy) {
    for (int j = 0; j < TILE_OUT && o0 + j < w->n; j++) {
        const int o = o0 + j;
        for (int i = 0; i < ri; i++) {
            float v = sums[j][i];
            if (bias) v += bias[o];
            const int64_t at = (int64_t)(r0 + i) * ldy + o;
            if (dt == DT_F32)
                ((float *)y)[at] = v;
            else
                ((uint16_t *)y)[at] = f32_to_bf16(v);
        }
    }
}

/* One tile of either kind, ri rows (dispatch to the literal specializations): its sums. */
static void q8_tile_any(const Q8Weights *w, const uint8_t *rec, const Q8Rows *x, int r0, int ri,
                        float sums[TILE_OUT][TILE_IN]) {
#if Q8_ISA == 256
#define Q8_PASSES(tile)                                                                                                \
    switch (ri) {                                                                                                      \
    case 1: tile(w, rec, x, r0, 1, 0, 4, sums); break;                                                                 \
    case 2: tile(w, rec, x, r0, 2, 0, 4, sums); break;                                                                 \
    case 3: tile(w, rec, x, r0, 3, 0, 2, sums), tile(w, rec, x, r0, 3, 2, 2, sums); break;                             \
    default: tile(w, rec, x, r0, 4, 0, 2, sums), tile(w, rec, x, r0, 4, 2, 2, sums); break;                            \
    }
    if (w->kind == Q8_KIND_Q4_1) {
        Q8_PASSES(q41_tile)
    } else {
        Q8_PASSES(q80_tile)
    }
#undef Q8_PASSES
#else
    if (w->kind == Q8_KIND_Q4_1) {
        switch (ri) {
        case 1: q41_tile(w, rec, x, r0, 1, sums); break;
        case 2: q41_tile(w, rec, x, r0, 2, sums); break;
        case 3: q41_tile(w, rec, x, r0, 3, sums); break;
        default: q41_tile(w, rec, x, r0, 4, sums); break;
        }
        return;
    }
    __m512 acc[TILE_OUT][TILE_IN];
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < TILE_IN; i++) acc[j][i] = _mm512_setzero_ps();
    switch (ri) {
    case 1: q80_tile(w, rec, x, r0, 1, acc); break;
    case 2: q80_tile(w, rec, x, r0, 2, acc); break;
    case 3: q80_tile(w, rec, x, r0, 3, acc); break;
    default: q80_tile(w, rec, x, r0, 4, acc); break;
    }
    for (int j = 0; j < TILE_OUT; j++)
        for (int i = 0; i < ri; i++) sums[j][i] = _mm512_reduce_add_ps(acc[j][i]);
#endif
}
#endif

int q8_num_tiles(const Q8Weights *w) { return (w->n + TILE_OUT - 1) / TILE_OUT; }

int q8_tile_bytes(const Q8Weights *w) { return (w->nb / 2) * record_bytes(w->kind); }

void q8_linear_range(const Q8Weights *w, const Q8Rows *x, const float *bias, int dt, void *y, int64_t ldy,
                     int t_begin, int t_end) {
#if HAVE_Q8
    const int64_t tile_bytes = (int64_t)(w->nb / 2) * record_bytes(w->kind);
    for (int t = t_begin; t < t_end; t++) {
        const uint8_t *rec = w->packed + t * tile_bytes;
        for (int r0 = 0; r0 < x->m; r0 += TILE_IN) {
            const int ri = x->m - r0 < TILE_IN ? x->m - r0 : TILE_IN;
            float sums[TILE_OUT][TILE_IN];
            q8_tile_any(w, rec, x, r0, ri, sums);
            q8_store(w, t * TILE_OUT, r0, ri, sums, bias, dt, y, ldy);
        }
    }
#else
    (void)w, (void)x, (void)bias, (void)dt, (void)y, (void)ldy, (void)t_begin, (void)t_end;
#endif
}

static int linear_q8(int kind, const void *x, int m, int k, const uint8_t *packed, const float *bias, int n,
                     int dt, void *y, int num_threads) {
    if (!q8_supported(k) || m <= 0) return -2;
    void *scratch = aligned_alloc(64, q8_rows_bytes(m, k));
    if (!scratch) return -1;
    Q8Rows rows;
    q8_rows_init(&rows, kind, m, k, scratch);
    quantize_rows_q8(&rows, x, dt);
    const Q8Weights w = {kind, n, k, k / 32, packed};
    const int tiles = q8_num_tiles(&w);
    /* Dynamic chunks: a descheduled thread does not hold the others up; every output is still
     * computed by one thread in one order, so results do not depend on the schedule. */
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads) if ((int64_t)n * k >= (1 << 17))
    for (int t = 0; t < tiles; t++) q8_linear_range(&w, &rows, bias, dt, y, n, t, t + 1);
    free(scratch);
    return 0;
}

/*
 * y [m, n] (dtype dt) = x [m, k] W^T (+ bias [n] float32) with x quantized to int8 per block of
 * 32, W of `kind` (0 Q4_1, 1 Q8_0) packed by q8_pack. Returns 0; -2 when this build or k does
 * not suit the int8 path (k % 64 != 0, neither AVX512-VNNI nor AVX2); -1 out of memory.
 */
int block_linear_q8(int kind, const void *x, int m, int k, const uint8_t *packed, const float *bias, int n, int dt,
                    void *y, int num_threads) {
    return linear_q8(kind, x, m, k, packed, bias, n, dt, y, num_threads);
}
