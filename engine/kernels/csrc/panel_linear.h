/* The batch invariant block linear (panel_linear.c), as the fused float32 step (panel_step.c)
 * calls it: rows quantized once (panel_quantize_rows), then ranges of panels. */
#ifndef PORTICO_PANEL_LINEAR_H
#define PORTICO_PANEL_LINEAR_H
#include <stddef.h>
#include <stdint.h>

#ifndef PANEL_LIMBS
#define PANEL_LIMBS 2 /* int8 digits an input is written in (3: |X| <= 2^20, a third more products) */
#endif

/* Float32 rows [m, k] in the kernel's integer form. Per row and block b of 32 inputs: the block's
 * scale s (a power of two, from its largest magnitude), each input x as X = rint(x / s), |X| <=
 * 2^13, written as two signed digits X = b * 2^7 + c with b, c in [-64, 64] (limbs
 * [row][b][digit c, b][32]; PANEL_LIMBS 3 adds a third, a * 2^14, for |X| <= 2^20); the digits'
 * sums per block (lsum [row][b][4]: Q8_0's offset); and s * sum(X) (xsum [row][b]: Q4_1's
 * minimum term). */
typedef struct {
    int8_t *limbs;
    float *scale, *xsum;
    int32_t *lsum;
    int m, k, nb;
} PanelRows;

size_t panel_rows_bytes(int m, int k);
/* Point rows' arrays into scratch (panel_rows_bytes(m, k) bytes, 64-byte aligned). */
void panel_rows_init(PanelRows *rows, int m, int k, void *scratch);
/* Row i of rows from float32 x [k]. */
void panel_quantize_row(const float *x, const PanelRows *rows, int i);
/* Rows 0..m-1 of rows times panels p0..p1-1 into float32 y [m, n] (bias added when given).
 * Returns -1 for a shape this entry does not take. */
int panel_linear_panels(int kind, const PanelRows *rows, const uint8_t *records, const float *bias, int n, float *y,
                        int p0, int p1);
/* Bytes of the panel records of a weight [n, k] (kind 0 = Q4_1, 1 = Q8_0). */
int64_t panel_bytes(int kind, int n, int k);
#endif
