/* int4 weights (quant.c's layout: blocks of 16 values in 8 bytes, byte j holding value j in its low nibble and value
 * j + 8 in its high one, each q + 8) against x quantized to integers, with the integer products llama.cpp's Q4
 * kernels use: each block of 32 values of a row of x is d = max|x| / 127 times x / d = q + r / 256, q = round(x / d)
 * and r = round((x / d - q) * 256) two 8-bit integers (quant_linear.py's quantize_activations: within d / 256 of x,
 * 16 bits a block where bfloat16 keeps 8 a value). A block's products are integers, summed exactly (vpmaddubsw: the
 * unsigned nibbles u = q_w + 8 times the signed q, and again r, in pairs; vpmaddwd: fours; then q's sums * 256 + r's),
 * scaled once by d / 256, and by the weight's scale at each group's end; the -8 of every nibble comes in before that
 * scale (x16_shifts), the offsets at the end, each times the group's sum of the quantized x. The result is
 * quant_linear_ref's on the quantized x, up to summation order.
 *
 * Why: with AVX2 and no AVX-512 BF16 a weight-only int4 linear is bound by turning nibbles into floats (five
 * instructions per 16 values before its multiply-adds), not by memory: 6-8 GB/s of weights against 15-20 for
 * bfloat16's gemv (two threads of an AVX2 EPYC). Here 64 values cost sixteen instructions. The rounding of x adds an
 * error a hundredth of what rounding x to bfloat16 does (tests/kernels/test_quant_x16.py); q alone (8-bit
 * activations, as llama.cpp's) measured 1.5x faster still at 4 to 16 rows of x, but 3x bfloat16's error, past the
 * bounds a bfloat16 model is held to against HF. Only a bfloat16 model takes this path (quant_linear.py's x16_runs):
 * float32 keeps the exact weight-only sums the parity tests hold to 1e-4.
 *
 * K a multiple of 64 (one step: a 32-byte load of weights, two blocks of x); groups multiples of 64, of 32, or the
 * whole row. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tandem_cpu.h"

#define X16_BLOCK 32 /* values of x per scale d */
#define X16_FINE 256.0f /* r's unit: d / 256 (x / d = q + r / 256) */
#define X16_STEP 64 /* values of k per step: 32 bytes of int4 weights */
#define X16_FEATURES 8 /* output features per block a thread takes */
#define X16_X_ROWS 4 /* rows of x per pass over a block's weights */

int tandem_quant_x16_runs(int format, int group_size, int K) {
    return format == TANDEM_QUANT_INT4 && K > 0 && K % X16_STEP == 0 &&
           (group_size % X16_STEP == 0 || group_size == X16_BLOCK || group_size >= K);
}

/* y's row m, features n .. n + count: the dots plus bias, and per group offset * (the group's sum of the quantized
 * x). */
static void x16_store(const float *dots, int m, int64_t n, int count, int N, int groups, const float *offsets,
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

static inline float x16_sum(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off") /* x / d - q exactly as torch computes it: a fused x * (1 / d) - q would not */

/* Row x quantized into the steps' layout: of each 64 values, 128 bytes, q's plane then r's (x16_quantize_block), each
 * as the low nibbles of a 32-byte load of weights meet it (values 0-7 and 16-23 of each block of 32: a block of 16
 * weights holds value j in byte j's low nibble), then as its high nibbles do (8-15, 24-31); `lanes`, per step, its
 * two blocks' d / 256 four times each (vpmaddwd's sums of the first block land in lanes 0-3); `sums`, per block, the
 * sum of its values. vcvtps2dq rounds to nearest, ties to even, as rintf and torch.round do. (One value at a time,
 * this cost 45 us a row at K = 8192, two-thirds of a 2048 x 8192 linear's weights.) */
static void x16_quantize_row(const float *x, int K, int8_t *ordered, float *lanes, float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), most = _mm256_set1_epi32(127);
    for (int k = 0; k < K; k += X16_STEP) {
        __m256i planes[2][2][4]; /* [q or r][block][8 values] */
        for (int half = 0; half < 2; half++) {
            const float *xs = x + k + half * X16_BLOCK;
            __m256 v[4], max = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xs + 8 * j);
                max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float scale = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))) / 127.0f;
            const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            const __m256 unit = _mm256_set1_ps(scale / X16_FINE);
            __m256 total = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                const __m256 scaled = _mm256_mul_ps(v[j], inverse);
                const __m256i q = _mm256_cvtps_epi32(scaled);
                /* |scaled - q| <= 1/2, exact; times 256, exact; 128 (a tie of x / d) clamps to 127 */
                const __m256 rest =
                    _mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(q)), _mm256_set1_ps(X16_FINE));
                const __m256i r = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(rest), most),
                                                   _mm256_sub_epi32(_mm256_setzero_si256(), most));
                planes[0][half][j] = q;
                planes[1][half][j] = r;
                const __m256i value = _mm256_add_epi32(_mm256_slli_epi32(q, 8), r);
                total = _mm256_add_ps(total, _mm256_mul_ps(_mm256_cvtepi32_ps(value), unit));
            }
            sums[(k + half * X16_BLOCK) / X16_BLOCK] = x16_sum(total);
            for (int lane = 0; lane < 4; lane++) lanes[k / 8 + half * 4 + lane] = scale / X16_FINE;
        }
        /* |q|, |r| <= 127: the packs saturate nothing; they interleave 4-value pieces, which `order` puts back */
        for (int plane = 0; plane < 2; plane++)
            for (int nibble = 0; nibble < 2; nibble++) {
                const __m256i first = _mm256_packs_epi32(planes[plane][0][nibble], planes[plane][0][nibble + 2]);
                const __m256i second = _mm256_packs_epi32(planes[plane][1][nibble], planes[plane][1][nibble + 2]);
                const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(first, second), order);
                _mm256_storeu_si256((__m256i *)(ordered + 2 * k + 64 * plane + 32 * nibble), bytes);
            }
    }
}
#pragma GCC pop_options

/* dots[m * ROWS + r]: features n .. n + ROWS - 1 against M rows of x (ordered planes 2K bytes and lanes K / 8 apart,
 * shifts 8 a span). Each feature's sums over a span (a group, or two groups of 32 lane by lane) take the span's
 * -8 terms (x16_shifts) and are scaled at its end. Inlined where M and ROWS are constants: ROWS * M <= 8
 * accumulators, each its own chain. */
static inline __attribute__((always_inline)) void x16_tile(const uint8_t *w, int64_t row_bytes, const float *scales,
                                                           int groups, int group, int64_t n, int K,
                                                           const int8_t *xq, const float *lanes,
                                                           const float *shifts, int spans, int M, int ROWS,
                                                           float *dots) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    const int span = group == X16_BLOCK ? X16_STEP : group; /* values between scalings */
    __m256 total[8];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) total[i] = _mm256_setzero_ps();
    const int groups_per_span = span / group; /* (a division per span, k0 / group, cost 15 % at one row of x) */
    for (int k0 = 0, g = 0, j = 0; k0 < K; k0 += span, g += groups_per_span, j++) {
        const int k1 = K - k0 < span ? K : k0 + span;
        __m256 part[8];
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) part[i] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k += X16_STEP) {
            /* x's step loaded once for every feature of the tile (as memory operands of each feature's products, the
             * loads were 7-15 % slower at one row of x) */
            __m256i x_low[X16_X_ROWS], x_high[X16_X_ROWS], r_low[X16_X_ROWS], r_high[X16_X_ROWS];
            __m256 d[X16_X_ROWS];
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                const int8_t *xs = xq + (int64_t)m * 2 * K + 2 * k;
                x_low[m] = _mm256_loadu_si256((const __m256i *)xs);
                x_high[m] = _mm256_loadu_si256((const __m256i *)(xs + 32));
                r_low[m] = _mm256_loadu_si256((const __m256i *)(xs + 64));
                r_high[m] = _mm256_loadu_si256((const __m256i *)(xs + 96));
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
                    /* u <= 15 and |q|, |r| <= 127: a pair's sum fits 16 bits (3,810), and so do two pairs'; a lane's
                     * 8 products of q (15,240 at most) times 256 plus r's fit 32 bits */
                    const __m256i q_pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low[m]),
                                                             _mm256_maddubs_epi16(high, x_high[m]));
                    const __m256i r_pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, r_low[m]),
                                                             _mm256_maddubs_epi16(high, r_high[m]));
                    const __m256 sums = _mm256_cvtepi32_ps(
                        _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(q_pairs, ones), 8),
                                         _mm256_madd_epi16(r_pairs, ones)));
                    part[m * ROWS + r] = _mm256_fmadd_ps(sums, d[m], part[m * ROWS + r]);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) {
            const float *s = scales + (n + i % ROWS) * groups + g;
            part[i] = _mm256_add_ps(part[i], _mm256_loadu_ps(shifts + ((int64_t)(i / ROWS) * spans + j) * 8));
            const __m256 scale = group == X16_BLOCK ? _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0]))
                                                   : _mm256_set1_ps(s[0]);
            total[i] = _mm256_fmadd_ps(part[i], scale, total[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) dots[i] = x16_sum(total[i]);
}

/* dots[m * count + r] for count <= X16_FEATURES features from n and M <= X16_X_ROWS rows of x: tiles of ROWS
 * features (4 for one or two rows of x, 2 for three or four), the rest one at a time. */
static inline __attribute__((always_inline)) void x16_tiles(const uint8_t *w, int64_t row_bytes, const float *scales,
                                                            int groups, int group, int64_t n, int count, int K,
                                                            const int8_t *xq, const float *lanes,
                                                            const float *shifts, int spans, int M, int ROWS,
                                                            float *dots) {
    int r0 = 0;
    for (; r0 + ROWS <= count; r0 += ROWS) {
        float tile[8];
        x16_tile(w, row_bytes, scales, groups, group, n + r0, K, xq, lanes, shifts, spans, M, ROWS, tile);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < ROWS; r++) dots[m * count + r0 + r] = tile[m * ROWS + r];
    }
    for (; r0 < count; r0++) {
        float one[X16_X_ROWS];
        x16_tile(w, row_bytes, scales, groups, group, n + r0, K, xq, lanes, shifts, spans, M, 1, one);
        for (int m = 0; m < M; m++) dots[m * count + r0] = one[m];
    }
}

static void x16_dots(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group, int64_t n,
                     int count, int K, const int8_t *xq, const float *lanes, const float *shifts, int spans, int M,
                     float *dots) {
#define X16_TILES(ROWS_OF_X, ROWS)                                                                                \
    x16_tiles(w, row_bytes, scales, groups, group, n, count, K, xq, lanes, shifts, spans, ROWS_OF_X, ROWS, dots)
    switch (M) {
    case 1: X16_TILES(1, 4); break;
    case 2: X16_TILES(2, 4); break;
    case 3: X16_TILES(3, 2); break;
    default: X16_TILES(4, 2); break;
    }
#undef X16_TILES
}

/* Per row of x and span of x16_tile (a group, or two groups of 32), the -8 of every nibble: 8 lanes that x16_tile
 * adds to a feature's sums before the span's scale, lanes 0-3 each -8 / 4 times the sum of q * d over the span's
 * first blocks of 32 of each step, lanes 4-7 over its second ones (the lanes of a pair of groups of 32). */
static void x16_shifts(const float *sums, int K, int span, float *shifts) {
    for (int k0 = 0, j = 0; k0 < K; k0 += span, j++) {
        float first = 0.0f, second = 0.0f;
        for (int k = k0; k < K && k < k0 + span; k += X16_STEP) {
            first += sums[k / X16_BLOCK];
            second += sums[k / X16_BLOCK + 1];
        }
        for (int lane = 0; lane < 8; lane++) shifts[j * 8 + lane] = -2.0f * (lane < 4 ? first : second);
    }
}
#define X16_ORDERED 1
#else
/* The portable path: the same integer sums per block, one value at a time (q_w = u - 8 itself), x's values
 * q * 256 + r in k's order (16 bits each, in the 2K bytes a row) and lanes the d / 256 per block. */
static void x16_dots(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group, int64_t n,
                     int count, int K, const int8_t *xq, const float *lanes, const float *shifts, int spans, int M,
                     float *dots) {
    (void)shifts, (void)spans;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        for (int m = 0; m < M; m++) {
            const int16_t *xs = (const int16_t *)(xq + (int64_t)m * 2 * K);
            const float *d = lanes + (int64_t)m * (K / X16_BLOCK);
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                const int k1 = K - g * group < group ? K : (g + 1) * group;
                float sum = 0.0f;
                for (int b = g * group / X16_BLOCK; b * X16_BLOCK < k1; b++) {
                    int32_t products = 0;
                    for (int k = b * X16_BLOCK; k < (b + 1) * X16_BLOCK; k++) {
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

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off") /* x / d - q exactly as torch computes it: a fused x * (1 / d) - q would not */

/* Block b of row x quantized: each value x / d = q + r / 256 (d = max|x| / 127; q = round(x / d), r = round((x / d - q)
 * * 256) clamped to [-127, 127], both to nearest, ties to even: torch.round), stored as q * 256 + r; d / 256 into
 * *unit; returns the sum of the block's values (q * 256 + r) * d / 256. */
static float x16_quantize_block(const float *x, int16_t *values, float *unit) {
    float max = 0.0f;
    for (int i = 0; i < X16_BLOCK; i++) max = fmaxf(max, fabsf(x[i]));
    const float scale = max / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    *unit = scale / X16_FINE;
    float sum = 0.0f;
    for (int i = 0; i < X16_BLOCK; i++) {
        const float scaled = x[i] * inverse, q = rintf(scaled);
        const float r = fminf(fmaxf(rintf((scaled - q) * X16_FINE), -127.0f), 127.0f);
        values[i] = (int16_t)(q * X16_FINE + r);
        sum += (float)values[i] * *unit;
    }
    return sum;
}
#pragma GCC pop_options

/* Row x quantized in k's order (x16_quantize_block), its d / 256 per block into `lanes`, and each block's sum. */
static void x16_quantize_row(const float *x, int K, int8_t *xq, float *lanes, float *sums) {
    for (int b = 0; b < K / X16_BLOCK; b++)
        sums[b] = x16_quantize_block(x + b * X16_BLOCK, (int16_t *)xq + b * X16_BLOCK, lanes + b);
}
#define X16_ORDERED 0
#endif

/* Bytes rounded up to whole cache lines (aligned_alloc's size is a multiple of its alignment). */
static size_t x16_lines(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* y = x16(x) W^T (+ bias) into y32 (float32) or, where it is NULL, y16 (bfloat16); tandem_quant_x16_runs holds. */
static void quant_x16_gemm(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                           const float *x, const float *bias, float *y32, uint16_t *y16, int M, int N, int K,
                           int num_threads) {
    const int group = group_size < K ? group_size : K, groups = (K + group - 1) / group;
    const int64_t row_bytes = K / 2;
    const int lane_stride = X16_ORDERED ? K / 8 : K / X16_BLOCK; /* per row of x */
    const int span = group == X16_BLOCK ? X16_STEP : group, spans = (K + span - 1) / span;
    /* on cache lines: a step's loads of x each within one line (K is a multiple of 64) */
    int8_t *xq = aligned_alloc(64, x16_lines((size_t)M * 2 * (size_t)K)); /* two bytes a value */
    float *lanes = aligned_alloc(64, x16_lines(sizeof(float) * (size_t)M * (size_t)lane_stride));
    float *sums = malloc(sizeof(float) * (size_t)(K / X16_BLOCK));
    float *xsums = offsets ? malloc(sizeof(float) * (size_t)M * (size_t)groups) : NULL;
    float *shifts = X16_ORDERED ? malloc(sizeof(float) * 8 * (size_t)M * (size_t)spans) : NULL;
    for (int m = 0; m < M; m++) {
        x16_quantize_row(x + (int64_t)m * K, K, xq + (int64_t)m * 2 * K, lanes + (int64_t)m * lane_stride, sums);
#if X16_ORDERED
        x16_shifts(sums, K, span, shifts + (int64_t)m * spans * 8);
#endif
        for (int g = 0; xsums && g < groups; g++) { /* groups are whole blocks */
            float sum = 0.0f;
            for (int b = g * group / X16_BLOCK; b < K / X16_BLOCK && b < (g + 1) * group / X16_BLOCK; b++)
                sum += sums[b];
            xsums[(int64_t)m * groups + g] = sum;
        }
    }
    const int64_t blocks = (N + X16_FEATURES - 1) / X16_FEATURES;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = block * X16_FEATURES;
        const int count = N - n < X16_FEATURES ? (int)(N - n) : X16_FEATURES;
        for (int m0 = 0; m0 < M; m0 += X16_X_ROWS) {
            const int rows = M - m0 < X16_X_ROWS ? M - m0 : X16_X_ROWS;
            float dots[X16_FEATURES * X16_X_ROWS];
            x16_dots(w, row_bytes, scales, groups, group, n, count, K, xq + (int64_t)m0 * 2 * K,
                    lanes + (int64_t)m0 * lane_stride, shifts ? shifts + (int64_t)m0 * spans * 8 : NULL, spans, rows,
                    dots);
            for (int m = 0; m < rows; m++)
                x16_store(dots + m * count, m0 + m, n, count, N, groups, offsets,
                         xsums ? xsums + (int64_t)(m0 + m) * groups : NULL, bias, y32, y16);
        }
    }
    free(shifts);
    free(xq);
    free(lanes);
    free(sums);
    free(xsums);
}

void tandem_quant_x16_gemm(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                           const float *x, const float *bias, float *y, int M, int N, int K, int num_threads) {
    if (M < 1 || N < 1) return;
    quant_x16_gemm(w, scales, offsets, group_size, x, bias, y, NULL, M, N, K, num_threads);
}

/* x and y bfloat16 (a bfloat16 model's linear), y rounded once from the float32 sums. */
void tandem_quant_x16_gemm_bf16(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                                const uint16_t *x, const float *bias, uint16_t *y, int M, int N, int K,
                                int num_threads) {
    if (M < 1 || N < 1) return;
    float *wide = malloc(sizeof(float) * (size_t)M * (size_t)K);
    for (int64_t i = 0; i < (int64_t)M * K; i++) wide[i] = bf16_load(x + i);
    quant_x16_gemm(w, scales, offsets, group_size, wide, bias, NULL, y, M, N, K, num_threads);
    free(wide);
}
