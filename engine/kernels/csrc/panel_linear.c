/* panel_linear: y = x W^T for W in GGUF Q4_1 / Q8_0 blocks, batch invariant by construction.
 *
 * The weights are repacked once (engine/models/block_linear.py, GGUFBlocks.pack_panels) into
 * panels of 16 output rows: for each panel and each block of 32 inputs, the 16 rows' quants side
 * by side (Q4_1: 16 bytes per pair of inputs kk and kk + 16, low nibble kk, high nibble kk + 16;
 * Q8_0: 16 bytes per input), then the 16 rows' scales (and minimums). The vectors run across
 * output rows, so every output element is one scalar chain, the same whatever the step:
 *
 *     acc = 0
 *     for each block b:                       (in order)
 *         t = 0
 *         for each input j of b:              (Q4_1: 0, 16, 1, 17, ..., 15, 31; Q8_0: 0..31)
 *             t = fma(x[j], q[j], t)          (q the small integer, exact in float32)
 *         acc = fma(t, d_b, acc)
 *         acc = fma(m_b, sum(x in b), acc)    (Q4_1; the sum in input order, once per row)
 *     y = acc (+ bias)
 *
 * The rows of a step, how many rows share a tile, how the output rows are split across threads,
 * the vector width: none of them changes a single element's operations, so a request's logits do
 * not depend on what else is in its step. The AVX2 path and the portable one (fmaf) compute the
 * same bits; AVX-512 CPUs run the AVX2 path (a wider one would compute the same bits too).
 */
#include "common.h"

#define PANEL 16
#define ROW_TILE 5      /* x rows per micro-tile (tiles of 1 row take 4 panels at once) */
#define TASK_PANELS 4   /* panels per thread task */
#define TASK_ROWS 64    /* x rows per thread task: a task's x rows stay in L2 */
#define WIDE_TILE 6     /* x rows per micro-tile on an unpacked panel: 12 chains of 8 outputs */
#define UNPACK_MIN_ROWS 12 /* a task with this many rows unpacks each panel to floats first */
#define CHUNK_BLOCKS 8  /* blocks of a panel unpacked at a time: 16 KiB of floats, kept in L1 */
enum { PANEL_Q4_1 = 0, PANEL_Q8_0 = 1 };

typedef struct {
    int kind, k, nb, n, np;
    const uint8_t *q;  /* [np][nb][qbytes] */
    const float *d;    /* [np][nb][16] */
    const float *mn;   /* [np][nb][16] (Q4_1) or NULL */
} Panels;

static inline int panel_qbytes(int kind) { return kind == PANEL_Q4_1 ? 256 : 512; }

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__)
/* Eight output rows' quants of input pair kk (Q4_1: lo = input kk, hi = input kk + 16) or of
 * input kk (Q8_0: lo only), as float32. */
INLINE void q4_pair(const uint8_t *qb, int kk, int v, __m256 *lo, __m256 *hi) {
    const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + kk * PANEL + v * 8)));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, _mm256_set1_epi32(0x0f)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
}

INLINE __m256 q8_one(const uint8_t *qb, int j, int v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + j * PANEL + v * 8))));
}

/* R rows (r0..) times NP panels (p0..), all blocks, into acc[r][pp * 16 + o] (zeroed here). */
INLINE void micro(const Panels *w, const float *xf, const float *xs, int r0, const int R, int p0, const int NP,
                  float *acc) {
    const int qbytes = panel_qbytes(w->kind);
    for (int i = 0; i < R * NP * PANEL; i++) acc[i] = 0.f;
    for (int b = 0; b < w->nb; b++) {
        __m256 t[ROW_TILE][8];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 2 * NP; v++) t[r][v] = _mm256_setzero_ps();
        const float *xb[ROW_TILE];
        for (int r = 0; r < R; r++) xb[r] = xf + (int64_t)(r0 + r) * w->k + b * 32;
        const uint8_t *qb[4];
        for (int pp = 0; pp < NP; pp++) qb[pp] = w->q + ((int64_t)(p0 + pp) * w->nb + b) * qbytes;
        /* A panel's two weight vectors are unpacked at a time and each x value is broadcast
         * once per panel: the chains (R * 2 * NP <= 10 vectors) stay in registers. */
        if (w->kind == PANEL_Q4_1) {
            for (int kk = 0; kk < 16; kk++)
                for (int pp = 0; pp < NP; pp++) {
                    __m256 lo0, hi0, lo1, hi1;
                    q4_pair(qb[pp], kk, 0, &lo0, &hi0);
                    q4_pair(qb[pp], kk, 1, &lo1, &hi1);
                    for (int r = 0; r < R; r++) {
                        const __m256 xl = _mm256_broadcast_ss(xb[r] + kk);
                        t[r][2 * pp] = _mm256_fmadd_ps(xl, lo0, t[r][2 * pp]);
                        t[r][2 * pp + 1] = _mm256_fmadd_ps(xl, lo1, t[r][2 * pp + 1]);
                        const __m256 xh = _mm256_broadcast_ss(xb[r] + kk + 16);
                        t[r][2 * pp] = _mm256_fmadd_ps(xh, hi0, t[r][2 * pp]);
                        t[r][2 * pp + 1] = _mm256_fmadd_ps(xh, hi1, t[r][2 * pp + 1]);
                    }
                }
        } else {
            for (int j = 0; j < 32; j++)
                for (int pp = 0; pp < NP; pp++) {
                    const __m256 w0 = q8_one(qb[pp], j, 0), w1 = q8_one(qb[pp], j, 1);
                    for (int r = 0; r < R; r++) {
                        const __m256 xv = _mm256_broadcast_ss(xb[r] + j);
                        t[r][2 * pp] = _mm256_fmadd_ps(xv, w0, t[r][2 * pp]);
                        t[r][2 * pp + 1] = _mm256_fmadd_ps(xv, w1, t[r][2 * pp + 1]);
                    }
                }
        }
        for (int pp = 0; pp < NP; pp++) {
            const int64_t at = ((int64_t)(p0 + pp) * w->nb + b) * PANEL;
            for (int v = 0; v < 2; v++) {
                const __m256 d = _mm256_loadu_ps(w->d + at + v * 8);
                const __m256 m = w->mn ? _mm256_loadu_ps(w->mn + at + v * 8) : _mm256_setzero_ps();
                for (int r = 0; r < R; r++) {
                    float *dst = acc + (r * NP + pp) * PANEL + v * 8;
                    __m256 a = _mm256_fmadd_ps(t[r][pp * 2 + v], d, _mm256_loadu_ps(dst));
                    if (w->mn) a = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + (int64_t)(r0 + r) * w->nb + b), a);
                    _mm256_storeu_ps(dst, a);
                }
            }
        }
    }
}

#define HAVE_UNPACKED 1
/* Blocks b0..b1-1 of panel p as float32 into wf, in each element's chain order: per block, per
 * step s of the chain (Q4_1: inputs 0, 16, 1, 17, ..., 15, 31; Q8_0: 0..31), the 16 outputs.
 * The quants are small integers: exact in float32, so the products are the ones above. */
static void unpack_panel(const Panels *w, int p, int b0, int b1, float *wf) {
    const int qbytes = panel_qbytes(w->kind);
    for (int b = b0; b < b1; b++) {
        const uint8_t *qb = w->q + ((int64_t)p * w->nb + b) * qbytes;
        float *dst = wf + (b - b0) * 32 * PANEL;
        for (int s = 0; s < 32; s++)
            for (int v = 0; v < 2; v++) {
                __m256 lo, hi;
                if (w->kind == PANEL_Q4_1) {
                    if (s & 1) continue; /* s and s + 1 come from the same bytes */
                    q4_pair(qb, s / 2, v, &lo, &hi);
                    _mm256_storeu_ps(dst + s * PANEL + v * 8, lo);
                    _mm256_storeu_ps(dst + (s + 1) * PANEL + v * 8, hi);
                } else {
                    _mm256_storeu_ps(dst + s * PANEL + v * 8, q8_one(qb, s, v));
                }
            }
    }
}

/* The x values of a tile of R rows (r0..) in the chains' step order, rows side by side:
 * xt[(b * 32 + s) * R + i] is the input that step s of block b multiplies for row r0 + i, and
 * xst[b * R + i] that row's block sum. A tile's broadcasts then read one stream, and the values
 * (copied, not computed) are the ones the chains read from x. */
static void pack_tile(const Panels *w, const float *xf, const float *xs, int r0, int R, float *xt, float *xst) {
    for (int i = 0; i < R; i++) {
        const float *xr = xf + (int64_t)(r0 + i) * w->k;
        for (int b = 0; b < w->nb; b++) {
            float *dst = xt + (int64_t)b * 32 * R + i;
            for (int s = 0; s < 32; s++) {
                const int j = w->kind == PANEL_Q4_1 ? (s >> 1) + ((s & 1) << 4) : s;
                dst[s * R] = xr[b * 32 + j];
            }
            if (xs) xst[b * R + i] = xs[(int64_t)(r0 + i) * w->nb + b];
        }
    }
}

/* R rows of a packed tile (xt, xst) times unpacked blocks b0..b1-1 (wf) of panel p, added into
 * acc[r][16] (the running sums, zeroed by the caller before block 0). The same chains as micro:
 * per block, t over the 32 steps in order, then acc = fma(t, d, acc) and the minimum's term.
 * All R rows take a step before the next one, so the 2R chains (12 vectors) hide the FMA
 * latency, and the weights come from L1 once per R rows instead of being unpacked per tile. */
INLINE void micro_unpacked(const Panels *w, const float *wf, const float *xt, const float *xst, const int R,
                           int p, int b0, int b1, float *acc) {
    for (int b = b0; b < b1; b++) {
        __m256 t[WIDE_TILE][2];
        for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm256_setzero_ps();
        const float *wb = wf + (b - b0) * 32 * PANEL, *xb = xt + (int64_t)b * 32 * R;
#pragma GCC unroll 4
        for (int s = 0; s < 32; s++) {
            const __m256 w0 = _mm256_loadu_ps(wb + s * PANEL), w1 = _mm256_loadu_ps(wb + s * PANEL + 8);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(xb + s * R + r);
                t[r][0] = _mm256_fmadd_ps(xv, w0, t[r][0]);
                t[r][1] = _mm256_fmadd_ps(xv, w1, t[r][1]);
            }
        }
        const int64_t at = ((int64_t)p * w->nb + b) * PANEL;
        for (int v = 0; v < 2; v++) {
            const __m256 d = _mm256_loadu_ps(w->d + at + v * 8);
            const __m256 m = w->mn ? _mm256_loadu_ps(w->mn + at + v * 8) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                float *dst = acc + r * PANEL + v * 8;
                __m256 a = _mm256_fmadd_ps(t[r][v], d, _mm256_loadu_ps(dst));
                if (w->mn) a = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xst + b * R + r), a);
                _mm256_storeu_ps(dst, a);
            }
        }
    }
}
#else
/* Portable: the same chains, one element at a time (fmaf rounds once, as the vector FMA does). */
INLINE void micro(const Panels *w, const float *xf, const float *xs, int r0, const int R, int p0, const int NP,
                  float *acc) {
    const int qbytes = panel_qbytes(w->kind);
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < NP; pp++)
            for (int o = 0; o < PANEL; o++) {
                const float *xr = xf + (int64_t)(r0 + r) * w->k;
                float a = 0.f;
                for (int b = 0; b < w->nb; b++) {
                    const uint8_t *qb = w->q + ((int64_t)(p0 + pp) * w->nb + b) * qbytes;
                    const int64_t at = ((int64_t)(p0 + pp) * w->nb + b) * PANEL + o;
                    float t = 0.f;
                    if (w->kind == PANEL_Q4_1) {
                        for (int kk = 0; kk < 16; kk++) {
                            const uint8_t byte = qb[kk * PANEL + o];
                            t = fmaf(xr[b * 32 + kk], (float)(byte & 0x0f), t);
                            t = fmaf(xr[b * 32 + kk + 16], (float)(byte >> 4), t);
                        }
                    } else {
                        for (int j = 0; j < 32; j++) t = fmaf(xr[b * 32 + j], (float)((const int8_t *)qb)[j * PANEL + o], t);
                    }
                    a = fmaf(t, w->d[at], a);
                    if (w->mn) a = fmaf(w->mn[at], xs[(int64_t)(r0 + r) * w->nb + b], a);
                }
                acc[(r * NP + pp) * PANEL + o] = a;
            }
}
#endif

/* acc [R][NP * 16], rows r0.. times panels p0..p0+NP-1, stored into y (bias added, rounded to dt). */
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

/* Rows r0..r0+R-1 times panels p0..p0+NP-1, stored into y (bias added, rounded to dt). */
static void tile_store(const Panels *w, const float *xf, const float *xs, int r0, int R, int p0, int NP,
                       const float *bias, int dt, void *y) {
    float acc[ROW_TILE * TASK_PANELS * PANEL]; /* >= R * NP * PANEL */
    /* Literal sizes let the compiler keep the chains in registers. */
#define MICRO_NP(RR)                                                                      \
    switch (NP) {                                                                          \
    case 1: micro(w, xf, xs, r0, RR, p0, 1, acc); break;                                   \
    case 2: micro(w, xf, xs, r0, RR, p0, 2, acc); break;                                   \
    case 3: micro(w, xf, xs, r0, RR, p0, 3, acc); break;                                   \
    default: micro(w, xf, xs, r0, RR, p0, 4, acc); break;                                  \
    }
    switch (R) {
    case 1: MICRO_NP(1) break;
    case 2: micro(w, xf, xs, r0, 2, p0, 1, acc); break;
    case 3: micro(w, xf, xs, r0, 3, p0, 1, acc); break;
    case 4: micro(w, xf, xs, r0, 4, p0, 1, acc); break;
    default: micro(w, xf, xs, r0, 5, p0, 1, acc); break;
    }
#undef MICRO_NP
    store_rows(w, acc, r0, R, p0, NP, bias, dt, y);
}

#ifdef HAVE_UNPACKED
/* One task of at least UNPACK_MIN_ROWS rows, its x rows packed tile by tile (pack_rows): each panel is unpacked to floats CHUNK_BLOCKS blocks at a time, and every tile of up to
 * WIDE_TILE rows runs over the chunk while it is in L1; each row's running sums wait in acc
 * between chunks (stored and reloaded exactly), so each element's chain is still the one above,
 * block by block in order. */
static void run_task_unpacked(const Panels *w, const float *xf, const float *xs, int r0, int r1, int p0, int p1,
                              const float *bias, int dt, void *y, const float *xt, const float *xst) {
    float wf[CHUNK_BLOCKS * 32 * PANEL];
    float acc[TASK_ROWS * PANEL];
    for (int p = p0; p < p1; p++) {
        memset(acc, 0, sizeof(float) * (size_t)(r1 - r0) * PANEL);
        for (int b0 = 0; b0 < w->nb; b0 += CHUNK_BLOCKS) {
            const int b1 = b0 + CHUNK_BLOCKS < w->nb ? b0 + CHUNK_BLOCKS : w->nb;
            unpack_panel(w, p, b0, b1, wf);
            for (int r = r0; r < r1; r += WIDE_TILE) {
                float *a = acc + (r - r0) * PANEL;
                const float *tx = xt + (int64_t)r * w->k, *ts = xst ? xst + (int64_t)r * w->nb : NULL;
                switch (r1 - r < WIDE_TILE ? r1 - r : WIDE_TILE) { /* literal sizes: chains in registers */
                case 1: micro_unpacked(w, wf, tx, ts, 1, p, b0, b1, a); break;
                case 2: micro_unpacked(w, wf, tx, ts, 2, p, b0, b1, a); break;
                case 3: micro_unpacked(w, wf, tx, ts, 3, p, b0, b1, a); break;
                case 4: micro_unpacked(w, wf, tx, ts, 4, p, b0, b1, a); break;
                case 5: micro_unpacked(w, wf, tx, ts, 5, p, b0, b1, a); break;
                default: micro_unpacked(w, wf, tx, ts, 6, p, b0, b1, a); break;
                }
            }
        }
        store_rows(w, acc, r0, r1 - r0, p, 1, bias, dt, y);
    }
}

/* Rows r0..r1-1 (one row task) packed for run_task_unpacked: the tile at row r (up to WIDE_TILE
 * rows) at xt[r * k] and xst[r * nb]. */
static void pack_rows(const Panels *w, const float *xf, const float *xs, int r0, int r1, float *xt, float *xst) {
    for (int r = r0; r < r1; r += WIDE_TILE)
        pack_tile(w, xf, xs, r, r1 - r < WIDE_TILE ? r1 - r : WIDE_TILE, xt + (int64_t)r * w->k,
                  xst ? xst + (int64_t)r * w->nb : NULL);
}
#endif

/* One task: panels p0..p1-1 for rows r0..r1-1. Several rows: tiles of up to ROW_TILE rows and
 * one panel; a lone row: tiles of one row and up to TASK_PANELS panels (enough chains to hide
 * the FMA latency). Either way each element's chain is the one above. */
static void run_task(const Panels *w, const float *xf, const float *xs, int r0, int r1, int p0, int p1,
                     const float *bias, int dt, void *y, const float *xt, const float *xst) {
#ifdef HAVE_UNPACKED
    if (r1 - r0 >= UNPACK_MIN_ROWS) {
        run_task_unpacked(w, xf, xs, r0, r1, p0, p1, bias, dt, y, xt, xst);
        return;
    }
#endif
    for (int r = r0; r < r1; r += ROW_TILE) {
        const int R = r1 - r < ROW_TILE ? r1 - r : ROW_TILE;
        if (R == 1) {
            for (int p = p0; p < p1; p += TASK_PANELS)
                tile_store(w, xf, xs, r, 1, p, p1 - p < TASK_PANELS ? p1 - p : TASK_PANELS, bias, dt, y);
        } else {
            for (int p = p0; p < p1; p++) tile_store(w, xf, xs, r, R, p, 1, bias, dt, y);
        }
    }
}

/* A float32 row's block sums (k / 32 of them, each in input order), as Q4_1's minimums need
 * them: panel_linear and the fused step (panel_step.c) both call this. */
void panel_block_sums(const float *x, int k, float *xs) {
    for (int b = 0; b < k / 32; b++) {
        float s = 0.f;
        for (int j = 0; j < 32; j++) s += x[b * 32 + j];
        xs[b] = s;
    }
}

/* Rows 0..m-1 (m < UNPACK_MIN_ROWS) of float32 x [m, k] (block sums xs [m, k / 32] for Q4_1)
 * times panels p0..p1-1 of the repack, into float32 y [m, n]: the tasks of panel_linear, whose
 * elements' chains do not depend on which panels a call takes (the fused step hands panels to
 * its threads in chunks). Returns -1 for a row count this entry does not take. */
int panel_linear_panels(int kind, const float *x, const float *xs, int m, int k, const uint8_t *q, const float *d,
                        const float *mn, const float *bias, int n, float *y, int p0, int p1) {
    if (m <= 0 || m >= UNPACK_MIN_ROWS) return -1;
    const Panels w = {kind, k, k / 32, n, (n + PANEL - 1) / PANEL, q, d, mn};
    for (int p = p0; p < p1; p += TASK_PANELS)
        run_task(&w, x, xs, 0, m, p, p + TASK_PANELS < p1 ? p + TASK_PANELS : p1, bias, DT_F32, y, NULL, NULL);
    return 0;
}

/* Bytes of a panel repack for n output rows and k inputs (kind 0 = Q4_1, 1 = Q8_0). */
int64_t panel_qs_bytes(int kind, int n, int k) {
    return (int64_t)((n + PANEL - 1) / PANEL) * (k / 32) * panel_qbytes(kind);
}

/*
 * x [m, k] (dtype dt) times the panel repack (q [np][nb][256 | 512] uint8, d and mn [np][nb][16]
 * float32, mn NULL for Q8_0) of W [n, k]; y [m, n] (dtype dt) = x W^T (+ bias [n] float32).
 * k a multiple of 32. Returns 0, or -1 (bad shape, no memory).
 */
int panel_linear(int kind, const void *x, int m, int k, const uint8_t *q, const float *d, const float *mn,
                 const float *bias, int n, int dt, void *y, int num_threads) {
    if (k % 32 || m <= 0 || n <= 0 || (kind == PANEL_Q4_1) != (mn != NULL)) return -1;
    const int nb = k / 32;
    /* float32 rows are read in place; bf16 ones widened once. Q4_1 needs each block's sum. */
    float *xwide = dt == DT_F32 ? NULL : (float *)malloc(sizeof(float) * (size_t)m * (size_t)k);
    float *xs = kind == PANEL_Q4_1 ? (float *)malloc(sizeof(float) * (size_t)m * (size_t)nb) : NULL;
    if ((dt != DT_F32 && !xwide) || (kind == PANEL_Q4_1 && !xs)) {
        free(xwide);
        free(xs);
        return -1;
    }
    const float *xf = xwide ? xwide : (const float *)x;
    /* Each row by itself (one thread, sums in input order): the split changes no bits. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m >= 32)
    for (int i = 0; i < m; i++) {
        if (xwide) load_row(x, dt, (int64_t)i * k, k, xwide + (int64_t)i * k);
        if (xs) panel_block_sums(xf + (int64_t)i * k, k, xs + (int64_t)i * nb);
    }
    const Panels w = {kind, k, nb, n, (n + PANEL - 1) / PANEL, q, d, mn};
    const int panel_tasks = (w.np + TASK_PANELS - 1) / TASK_PANELS;
    const int row_tasks = (m + TASK_ROWS - 1) / TASK_ROWS;
    const int tasks = panel_tasks * row_tasks;
    float *xt = NULL, *xst = NULL; /* x packed for the tasks on unpacked panels, once per call */
#ifdef HAVE_UNPACKED
    if (m >= UNPACK_MIN_ROWS) {
        xt = (float *)malloc(sizeof(float) * (size_t)m * (size_t)k);
        xst = xs ? (float *)malloc(sizeof(float) * (size_t)m * (size_t)nb) : NULL;
        if (!xt || (xs && !xst)) {
            free(xwide), free(xs), free(xt), free(xst);
            return -1;
        }
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int rt = 0; rt < row_tasks; rt++) {
            const int r0 = rt * TASK_ROWS, r1 = r0 + TASK_ROWS < m ? r0 + TASK_ROWS : m;
            if (r1 - r0 >= UNPACK_MIN_ROWS) pack_rows(&w, xf, xs, r0, r1, xt, xst);
        }
    }
#endif
    /* Dynamic tasks: a descheduled thread does not hold the call up. Each output element is
     * computed whole by the one task that owns it, so the schedule changes no result. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if ((int64_t)n * k * m >= (1 << 17))
    for (int t = 0; t < tasks; t++) {
        const int pt = t % panel_tasks, rt = t / panel_tasks;
        const int p0 = pt * TASK_PANELS, p1 = p0 + TASK_PANELS < w.np ? p0 + TASK_PANELS : w.np;
        const int r0 = rt * TASK_ROWS, r1 = r0 + TASK_ROWS < m ? r0 + TASK_ROWS : m;
        run_task(&w, xf, xs, r0, r1, p0, p1, bias, dt, y, xt, xst);
    }
    free(xwide);
    free(xs);
    free(xt);
    free(xst);
    return 0;
}
