/* Weight-only quantized linears for the decode batch: y = x W^T (+ bias) where W is stored as int8 (one
 * value per byte) or int4 (two values per byte, each nibble q + 8), with one float32 scale per output feature
 * and group of `group_size` k (the last group of a row may be partial). int4 rows are laid out in blocks of 16
 * values in 8 bytes: byte j of a block holds value j in its low nibble and value j + 8 in its high one, so
 * that zero-extending 8 bytes to 8 lanes gives values 0..7 (low nibbles) and 8..15 (high nibbles) in order,
 * with no shuffle; a row is padded to whole blocks.
 *
 * In registers, each group's integer values are converted to float32 and multiplied with x, and the group's
 * sum is scaled once at its end: exact products (|q| < 2^8) accumulated in float32, as quant_linear_ref's
 * float32 matmul of the dequantized weight, up to summation order. At one to a few rows the cost is
 * streaming the weights: int8 reads a quarter of float32's bytes, int4 an eighth.
 *
 * Threads split the output features in blocks of QUANT_ROWS; each block reads its weight rows from memory
 * once for every row of x (blocks of up to 4 rows of x read them again from L1). */

#include <stdint.h>

#include "tandem_cpu.h"

#define QUANT_ROWS 4 /* output features per block */
#define QUANT_X_ROWS 4 /* rows of x per pass over a block */

static inline float quant_at(const uint8_t *row, int bits, int k) {
    if (bits == 8) return (float)(int8_t)row[k];
    const int byte = row[(k >> 4) * 8 + (k & 7)];
    return (float)(((k & 8) ? byte >> 4 : byte & 15) - 8);
}

/* Bytes per row of W. */
static inline int64_t quant_row_bytes(int bits, int K) { return bits == 8 ? K : (K + 15) / 16 * 8; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float quant_sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* The 16 values of a row from k (a multiple of 16 for int4) as two vectors of 8 floats, not yet scaled. */
static inline __attribute__((always_inline)) void quant_load16(const uint8_t *row, int BITS, int k, __m256 *lo,
                                                               __m256 *hi) {
    if (BITS == 8) {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k))));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8))));
        return;
    }
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
    const __m256i eight = _mm256_set1_epi32(8);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), eight));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight));
}

/* dots[m * ROWS + r]: W's rows n..n+ROWS-1 against x's M rows; ROWS * M <= 4 vector accumulators, each its
 * own chain of multiply-adds. Inlined where BITS, ROWS and M are constants, so each case is unrolled. */
static inline __attribute__((always_inline)) void quant_block(const uint8_t *w, int64_t row_bytes,
                                                              const float *scales, int groups, int group_size,
                                                              int BITS, int64_t n, int K, const float *x, int M,
                                                              int ROWS, float *dots) {
    __m256 total[QUANT_ROWS];
    float tail_total[QUANT_ROWS] = {0};
#pragma GCC unroll 4
    for (int i = 0; i < ROWS * M; i++) total[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
        __m256 acc[QUANT_ROWS];
        float tail[QUANT_ROWS] = {0};
#pragma GCC unroll 4
        for (int i = 0; i < ROWS * M; i++) acc[i] = _mm256_setzero_ps();
        int k = k0;
        for (; k + 16 <= k1; k += 16) {
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) {
                /* The same place in the next block's rows: a row of a few hundred bytes ends before the
                 * hardware prefetcher has followed it. (A prefetch past the weights' end does not fault.) */
                _mm_prefetch((const char *)(w + (n + r + ROWS) * row_bytes + (BITS == 8 ? k : k / 2)), _MM_HINT_T0);
                __m256 lo, hi;
                quant_load16(w + (n + r) * row_bytes, BITS, k, &lo, &hi);
#pragma GCC unroll 4
                for (int m = 0; m < M; m++) {
                    const float *xs = x + (int64_t)m * K + k;
                    acc[m * ROWS + r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs), acc[m * ROWS + r]);
                    acc[m * ROWS + r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs + 8), acc[m * ROWS + r]);
                }
            }
        }
        for (; k < k1; k++)
            for (int r = 0; r < ROWS; r++) {
                const float weight = quant_at(w + (n + r) * row_bytes, BITS, k);
                for (int m = 0; m < M; m++) tail[m * ROWS + r] += weight * x[(int64_t)m * K + k];
            }
#pragma GCC unroll 4
        for (int i = 0; i < ROWS * M; i++) {
            const float scale = scales[(n + i % ROWS) * groups + g];
            total[i] = _mm256_fmadd_ps(acc[i], _mm256_set1_ps(scale), total[i]);
            tail_total[i] += tail[i] * scale;
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < ROWS * M; i++) dots[i] = quant_sum8(total[i]) + tail_total[i];
}

/* dots[m * count + r] for the `count` <= QUANT_ROWS features from n and M <= QUANT_X_ROWS rows of x. */
static inline __attribute__((always_inline)) void quant_rows(const uint8_t *w, int64_t row_bytes,
                                                             const float *scales, int groups, int group_size,
                                                             int BITS, int64_t n, int count, int K, const float *x,
                                                             int M, float *dots) {
    if (M == 1 && count == 4) {
        quant_block(w, row_bytes, scales, groups, group_size, BITS, n, K, x, 1, 4, dots);
        return;
    }
    if (M == 2 && count % 2 == 0) {
        for (int r0 = 0; r0 < count; r0 += 2) {
            float two[4];
            quant_block(w, row_bytes, scales, groups, group_size, BITS, n + r0, K, x, 2, 2, two);
            for (int m = 0; m < 2; m++)
                for (int r = 0; r < 2; r++) dots[m * count + r0 + r] = two[m * 2 + r];
        }
        return;
    }
    for (int r = 0; r < count; r++) {
        float one[QUANT_X_ROWS];
        switch (M) {
        case 1: quant_block(w, row_bytes, scales, groups, group_size, BITS, n + r, K, x, 1, 1, one); break;
        case 2: quant_block(w, row_bytes, scales, groups, group_size, BITS, n + r, K, x, 2, 1, one); break;
        case 3: quant_block(w, row_bytes, scales, groups, group_size, BITS, n + r, K, x, 3, 1, one); break;
        default: quant_block(w, row_bytes, scales, groups, group_size, BITS, n + r, K, x, 4, 1, one); break;
        }
        for (int m = 0; m < M; m++) dots[m * count + r] = one[m];
    }
}

static void quant_rows8(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                        int64_t n, int count, int K, const float *x, int M, float *dots) {
    quant_rows(w, row_bytes, scales, groups, group_size, 8, n, count, K, x, M, dots);
}

static void quant_rows4(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                        int64_t n, int count, int K, const float *x, int M, float *dots) {
    quant_rows(w, row_bytes, scales, groups, group_size, 4, n, count, K, x, M, dots);
}
#else
/* The portable path: the same sums, one weight at a time. */
static void quant_portable(const uint8_t *w, int bits, int64_t row_bytes, const float *scales, int groups,
                           int group_size, int64_t n, int count, int K, const float *x, int M, float *dots) {
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        for (int m = 0; m < M; m++) {
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
                float sum = 0.0f;
                for (int k = k0; k < k1; k++) sum += quant_at(row, bits, k) * x[(int64_t)m * K + k];
                total += sum * scales[(n + r) * groups + g];
            }
            dots[m * count + r] = total;
        }
    }
}

static void quant_rows8(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                        int64_t n, int count, int K, const float *x, int M, float *dots) {
    quant_portable(w, 8, row_bytes, scales, groups, group_size, n, count, K, x, M, dots);
}

static void quant_rows4(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                        int64_t n, int count, int K, const float *x, int M, float *dots) {
    quant_portable(w, 4, row_bytes, scales, groups, group_size, n, count, K, x, M, dots);
}
#endif

void tandem_quant_gemm(const uint8_t *w, int bits, const float *scales, int group_size, const float *x,
                       const float *bias, float *y, int M, int N, int K, int num_threads) {
    if (M < 1 || N < 1) return;
    const int64_t row_bytes = quant_row_bytes(bits, K);
    const int groups = K > 0 ? (K + group_size - 1) / group_size : 0;
    const int64_t blocks = (N + QUANT_ROWS - 1) / QUANT_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = block * QUANT_ROWS;
        const int count = N - n < QUANT_ROWS ? (int)(N - n) : QUANT_ROWS;
        for (int m0 = 0; m0 < M; m0 += QUANT_X_ROWS) {
            const int rows = M - m0 < QUANT_X_ROWS ? M - m0 : QUANT_X_ROWS;
            const float *xs = x + (int64_t)m0 * K;
            float dots[QUANT_ROWS * QUANT_X_ROWS];
            if (bits == 8) quant_rows8(w, row_bytes, scales, groups, group_size, n, count, K, xs, rows, dots);
            else quant_rows4(w, row_bytes, scales, groups, group_size, n, count, K, xs, rows, dots);
            for (int m = 0; m < rows; m++)
                for (int r = 0; r < count; r++)
                    y[(int64_t)(m0 + m) * N + n + r] = dots[m * count + r] + (bias ? bias[n + r] : 0.0f);
        }
    }
}
