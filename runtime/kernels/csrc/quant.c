/* Weight-only quantized linears: y = x W^T (+ bias) where W (N, K) is stored as
 * - int8 (TANDEM_QUANT_INT8): one value per byte;
 * - int4 (TANDEM_QUANT_INT4): two values per byte, each nibble q + 8, in blocks of 16 values in 8 bytes: byte j of
 *   a block holds value j in its low nibble and value j + 8 in its high one, so that zero-extending 8 bytes to 8
 *   lanes gives values 0..7 (low nibbles) and 8..15 (high nibbles) in order, with no shuffle; a row is padded to
 *   whole blocks;
 * - FP8 e4m3fn (TANDEM_QUANT_FP8): one value per byte (no infinities; 0x7f and 0xff are NaN; subnormals);
 * with one float32 scale, and optionally one float32 offset, per output feature and group of `group_size` k (the
 * last group of a row may be partial): w = q * scale (+ offset).
 *
 * In registers, each group's raw values are converted to float32 and multiplied with x, and the group's sum is
 * scaled once at its end: exact products accumulated in float32, as quant_linear_ref's float32 matmul of the
 * dequantized weight, up to summation order. The offsets come in at the end as offset * (the group's sum of x),
 * one multiply-add per group; int4's steps of one block and single values sum its unsigned nibbles u = q + 8,
 * and their -8 comes in the same way (as -8 * scale), which saves two subtractions per 16 values. With AVX-512,
 * int4's steps of two blocks (float32) and four (bfloat16, where x holds bfloat16 values and the CPU has AVX-512
 * BF16: each product is exact in float32 still) look q up from the nibble directly, one permute per 16 or 32
 * values; one row of x takes eight blocks a step (quant_int4_wide). At one to a few rows the cost is streaming
 * the weights: int8 and FP8 read a quarter of float32's bytes, int4 an eighth.
 *
 * Threads split the output features in blocks of QUANT_ROWS; each block reads its weight rows from memory once
 * for every row of x (blocks of up to 4 rows of x read them again from L1); with AVX2 but not AVX-512, batches
 * from 17 rows (int8's from 24) expand a block's weights to float32 once instead and run outer products on them,
 * prefills included (quant_expands). Elsewhere a prefill runs tandem_quant_dequantize on panels of rows and a
 * float32 GEMM on each (quant_linear.py). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "panel.h"
#include "tandem_cpu.h"

#define QUANT_ROWS 8 /* output features per block */
#define QUANT_CONVERT_ROWS 12 /* per block of converted rows (quant_bf16_rows), at least QUANT_ROWS */
#define QUANT_PANEL TANDEM_PANEL /* per block of converted rows laid out as a panel (quant_panel_dots) */
/* Rows of x per pass over a block, and vector accumulators of a block (ROWS x M). With AVX-512's 32 registers,
 * passes of 8 rows (16 accumulators) and blocks of 4 x 4 measured no faster than these (2048 x 512 int8 / int4
 * weights in L2, one thread: 8 rows in one pass 176-185 / 267-309 us, in two of 4 rows 160-175 / 260-300). */
#define QUANT_X_ROWS 4
#define QUANT_ACCUMULATORS 8

/* Whether one row of x against int4 weights runs quant_int4_wide's steps of eight blocks (with AVX-512 BF16, and x
 * of bfloat16 values): K whole steps of 128 values, and the groups whole steps too or 32 or 64 values (GGUF's Q4_0
 * and Q4_K are groups of 32). */
static inline int quant_wide(int format, int M, int group_size, int K) {
#if defined(__AVX512BF16__)
    return format == TANDEM_QUANT_INT4 && M == 1 && K % 128 == 0 &&
           (group_size % 128 == 0 || group_size >= K || group_size == 32 || group_size == 64);
#else
    (void)format, (void)M, (void)group_size, (void)K;
    return 0;
#endif
}

/* FP8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9). */
static inline float quant_fp8(uint8_t byte) {
    const int magnitude = byte & 0x7f;
    float value;
    if (magnitude == 0x7f) value = NAN;
    else if (magnitude < 8) value = ldexpf((float)magnitude, -9);
    else value = ldexpf((float)(8 + (magnitude & 7)), (magnitude >> 3) - 10);
    return byte & 0x80 ? -value : value;
}

/* The raw value at k: int8 q, int4 u = q + 8 (the -8 comes in per group), FP8 the value. */
static inline float quant_at(const uint8_t *row, int format, int k) {
    if (format == TANDEM_QUANT_INT8) return (float)(int8_t)row[k];
    if (format == TANDEM_QUANT_FP8) return quant_fp8(row[k]);
    const int byte = row[(k >> 4) * 8 + (k & 7)];
    return (float)((k & 8) ? byte >> 4 : byte & 15);
}

/* Bytes per row of W. */
static inline int64_t quant_row_bytes(int format, int K) {
    return format == TANDEM_QUANT_INT4 ? (int64_t)(K + 15) / 16 * 8 : K;
}

/* What a raw value is short of q (int4 stores q + 8): added per group as shift * scale * (the group's sum of x). */
static inline float quant_shift(int format) { return format == TANDEM_QUANT_INT4 ? -8.0f : 0.0f; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The vector path loads FP8 as float16 (bits << 7: exponent and mantissa land in place, subnormals included,
 * which F16C converts exactly) worth value / 256; the group's scale takes the 256 back. */
#define QUANT_FP8_UNIT 256.0f

static inline float quant_vector_unit(int format) { return format == TANDEM_QUANT_FP8 ? QUANT_FP8_UNIT : 1.0f; }

#if defined(__AVX512F__)
/* AVX-512: the 16 values of a step in one vector. Built only where the CPU has AVX-512 (-march=native): the
 * development machine (AVX2) has never run this branch; tests/kernels/test_quant_linear.py checks it where it
 * builds. */
typedef __m512 quant_vec;
#define QUANT_LANES 16
#define qv_zero _mm512_setzero_ps
#define qv_set1 _mm512_set1_ps
#define qv_loadu _mm512_loadu_ps
#define qv_storeu _mm512_storeu_ps
#define qv_fmadd _mm512_fmadd_ps
#define qv_mul _mm512_mul_ps
#define qv_add _mm512_add_ps
static inline float qv_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
/* bfloat16 q = u - 8 for each nibble u, twice: the values of a nibble as vpermw looks them up by 5 bits */
#define QUANT_NIBBLES_BF16                                                                                         \
    _mm512_set_epi16(0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0xbf80, 0xc000, 0xc040,      \
                     0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000,      \
                     0x3f80, 0x0000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100)
#else
typedef __m256 quant_vec;
#define QUANT_LANES 8
#define qv_zero _mm256_setzero_ps
#define qv_set1 _mm256_set1_ps
#define qv_loadu _mm256_loadu_ps
#define qv_storeu _mm256_storeu_ps
#define qv_fmadd _mm256_fmadd_ps
#define qv_mul _mm256_mul_ps
#define qv_add _mm256_add_ps
static inline float qv_sum(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}
#endif
#define QUANT_VECS (16 / QUANT_LANES) /* vectors per step of 16 values */

/* FP8 bytes (16-bit lanes) as float16 bits worth value / 256: 0x7f / 0xff (NaN) all ones, a float16 NaN. */
static inline __m256i quant_fp8_halves(__m256i bytes) {
    const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7f));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                         _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8));
    return _mm256_or_si256(half, _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7f)));
}

/* The 16 raw values of a row from k (a multiple of 16 for int4) as QUANT_VECS vectors (FP8: / 256). */
static inline __attribute__((always_inline)) void quant_load16(const uint8_t *row, int FORMAT, int k,
                                                               quant_vec *v) {
#if defined(__AVX512F__)
    if (FORMAT == TANDEM_QUANT_INT8) {
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k))));
    } else if (FORMAT == TANDEM_QUANT_FP8) {
        v[0] = _mm512_cvtph_ps(quant_fp8_halves(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + k)))));
    } else { /* the block's 8 bytes in lanes 0-7 and again in 8-15: low nibbles, then high ones */
        const __m128i eight = _mm_loadl_epi64((const __m128i *)(row + k / 2));
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(eight, eight));
        const __m512i shifts = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
        v[0] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bytes, shifts), _mm512_set1_epi32(15)));
    }
#else
    if (FORMAT == TANDEM_QUANT_INT8) {
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k))));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8))));
    } else if (FORMAT == TANDEM_QUANT_FP8) {
        const __m256i half = quant_fp8_halves(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + k))));
        v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
        v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    } else {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        v[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
#endif
}

/* dots[m * ROWS + r]: W's rows n..n+ROWS-1 against x's M rows (raw values, scaled per group); ROWS * M <=
 * QUANT_ACCUMULATORS vector accumulators, each its own chain of multiply-adds. Inlined where FORMAT, ROWS and M are
 * constants, so each case is unrolled. With AVX-512, int4 takes two blocks (16 bytes) a step where xperm holds x
 * in quant_permute's order: one widening gives 16 lanes whose low nibbles are the blocks' values 0-7 and whose
 * high nibbles are their values 8-15, half the instructions per value of a block at a time. */
static inline __attribute__((always_inline)) void quant_block(const uint8_t *w, int64_t row_bytes,
                                                              const float *scales, int groups, int group_size,
                                                              int FORMAT, int64_t n, int K, const float *x,
                                                              const float *xperm, const uint16_t *xbf, int M,
                                                              int ROWS, float *dots) {
    (void)xperm, (void)xbf; /* read by the AVX-512 int4 steps only */
    const int value_bytes = FORMAT == TANDEM_QUANT_INT4 ? 2 : 1; /* values per byte's step in k */
    const float unit = quant_vector_unit(FORMAT);
    quant_vec total[QUANT_ACCUMULATORS];
    float tail_total[QUANT_ACCUMULATORS] = {0};
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) total[i] = qv_zero();
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
        quant_vec acc[QUANT_ACCUMULATORS];
        float tail[QUANT_ACCUMULATORS] = {0};
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) acc[i] = qv_zero();
        int k = k0;
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
        /* four blocks a step in bfloat16, against x in quant_pack_bf16's order */
        if (FORMAT == TANDEM_QUANT_INT4 && xbf)
            for (; k + 64 <= k1; k += 64) {
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    /* Into L2 for blocks of 4 features (two rows of x; 16 x 8192 x 2048 int4 weights from
                     * memory, 2 threads of an AVX-512 EPYC: 9.2-10.1 ms into L1, 6.5-7.3 into L2), into L1 for
                     * one feature at a time (one row of x), which measured slower into L2. */
                    if (((k / 2) & 63) == 0) {
                        const char *line = (const char *)(w + (n + r + ROWS) * row_bytes + k / 2);
                        if (ROWS >= 4) _mm_prefetch(line, _MM_HINT_T1);
                        else _mm_prefetch(line, _MM_HINT_T0);
                    }
                    const __m512i bytes = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(w + (n + r) * row_bytes + k / 2)));
                    /* vpermw reads the low 5 bits of each index: the table repeats its 16 values */
                    const __m512bh low = (__m512bh)_mm512_permutexvar_epi16(bytes, QUANT_NIBBLES_BF16);
                    const __m512bh high =
                        (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), QUANT_NIBBLES_BF16);
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++) {
                        const uint16_t *xs = xbf + (int64_t)m * K + k;
                        acc[m * ROWS + r] = _mm512_dpbf16_ps(acc[m * ROWS + r], low,
                                                             (__m512bh)_mm512_loadu_si512((const void *)xs));
                        acc[m * ROWS + r] = _mm512_dpbf16_ps(acc[m * ROWS + r], high,
                                                             (__m512bh)_mm512_loadu_si512((const void *)(xs + 32)));
                    }
                }
            }
#endif
        /* q = u - 8 of each nibble u: no shift to add back for these steps, whose sums then do not cancel */
        const __m512 nibbles = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
        if (FORMAT == TANDEM_QUANT_INT4 && xperm) /* two blocks a step, against x in quant_permute's order */
            for (; k + 32 <= k1; k += 32) {
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    if (((k / 2) & 63) < 16)
                        _mm_prefetch((const char *)(w + (n + r + ROWS) * row_bytes + k / 2), _MM_HINT_T0);
                    const __m512i bytes =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (n + r) * row_bytes + k / 2)));
                    /* vpermps reads the low 4 bits of each index: a nibble's value in one instruction */
                    const __m512 low = _mm512_permutexvar_ps(bytes, nibbles);
                    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), nibbles);
#pragma GCC unroll 8
                    for (int m = 0; m < M; m++) {
                        const float *xs = xperm + (int64_t)m * K + k;
                        acc[m * ROWS + r] = qv_fmadd(low, qv_loadu(xs), acc[m * ROWS + r]);
                        acc[m * ROWS + r] = qv_fmadd(high, qv_loadu(xs + 16), acc[m * ROWS + r]);
                    }
                }
            }
#endif
        for (; k + 16 <= k1; k += 16) {
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                /* The same place in the next block's rows: a row of a few hundred bytes ends before the
                 * hardware prefetcher has followed it. (A prefetch past the weights' end does not fault.) Into
                 * L2: a prefetch into L1 holds one of its few miss buffers until the line comes, and int8 streamed
                 * from memory at 22 GB/s so against 30 into L2 (2 threads of an AVX-512 EPYC, one row of x;
                 * 8192 x 2048 weights, 16 copies). int4's steps below measured better into L1. */
                if (((k / value_bytes) & 63) < 16 / value_bytes)  /* once per cache line */
                    _mm_prefetch((const char *)(w + (n + r + ROWS) * row_bytes + k / value_bytes), _MM_HINT_T1);
                quant_vec values[QUANT_VECS];
                quant_load16(w + (n + r) * row_bytes, FORMAT, k, values);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++) {
                    const float *xs = x + (int64_t)m * K + k;
#pragma GCC unroll 2
                    for (int v = 0; v < QUANT_VECS; v++)
                        acc[m * ROWS + r] = qv_fmadd(values[v], qv_loadu(xs + v * QUANT_LANES), acc[m * ROWS + r]);
                }
            }
        }
        const int has_tail = k < k1; /* small groups (GGUF's 16 and 32) have none: skip its scalar work */
        for (; k < k1; k++)
            for (int r = 0; r < ROWS; r++) {
                const float weight = quant_at(w + (n + r) * row_bytes, FORMAT, k);
                for (int m = 0; m < M; m++) tail[m * ROWS + r] += weight * x[(int64_t)m * K + k];
            }
#pragma GCC unroll 8
        for (int i = 0; i < ROWS * M; i++) {
            const float scale = scales[(n + i % ROWS) * groups + g];
            total[i] = qv_fmadd(acc[i], qv_set1(scale * unit), total[i]);
            if (has_tail) tail_total[i] += tail[i] * scale;
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) dots[i] = qv_sum(total[i]) + tail_total[i];
}

#if defined(__AVX512BF16__)
/* One of quant_int4_wide's steps, 128 values from k of a row: its four vectors of values times x's, added into
 * sums[0..3]. */
static inline __attribute__((always_inline)) void quant_wide_step(const uint8_t *row, int64_t row_bytes, int k,
                                                                  const uint16_t *xbf, __m512 *sums) {
    /* the next feature's row, into L1 (into L2, or none, measured slower: 22.8 and 20.3 against 25.3 GB/s from
     * memory, 2 threads of an AVX-512 BF16 EPYC) */
    _mm_prefetch((const char *)(row + row_bytes + k / 2), _MM_HINT_T0);
    const __m512i words = _mm512_loadu_si512((const void *)(row + k / 2));
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i nibbles = j ? _mm512_srli_epi16(words, 4 * j) : words;
        const __m512bh values = (__m512bh)_mm512_permutexvar_epi16(nibbles, QUANT_NIBBLES_BF16);
        const __m512bh xs = (__m512bh)_mm512_loadu_si512((const void *)(xbf + k + 32 * j));
        sums[j] = _mm512_dpbf16_ps(sums[j], values, xs);
    }
}

/* quant_int4_wide for groups of 32 or 64 values (4 or 2 a step), which end inside a step: lane l of a step's sums
 * holds words 2l and 2l + 1, both of block l / 2, so each step's sums are scaled lane by lane, by the scale of its
 * block's group. scales: the row's. */
static float quant_int4_wide_lanes(const uint8_t *row, int64_t row_bytes, const float *scales, int group, int K,
                                   const uint16_t *xbf) {
    __m512 total[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) total[j] = _mm512_setzero_ps();
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane_group = _mm512_srli_epi32(lane, group == 32 ? 2 : 3); /* each lane's group in the step */
    const __mmask8 step_groups = group == 32 ? 0xf : 0x3;
    for (int k = 0; k < K; k += 128) {
        __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        quant_wide_step(row, row_bytes, k, xbf, part);
        const __m512 scale = _mm512_permutexvar_ps(
            lane_group, _mm512_castps128_ps512(_mm_maskz_loadu_ps(step_groups, scales + k / group)));
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) total[j] = _mm512_fmadd_ps(part[j], scale, total[j]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(total[0], total[1]), _mm512_add_ps(total[2], total[3])));
}

/* Row n of int4 W against one row of x (bfloat16 values, in quant_pack_bf16's wide order), K and the groups as
 * quant_wide says. A step is 64 bytes, eight blocks: each 16-bit word holds four nibbles, and vpermw looks each up
 * straight from the word shifted by 0, 4, 8 and 12 (it reads an index's low 5 bits, and the table repeats its 16
 * values), with no widening; four sums, each its own chain of vdpbf16ps, scaled into four totals at each group's
 * end (groups of 32 and 64 values: quant_int4_wide_lanes). One chain, as quant_block's steps run for one feature,
 * waits out the latency of vdpbf16ps every step. */
static float quant_int4_wide(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                             int64_t n, int K, const uint16_t *xbf) {
    const uint8_t *row = w + n * row_bytes;
    const int group = group_size < K ? group_size : K;
    if (group < 128) return quant_int4_wide_lanes(row, row_bytes, scales + n * groups, group, K, xbf);
    __m512 total[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) total[j] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 part[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) part[j] = _mm512_setzero_ps();
        for (int k = g * group; k < (g + 1) * group && k < K; k += 128) quant_wide_step(row, row_bytes, k, xbf, part);
        const __m512 scale = _mm512_set1_ps(scales[n * groups + g]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) total[j] = _mm512_fmadd_ps(part[j], scale, total[j]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(total[0], total[1]), _mm512_add_ps(total[2], total[3])));
}
#endif

/* dots[m * count + r] for the `count` <= QUANT_ROWS features from n and M <= QUANT_X_ROWS rows of x, in blocks of
 * ROWS features (see quant_rows for ROWS per M) and the rest one at a time. */
static inline __attribute__((always_inline)) void quant_tiles(const uint8_t *w, int64_t row_bytes,
                                                              const float *scales, int groups, int group_size,
                                                              int FORMAT, int64_t n, int count, int K,
                                                              const float *x, const float *xperm,
                                                              const uint16_t *xbf, int M,
                                                              int ROWS, float *dots) {
    int r0 = 0;
    for (; r0 + ROWS <= count; r0 += ROWS) {
        float tile[QUANT_ROWS * QUANT_X_ROWS];
        quant_block(w, row_bytes, scales, groups, group_size, FORMAT, n + r0, K, x, xperm, xbf, M, ROWS, tile);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < ROWS; r++) dots[m * count + r0 + r] = tile[m * ROWS + r];
    }
    for (; r0 < count; r0++) {
        float one[QUANT_X_ROWS];
        quant_block(w, row_bytes, scales, groups, group_size, FORMAT, n + r0, K, x, xperm, xbf, M, 1, one);
        for (int m = 0; m < M; m++) dots[m * count + r0] = one[m];
    }
}

static inline __attribute__((always_inline)) void quant_rows(const uint8_t *w, int64_t row_bytes,
                                                             const float *scales, int groups, int group_size,
                                                             int FORMAT, int64_t n, int count, int K,
                                                             const float *x, const float *xperm,
                                                             const uint16_t *xbf, int M,
                                                             float *dots) {
#define QUANT_TILES(ROWS_OF_X, ROWS)                                                                             \
    quant_tiles(w, row_bytes, scales, groups, group_size, FORMAT, n, count, K, x, xperm, xbf, ROWS_OF_X, ROWS, dots)
    /* 8 accumulators: 8 x 1, 4 x 2, 2 x 3, 2 x 4. int4's one row of x reads one feature's row at a time: its
     * weights stream from memory faster as one sequence than as 8 rows side by side (2 threads of this AVX-512 BF16
     * EPYC, 16 x 8192 x 2048 weights: 22.9 against 15.9 GB/s with a bfloat16 x, 17.8 against 14.0 with float32;
     * int8 measured slower so, 18.2 against 23.6 GB/s at 2 features). */
    switch (M) {
    case 1:
        if (FORMAT == TANDEM_QUANT_INT4) QUANT_TILES(1, 1);
        else QUANT_TILES(1, 8);
        break;
    case 2: QUANT_TILES(2, 4); break;
    case 3: QUANT_TILES(3, 2); break;
    default: QUANT_TILES(4, 2); break;
    }
#undef QUANT_TILES
}

static void quant_dots(const uint8_t *w, int format, int64_t row_bytes, const float *scales, int groups,
                       int group_size, int64_t n, int count, int K, const float *x, const float *xperm,
                       const uint16_t *xbf, int M, float *dots) {
    switch (format) {
    case TANDEM_QUANT_INT8:
        quant_rows(w, row_bytes, scales, groups, group_size, TANDEM_QUANT_INT8, n, count, K, x, NULL, NULL, M, dots);
        break;
    case TANDEM_QUANT_INT4:
        quant_rows(w, row_bytes, scales, groups, group_size, TANDEM_QUANT_INT4, n, count, K, x, xperm, xbf, M,
                   dots);
        break;
    default:
        quant_rows(w, row_bytes, scales, groups, group_size, TANDEM_QUANT_FP8, n, count, K, x, NULL, NULL, M, dots);
        break;
    }
}

/* Row n of W dequantized as the reference does it, q * scale (offsets not yet added), into out[0..K). */
static inline __attribute__((always_inline)) void quant_expand_row(const uint8_t *row, const float *scales,
                                                                   int groups, int group_size, int FORMAT, int K,
                                                                   float *out) {
    const float unit = quant_vector_unit(FORMAT), shift = quant_shift(FORMAT);
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
        const quant_vec scale = qv_set1(scales[g] * unit);
        int k = k0;
        for (; k + 16 <= k1; k += 16) {
            quant_vec values[QUANT_VECS];
            quant_load16(row, FORMAT, k, values);
            for (int v = 0; v < QUANT_VECS; v++)
                qv_storeu(out + k + v * QUANT_LANES, qv_mul(qv_add(values[v], qv_set1(shift)), scale));
        }
        for (; k < k1; k++) out[k] = (quant_at(row, FORMAT, k) + shift) * scales[g];
    }
}

static void quant_expand(const uint8_t *row, int format, const float *scales, int groups, int group_size, int K,
                         float *out) {
    switch (format) {
    case TANDEM_QUANT_INT8: quant_expand_row(row, scales, groups, group_size, TANDEM_QUANT_INT8, K, out); break;
    case TANDEM_QUANT_INT4: quant_expand_row(row, scales, groups, group_size, TANDEM_QUANT_INT4, K, out); break;
    default: quant_expand_row(row, scales, groups, group_size, TANDEM_QUANT_FP8, K, out); break;
    }
}
#else
/* The portable path: the same sums, one weight at a time. */
static void quant_dots(const uint8_t *w, int format, int64_t row_bytes, const float *scales, int groups,
                       int group_size, int64_t n, int count, int K, const float *x, const float *xperm,
                       const uint16_t *xbf, int M, float *dots) {
    (void)xperm, (void)xbf;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        for (int m = 0; m < M; m++) {
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
                float sum = 0.0f;
                for (int k = k0; k < k1; k++) sum += quant_at(row, format, k) * x[(int64_t)m * K + k];
                total += sum * scales[(n + r) * groups + g];
            }
            dots[m * count + r] = total;
        }
    }
}

static void quant_expand(const uint8_t *row, int format, const float *scales, int groups, int group_size, int K,
                         float *out) {
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
        for (int k = k0; k < k1; k++) out[k] = (quant_at(row, format, k) + quant_shift(format)) * scales[g];
    }
}
#endif

/* Whether one row of x against int4 weights runs quant_int4_row's steps of two blocks (AVX2 without AVX-512): K
 * whole steps of 32 values, and the groups whole steps too. */
static inline int quant_one_row(int format, int M, int group_size, int K) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return format == TANDEM_QUANT_INT4 && M == 1 && K % 32 == 0 && (group_size % 32 == 0 || group_size >= K);
#else
    (void)format, (void)M, (void)group_size, (void)K;
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* Row n of int4 W against one row of x (float32), K and the groups as quant_one_row says: the raw nibbles u = q + 8
 * (quant_store adds the -8), two blocks a step into four sums, each its own chain of multiply-adds, scaled into four
 * totals at each group's end. quant_block's steps of one block for one feature wait for one accumulator twice
 * every 16 values, and pay a group's bookkeeping every 128 (an AVX2 EPYC, one thread, 2048 x 2048 weights in the
 * cache: 431 -> 300 us). */
static float quant_int4_row(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                            int64_t n, int K, const float *x) {
    const uint8_t *row = w + n * row_bytes;
    const int group = group_size < K ? group_size : K;
    const __m256i fifteen = _mm256_set1_epi32(15);
    __m256 total[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) total[j] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 part[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) part[j] = _mm256_setzero_ps();
        const int k1 = (g + 1) * group < K ? (g + 1) * group : K;
        for (int k = g * group; k < k1; k += 32) {
            /* the next feature's row, into L1 once per line of this one */
            if ((k & 127) == 0) _mm_prefetch((const char *)(row + row_bytes + k / 2), _MM_HINT_T0);
            const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
            const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2 + 8)));
            part[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, fifteen)), _mm256_loadu_ps(x + k),
                                      part[0]);
            part[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), _mm256_loadu_ps(x + k + 8),
                                      part[1]);
            part[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, fifteen)),
                                      _mm256_loadu_ps(x + k + 16), part[2]);
            part[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), _mm256_loadu_ps(x + k + 24),
                                      part[3]);
        }
        const __m256 scale = _mm256_set1_ps(scales[n * groups + g]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) total[j] = _mm256_fmadd_ps(part[j], scale, total[j]);
    }
    return qv_sum(_mm256_add_ps(_mm256_add_ps(total[0], total[1]), _mm256_add_ps(total[2], total[3])));
}

#else
static float quant_int4_row(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                            int64_t n, int K, const float *x) {
    (void)w, (void)row_bytes, (void)scales, (void)groups, (void)group_size, (void)n, (void)K, (void)x;
    return 0.0f;
}
#endif

/* One row of W as the reference dequantizes it, q * scale + offset (its group's scales and offsets), into out. */
static void quant_dequantize_row(const uint8_t *row, int format, const float *scales, const float *offsets,
                                 int groups, int group_size, int K, float *out) {
    quant_expand(row, format, scales, groups, group_size, K, out);
    if (!offsets) return;
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
        for (int k = k0; k < k1; k++) out[k] += offsets[g];
    }
}

/* Whether a batch of M rows runs on expanded panels (quant_expanded_dots), with AVX2 but not AVX-512: int4 and FP8
 * from 17 rows, int8 from 24. The steps above convert a block's values again for every 4 rows of x; expanded once
 * (16 output features laid out k after k), the weights are read as float32 from L1 and L2 by outer products of 6
 * rows by 16 features, within 0-15 % of oneDNN's float32 GEMM on its own packed weights. Two threads of an AVX2 EPYC,
 * two builds of this file taking turns, ms, steps against expanded panels: int8 3352 x 768 at 17 / 24 / 32 / 64 rows
 * 1.46 / 2.04 / 2.86 / 5.89 against 1.47 / 1.35 / 1.94 / 3.45, 2048 x 2048 2.22 / 2.97 / 4.17 / 8.04 against 2.17 /
 * 2.93 / 3.64 / 5.79, 8192 x 2048 8.8 / 12.7 / 16.7 / 34.1 against 8.8 / 13.1 / 14.4 / 25.5; int4 3352 x 768 1.75 /
 * 3.05 / 4.25 / 8.88 against 1.31 / 2.27 / 2.83 / 5.29, 2048 x 2048 3.50 / 4.02 / 4.87 / 8.71 against 3.50 / 2.73 /
 * 3.74 / 6.03, 8192 x 2048 15.0 / 17.1 / 19.7 / 34.4 against 13.5 / 11.4 / 15.4 / 23.2 (below 17 rows the steps win
 * or tie). A first layout, tiles of 3 rows by 4 features on the rows as dequantized (dot products, each step 7 loads
 * for 12 multiply-adds, the weights streaming from L2), was 1.5-1.7x slower at 64 rows and lost to int8's steps at
 * every count of rows; laying a row out one value at a time cost more than the products at 17 to 32 rows. */
#define QUANT_EXPAND_MIN_ROWS 17
#define QUANT_EXPAND_MIN_ROWS_INT8 24
/* Bytes of float32 weights a thread expands at a time: they stay in L2 while every row of x passes over them. */
#define QUANT_EXPAND_BYTES 131072
/* Rows of x a prefill runs at a time (each chunk expands the weights again): x stays in L2 and L3. Whole, 2,048
 * rows of 2048 x 2048 int4 took 327 ms, 1.7x oneDNN's float32 GEMM; in chunks of 256, 512 or 1,024 rows 169, 170 and
 * 195 ms (oneDNN 158). Against the float32 panels of quant_linear.py (dequantized, then torch's GEMM), ms at 128 /
 * 512 / 2,048 rows: int8 3352 x 768 6.7 / 23.9 / 149 against 6.0 / 22.3 / 99, 2048 x 2048 19.7 / 52.2 / 183 against
 * 14.1 / 50.3 / 173; int4 3352 x 768 8.2 / 33.5 / 173 against 6.9 / 24.6 / 105, 2048 x 2048 12.5 / 44.8 / 249
 * against 11.0 / 44.5 / 173 (oneDNN on float32 weights: 7.0 / 23.0 / 105 and 10.6 / 38.6 / 162). */
#define QUANT_EXPAND_CHUNK 512
static inline int quant_expands(int format, int M) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
    return M >= (format == TANDEM_QUANT_INT8 ? QUANT_EXPAND_MIN_ROWS_INT8 : QUANT_EXPAND_MIN_ROWS);
#else
    (void)format, (void)M;
    return 0;
#endif
}

int tandem_quant_expands(void) { return quant_expands(TANDEM_QUANT_INT4, QUANT_EXPAND_MIN_ROWS); }

/* The expanded panels' outer products: 16 output features by 6 rows of x (12 of AVX2's 16 registers), over
 * chunks of 512 values of k (32 KiB of a panel, in L1 and L2 while every row of x passes over it; chunks of 128 to
 * 1,024 and the whole of K measured within the noise of each other, 512 the best at 512 rows). */
#define QUANT_OUTER_FEATURES 16
#define QUANT_OUTER_ROWS 6
#define QUANT_OUTER_K 512
/* Values of k each product sums from zero before it is added to the result: one sum over the whole of K, a value
 * at a time, strayed from the float64 result 1.6x as far as torch's GEMM did at K = 2048 (mean |error| 4.3e-6
 * against 2.7e-6); in sums of 32, 1.8e-6 (and 1.9e-7 against torch's 2.5e-7 at K = 64), 5-15 % slower. */
#define QUANT_OUTER_SUM 32

/* Output features per expanded block: QUANT_EXPAND_BYTES of float32 weights, whole panels, at least one. */
static inline int quant_expand_rows(int K) {
    const int64_t bytes_per_panel = 4 * (int64_t)(K > 0 ? K : 1) * QUANT_OUTER_FEATURES;
    const int64_t fit = QUANT_EXPAND_BYTES / bytes_per_panel * QUANT_OUTER_FEATURES;
    return fit > QUANT_OUTER_FEATURES ? (int)fit : QUANT_OUTER_FEATURES;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* A panel's 16 dequantized weight rows (`rows`, K apart) laid out k after k (K x 16 floats), as the outer products
 * below read them: 8 x 8 transposes in registers (one value at a time, a store to another line of L2 each, cost
 * more than the products themselves at 17 to 32 rows of x). */
static void quant_outer_pack(const float *rows, int K, float *panel) {
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int f0 = 0; f0 < QUANT_OUTER_FEATURES; f0 += 8) {
            __m256 r[8], t[8], u[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows + (int64_t)(f0 + i) * K + k);
#pragma GCC unroll 4
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
#pragma GCC unroll 2
            for (int h = 0; h < 8; h += 4) {
                u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
                u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
                u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
                u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
            }
            /* column j: value k + j of the 8 rows */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_ps(panel + (int64_t)(k + j) * QUANT_OUTER_FEATURES + f0,
                                 _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
                _mm256_storeu_ps(panel + (int64_t)(k + j + 4) * QUANT_OUTER_FEATURES + f0,
                                 _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
            }
        }
    for (; k < K; k++)
        for (int f = 0; f < QUANT_OUTER_FEATURES; f++)
            panel[(int64_t)k * QUANT_OUTER_FEATURES + f] = rows[(int64_t)f * K + k];
}

/* c[m * stride + f] (+)= sum over kc values of k of x[m * K + k] * panel[k * 16 + f], for ROWS <= 6 rows of x and
 * one panel's 16 features: 12 accumulators, each k two loads of weights and one broadcast per row of x for 12
 * multiply-adds, no sums across lanes, each product summed QUANT_OUTER_SUM values at a time. */
static inline __attribute__((always_inline)) void quant_outer_tile(const float *panel, const float *x, int K, int kc,
                                                                   int ROWS, float *c, int stride, int accumulate) {
    for (int k0 = 0; k0 < kc; k0 += QUANT_OUTER_SUM) {
        const int k1 = kc - k0 < QUANT_OUTER_SUM ? kc : k0 + QUANT_OUTER_SUM;
        __m256 acc[QUANT_OUTER_ROWS][2];
#pragma GCC unroll 6
        for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k++) {
            const __m256 w0 = _mm256_loadu_ps(panel + k * QUANT_OUTER_FEATURES);
            const __m256 w1 = _mm256_loadu_ps(panel + k * QUANT_OUTER_FEATURES + 8);
#pragma GCC unroll 6
            for (int m = 0; m < ROWS; m++) {
                const __m256 xs = _mm256_broadcast_ss(x + (int64_t)m * K + k);
                acc[m][0] = _mm256_fmadd_ps(xs, w0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xs, w1, acc[m][1]);
            }
        }
#pragma GCC unroll 6
        for (int m = 0; m < ROWS; m++) {
            if (accumulate || k0 > 0) {
                acc[m][0] = _mm256_add_ps(_mm256_loadu_ps(c + m * stride), acc[m][0]);
                acc[m][1] = _mm256_add_ps(_mm256_loadu_ps(c + m * stride + 8), acc[m][1]);
            }
            _mm256_storeu_ps(c + m * stride, acc[m][0]);
            _mm256_storeu_ps(c + m * stride + 8, acc[m][1]);
        }
    }
}

/* `count` weight rows (from `w`, their scales and offsets) dequantized as the reference does, into panels of 16
 * features (quant_outer_pack; a partial panel's missing features zeros, their sums never stored), through `rows`
 * (16 x K floats); returns the number of panels. */
static int quant_expand_block(const uint8_t *w, int format, int64_t row_bytes, const float *scales,
                              const float *offsets, int groups, int group_size, int count, int K, float *rows,
                              float *panels) {
    const int total = (count + QUANT_OUTER_FEATURES - 1) / QUANT_OUTER_FEATURES;
    for (int p = 0; p < total; p++) {
        for (int f = 0; f < QUANT_OUTER_FEATURES; f++) {
            const int64_t r = (int64_t)p * QUANT_OUTER_FEATURES + f;
            if (r < count)
                quant_dequantize_row(w + r * row_bytes, format, scales + r * groups,
                                     offsets ? offsets + r * groups : NULL, groups, group_size, K,
                                     rows + (int64_t)f * K);
            else
                memset(rows + (int64_t)f * K, 0, sizeof(float) * (size_t)K);
        }
        quant_outer_pack(rows, K, panels + (int64_t)p * K * QUANT_OUTER_FEATURES);
    }
    return total;
}

/* dots[m * stride + f] for all M rows of x against the block's `panels` panels (quant_expand_block). */
static void quant_expanded_dots(const float *packed, int panels, const float *x, int M, int K, float *dots,
                                int stride) {
    for (int k0 = 0; k0 < K; k0 += QUANT_OUTER_K) {
        const int kc = K - k0 < QUANT_OUTER_K ? K - k0 : QUANT_OUTER_K;
        for (int p = 0; p < panels; p++) {
            const float *panel = packed + ((int64_t)p * K + k0) * QUANT_OUTER_FEATURES;
            for (int m0 = 0; m0 < M; m0 += QUANT_OUTER_ROWS) {
                const int rows = M - m0 < QUANT_OUTER_ROWS ? M - m0 : QUANT_OUTER_ROWS;
                const float *xs = x + (int64_t)m0 * K + k0;
                float *c = dots + (int64_t)m0 * stride + p * QUANT_OUTER_FEATURES;
                switch (rows) {
                case 6: quant_outer_tile(panel, xs, K, kc, 6, c, stride, k0 > 0); break;
                case 5: quant_outer_tile(panel, xs, K, kc, 5, c, stride, k0 > 0); break;
                case 4: quant_outer_tile(panel, xs, K, kc, 4, c, stride, k0 > 0); break;
                case 3: quant_outer_tile(panel, xs, K, kc, 3, c, stride, k0 > 0); break;
                case 2: quant_outer_tile(panel, xs, K, kc, 2, c, stride, k0 > 0); break;
                default: quant_outer_tile(panel, xs, K, kc, 1, c, stride, k0 > 0); break;
                }
            }
        }
    }
}
#else
static int quant_expand_block(const uint8_t *w, int format, int64_t row_bytes, const float *scales,
                              const float *offsets, int groups, int group_size, int count, int K, float *rows,
                              float *panels) {
    (void)w, (void)format, (void)row_bytes, (void)scales, (void)offsets, (void)groups, (void)group_size;
    (void)count, (void)K, (void)rows, (void)panels;
    return 0;
}
static void quant_expanded_dots(const float *packed, int panels, const float *x, int M, int K, float *dots,
                                int stride) {
    (void)packed, (void)panels, (void)x, (void)M, (void)K, (void)dots, (void)stride;
}
#endif

/* What each group adds besides its scaled raw values: offset times the group's sum of x (xsums), and shift *
 * scale times the sum of x over the part of the group summed as raw values (xshift). */
static inline float quant_group_terms(const float *scales, const float *offsets, float shift, int groups,
                                      const float *xsums, const float *xshift) {
    float sums[4] = {0};
    int g = 0;
    for (; g + 4 <= groups; g += 4)
        for (int j = 0; j < 4; j++)
            sums[j] += (offsets ? offsets[g + j] * xsums[g + j] : 0.0f) +
                       (xshift ? shift * scales[g + j] * xshift[g + j] : 0.0f);
    for (; g < groups; g++)
        sums[0] += (offsets ? offsets[g] * xsums[g] : 0.0f) + (xshift ? shift * scales[g] * xshift[g] : 0.0f);
    return (sums[0] + sums[1]) + (sums[2] + sums[3]);
}

/* Each row's sum of x per group over [k0 + skip(group length), k1), in a new (M, groups) array. */
static float *quant_x_sums(const float *x, int M, int K, int group_size, int groups, int skip_steps_of) {
    float *sums = malloc(sizeof(float) * (size_t)M * (size_t)(groups > 0 ? groups : 1));
    for (int m = 0; m < M; m++)
        for (int g = 0; g < groups; g++) {
            const int k0 = g * group_size, k1 = K - k0 < group_size ? K : k0 + group_size;
            const int from = skip_steps_of ? k0 + (k1 - k0) / skip_steps_of * skip_steps_of : k0;
            float sum = 0.0f;
            for (int k = from; k < k1; k++) sum += x[(int64_t)m * K + k];
            sums[(int64_t)m * groups + g] = sum;
        }
    return sums;
}

/* x's rows in the order of quant_block's int4 steps of two blocks, for each whole 32 values from a multiple of
 * 32: values 0-7, 16-23 (the blocks' low nibbles), then 8-15, 24-31 (their high nibbles); NULL where the steps
 * do not run (no AVX-512, not int4, or groups that do not start at multiples of 32). */
static float *quant_permute(int format, int group_size, const float *x, int M, int K) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (format != TANDEM_QUANT_INT4 || (group_size % 32 != 0 && group_size < K) || K < 32) return NULL;
    static const int order[32] = {0,  1,  2,  3,  4,  5,  6,  7,  16, 17, 18, 19, 20, 21, 22, 23,
                                  8,  9,  10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    float *out = malloc(sizeof(float) * (size_t)M * (size_t)K);
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * K;
        float *to = out + (int64_t)m * K;
        int k = 0;
        for (; k + 32 <= K; k += 32)
            for (int j = 0; j < 32; j++) to[k + j] = row[k + order[j]];
        for (; k < K; k++) to[k] = row[k];
    }
    return out;
#else
    (void)format, (void)group_size, (void)x, (void)M, (void)K;
    return NULL;
#endif
}

/* Whether quant_block's int4 steps of four blocks run: AVX-512 BF16, int4, groups that start at multiples of 64;
 * and only where every value of x is a bfloat16 (quant_bf16_valued; not a float32 model's): bfloat16 products
 * are exact in float32, so with a bfloat16 model's activations the steps sum what the float32 ones do. */
static int quant_packs_bf16(int format, int group_size, int K) {
#if defined(__AVX512BF16__)
    return format == TANDEM_QUANT_INT4 && (group_size % 64 == 0 || group_size >= K) && K >= 64;
#else
    (void)format, (void)group_size, (void)K;
    return 0;
#endif
}

/* Every value of x a bfloat16 one (its float32 bits' low half zero). */
static int quant_bf16_valued(const float *x, int64_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t low_bits = 0;
    for (int64_t i = 0; i < n; i++) low_bits |= bits[i] & 0xffff;
    return low_bits == 0;
}

/* x's rows (bfloat16 values) as bfloat16 in the order of those steps, for each whole 64 values from a multiple of
 * 64: the 32 bytes' low nibbles (values 0-7, 16-23, 32-39, 48-55), then their high ones; the rest as it lies. With
 * `wide`, each whole 128 values from a multiple of 128 first, in the order of quant_int4_wide's steps. */
static uint16_t *quant_pack_bf16(const float *x, int M, int K, int wide) {
    const uint32_t *bits = (const uint32_t *)x;
    uint16_t *out = malloc(sizeof(uint16_t) * (size_t)M * (size_t)K);
    for (int m = 0; m < M; m++) {
        const uint32_t *row = bits + (int64_t)m * K;
        uint16_t *to = out + (int64_t)m * K;
        int k = 0;
        if (wide)
            for (; k + 128 <= K; k += 128)
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 32; i++) {
                        /* word i: bytes 2(i % 4) and 2(i % 4) + 1 of block i / 4; nibble j of it the value below */
                        const int value = 16 * (i / 4) + 2 * (i % 4) + (j >> 1) + 8 * (j & 1);
                        to[k + 32 * j + i] = (uint16_t)(row[k + value] >> 16);
                    }
        for (; k + 64 <= K; k += 64)
            for (int j = 0; j < 32; j++) {
                const int value = 16 * (j / 8) + j % 8; /* byte j's low nibble; its high one is 8 further */
                to[k + j] = (uint16_t)(row[k + value] >> 16);
                to[k + 32 + j] = (uint16_t)(row[k + value + 8] >> 16);
            }
        for (; k < K; k++) to[k] = (uint16_t)(row[k] >> 16);
    }
    return out;
}

/* Whether a batch of M rows runs on converted rows (quant_bf16_rows, quant_bf16_dots) rather than the steps above,
 * which convert the same weights again for every QUANT_X_ROWS rows of x: with AVX-512 BF16, int8 or int4, K and
 * the groups whole steps of 32, and x's values bfloat16 ones, whose products with q are exact in float32. int8 from
 * 4 rows, where its steps multiply 16 values at a time in float32 (one thread of this machine's AVX-512 BF16 EPYC,
 * N = K = 2048: 4 rows 0.34 ms either way, 8 rows 0.54 against 0.74, 16 rows 0.88 against 1.47); int4 past 16 rows,
 * as its steps of four blocks already multiply in bfloat16 (16 rows 1.07 ms against 1.10). */
#define QUANT_CONVERT_MIN_ROWS_INT8 4
#define QUANT_CONVERT_MIN_ROWS_INT4 17
static int quant_converts(int format, int group_size, int M, int K) {
#if defined(__AVX512BF16__)
    const int from = format == TANDEM_QUANT_INT8 ? QUANT_CONVERT_MIN_ROWS_INT8 : QUANT_CONVERT_MIN_ROWS_INT4;
    return (format == TANDEM_QUANT_INT8 || format == TANDEM_QUANT_INT4) && M >= from && K % 32 == 0 &&
           (group_size % 32 == 0 || group_size >= K);
#else
    (void)format, (void)group_size, (void)M, (void)K;
    return 0;
#endif
}

/* x's rows (bfloat16 values) as bfloat16 in their own order. */
static uint16_t *quant_x_bf16(const float *x, int M, int K) {
    const uint32_t *bits = (const uint32_t *)x;
    uint16_t *out = malloc(sizeof(uint16_t) * (size_t)M * (size_t)K);
    for (int64_t i = 0; i < (int64_t)M * K; i++) out[i] = (uint16_t)(bits[i] >> 16);
    return out;
}

#if defined(__AVX512BF16__)
/* Rows n .. n + count of an int8 or int4 weight as bfloat16 values q (count, K), exact (small integers are
 * bfloat16 values; int4's -8 applied here); K a multiple of 32. In k's order, or for int4 with `permuted` in
 * quant_pack_bf16's (x's rows then come from it). */
static void quant_bf16_rows(const uint8_t *w, int format, int64_t row_bytes, int64_t n, int count, int K,
                            int permuted, int block_rows, uint16_t *out) {
    /* Each line of the next block's rows is fetched into L2 as this block's is converted, so that the loads
     * stream while the block's dot products run (4 rows of x, 8192 x 2048 int8 weights from memory, 2 threads
     * of an AVX-512 EPYC: 20.4 ms for 16 copies without, 16.0 with). */
    const int64_t ahead = block_rows * row_bytes;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        int k = 0;
        if (permuted) /* int4 in quant_pack_bf16's order: 64 values looked up from 32 bytes' nibbles */
            for (; k + 64 <= K; k += 64) {
                if (((k / 2) & 63) == 0) _mm_prefetch((const char *)(row + ahead + k / 2), _MM_HINT_T1);
                const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + k / 2)));
                uint16_t *to = out + (int64_t)r * K + k;
                _mm512_storeu_si512((void *)to, _mm512_permutexvar_epi16(bytes, QUANT_NIBBLES_BF16));
                _mm512_storeu_si512((void *)(to + 32),
                                    _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), QUANT_NIBBLES_BF16));
            }
        for (; k < K; k += 32) {
            __m128i lo, hi;
            const int64_t at = format == TANDEM_QUANT_INT8 ? k : k / 2; /* the step's bytes */
            if ((at & 63) < (format == TANDEM_QUANT_INT8 ? 32 : 16))
                _mm_prefetch((const char *)(row + ahead + at), _MM_HINT_T1);
            if (format == TANDEM_QUANT_INT8) {
                lo = _mm_loadu_si128((const __m128i *)(row + k));
                hi = _mm_loadu_si128((const __m128i *)(row + k + 16));
            } else { /* two blocks in 16 bytes: each block's low nibbles are its values 0-7, its high ones 8-15 */
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + k / 2)), mask = _mm_set1_epi8(0x0f);
                const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                lo = _mm_sub_epi8(_mm_unpacklo_epi64(low, high), _mm_set1_epi8(8));
                hi = _mm_sub_epi8(_mm_unpackhi_epi64(low, high), _mm_set1_epi8(8));
            }
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
            const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
            _mm512_storeu_si512((void *)(out + (int64_t)r * K + k), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* dots[m * stride + r] for M <= 4 rows of x and R converted weight rows: M x R accumulators of vdpbf16ps over
 * each group's steps of 32. With ONE group (int8's per-feature scales) the sums are scaled once at the end and
 * M x R may be 24; with more, each group's sums go times its scale into M x R totals (M x R <= 16; the
 * totals of 4 x 4 spill, and measured faster than 4 x 3 or 4 x 2 held in registers). Inlined where M, R and ONE
 * are constants, so each case is unrolled. */
static inline __attribute__((always_inline)) void quant_bf16_tile(const uint16_t *w, const float *scales,
                                                                  int groups, int group, const uint16_t *x, int K,
                                                                  int M, int R, int ONE, float *dots, int stride) {
    __m512 total[24], acc[24];
#pragma GCC unroll 24
    for (int i = 0; i < M * R; i++) total[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
#pragma GCC unroll 24
        for (int i = 0; i < M * R; i++) acc[i] = _mm512_setzero_ps();
        for (int k = k0; k < k1; k += 32) {
            /* x's rows held, each weight row loaded once: M + 1 loads per M x R products */
            __m512bh xs[4];
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                xs[m] = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + k));
                __asm__("" : "+v"(xs[m])); /* else GCC loads x again for every weight row */
            }
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m512bh values = (__m512bh)_mm512_loadu_si512((const void *)(w + (int64_t)r * K + k));
#pragma GCC unroll 4
                for (int m = 0; m < M; m++) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], values, xs[m]);
            }
        }
        if (ONE) break;
#pragma GCC unroll 24
        for (int i = 0; i < M * R; i++)
            total[i] = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(scales[(i % R) * groups + g]), total[i]);
    }
#pragma GCC unroll 24
    for (int i = 0; i < M * R; i++)
        dots[(i / R) * stride + i % R] =
            ONE ? _mm512_reduce_add_ps(acc[i]) * scales[i % R] : _mm512_reduce_add_ps(total[i]);
}

/* dots[m * count + r] for M <= 4 rows of x against `count` <= QUANT_CONVERT_ROWS converted rows: 6 at a time
 * with one group, 4 with more, then one at a time. */
static void quant_bf16_dots(const uint16_t *w, const float *scales, int groups, int group, const uint16_t *x,
                            int K, int M, int count, float *dots) {
#define QUANT_BF16_TILE(ROWS_OF_X, R, ONE)                                                                         \
    quant_bf16_tile(w + (int64_t)r * K, scales + (int64_t)r * groups, groups, group, x, K, ROWS_OF_X, R, ONE,     \
                    dots + r, count)
    int r = 0;
    if (groups == 1)
        for (; r + 6 <= count; r += 6) switch (M) {
            case 1: QUANT_BF16_TILE(1, 6, 1); break;
            case 2: QUANT_BF16_TILE(2, 6, 1); break;
            case 3: QUANT_BF16_TILE(3, 6, 1); break;
            default: QUANT_BF16_TILE(4, 6, 1); break;
            }
    else
        for (; r + 4 <= count; r += 4) switch (M) {
            case 1: QUANT_BF16_TILE(1, 4, 0); break;
            case 2: QUANT_BF16_TILE(2, 4, 0); break;
            case 3: QUANT_BF16_TILE(3, 4, 0); break;
            default: QUANT_BF16_TILE(4, 4, 0); break;
            }
    for (; r < count; r++) switch (M) {
        case 1: QUANT_BF16_TILE(1, 1, 0); break;
        case 2: QUANT_BF16_TILE(2, 1, 0); break;
        case 3: QUANT_BF16_TILE(3, 1, 0); break;
        default: QUANT_BF16_TILE(4, 1, 0); break;
        }
#undef QUANT_BF16_TILE
}
/* The converted panels: a block of PANEL converted rows laid out as the bfloat16 panel GEMM's panels (pairs of k
 * per feature), then multiplied by its steps (panel.h), each step of a pair of k one load of the panel's row and a
 * broadcast per row of x: no sums across lanes, which the tiles of quant_bf16_dots end with, and a block of rows of
 * x held against 32 features. */

/* 16 vectors of 16 32-bit values as their transpose: vector j holds value j of each. */
static inline __attribute__((always_inline)) void quant_transpose16(__m512i r[16]) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* s[4g + c], lane L: column 4L + c of rows 4g .. 4g + 3 */
    __m512i s[16];
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        s[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        s[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        s[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        s[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* for each c, the 4 x 4 blocks of 128 bits (g, L) transposed: column 4L + c */
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* `count` <= QUANT_PANEL converted rows (count, K) as one panel (K / 2, QUANT_PANEL, 2), features past count
 * zeros; K a multiple of 32. */
static void quant_panel_of_rows(const uint16_t *rows, int count, int K, uint16_t *panel) {
    for (int f0 = 0; f0 < QUANT_PANEL; f0 += 16)
        for (int p0 = 0; p0 < K / 2; p0 += 16) {
            __m512i r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                r[i] = f0 + i < count ? _mm512_loadu_si512((const void *)(rows + (int64_t)(f0 + i) * K + 2 * p0))
                                      : _mm512_setzero_si512();
            quant_transpose16(r);
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                _mm512_storeu_si512((void *)(panel + ((int64_t)(p0 + j) * QUANT_PANEL + f0) * 2), r[j]);
        }
}

/* dots[m * QUANT_PANEL + f] for ROWS <= PANEL_ROWS rows of x with one group: each feature's sums times its
 * scale (table[f]) once at the end. */
static inline __attribute__((always_inline)) void quant_panel_block(const uint16_t *panel, const float *table,
                                                                   const uint16_t *x, int K, float *dots,
                                                                   const int ROWS) {
    __m512 acc[PANEL_ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    panel_bf16_steps(panel, x, K, 0, K, NULL, 1, acc, ROWS);
    const __m512 s0 = _mm512_loadu_ps(table), s1 = _mm512_loadu_ps(table + 16);
    for (int r = 0; r < ROWS; r++) {
        _mm512_storeu_ps(dots + r * QUANT_PANEL, _mm512_mul_ps(acc[r][0], s0));
        _mm512_storeu_ps(dots + r * QUANT_PANEL + 16, _mm512_mul_ps(acc[r][1], s1));
    }
}

/* As quant_panel_block with more groups: each group's sums times its scales (table[g * QUANT_PANEL + f]) added
 * into the totals in `dots`, so that a block holds PANEL_ROWS rows in its 2 * PANEL_ROWS accumulators as with one
 * group (the totals in registers too allowed 6 rows, and GCC spilled a panel row every step). */
static inline __attribute__((always_inline)) void quant_panel_groups(const uint16_t *panel, const float *table,
                                                                    int groups, int group, const uint16_t *x, int K,
                                                                    float *dots, const int ROWS) {
    __m512 acc[PANEL_ROWS][2];
    for (int g = 0; g < groups; g++) {
        const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        panel_bf16_steps(panel, x, K, k0, k1, NULL, 1, acc, ROWS);
        const __m512 s0 = _mm512_loadu_ps(table + g * QUANT_PANEL), s1 = _mm512_loadu_ps(table + g * QUANT_PANEL + 16);
        for (int r = 0; r < ROWS; r++) {
            float *total = dots + r * QUANT_PANEL;
            const __m512 t0 = g ? _mm512_loadu_ps(total) : _mm512_setzero_ps();
            const __m512 t1 = g ? _mm512_loadu_ps(total + 16) : _mm512_setzero_ps();
            _mm512_storeu_ps(total, _mm512_fmadd_ps(acc[r][0], s0, t0));
            _mm512_storeu_ps(total + 16, _mm512_fmadd_ps(acc[r][1], s1, t1));
        }
    }
}

/* dots[m * QUANT_PANEL + f] for M rows of x (bfloat16, in the converted rows' order of k) against `count` <=
 * QUANT_PANEL converted rows: laid out as a panel (into `panel`, K * QUANT_PANEL values), their scales as a table
 * by group (into `table`, groups * QUANT_PANEL), then blocks of rows of x. group: the groups' length (K for one). */
static void quant_panel_dots(const uint16_t *rows, const float *scales, int groups, int group, const uint16_t *x,
                             int K, int M, int count, uint16_t *panel, float *table, float *dots) {
    quant_panel_of_rows(rows, count, K, panel);
    for (int g = 0; g < groups; g++)
        for (int f = 0; f < QUANT_PANEL; f++) table[g * QUANT_PANEL + f] = f < count ? scales[f * groups + g] : 0.0f;
    for (int m0 = 0; m0 < M; m0 += PANEL_ROWS) {
        const int rows = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
        const uint16_t *xs = x + (int64_t)m0 * K;
        float *out = dots + (int64_t)m0 * QUANT_PANEL;
#define QUANT_PANEL_BLOCK(R) quant_panel_block(panel, table, xs, K, out, R)
#define QUANT_PANEL_GROUPS(R) quant_panel_groups(panel, table, groups, group, xs, K, out, R)
        if (groups == 1) {
            PANEL_CASES(QUANT_PANEL_BLOCK)
        } else {
            PANEL_CASES(QUANT_PANEL_GROUPS)
        }
#undef QUANT_PANEL_GROUPS
#undef QUANT_PANEL_BLOCK
    }
}
#else
static void quant_bf16_rows(const uint8_t *w, int format, int64_t row_bytes, int64_t n, int count, int K,
                            int permuted, int block_rows, uint16_t *out) {
    (void)w, (void)format, (void)row_bytes, (void)n, (void)count, (void)K, (void)permuted, (void)block_rows;
    (void)out;
}

static void quant_panel_dots(const uint16_t *rows, const float *scales, int groups, int group, const uint16_t *x,
                             int K, int M, int count, uint16_t *panel, float *table, float *dots) {
    (void)rows, (void)scales, (void)groups, (void)group, (void)x, (void)K, (void)M, (void)count, (void)panel;
    (void)table, (void)dots;
}

static float quant_int4_wide(const uint8_t *w, int64_t row_bytes, const float *scales, int groups, int group_size,
                             int64_t n, int K, const uint16_t *xbf) {
    (void)w, (void)row_bytes, (void)scales, (void)groups, (void)group_size, (void)n, (void)K, (void)xbf;
    return 0.0f;
}

static void quant_bf16_dots(const uint16_t *w, const float *scales, int groups, int group, const uint16_t *x,
                            int K, int M, int count, float *dots) {
    (void)w, (void)scales, (void)groups, (void)group, (void)x, (void)K, (void)M, (void)count, (void)dots;
}
#endif

/* Row m of y's features n .. n + count from their dots (dots[i * stride + r], i from 0 for row m0): bias, the
 * offsets' and int4 shift's terms, then stored in float32 (y32) or bfloat16 (y16). */
static void quant_store(const float *dots, int stride, int m0, int rows, int64_t n, int count, int N, int groups,
                        const float *scales, const float *offsets, float shift, const float *xsums,
                        const float *xshift, const float *bias, float *y32, uint16_t *y16) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (!xsums && !xshift) { /* 16 features at a time: a fifth of a batch's time at 32 rows went here one by one */
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < count; r += 16) {
                const __mmask16 mask = count - r >= 16 ? 0xffff : (__mmask16)((1u << (count - r)) - 1);
                __m512 value = _mm512_maskz_loadu_ps(mask, dots + m * stride + r);
                if (bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, bias + n + r));
                const int64_t at = (int64_t)(m0 + m) * N + n + r;
                if (y32) _mm512_mask_storeu_ps(y32 + at, mask, value);
                else bf16_store16(y16 + at, value, mask);
            }
        return;
    }
#endif
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < count; r++) {
            float value = dots[m * stride + r] + (bias ? bias[n + r] : 0.0f);
            if (xsums || xshift)
                value += quant_group_terms(scales + (n + r) * groups, offsets ? offsets + (n + r) * groups : NULL,
                                           shift, groups, xsums ? xsums + (int64_t)(m0 + m) * groups : NULL,
                                           xshift ? xshift + (int64_t)(m0 + m) * groups : NULL);
            const int64_t at = (int64_t)(m0 + m) * N + n + r;
            if (y32) y32[at] = value;
            else bf16_store(y16 + at, value);
        }
}

/* Whether converted rows run as panels (quant_panel_dots) rather than in tiles (quant_bf16_dots): int4, from 48 rows
 * of x, or wherever it converts (past 16) with K up to 1536. Laying the rows out as a panel costs about what the
 * tiles lose to their sums across lanes and, with groups, to scaling 16 totals per group; int4's groups pay for it,
 * int8's single scale does not. Two threads of the AVX-512 BF16 EPYC, GMAC/s of int4's tiles against panels: N x K =
 * 3352 x 768 at 17 / 32 / 48 rows 123 / 137 / 141 against 129 / 151 / 162, 768 x 1536 117 / 133 / 132 against 122 /
 * 137 / 149; 2048 x 2048 131 / 145 / 147 against 103 / 127 / 146, 255 rows 114 against 172. One thread, N = K =
 * 2048, int8 / int4: 32 rows 74-79 / 67-73 against 60-70 / 63-69, 255 rows 79-83 / 70-72 against 68-84 / 85-89. */
#define QUANT_PANEL_MIN_ROWS_INT4 48
#define QUANT_PANEL_SMALL_K 1536
static int quant_panels(int format, int M, int K) {
    return format == TANDEM_QUANT_INT4 && (M >= QUANT_PANEL_MIN_ROWS_INT4 || K <= QUANT_PANEL_SMALL_K);
}

/* y = x W^T (+ bias) into y32 (float32) or, where it is NULL, y16 (bfloat16, rounded once from the float32 sums). */
static void quant_gemm(const uint8_t *w, int format, const float *scales, const float *offsets, int group_size,
                       const float *x, const float *bias, float *y32, uint16_t *y16, int M, int N, int K,
                       int num_threads) {
    if (M < 1 || N < 1) return;
    if (quant_expands(format, M) && M > QUANT_EXPAND_CHUNK) { /* a prefill: in chunks of rows, x in cache */
        for (int m0 = 0; m0 < M; m0 += QUANT_EXPAND_CHUNK) {
            const int rows = M - m0 < QUANT_EXPAND_CHUNK ? M - m0 : QUANT_EXPAND_CHUNK;
            quant_gemm(w, format, scales, offsets, group_size, x + (int64_t)m0 * K, bias,
                       y32 ? y32 + (int64_t)m0 * N : NULL, y16 ? y16 + (int64_t)m0 * N : NULL, rows, N, K,
                       num_threads);
        }
        return;
    }
    /* x in bfloat16 (its values checked once) for converted rows, int4 in quant_pack_bf16's order where it runs
     * (its weights convert faster so), else as it lies; or for int4's steps of four blocks */
    const int converts = quant_converts(format, group_size, M, K), wide_steps = quant_wide(format, M, group_size, K);
    const int packs = wide_steps || quant_packs_bf16(format, group_size, K);
    const int bf16_x = (converts || packs) && quant_bf16_valued(x, (int64_t)M * K);
    uint16_t *xrows = NULL, *xbf = NULL;
    const int permuted = packs;
    const int wide = bf16_x && wide_steps; /* (int4's converted rows start past 16 rows) */
    const int one_row = quant_one_row(format, M, group_size, K);
    const int expanded = !converts && quant_expands(format, M); /* weights expanded whole: offsets, shift too */
    if (bf16_x && converts) xrows = packs ? quant_pack_bf16(x, M, K, 0) : quant_x_bf16(x, M, K);
    else if (bf16_x && packs) xbf = quant_pack_bf16(x, M, K, wide);
    float *xperm = xrows || wide ? NULL : quant_permute(format, group_size, x, M, K);
    const int64_t row_bytes = quant_row_bytes(format, K);
    const int groups = K > 0 ? (K + group_size - 1) / group_size : 0;
    const int group = group_size < K ? group_size : K;
    /* output features per block: converted rows as panels, or in tiles of 6 or 4 features */
    const int panels = xrows && quant_panels(format, M, K);
    const int block_rows = panels     ? QUANT_PANEL
                           : xrows    ? QUANT_CONVERT_ROWS
                           : expanded ? quant_expand_rows(K)
                                      : QUANT_ROWS;
    const int64_t blocks = (N + block_rows - 1) / block_rows;
    /* wide steps, and expanded weights, hold q itself too */
    const float shift = xrows || wide || expanded ? 0.0f : quant_shift(format);
    /* The offsets' sums of x over whole groups; int4's shift only over what the steps of one block and the
     * single values sum as q + 8 (the steps of two and four blocks, and converted rows, hold q itself). */
    float *xsums = offsets && !expanded ? quant_x_sums(x, M, K, group_size, groups, 0) : NULL;
    float *xshift = shift != 0.0f ? quant_x_sums(x, M, K, group_size, groups, xperm ? 32 : 0) : NULL;
#pragma omp parallel num_threads(num_threads)
    {
    uint16_t *converted = xrows ? malloc(sizeof(uint16_t) * (size_t)block_rows * (size_t)K) : NULL;
    uint16_t *panel = panels ? malloc(sizeof(uint16_t) * QUANT_PANEL * (size_t)K) : NULL;
    float *table = panels ? malloc(sizeof(float) * QUANT_PANEL * (size_t)groups) : NULL;
    float *panel_dots = panels ? malloc(sizeof(float) * QUANT_PANEL * (size_t)M) : NULL;
    float *weights = expanded ? malloc(sizeof(float) * (size_t)block_rows * (size_t)K) : NULL;
    float *expanded_rows = expanded ? malloc(sizeof(float) * QUANT_OUTER_FEATURES * (size_t)K) : NULL;
    float *expanded_dots = expanded ? malloc(sizeof(float) * (size_t)block_rows * (size_t)M) : NULL;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = block * block_rows;
        const int count = N - n < block_rows ? (int)(N - n) : block_rows;
        if (converted) quant_bf16_rows(w, format, row_bytes, n, count, K, permuted, block_rows, converted);
        if (weights) {
            const int panels = quant_expand_block(w + n * row_bytes, format, row_bytes, scales + n * groups,
                                                  offsets ? offsets + n * groups : NULL, groups, group_size, count,
                                                  K, expanded_rows, weights);
            quant_expanded_dots(weights, panels, x, M, K, expanded_dots, block_rows);
            quant_store(expanded_dots, block_rows, 0, M, n, count, N, groups, scales, NULL, 0.0f, NULL, NULL, bias,
                        y32, y16);
            continue;
        }
        if (panels) {
            quant_panel_dots(converted, scales + n * groups, groups, group, xrows, K, M, count, panel, table,
                             panel_dots);
            quant_store(panel_dots, QUANT_PANEL, 0, M, n, count, N, groups, scales, offsets, shift, xsums, xshift,
                        bias, y32, y16);
            continue;
        }
        for (int m0 = 0; m0 < M; m0 += QUANT_X_ROWS) {
            const int rows = M - m0 < QUANT_X_ROWS ? M - m0 : QUANT_X_ROWS;
            const float *xs = x + (int64_t)m0 * K, *xps = xperm ? xperm + (int64_t)m0 * K : NULL;
            float dots[QUANT_CONVERT_ROWS * QUANT_X_ROWS];
            if (converted)
                quant_bf16_dots(converted, scales + n * groups, groups, group, xrows + (int64_t)m0 * K, K, rows,
                                count, dots);
            else if (wide)
                for (int r = 0; r < count; r++)
                    dots[r] = quant_int4_wide(w, row_bytes, scales, groups, group_size, n + r, K, xbf);
            else if (one_row)
                for (int r = 0; r < count; r++)
                    dots[r] = quant_int4_row(w, row_bytes, scales, groups, group_size, n + r, K, x);
            else
                quant_dots(w, format, row_bytes, scales, groups, group_size, n, count, K, xs, xps,
                           xbf ? xbf + (int64_t)m0 * K : NULL, rows, dots);
            quant_store(dots, count, m0, rows, n, count, N, groups, scales, offsets, shift, xsums, xshift, bias,
                        y32, y16);
        }
    }
    free(converted);
    free(panel);
    free(table);
    free(panel_dots);
    free(weights);
    free(expanded_rows);
    free(expanded_dots);
    }
    free(xrows);
    free(xsums);
    free(xshift);
    free(xperm);
    free(xbf);
}

void tandem_quant_gemm(const uint8_t *w, int format, const float *scales, const float *offsets, int group_size,
                       const float *x, const float *bias, float *y, int M, int N, int K, int num_threads) {
    quant_gemm(w, format, scales, offsets, group_size, x, bias, y, NULL, M, N, K, num_threads);
}

/* tandem_quant_gemm for a bfloat16 model's linear: x and y bfloat16, x widened once here, so that the caller
 * needs no conversions around it (two small copies a linear, 0.7 ms of a 1.23B hybrid's 28.7 ms int4 step). */
void tandem_quant_gemm_bf16(const uint8_t *w, int format, const float *scales, const float *offsets,
                            int group_size, const uint16_t *x, const float *bias, uint16_t *y, int M, int N, int K,
                            int num_threads) {
    if (M < 1 || N < 1) return;
    float *wide = malloc(sizeof(float) * (size_t)M * (size_t)K);
    for (int64_t i = 0; i < (int64_t)M * K; i++) wide[i] = bf16_load(x + i);
    quant_gemm(w, format, scales, offsets, group_size, wide, bias, NULL, y, M, N, K, num_threads);
    free(wide);
}

void tandem_quant_dequantize(const uint8_t *w, int format, const float *scales, const float *offsets,
                             int group_size, float *out, int N, int K, int num_threads) {
    if (N < 1 || K < 1) return;
    const int64_t row_bytes = quant_row_bytes(format, K);
    const int groups = (K + group_size - 1) / group_size;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        quant_dequantize_row(w + n * row_bytes, format, scales + n * groups, offsets ? offsets + n * groups : NULL,
                             groups, group_size, K, out + n * K);
}
