/* panel_linear: y = x W^T for W in GGUF Q4_1 / Q8_0 blocks, batch invariant by construction.
 *
 * Each float32 input row is first written in integers, block by block (panel_quantize_row): a
 * block of 32 inputs gets a power-of-two scale s from its largest magnitude, and each input x
 * becomes X = rint(x / s) with |X| <= 2^13 (14 significant bits against the block's largest
 * value, where float32 carries 24), written as two int8 digits (PANEL_LIMBS; three, for 2^20,
 * cost a third more products). The products of the weights' small integers with those digits
 * are integer dot products (AVX512-VNNI's vpdpbusd, AVX2's
 * vpmaddubsw + vpmaddwd, or plain C): exact, so their order, the vector width, the tile and
 * the thread that computes them cannot change a bit. Then each output element is one fixed
 * chain of float32 operations, block by block in order:
 *
 *     acc = 0
 *     for each block b:
 *         D0, D1 = the block's integer dot products of the quants with digits c, b
 *                  (Q8_0: quants + 128 as stored, less 128 x the digits' sums)
 *         t = fma(D0, 1, D1 * 2^7)                   (int -> float conversions exact)
 *         acc = fma(t, d_b * s_b, acc)               (d_b * s_b exact: s_b a power of two)
 *         acc = fma(m_b, s_b * sum(X), acc)          (Q4_1's minimum)
 *     y = acc (+ bias)
 *
 * so a request's logits do not depend on what else is in its step, on the thread count or on
 * the instruction set. The weights are repacked once (engine/models/block_linear.py,
 * GGUFBlocks.pack_panels) into panels of 16 output rows: per panel and block, the quants of 4
 * inputs x 16 rows at a time (64 bytes: row o's 4 bytes at 4 * o), Q4_1 as in the file (byte j:
 * input j in the low nibble, j + 16 in the high), Q8_0 offset by 128; then the 16 rows' scales
 * (and minimums) as float16, as the file stores them: one record of 320 (Q4_1) or 544 (Q8_0)
 * bytes, so a panel is one forward stream.
 */
#include "panel_linear.h"

#include "common.h"

#define PANEL 16
#define TASK_PANELS 4 /* panels per thread task */
#define TASK_ROWS 64  /* x rows per thread task */
#ifndef ROW_AHEAD
#define ROW_AHEAD 4 /* blocks a lone row's software prefetch runs ahead (decode step p50: 4 0.91x of none; 2 0.94x, 8 0.93x, 16 0.95x) */
#endif
#ifndef ONE_ROW_PANELS
#define ONE_ROW_PANELS 1 /* panels run_task's lone row takes at once (4 were 1.5x slower); the fused step's: ONE_ROW_STREAMS */
#endif
#define X_BITS (7 * PANEL_LIMBS - 1) /* |X| <= 2^X_BITS */
#define DIGIT_WEIGHT(l) ((float)(1 << (7 * (l)))) /* digit l counts 2^(7 l) */
enum { PANEL_Q4_1 = 0, PANEL_Q8_0 = 1 };
#define DIGITS_PER_BLOCK (PANEL_LIMBS * 32)

typedef struct {
    int kind, k, nb, n, np;
    const uint8_t *rec; /* [np][nb][record_bytes]: quants, then float16 scales (and minimums) */
} Panels;

static inline int panel_qbytes(int kind) { return kind == PANEL_Q4_1 ? 256 : 512; }
static inline int record_bytes(int kind) { return kind == PANEL_Q4_1 ? 256 + 64 : 512 + 32; }
/* Panel p's record of block b. */
static inline const uint8_t *record(const Panels *w, int p, int b) {
    return w->rec + ((int64_t)p * w->nb + b) * record_bytes(w->kind);
}

#define INLINE static inline __attribute__((always_inline))

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t panel_rows_bytes(int m, int k) {
    const size_t blocks = (size_t)m * (size_t)(k / 32);
    return align64(blocks * DIGITS_PER_BLOCK) + 2 * align64(blocks * sizeof(float)) + align64(blocks * 4 * sizeof(int32_t));
}

void panel_rows_init(PanelRows *rows, int m, int k, void *scratch) {
    const size_t blocks = (size_t)m * (size_t)(k / 32);
    char *p = (char *)scratch;
    rows->m = m, rows->k = k, rows->nb = k / 32;
    rows->limbs = (int8_t *)p;
    p += align64(blocks * DIGITS_PER_BLOCK);
    rows->scale = (float *)p;
    p += align64(blocks * sizeof(float));
    rows->xsum = (float *)p;
    p += align64(blocks * sizeof(float));
    rows->lsum = (int32_t *)p;
}

static inline float float_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A block whose largest magnitude's bits are top: its scale, the factor up = 1 / scale, or 0
 * when the block is taken as zeros (largest below 2^-107) and -1 when it holds inf or NaN. */
static inline int block_scale(uint32_t top, float *up, float *scale) {
    if (top >= 0x7f800000u) return -1;
    const int e = (int)(top >> 23); /* largest in [2^(e-127), 2^(e-126)) */
    if (e < X_BITS + 1) return 0;
    *up = float_of_bits((uint32_t)(X_BITS + 253 - e) << 23); /* 2^(X_BITS + 126 - e) */
    *scale = float_of_bits((uint32_t)(e - X_BITS + 1) << 23); /* 2^(e - 126 - X_BITS) */
    return 1;
}

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
static inline int32_t hsum_epi32_256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

static void zero_block(int8_t *limbs, float *scale, float *xsum, int32_t *lsum, float fill) {
    memset(limbs, 0, DIGITS_PER_BLOCK);
    memset(lsum, 0, 4 * sizeof(int32_t));
    *scale = fill;
    *xsum = fill;
}

/* One block of 32 inputs into its digits, scale, sums: the definition (every build's vector
 * version computes these same integers). */
static void quantize_block(const float *xb, int8_t *limbs, float *scale, float *xsum, int32_t *lsum) {
    uint32_t top = 0;
    for (int j = 0; j < 32; j++) {
        uint32_t u;
        memcpy(&u, xb + j, 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    float up = 0.f, s = 0.f;
    const int how = block_scale(top, &up, &s);
    if (how <= 0) {
        zero_block(limbs, scale, xsum, lsum, how < 0 ? NAN : 0.f);
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vup = _mm512_set1_ps(up);
    const __m512i half = _mm512_set1_epi32(64);
    __m512i sx = _mm512_setzero_si512(), sl[PANEL_LIMBS];
    for (int l = 0; l < PANEL_LIMBS; l++) sl[l] = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), vup));
        __m512i rest = x;
        for (int l = 0; l < PANEL_LIMBS; l++) {
            const __m512i q = l + 1 < PANEL_LIMBS ? _mm512_srai_epi32(_mm512_add_epi32(rest, half), 7)
                                                  : _mm512_setzero_si512();
            const __m512i digit = _mm512_sub_epi32(rest, _mm512_slli_epi32(q, 7));
            _mm_storeu_si128((__m128i *)(limbs + l * 32 + 16 * h), _mm512_cvtepi32_epi8(digit));
            sl[l] = _mm512_add_epi32(sl[l], digit);
            rest = q;
        }
        sx = _mm512_add_epi32(sx, x);
    }
    for (int l = 0; l < PANEL_LIMBS; l++) lsum[l] = _mm512_reduce_add_epi32(sl[l]);
    const int32_t sum = _mm512_reduce_add_epi32(sx);
#elif defined(__AVX2__)
    const __m256 vup = _mm256_set1_ps(up);
    const __m256i half = _mm256_set1_epi32(64);
    __m256i sx = _mm256_setzero_si256(), sl[PANEL_LIMBS];
    for (int l = 0; l < PANEL_LIMBS; l++) sl[l] = _mm256_setzero_si256();
    for (int h = 0; h < 4; h++) {
        const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * h), vup));
        __m256i rest = x;
        for (int l = 0; l < PANEL_LIMBS; l++) {
            const __m256i q = l + 1 < PANEL_LIMBS ? _mm256_srai_epi32(_mm256_add_epi32(rest, half), 7)
                                                  : _mm256_setzero_si256();
            const __m256i digit = _mm256_sub_epi32(rest, _mm256_slli_epi32(q, 7));
            /* digits lie in [-64, 64]: the packs do not saturate */
            const __m128i d16 = _mm_packs_epi32(_mm256_castsi256_si128(digit), _mm256_extracti128_si256(digit, 1));
            _mm_storel_epi64((__m128i *)(limbs + l * 32 + 8 * h), _mm_packs_epi16(d16, d16));
            sl[l] = _mm256_add_epi32(sl[l], digit);
            rest = q;
        }
        sx = _mm256_add_epi32(sx, x);
    }
    for (int l = 0; l < PANEL_LIMBS; l++) lsum[l] = hsum_epi32_256(sl[l]);
    const int32_t sum = hsum_epi32_256(sx);
#else
    int32_t sum = 0;
    memset(lsum, 0, 4 * sizeof(int32_t));
    for (int j = 0; j < 32; j++) {
        const int32_t x = (int32_t)rintf(xb[j] * up);
        int32_t rest = x;
        for (int l = 0; l < PANEL_LIMBS; l++) {
            const int32_t q = l + 1 < PANEL_LIMBS ? (rest + 64) >> 7 : 0, digit = rest - q * 128;
            limbs[l * 32 + j] = (int8_t)digit;
            lsum[l] += digit;
            rest = q;
        }
        sum += x;
    }
#endif
    *scale = s;
    *xsum = (float)sum * s;
}

void panel_quantize_row(const float *x, const PanelRows *rows, int i) {
    const int64_t at = (int64_t)i * rows->nb;
    for (int b = 0; b < rows->nb; b++)
        quantize_block(x + b * 32, rows->limbs + (at + b) * DIGITS_PER_BLOCK, rows->scale + at + b, rows->xsum + at + b,
                       rows->lsum + (at + b) * 4);
}

/* The float chain's step for one block of one element (see the top): every build runs it. */
static inline float chain_step(float acc, const int32_t *dsum, float d, float s, const float *mn, float xsum) {
    float t = (float)dsum[PANEL_LIMBS - 1] * DIGIT_WEIGHT(PANEL_LIMBS - 1);
    for (int l = PANEL_LIMBS - 2; l >= 0; l--) t = fmaf((float)dsum[l], DIGIT_WEIGHT(l), t);
    acc = fmaf(t, d * s, acc);
    return mn ? fmaf(*mn, xsum, acc) : acc;
}

/* Rows r0.. of x (R of them) times panels p0.. (NP of them) into out[(r * NP + pp) * 16 + o]. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PANEL_ISA 512
#define TILE_ROWS 6 /* rows a tile of one panel */
#ifndef PAIR_MIN_ROWS
#define PAIR_MIN_ROWS 8 /* from this many rows a task, tiles of 2 rows x 2 panels (run_task) */
#endif
/* One block's step for 16 elements; rec: the panel's record of the block. */
INLINE __m512 chain16(__m512 acc, const __m512i *dsum, const uint8_t *rec, int qbytes, int has_min, float s,
                      float xsum) {
#if PANEL_LIMBS == 2
    /* t as the exact integer D0 + 2^7 D1 converted once: the same bits as the chain's
     * fma(D0, 1, D1 * 2^7) (chain8 says why), in two integer operations. A 512-row prefill's
     * linears on one thread: 0.90x the time of the float form. */
    __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(dsum[0], _mm512_slli_epi32(dsum[1], 7)));
#else
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dsum[PANEL_LIMBS - 1]), _mm512_set1_ps(DIGIT_WEIGHT(PANEL_LIMBS - 1)));
    for (int l = PANEL_LIMBS - 2; l >= 0; l--)
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dsum[l]), _mm512_set1_ps(DIGIT_WEIGHT(l)), t);
#endif
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + qbytes)));
    acc = _mm512_fmadd_ps(t, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc);
    if (!has_min) return acc;
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + qbytes + 32)));
    return _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum), acc);
}

INLINE void micro(const Panels *w, const PanelRows *x, int r0, const int R, int p0, const int NP, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int q4 = w->kind == PANEL_Q4_1, qbytes = panel_qbytes(w->kind);
    __m512 acc[TILE_ROWS];
    for (int i = 0; i < R * NP; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < w->nb; b++) {
        __m512i dsum[TILE_ROWS][PANEL_LIMBS];
        for (int i = 0; i < R * NP; i++)
            for (int l = 0; l < PANEL_LIMBS; l++) dsum[i][l] = _mm512_setzero_si512();
        const int8_t *lb[TILE_ROWS];
        for (int r = 0; r < R; r++) lb[r] = x->limbs + ((int64_t)(r0 + r) * x->nb + b) * DIGITS_PER_BLOCK;
        const uint8_t *rec[TILE_ROWS];
        for (int pp = 0; pp < NP; pp++) rec[pp] = record(w, p0 + pp, b);
        if (q4) {
            for (int j = 0; j < 4; j++)
                for (int pp = 0; pp < NP; pp++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(rec[pp] + j * 64));
                    const __m512i lo = _mm512_and_si512(raw, low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    for (int r = 0; r < R; r++)
                        for (int l = 0; l < PANEL_LIMBS; l++) {
                            __m512i *s = &dsum[r * NP + pp][l];
                            *s = _mm512_dpbusd_epi32(*s, lo, _mm512_set1_epi32(load_i32(lb[r] + l * 32 + 4 * j)));
                            *s = _mm512_dpbusd_epi32(*s, hi, _mm512_set1_epi32(load_i32(lb[r] + l * 32 + 16 + 4 * j)));
                        }
                }
        } else {
            for (int j = 0; j < 8; j++)
                for (int pp = 0; pp < NP; pp++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(rec[pp] + j * 64));
                    for (int r = 0; r < R; r++)
                        for (int l = 0; l < PANEL_LIMBS; l++)
                            dsum[r * NP + pp][l] = _mm512_dpbusd_epi32(
                                dsum[r * NP + pp][l], raw, _mm512_set1_epi32(load_i32(lb[r] + l * 32 + 4 * j)));
                }
            for (int r = 0; r < R; r++)
                for (int l = 0; l < PANEL_LIMBS; l++) {
                    const __m512i off = _mm512_set1_epi32(128 * x->lsum[((int64_t)(r0 + r) * x->nb + b) * 4 + l]);
                    for (int pp = 0; pp < NP; pp++) dsum[r * NP + pp][l] = _mm512_sub_epi32(dsum[r * NP + pp][l], off);
                }
        }
        for (int r = 0; r < R; r++) {
            const int64_t xb = (int64_t)(r0 + r) * x->nb + b;
            for (int pp = 0; pp < NP; pp++)
                acc[r * NP + pp] =
                    chain16(acc[r * NP + pp], dsum[r * NP + pp], rec[pp], qbytes, q4, x->scale[xb], x->xsum[xb]);
        }
    }
    for (int i = 0; i < R * NP; i++) _mm512_storeu_ps(out + i * PANEL, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PANEL_ISA 256
#define TILE_ROWS 4 /* rows a tile (micro_rows) */
/* An empty asm the sums pass through after each group of products: integer sums reassociate,
 * and without it GCC hoisted a whole block's products ahead of their additions, spilling each
 * to the stack (one store and one load per vpmaddubsw, half the speed). Only timing. */
INLINE void keep(__m256i *v) { __asm__("" : "+x"(*v)); }

/* Q8_0's products: vpmaddubsw's pairs widened to int32 at once (vpmaddwd by ones). Q4_1's
 * pairs of products are summed in int16 lanes and widened once a block: a digit is in
 * [-64, 64] and a nibble in [0, 15], so each vpmaddubsw lane is at most 2 * 15 * 64 = 1920 in
 * magnitude and a block's 8 of them (4 groups x low and high nibbles) at most 15360 < 2^15:
 * no lane saturates, the sums are the same integers (micro_rows, row_block). */

/* One block's step for 8 elements (half h of the panel). */
INLINE __m256 chain8(__m256 acc, const __m256i *dsum, const uint8_t *rec, int qbytes, int has_min, int h, float s,
                     float xsum) {
#if PANEL_LIMBS == 2
    /* The chain's t = fma(D0, 1, D1 * 2^7) rounds the exact integer D0 + 2^7 D1 once (D1 * 2^7
     * is exact); so does converting that integer, summed here in int32 (|D0 + 2^7 D1| < 2^26:
     * no overflow). The same bits, with two integer operations in place of a multiply and an
     * fma, which share the two vector multiply pipes with the vpmaddubsw products. */
    __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(dsum[0], _mm256_slli_epi32(dsum[1], 7)));
#else
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dsum[PANEL_LIMBS - 1]), _mm256_set1_ps(DIGIT_WEIGHT(PANEL_LIMBS - 1)));
    for (int l = PANEL_LIMBS - 2; l >= 0; l--)
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dsum[l]), _mm256_set1_ps(DIGIT_WEIGHT(l)), t);
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + qbytes + 16 * h)));
    acc = _mm256_fmadd_ps(t, _mm256_mul_ps(d, _mm256_set1_ps(s)), acc);
    if (!has_min) return acc;
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + qbytes + 32 + 16 * h)));
    return _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum), acc);
}

/* Q4_1's 64 bytes of 4 inputs x 16 rows as the low and high nibbles of each half (8 rows). */
INLINE void split_nibbles(const uint8_t *group, __m256i low, __m256i lo[2], __m256i hi[2]) {
    for (int h = 0; h < 2; h++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(group + h * 32));
        lo[h] = _mm256_and_si256(raw, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}

/* Rows r0..r0+R-1 (1 < R <= TILE_ROWS) times one panel, both halves of it at once: each
 * digit's broadcast serves 16 outputs, as for a lone row (row_block), and the panel's records
 * stay in L1 for the next rows (run_task). Each output's chain is the one the file's header
 * writes, block by block. Against the tile it replaced, half a panel a pass (8 outputs a
 * broadcast; 12 int16 sums for 4 rows, where these take 16 and spill a few): steps of 2, 4 and
 * 64 decode rows 0.86x, 0.92x and 0.96x the time (load.kernel_ab, alternated). Its own loop,
 * not row_block's: that block as a function taking the accumulators by pointer ran 64 rows
 * 1.05x slower. */
INLINE void micro_rows(const Panels *w, const PanelRows *x, int r0, const int R, int p0, float *out) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int q4 = w->kind == PANEL_Q4_1, qbytes = panel_qbytes(w->kind);
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < w->nb; b++) {
        __m256i dsum[TILE_ROWS][2][PANEL_LIMBS];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < PANEL_LIMBS; l++) dsum[r][h][l] = _mm256_setzero_si256();
        const uint8_t *rec = record(w, p0, b);
        const int8_t *lb[TILE_ROWS];
        for (int r = 0; r < R; r++) lb[r] = x->limbs + ((int64_t)(r0 + r) * x->nb + b) * DIGITS_PER_BLOCK;
        if (q4) {
#pragma GCC unroll 1
            for (int j = 0; j < 4; j++) {
                __m256i lo[2], hi[2];
                split_nibbles(rec + j * 64, low, lo, hi);
                for (int r = 0; r < R; r++)
                    for (int l = 0; l < PANEL_LIMBS; l++) {
                        const __m256i dl = _mm256_set1_epi32(load_i32(lb[r] + l * 32 + 4 * j));
                        const __m256i dh = _mm256_set1_epi32(load_i32(lb[r] + l * 32 + 16 + 4 * j));
                        for (int h = 0; h < 2; h++) {
                            dsum[r][h][l] = _mm256_add_epi16(
                                _mm256_add_epi16(dsum[r][h][l], _mm256_maddubs_epi16(lo[h], dl)),
                                _mm256_maddubs_epi16(hi[h], dh));
                            keep(&dsum[r][h][l]);
                        }
                    }
            }
            for (int r = 0; r < R; r++)
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < PANEL_LIMBS; l++) dsum[r][h][l] = _mm256_madd_epi16(dsum[r][h][l], ones);
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j++) {
                const __m256i raw0 = _mm256_loadu_si256((const __m256i *)(rec + j * 64));
                const __m256i raw1 = _mm256_loadu_si256((const __m256i *)(rec + j * 64 + 32));
                for (int r = 0; r < R; r++)
                    for (int l = 0; l < PANEL_LIMBS; l++) {
                        const __m256i d = _mm256_set1_epi32(load_i32(lb[r] + l * 32 + 4 * j));
                        dsum[r][0][l] = _mm256_add_epi32(dsum[r][0][l], _mm256_madd_epi16(_mm256_maddubs_epi16(raw0, d), ones));
                        dsum[r][1][l] = _mm256_add_epi32(dsum[r][1][l], _mm256_madd_epi16(_mm256_maddubs_epi16(raw1, d), ones));
                        keep(&dsum[r][0][l]), keep(&dsum[r][1][l]);
                    }
            }
            for (int r = 0; r < R; r++) {
                const int64_t xb = (int64_t)(r0 + r) * x->nb + b;
                for (int l = 0; l < PANEL_LIMBS; l++) {
                    const __m256i off = _mm256_set1_epi32(128 * x->lsum[xb * 4 + l]);
                    for (int h = 0; h < 2; h++) dsum[r][h][l] = _mm256_sub_epi32(dsum[r][h][l], off);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t xb = (int64_t)(r0 + r) * x->nb + b;
            for (int h = 0; h < 2; h++)
                acc[r][h] = chain8(acc[r][h], dsum[r][h], rec, qbytes, q4, h, x->scale[xb], x->xsum[xb]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * PANEL, acc[r][0]);
        _mm256_storeu_ps(out + r * PANEL + 8, acc[r][1]);
    }
}

/* A lone row times one block of one panel, both halves at once (each digit's broadcast serves
 * 16 outputs): acc[0..1] take the block's step of the chain. */
INLINE void row_block(const Panels *w, const PanelRows *x, int r0, int p0, int b, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int q4 = w->kind == PANEL_Q4_1, qbytes = panel_qbytes(w->kind), rb = record_bytes(w->kind);
    __m256i dsum[2][PANEL_LIMBS];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < PANEL_LIMBS; l++) dsum[h][l] = _mm256_setzero_si256();
    const int64_t xb = (int64_t)r0 * x->nb + b;
    const int8_t *lb = x->limbs + xb * DIGITS_PER_BLOCK;
    const uint8_t *rec = record(w, p0, b);
    /* The record ROW_AHEAD blocks on (this panel's or the next one's in memory) into L1: a
     * lone row reads its weights once, at the pace of memory, and the hardware prefetcher
     * alone left the decode step 8% slower. A prefetch never faults past the end. */
    for (int c = 0; c < rb; c += 64) _mm_prefetch((const char *)rec + ROW_AHEAD * rb + c, _MM_HINT_T0);
    if (q4) {
#pragma GCC unroll 1 /* unrolled, GCC hoisted the block's 16 broadcasts and spilled them (2% a step) */
        for (int j = 0; j < 4; j++) {
            __m256i lo[2], hi[2];
            split_nibbles(rec + j * 64, low, lo, hi);
            for (int l = 0; l < PANEL_LIMBS; l++) {
                const __m256i dl = _mm256_set1_epi32(load_i32(lb + l * 32 + 4 * j));
                const __m256i dh = _mm256_set1_epi32(load_i32(lb + l * 32 + 16 + 4 * j));
                for (int h = 0; h < 2; h++) {
                    dsum[h][l] = _mm256_add_epi16(_mm256_add_epi16(dsum[h][l], _mm256_maddubs_epi16(lo[h], dl)),
                                                  _mm256_maddubs_epi16(hi[h], dh));
                    keep(&dsum[h][l]);
                }
            }
        }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < PANEL_LIMBS; l++) dsum[h][l] = _mm256_madd_epi16(dsum[h][l], ones);
    } else {
        for (int j = 0; j < 8; j++) {
            const __m256i raw0 = _mm256_loadu_si256((const __m256i *)(rec + j * 64));
            const __m256i raw1 = _mm256_loadu_si256((const __m256i *)(rec + j * 64 + 32));
            for (int l = 0; l < PANEL_LIMBS; l++) {
                const __m256i d = _mm256_set1_epi32(load_i32(lb + l * 32 + 4 * j));
                dsum[0][l] = _mm256_add_epi32(dsum[0][l], _mm256_madd_epi16(_mm256_maddubs_epi16(raw0, d), ones));
                dsum[1][l] = _mm256_add_epi32(dsum[1][l], _mm256_madd_epi16(_mm256_maddubs_epi16(raw1, d), ones));
                keep(&dsum[0][l]), keep(&dsum[1][l]);
            }
        }
        for (int l = 0; l < PANEL_LIMBS; l++) {
            const __m256i off = _mm256_set1_epi32(128 * x->lsum[xb * 4 + l]);
            for (int h = 0; h < 2; h++) dsum[h][l] = _mm256_sub_epi32(dsum[h][l], off);
        }
    }
    for (int h = 0; h < 2; h++) acc[h] = chain8(acc[h], dsum[h], rec, qbytes, q4, h, x->scale[xb], x->xsum[xb]);
}

/* A lone row times one panel. */
INLINE void micro_row(const Panels *w, const PanelRows *x, int r0, int p0, float *out) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < w->nb; b++) row_block(w, x, r0, p0, b, acc);
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
}

#ifndef ONE_ROW_STREAMS
/* Runs of panels a lone row walks side by side. Memory here serves several forward streams a
 * core faster than one (a /tmp read loop of 96 MB on two threads: 25-28 GB/s as one stream a
 * thread, 43-48 as four interleaved every 64 bytes; interleaved every 4 KB, no faster than
 * one), and a decode step is mostly its weights read once. Decode step p50, one row at 300
 * positions (load.kernel_ab, variants alternated in one process), 2 runs against 1: 0.91x,
 * 0.92x, 0.92x, 0.98x, 0.99x in five runs (the gain comes and goes with the host's memory
 * traffic); 3 runs 0.95x, 4 runs 0.94x; 2 runs read 64 bytes at a time side by side 1.04x. */
#define ONE_ROW_STREAMS 2
#endif
/* A lone row times ONE_ROW_STREAMS panels from as many places at once, block by block: as many
 * forward streams of records in flight. Each panel's chain is the same, block after block in
 * order: only how the panels' progress interleaves changes, never a bit of a result. */
static void multi_row(const Panels *w, const PanelRows *x, int r0, const int *p, float *const *out) {
    __m256 acc[ONE_ROW_STREAMS][2];
    for (int s = 0; s < ONE_ROW_STREAMS; s++) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
    for (int b = 0; b < w->nb; b++)
        for (int s = 0; s < ONE_ROW_STREAMS; s++) row_block(w, x, r0, p[s], b, acc[s]);
    for (int s = 0; s < ONE_ROW_STREAMS; s++) {
        _mm256_storeu_ps(out[s], acc[s][0]);
        _mm256_storeu_ps(out[s] + 8, acc[s][1]);
    }
}
#else
#define PANEL_ISA 0
#define TILE_ROWS 4
/* Portable: the same integers and the same chain, one element at a time. */
INLINE void micro(const Panels *w, const PanelRows *x, int r0, const int R, int p0, const int NP, float *out) {
    const int q4 = w->kind == PANEL_Q4_1, qbytes = panel_qbytes(w->kind);
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < NP; pp++)
            for (int o = 0; o < PANEL; o++) {
                float acc = 0.f;
                for (int b = 0; b < w->nb; b++) {
                    const int64_t xb = (int64_t)(r0 + r) * x->nb + b;
                    const int8_t *lb = x->limbs + xb * DIGITS_PER_BLOCK;
                    const uint8_t *rec = record(w, p0 + pp, b);
                    int32_t dsum[PANEL_LIMBS] = {0};
                    for (int j = 0; j < qbytes / 64; j++)
                        for (int i = 0; i < 4; i++) {
                            const int byte = rec[j * 64 + o * 4 + i];
                            for (int l = 0; l < PANEL_LIMBS; l++)
                                dsum[l] += q4 ? (byte & 0x0f) * lb[l * 32 + 4 * j + i] + (byte >> 4) * lb[l * 32 + 16 + 4 * j + i]
                                              : byte * lb[l * 32 + 4 * j + i];
                        }
                    if (!q4)
                        for (int l = 0; l < PANEL_LIMBS; l++) dsum[l] -= 128 * x->lsum[xb * 4 + l];
                    uint16_t half[2];
                    memcpy(half, rec + qbytes + 2 * o, 2);
                    if (q4) memcpy(half + 1, rec + qbytes + 32 + 2 * o, 2);
                    const float mn = q4 ? f16_to_f32(half[1]) : 0.f;
                    acc = chain_step(acc, dsum, f16_to_f32(half[0]), x->scale[xb], q4 ? &mn : NULL, x->xsum[xb]);
                }
                out[(r * NP + pp) * PANEL + o] = acc;
            }
}
#endif

/* acc [R][NP * 16], rows r0.. times panels p0.., stored into y (bias added, rounded to dt). */
static void store_rows(const Panels *w, const float *acc, int r0, int R, int p0, int NP, const float *bias, int dt,
                       void *y) {
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < NP; pp++)
            for (int o = 0; o < PANEL; o++) {
                const int out = (p0 + pp) * PANEL + o;
                if (out >= w->n) break;
                float v = acc[(r * NP + pp) * PANEL + o];
                if (bias) v += bias[out];
                const int64_t at = (int64_t)(r0 + r) * w->n + out;
                if (dt == DT_F32) ((float *)y)[at] = v;
                else ((uint16_t *)y)[at] = f32_to_bf16(v);
            }
}

/* Rows r0..r0+R-1 (R <= TILE_ROWS) times panels p0..p0+NP-1 (NP > 1 only for one row). */
static void tile_store(const Panels *w, const PanelRows *x, int r0, int R, int p0, int NP, const float *bias, int dt,
                       void *y) {
    float acc[TILE_ROWS * TASK_PANELS * PANEL];
    /* Literal sizes keep the sums in registers. */
#if PANEL_ISA == 256
    if (R == 1)
        for (int pp = 0; pp < NP; pp++) micro_row(w, x, r0, p0 + pp, acc + pp * PANEL);
    else if (R == 2) micro_rows(w, x, r0, 2, p0, acc);
    else if (R == 3) micro_rows(w, x, r0, 3, p0, acc);
    else micro_rows(w, x, r0, 4, p0, acc);
#else
    if (R == 1) {
        switch (NP) {
        case 1: micro(w, x, r0, 1, p0, 1, acc); break;
        case 2: micro(w, x, r0, 1, p0, 2, acc); break;
#if PANEL_ISA == 512
        case 3: micro(w, x, r0, 1, p0, 3, acc); break;
        default: micro(w, x, r0, 1, p0, 4, acc); break;
#else
        default: micro(w, x, r0, 1, p0, 2, acc), micro(w, x, r0, 1, p0 + 2, NP - 2, acc + 2 * PANEL); break;
#endif
        }
    } else {
        switch (R) {
        case 2: micro(w, x, r0, 2, p0, 1, acc); break;
        case 3: micro(w, x, r0, 3, p0, 1, acc); break;
        case 4: micro(w, x, r0, 4, p0, 1, acc); break;
#if TILE_ROWS >= 6
        case 5: micro(w, x, r0, 5, p0, 1, acc); break;
        case 6: micro(w, x, r0, 6, p0, 1, acc); break;
#endif
        default: break;
        }
    }
#endif
    store_rows(w, acc, r0, R, p0, NP, bias, dt, y);
}

/* One task: panels p0..p1-1 for rows r0..r1-1. A lone row: tiles of up to TASK_PANELS panels;
 * several: for each panel (its quants stay in L1), tiles of up to TILE_ROWS rows. */
static void run_task(const Panels *w, const PanelRows *x, int r0, int r1, int p0, int p1, const float *bias, int dt,
                     void *y) {
    if (r1 - r0 == 1) {
        for (int p = p0; p < p1; p += ONE_ROW_PANELS)
            tile_store(w, x, r0, 1, p, p1 - p < ONE_ROW_PANELS ? p1 - p : ONE_ROW_PANELS, bias, dt, y);
        return;
    }
#if PANEL_ISA == 512
    /* AVX-512, many rows: tiles of 2 rows x 2 panels, each digit's broadcast serving two
     * panels' products (a 512-row prefill's linears on one thread 0.94x the time of 6-row tiles
     * of one panel; 2 x 3, 2 x 4 and 3 x 3 no better, 4 x 2 worse). Below PAIR_MIN_ROWS the
     * weights stream from memory once per 6 rows instead (a 4-row decode step 1.15x slower in
     * pairs). The same chains, so the same bits. */
    for (; r1 - r0 >= PAIR_MIN_ROWS && p0 + 1 < p1; p0 += 2)
        for (int r = r0; r < r1; r += 2) {
            float acc[2 * 2 * PANEL];
            const int R = r1 - r < 2 ? 1 : 2;
            if (R == 2) micro(w, x, r, 2, p0, 2, acc);
            else micro(w, x, r, 1, p0, 2, acc);
            store_rows(w, acc, r, R, p0, 2, bias, dt, y);
        }
#endif
    for (int p = p0; p < p1; p++)
        for (int r = r0; r < r1; r += TILE_ROWS) {
            const int R = r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS;
            tile_store(w, x, r, R, p, 1, bias, dt, y);
        }
}

int panel_linear_panels(int kind, const PanelRows *rows, const uint8_t *records, const float *bias, int n, float *y,
                        int p0, int p1) {
    if (rows->m <= 0 || rows->k % 32) return -1;
    const Panels w = {kind, rows->k, rows->nb, n, (n + PANEL - 1) / PANEL, records};
#if PANEL_ISA == 256
    if (ONE_ROW_STREAMS > 1 && rows->m == 1 && p1 - p0 >= ONE_ROW_STREAMS) {
        /* The chunk in ONE_ROW_STREAMS runs, walked side by side; the remainder one by one. */
        const int len = (p1 - p0) / ONE_ROW_STREAMS;
        float acc[ONE_ROW_STREAMS * PANEL];
        for (int i = 0; i < len; i++) {
            int p[ONE_ROW_STREAMS];
            float *outs[ONE_ROW_STREAMS];
            for (int s = 0; s < ONE_ROW_STREAMS; s++) p[s] = p0 + s * len + i, outs[s] = acc + s * PANEL;
            multi_row(&w, rows, 0, p, outs);
            for (int s = 0; s < ONE_ROW_STREAMS; s++) store_rows(&w, acc + s * PANEL, 0, 1, p[s], 1, bias, DT_F32, y);
        }
        for (int p = p0 + ONE_ROW_STREAMS * len; p < p1; p++) tile_store(&w, rows, 0, 1, p, 1, bias, DT_F32, y);
        return 0;
    }
#endif
    for (int p = p0; p < p1; p += TASK_PANELS)
        run_task(&w, rows, 0, rows->m, p, p + TASK_PANELS < p1 ? p + TASK_PANELS : p1, bias, DT_F32, y);
    return 0;
}

/* Bytes of a panel repack for n output rows and k inputs (kind 0 = Q4_1, 1 = Q8_0). */
int64_t panel_bytes(int kind, int n, int k) {
    return (int64_t)((n + PANEL - 1) / PANEL) * (k / 32) * record_bytes(kind);
}

/*
 * x [m, k] (dtype dt) times the panel repack of W [n, k] (records [np][nb][320 | 544] uint8: a
 * block's quants, then its 16 rows' float16 scales and, Q4_1, minimums); y [m, n] (dtype dt) =
 * x W^T (+ bias [n] float32). k a multiple of 32. Returns 0, or -1 (bad shape, no memory).
 */
int panel_linear(int kind, const void *x, int m, int k, const uint8_t *records, const float *bias, int n, int dt,
                 void *y, int num_threads) {
    if (k % 32 || m <= 0 || n <= 0 || (kind != PANEL_Q4_1 && kind != PANEL_Q8_0)) return -1;
    void *scratch = aligned_alloc(64, align64(panel_rows_bytes(m, k)));
    float *xwide = dt == DT_F32 ? NULL : (float *)malloc(sizeof(float) * (size_t)m * (size_t)k);
    if (!scratch || (dt != DT_F32 && !xwide)) {
        free(scratch);
        free(xwide);
        return -1;
    }
    PanelRows rows;
    panel_rows_init(&rows, m, k, scratch);
    /* Each row by itself: the split changes no bits. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m >= 32)
    for (int i = 0; i < m; i++) {
        const float *xf = (const float *)x + (int64_t)i * k;
        if (xwide) {
            load_row(x, dt, (int64_t)i * k, k, xwide + (int64_t)i * k);
            xf = xwide + (int64_t)i * k;
        }
        panel_quantize_row(xf, &rows, i);
    }
    const Panels w = {kind, k, k / 32, n, (n + PANEL - 1) / PANEL, records};
    const int panel_tasks = (w.np + TASK_PANELS - 1) / TASK_PANELS;
    const int row_tasks = (m + TASK_ROWS - 1) / TASK_ROWS;
    const int tasks = panel_tasks * row_tasks;
    /* Dynamic tasks: a descheduled thread does not hold the call up. Each output element is
     * computed whole by the one task that owns it, so the schedule changes no result. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if ((int64_t)n * k * m >= (1 << 17))
    for (int t = 0; t < tasks; t++) {
        const int pt = t % panel_tasks, rt = t / panel_tasks;
        const int p0 = pt * TASK_PANELS, p1 = p0 + TASK_PANELS < w.np ? p0 + TASK_PANELS : w.np;
        const int r0 = rt * TASK_ROWS, r1 = r0 + TASK_ROWS < m ? r0 + TASK_ROWS : m;
        run_task(&w, &rows, r0, r1, p0, p1, bias, dt, y);
    }
    free(xwide);
    free(scratch);
    return 0;
}
