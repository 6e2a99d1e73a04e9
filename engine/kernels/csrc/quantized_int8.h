/* The int8-activation block linears (quantized_int8.c), shared with the fused decode step
 * (decode_step.c), which calls their parts inside its own parallel region.
 */
#ifndef PORTICO_QUANTIZED_INT8_H
#define PORTICO_QUANTIZED_INT8_H
#include "common.h"

enum { Q8_KIND_Q4_1 = 0, Q8_KIND_Q8_0 = 1 };

/* Activation rows quantized to int8 per block of 32 values (d = amax / 127, q = round(x / d)),
 * laid out in the order the kernel of `kind` reads them (see quantize_rows_q8). */
typedef struct {
    int kind, m, k, nb;
    int8_t *q;   /* [m, k] */
    float *dpat;  /* [m, nb / 2, 16]: each pair of blocks' scales as the lanes of its products */
    float *xspat; /* [m, nb / 2, 16]: d * sum(q) of each block / 8 on its lanes (Q8_0: * -128) */
} Q8Rows;

/* One weight matrix [n, k] in GGUF blocks of 32, packed by q8_pack. */
typedef struct {
    int kind, n, k, nb;
    const uint8_t *packed;
} Q8Weights;

/* Bytes q8_pack writes for a [n, k] matrix of `kind`. */
size_t q8_packed_bytes(int kind, int n, int k);
/* Repack GGUF blocks (Q4_1 qs [n, k/2] with d, mins [n, k/32] float32; Q8_0 qs [n, k] int8 with
 * d [n, k/32]) into the int8 kernel's tile records. 0, or -2 when k % 64 != 0. */
int q8_pack(int kind, int n, int k, const uint8_t *qs, const float *d, const float *mins, uint8_t *out);

/* Whether this build has the int8 path (AVX512-VNNI and BW, or AVX2 with FMA and F16C) and k
 * suits it (k % 64 == 0). */
int q8_supported(int k);
/* Bytes of scratch a Q8Rows of m rows of k values needs (see q8_rows_init). */
size_t q8_rows_bytes(int m, int k);
/* Point rows' arrays into scratch (q8_rows_bytes(m, k) bytes, 64-byte aligned). */
void q8_rows_init(Q8Rows *rows, int kind, int m, int k, void *scratch);
/* Quantize x [m, k] (dtype dt, row stride k) into rows. Serial: a few microseconds. */
void quantize_rows_q8(Q8Rows *rows, const void *x, int dt);
/* The same for rows r_begin..r_end-1, blocks of 32 b_begin..b_end-1 only (any split of the
 * work gives the same rows). */
void quantize_blocks_q8(Q8Rows *rows, const void *x, int dt, int r_begin, int r_end, int b_begin, int b_end);
/* Tiles of 4 output rows in w (the unit of work a thread takes). */
int q8_num_tiles(const Q8Weights *w);
/* Packed bytes of one tile. */
int q8_tile_bytes(const Q8Weights *w);
/* y [m, n] (dtype dt, row stride ldy) = x W^T (+ bias float32), output tiles t_begin..t_end-1. */
void q8_linear_range(const Q8Weights *w, const Q8Rows *x, const float *bias, int dt, void *y,
                     int64_t ldy, int t_begin, int t_end);
#endif /* PORTICO_QUANTIZED_INT8_H */
