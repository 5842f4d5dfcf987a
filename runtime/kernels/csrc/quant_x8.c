/* int4 weights (quant.c's layout: blocks of 16 values in 8 bytes, byte j holding value j in its low nibble and value
 * j + 8 in its high one, each q + 8) against x quantized to 8 bits, as llama.cpp's Q4 kernels run them:
 * each block of 32 values of a row of x becomes q = round(x / d), d = max|x| / 127 (quant_linear.py's
 * quantize_activations), and a block's products are integers, summed exactly (vpmaddubsw: the unsigned nibbles u =
 * q_w + 8 times the signed q of x, in pairs; vpmaddwd: fours), then scaled once by d, and by the weight's scale at
 * each group's end; the -8 of every nibble comes in before that scale (x8_shifts), the offsets at the end, each
 * times the group's sum of the dequantized x. The result is quant_linear_ref's on the dequantized x, up to
 * summation order.
 *
 * Why: with AVX2 and no AVX-512 BF16 a weight-only int4 linear is bound by turning nibbles into floats (five
 * instructions per 16 values before its multiply-adds), not by memory: 6-8 GB/s of weights against 15-17 for
 * bfloat16's gemv. Here 64 values cost ten instructions, and the weights stream at 11-15 GB/s (one row of x, two
 * threads of an AVX2 EPYC). The rounding of x adds an error a twentieth of int4's own, 3x what rounding x to
 * bfloat16 does (tests/kernels/test_quant_x8.py measures them), which is why only int4 takes this path, and only in a
 * bfloat16 model (quant_linear.py's x8_runs): float32 keeps the exact weight-only sums the parity tests hold to 1e-4.
 *
 * K a multiple of 64 (one step: a 32-byte load of weights, two blocks of x); groups multiples of 64, of 32, or the
 * whole row. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tandem_cpu.h"

#define X8_BLOCK 32 /* values of x per scale d */
#define X8_STEP 64 /* values of k per step: 32 bytes of int4 weights */
#define X8_FEATURES 8 /* output features per block a thread takes */
#define X8_X_ROWS 4 /* rows of x per pass over a block's weights */

int tandem_quant_x8_runs(int format, int group_size, int K) {
    return format == TANDEM_QUANT_INT4 && K > 0 && K % X8_STEP == 0 &&
           (group_size % X8_STEP == 0 || group_size == X8_BLOCK || group_size >= K);
}

/* y's row m, features n .. n + count: the dots plus bias, and per group offset * (the group's sum of q * d). */
static void x8_store(const float *dots, int m, int64_t n, int count, int N, int groups, const float *offsets,
                     const float *xsums, const float *bias, float *y32, uint16_t *y16) {
    for (int r = 0; r < count; r++) {
        float value = dots[r] + (bias ? bias[n + r] : 0.0f);
        if (offsets) {
            const float *o = offsets + (n + r) * groups;
            float sums[4] = {0}; /* side by side: one chain of adds over 16 groups cost 10 % at one row of x */
            int g = 0;
            for (; g + 4 <= groups; g += 4)
                for (int j = 0; j < 4; j++) sums[j] += o[g + j] * xsums[g + j];
            for (; g < groups; g++) sums[0] += o[g] * xsums[g];
            value += (sums[0] + sums[1]) + (sums[2] + sums[3]);
        }
        const int64_t at = (int64_t)m * N + n + r;
        if (y32) y32[at] = value;
        else bf16_store(y16 + at, value);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float x8_sum(__m256 v);

/* Row x quantized into the steps' layout: of each 64 values, the 32 bytes of q that the low nibbles of a 32-byte
 * load of weights meet (values 0-7 and 16-23 of each block of 32: a block of 16 weights holds value j in byte j's
 * low nibble), then the 32 that its high nibbles meet (8-15, 24-31); `lanes`, per step, its two blocks' d four
 * times each (vpmaddwd's sums of the first block land in lanes 0-3); `sums`, per block, the sum of its q * d.
 * vcvtps2dq rounds to nearest, ties to even, as rintf and torch.round do. (One value at a time, this cost 45 us
 * a row at K = 8192, two-thirds of a 2048 x 8192 linear's weights.) */
static void x8_quantize_row(const float *x, int K, int8_t *ordered, float *lanes, float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < K; k += X8_STEP) {
        __m256i q[2][4];
        for (int half = 0; half < 2; half++) {
            const float *xs = x + k + half * X8_BLOCK;
            __m256 v[4], max = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xs + 8 * j);
                max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float scale = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))) / 127.0f;
            const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            __m256 total = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                q[half][j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
                total = _mm256_add_ps(total, _mm256_mul_ps(_mm256_cvtepi32_ps(q[half][j]), _mm256_set1_ps(scale)));
            }
            sums[(k + half * X8_BLOCK) / X8_BLOCK] = x8_sum(total);
            for (int lane = 0; lane < 4; lane++) lanes[k / 8 + half * 4 + lane] = scale;
        }
        /* |q| <= 127: the packs saturate nothing; they interleave 4-value pieces, which `order` puts back */
        for (int nibble = 0; nibble < 2; nibble++) {
            const __m256i first = _mm256_packs_epi32(q[0][nibble], q[0][nibble + 2]);
            const __m256i second = _mm256_packs_epi32(q[1][nibble], q[1][nibble + 2]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(first, second), order);
            _mm256_storeu_si256((__m256i *)(ordered + k + 32 * nibble), bytes);
        }
    }
}

static inline float x8_sum(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* dots[m * ROWS + r]: features n .. n + ROWS - 1 against M rows of x (ordered q and lanes K / 8 apart per row,
 * shifts 8 a span). Each feature's sums over a span (a group, or two groups of 32 lane by lane) take the span's
 * -8 terms (x8_shifts) and are scaled at its end. Inlined where M and ROWS are constants: ROWS * M <= 8
 * accumulators, each its own chain. */
static inline __attribute__((always_inline)) void x8_tile(const uint8_t *w, int64_t row_bytes, const float *scales,
                                                          int groups, int group, int64_t n, int K,
                                                          const int8_t *xq, const float *lanes,
                                                          const float *shifts, int spans, int M, int ROWS,
                                                          float *dots) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    const int span = group == X8_BLOCK ? X8_STEP : group; /* values between scalings */
    __m256 total[8];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) total[i] = _mm256_setzero_ps();
    const int groups_per_span = span / group; /* (a division per span, k0 / group, cost 15 % at one row of x) */
    for (int k0 = 0, g = 0, j = 0; k0 < K; k0 += span, g += groups_per_span, j++) {
        const int k1 = K - k0 < span ? K : k0 + span;
        __m256 part[8];
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) part[i] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k += X8_STEP) {
            /* x's step loaded once for every feature of the tile (as memory operands of each feature's products, the
             * loads were 7-15 % slower at one row of x) */
            __m256i x_low[X8_X_ROWS], x_high[X8_X_ROWS];
            __m256 d[X8_X_ROWS];
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                const int8_t *xs = xq + (int64_t)m * K + k;
                x_low[m] = _mm256_loadu_si256((const __m256i *)xs);
                x_high[m] = _mm256_loadu_si256((const __m256i *)(xs + 32));
                d[m] = _mm256_loadu_ps(lanes + (int64_t)m * (K / 8) + k / 8);
            }
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                const uint8_t *row = w + (n + r) * row_bytes;
                /* the same place in the next tile's rows, into L2, once per line (what quant.c's int8 steps do) */
                if ((k & 127) == 0) _mm_prefetch((const char *)(row + ROWS * row_bytes + k / 2), _MM_HINT_T1);
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + k / 2));
                const __m256i low = _mm256_and_si256(bytes, nibble);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
#pragma GCC unroll 4
                for (int m = 0; m < M; m++) {
                    /* u <= 15 and |q| <= 127: a pair's sum fits 16 bits (3,810), and so do two pairs' */
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low[m]),
                                                           _mm256_maddubs_epi16(high, x_high[m]));
                    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                    part[m * ROWS + r] = _mm256_fmadd_ps(sums, d[m], part[m * ROWS + r]);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) {
            const float *s = scales + (n + i % ROWS) * groups + g;
            part[i] = _mm256_add_ps(part[i], _mm256_loadu_ps(shifts + ((int64_t)(i / ROWS) * spans + j) * 8));
            const __m256 scale = group == X8_BLOCK ? _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0]))
                                                   : _mm256_set1_ps(s[0]);
            total[i] = _mm256_fmadd_ps(part[i], scale, total[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) dots[i] = x8_sum(total[i]);
}

/* dots[m * count + r] for count <= X8_FEATURES features from n and M <= X8_X_ROWS rows of x: tiles of ROWS
 * features (4 for one or two rows of x, 2 for three or four), the rest one at a time. */
static inline __attribute__((always_inline)) void x8_tiles(const uint8_t *w, int64_t row_bytes, const float *scales,
                                                           int groups, int group, int64_t n, int count, int K,
                                                           const int8_t *xq, const float *lanes,
                                                           const float *shifts, int spans, int M, int ROWS,
                                                           float *dots) {
    int r0 = 0;
    for (; r0 + ROWS <= count; r0 += ROWS) {
        float tile[8];
        x8_tile(w, row_bytes, scales, groups, group, n + r0, K, xq, lanes, shifts, spans, M, ROWS, tile);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < ROWS; r++) dots[m * count + r0 + r] = tile[m * ROWS + r];
    }
    for (; r0 < count; r0++) {
        float one[X8_X_ROWS];
        x8_tile(w, row_bytes, scales, groups, group, n + r0, K, xq, lanes, shifts, spans, M, 1, one);
        for (int m = 0; m < M; m++) dots[m * count + r0] = one[m];
    }
}

static void x8_dots(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group, int64_t n,
                    int count, int K, const int8_t *xq, const float *lanes, const float *shifts, int spans, int M,
                    float *dots) {
#define X8_TILES(ROWS_OF_X, ROWS)                                                                                \
    x8_tiles(w, row_bytes, scales, groups, group, n, count, K, xq, lanes, shifts, spans, ROWS_OF_X, ROWS, dots)
    switch (M) {
    case 1: X8_TILES(1, 4); break;
    case 2: X8_TILES(2, 4); break;
    case 3: X8_TILES(3, 2); break;
    default: X8_TILES(4, 2); break;
    }
#undef X8_TILES
}

/* Per row of x and span of x8_tile (a group, or two groups of 32), the -8 of every nibble: 8 lanes that x8_tile
 * adds to a feature's sums before the span's scale, lanes 0-3 each -8 / 4 times the sum of q * d over the span's
 * first blocks of 32 of each step, lanes 4-7 over its second ones (the lanes of a pair of groups of 32). */
static void x8_shifts(const float *sums, int K, int span, float *shifts) {
    for (int k0 = 0, j = 0; k0 < K; k0 += span, j++) {
        float first = 0.0f, second = 0.0f;
        for (int k = k0; k < K && k < k0 + span; k += X8_STEP) {
            first += sums[k / X8_BLOCK];
            second += sums[k / X8_BLOCK + 1];
        }
        for (int lane = 0; lane < 8; lane++) shifts[j * 8 + lane] = -2.0f * (lane < 4 ? first : second);
    }
}
#define X8_ORDERED 1
#else
/* The portable path: the same integer sums per block, one value at a time (q_w = u - 8 itself), xq in k's order
 * and lanes the d. */
static void x8_dots(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group, int64_t n,
                    int count, int K, const int8_t *xq, const float *lanes, const float *shifts, int spans, int M,
                    float *dots) {
    (void)shifts, (void)spans;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        for (int m = 0; m < M; m++) {
            const int8_t *xs = xq + (int64_t)m * K;
            const float *d = lanes + (int64_t)m * (K / X8_BLOCK);
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                const int k1 = K - g * group < group ? K : (g + 1) * group;
                float sum = 0.0f;
                for (int b = g * group / X8_BLOCK; b * X8_BLOCK < k1; b++) {
                    int32_t products = 0;
                    for (int k = b * X8_BLOCK; k < (b + 1) * X8_BLOCK; k++) {
                        const int byte = row[(k >> 4) * 8 + (k & 7)];
                        products += (((k & 8) ? byte >> 4 : byte & 15) - 8) * xs[k];
                    }
                    sum += (float)products * d[b];
                }
                total += sum * scales[(n + r) * groups + g];
            }
            dots[m * count + r] = total;
        }
    }
}
/* Block b of row x quantized: its q in k's order, its d, and the sum of its q * d (what the sums stand for). */
static float x8_quantize_block(const float *x, int8_t *q, float *d) {
    float max = 0.0f;
    for (int i = 0; i < X8_BLOCK; i++) max = fmaxf(max, fabsf(x[i]));
    const float scale = max / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    float sum = 0.0f;
    for (int i = 0; i < X8_BLOCK; i++) {
        const float value = rintf(x[i] * inverse); /* to nearest, ties to even: torch.round */
        q[i] = (int8_t)value;
        sum += value * scale;
    }
    *d = scale;
    return sum;
}

/* Row x quantized in k's order: q, d per block (`lanes`), and each block's sum of q * d. */
static void x8_quantize_row(const float *x, int K, int8_t *q, float *lanes, float *sums) {
    for (int b = 0; b < K / X8_BLOCK; b++)
        sums[b] = x8_quantize_block(x + b * X8_BLOCK, q + b * X8_BLOCK, lanes + b);
}
#define X8_ORDERED 0
#endif

/* Bytes rounded up to whole cache lines (aligned_alloc's size is a multiple of its alignment). */
static size_t x8_lines(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* y = x8(x) W^T (+ bias) into y32 (float32) or, where it is NULL, y16 (bfloat16); tandem_quant_x8_runs holds. */
static void quant_x8_gemm(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                          const float *x, const float *bias, float *y32, uint16_t *y16, int M, int N, int K,
                          int num_threads) {
    const int group = group_size < K ? group_size : K, groups = (K + group - 1) / group;
    const int64_t row_bytes = K / 2;
    const int lane_stride = X8_ORDERED ? K / 8 : K / X8_BLOCK; /* per row of x */
    const int span = group == X8_BLOCK ? X8_STEP : group, spans = (K + span - 1) / span;
    /* on cache lines: a step's loads of x each within one line (K is a multiple of 64) */
    int8_t *xq = aligned_alloc(64, x8_lines((size_t)M * (size_t)K));
    float *lanes = aligned_alloc(64, x8_lines(sizeof(float) * (size_t)M * (size_t)lane_stride));
    float *sums = malloc(sizeof(float) * (size_t)(K / X8_BLOCK));
    float *xsums = offsets ? malloc(sizeof(float) * (size_t)M * (size_t)groups) : NULL;
    float *shifts = X8_ORDERED ? malloc(sizeof(float) * 8 * (size_t)M * (size_t)spans) : NULL;
    for (int m = 0; m < M; m++) {
        x8_quantize_row(x + (int64_t)m * K, K, xq + (int64_t)m * K, lanes + (int64_t)m * lane_stride, sums);
#if X8_ORDERED
        x8_shifts(sums, K, span, shifts + (int64_t)m * spans * 8);
#endif
        for (int g = 0; xsums && g < groups; g++) { /* groups are whole blocks */
            float sum = 0.0f;
            for (int b = g * group / X8_BLOCK; b < K / X8_BLOCK && b < (g + 1) * group / X8_BLOCK; b++) sum += sums[b];
            xsums[(int64_t)m * groups + g] = sum;
        }
    }
    const int64_t blocks = (N + X8_FEATURES - 1) / X8_FEATURES;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = block * X8_FEATURES;
        const int count = N - n < X8_FEATURES ? (int)(N - n) : X8_FEATURES;
        for (int m0 = 0; m0 < M; m0 += X8_X_ROWS) {
            const int rows = M - m0 < X8_X_ROWS ? M - m0 : X8_X_ROWS;
            float dots[X8_FEATURES * X8_X_ROWS];
            x8_dots(w, row_bytes, scales, groups, group, n, count, K, xq + (int64_t)m0 * K,
                    lanes + (int64_t)m0 * lane_stride, shifts ? shifts + (int64_t)m0 * spans * 8 : NULL, spans, rows,
                    dots);
            for (int m = 0; m < rows; m++)
                x8_store(dots + m * count, m0 + m, n, count, N, groups, offsets,
                         xsums ? xsums + (int64_t)(m0 + m) * groups : NULL, bias, y32, y16);
        }
    }
    free(shifts);
    free(xq);
    free(lanes);
    free(sums);
    free(xsums);
}

void tandem_quant_x8_gemm(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                          const float *x, const float *bias, float *y, int M, int N, int K, int num_threads) {
    if (M < 1 || N < 1) return;
    quant_x8_gemm(w, scales, offsets, group_size, x, bias, y, NULL, M, N, K, num_threads);
}

/* x and y bfloat16 (a bfloat16 model's linear), y rounded once from the float32 sums. */
void tandem_quant_x8_gemm_bf16(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                               const uint16_t *x, const float *bias, uint16_t *y, int M, int N, int K,
                               int num_threads) {
    if (M < 1 || N < 1) return;
    float *wide = malloc(sizeof(float) * (size_t)M * (size_t)K);
    for (int64_t i = 0; i < (int64_t)M * K; i++) wide[i] = bf16_load(x + i);
    quant_x8_gemm(w, scales, offsets, group_size, wide, bias, NULL, y, M, N, K, num_threads);
    free(wide);
}
