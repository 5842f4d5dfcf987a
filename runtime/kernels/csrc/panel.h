/* The bfloat16 panel GEMM's inner steps, for cpu_native.c's panel_gemm and quant.c's converted panels: a panel
 * of TANDEM_PANEL output features laid out as pairs of k per feature, (K / 2, TANDEM_PANEL, 2), against a block of
 * rows of x in the outer-product form, each step of a pair of k one load of the panel's row and a broadcast per
 * row of x, the block's ROWS x 32 sums in 2 * ROWS registers. */
#ifndef TANDEM_PANEL_H
#define TANDEM_PANEL_H

#include <stdint.h>
#include <string.h>

#include "tandem_cpu.h"

#define PANEL_ROWS 12 /* rows of x per block: 24 accumulators */

/* A call for `rows` (1..PANEL_ROWS) rows, with the row count a constant in each case (so the accumulators stay in
 * registers). */
#define PANEL_CASES(CALL) \
    switch (rows) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); break; \
    }

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* ROWS rows of bfloat16 x (x_stride apart) against the panel's pairs of k from k0 to k1 (even), added into acc.
 * next: a panel to fetch into L2 meanwhile, a line pair every `passes` steps (or NULL). */
static inline __attribute__((always_inline)) void panel_bf16_steps(const uint16_t *w, const uint16_t *x,
                                                                  int64_t x_stride, int k0, int k1,
                                                                  const uint16_t *next, int passes,
                                                                  __m512 acc[][2], const int ROWS) {
    for (int k = k0, ahead = 0; k < k1; k += 2) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * TANDEM_PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * TANDEM_PANEL + 32);
        if (next && (k / 2) % passes == 0 && ahead < k1) {
            _mm_prefetch((const char *)(next + ahead * TANDEM_PANEL), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + ahead * TANDEM_PANEL + 32), _MM_HINT_T1);
            ahead += 2;
        }
        for (int r = 0; r < ROWS; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + k, sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
        }
    }
}
#endif

#endif
