/* Batched LoRA for the CPU (Punica's BGMV; runtime/kernels/lora.py holds the torch reference and the contract):
 * every token row multiplies by the adapter in its own slot of a pool (float32, or bfloat16 for a bfloat16 model,
 * widened as it is read; the sums are float32); x and y are float32 or bfloat16.
 *
 *   shrink: s[t, r] = sum_k x[t, k] A[slot[t], r, k]
 *   expand: y[t, n] += sum_r s[t, r] B[slot[t], r, n] + bias[slot[t], n]     (B stored (R, out): rows of it added)
 *
 * Rows in `skip_slot` (the pool's zero slot, the base model's rows) are skipped: the shrink writes zeros and
 * the expand leaves y as it is, which is what adding the zero slot's zeros gives, bit for bit. Threads split
 * the chunks of rows (shrink) and chunks times blocks of output features (expand), for calls large enough to
 * pay; the shrink's sums run over 16 lanes and the expand adds rows of B, which GCC vectorises as written. */

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tandem_cpu.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define LORA_LANES 16
#define LORA_CHUNK 8    /* rows of one slot that share one read of its weights */
/* Below this many multiply-adds a call runs on one thread: waking the team costs more than it saves (a decode
 * step calls the two kernels for every linear of the model, and a 32-row rank-16 call is ~0.1 ms of one core;
 * on a loaded machine each parallel region waits for a descheduled thread, which measured ~8 ms a call). */
#define LORA_PARALLEL_MIN 131072
/* ... or when one slot's B is this many values (a batch-1 expand of a wide linear reads 64 KiB or more of it). */
#define LORA_PARALLEL_READ 32768

/* Value i of a slot's row: float32, or bfloat16 widened (exactly). `bf16` is a constant at each call. */
static inline float lora_at(const void *row, const int bf16, int64_t i) {
    return bf16 ? bf16_load((const uint16_t *)row + i) : ((const float *)row)[i];
}

static inline float lora_dot(const void *a, const int a_bf16, const float *x, int n) {
    float lanes[LORA_LANES] = {0};
    int i = 0;
    for (; i + LORA_LANES <= n; i += LORA_LANES)
        for (int j = 0; j < LORA_LANES; j++) lanes[j] += lora_at(a, a_bf16, i + j) * x[i + j];
    float total = 0.0f;
    for (int j = 0; j < LORA_LANES; j++) total += lanes[j];
    for (; i < n; i++) total += lora_at(a, a_bf16, i) * x[i];
    return total;
}

/* Sixteen floats, one AVX-512 register (two AVX registers elsewhere): GCC's and Clang's vector extension, which
 * keeps the blocked sums below in registers where plain arrays of lanes were spilled. */
typedef float lora_v16 __attribute__((vector_size(LORA_LANES * sizeof(float))));
typedef uint16_t lora_h16 __attribute__((vector_size(LORA_LANES * sizeof(uint16_t))));
typedef uint32_t lora_u16 __attribute__((vector_size(LORA_LANES * sizeof(uint32_t))));

/* Sixteen values of a slot's row from i into *v, bfloat16 widened by a shift in registers. */
static inline void lora_load16(lora_v16 *v, const void *row, const int bf16, int64_t i) {
    if (bf16) {
        lora_h16 half;
        memcpy(&half, (const uint16_t *)row + i, sizeof half);
        const lora_u16 bits = __builtin_convertvector(half, lora_u16) << 16;
        memcpy(v, &bits, sizeof *v);
    } else {
        memcpy(v, (const float *)row + i, sizeof *v);
    }
}

/* p[0..16) += delta, for a bfloat16 y: widened, added, rounded as bf16_store does (to nearest even; a NaN
 * stays NaN), 16 values at a time in registers. */
static inline void lora_add16_bf16(uint16_t *p, const float *delta) {
    lora_h16 half;
    memcpy(&half, p, sizeof half);
    lora_u16 bits = __builtin_convertvector(half, lora_u16) << 16;
    lora_v16 v, d;
    memcpy(&v, &bits, sizeof v);
    memcpy(&d, delta, sizeof d);
    v += d;
    memcpy(&bits, &v, sizeof bits);
    const lora_u16 nan = (lora_u16)((bits & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    const lora_u16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
    half = __builtin_convertvector((nan & quiet) | (~nan & rounded), lora_h16);
    memcpy(p, &half, sizeof half);
}

/* Rows summed at once: 8 chains of 16 lanes fill a quarter of AVX-512's 32 registers. Without AVX-512, blocking
 * measured slower than one row at a time (GCC spills the 16-lane sums of several rows), so the kernels keep
 * the single-row loops there. */
#ifdef __AVX512F__
#define LORA_DOT_ROWS 8
#define LORA_EXPAND_ROWS 8 /* 8 rows of a 32-feature block: 16 registers of sums (4 rows of 64 measured 2x slower) */
#define LORA_BLOCK_N 32    /* output features per expand task */
#define LORA_PREFETCH_BLOCKS 4
#else
#define LORA_DOT_ROWS 1    /* the vector extension's 16 lanes spill on AVX2: one row at a time, as lora_dot */
#define LORA_EXPAND_ROWS 1
#define LORA_BLOCK_N 64
#define LORA_PREFETCH_BLOCKS 4
#endif

/* Dot products of one row of A with the rows `x[0..LORA_CHUNK)` at once: the chunk's rows are independent
 * chains of fused multiply-adds (one row alone waits on its own adds: a quarter of the FMA throughput), and A's
 * row is read once for all of them. Each output sums exactly as lora_dot does (16 lanes, then the lanes in
 * order, then the tail), so the blocking changes no bit. `rows` (2, 4 or LORA_DOT_ROWS) is a constant at each
 * call, so that the loops unroll; a block of fewer rows repeats its last row, whose extra results are dropped. */
static inline void lora_dots(const void *a, const int a_bf16, const float *const *x, int n, float *out,
                             const int rows) {
    assert(rows <= LORA_DOT_ROWS);
    lora_v16 acc[LORA_DOT_ROWS], av, xv;
    for (int row = 0; row < rows; row++) acc[row] = (lora_v16){0};
    int i = 0;
    for (; i + LORA_LANES <= n; i += LORA_LANES) {
        lora_load16(&av, a, a_bf16, i);
        for (int row = 0; row < rows; row++) {
            memcpy(&xv, x[row] + i, sizeof xv);
            acc[row] += av * xv;
        }
    }
    for (int row = 0; row < rows; row++) {
        float total = 0.0f;
        for (int j = 0; j < LORA_LANES; j++) total += acc[row][j];
        for (int k = i; k < n; k++) total += lora_at(a, a_bf16, k) * x[row][k];
        out[row] = total;
    }
}

/* Rows grouped by slot, in chunks of at most LORA_CHUNK rows of one slot: a chunk reads its slot's A (or a
 * block of B) once for all its rows, from L1, instead of once per row (32 decode rows over 4 adapters read each
 * adapter's weights 8 times less). Each output still sums in the same order, so results are unchanged bit for
 * bit. `order` gets the non-skipped rows sorted by slot (stable), `chunk_start` the first position in `order`
 * of each chunk and, last, the end; returns the number of chunks. */
static int lora_chunks(const int64_t *indices, int64_t skip_slot, int rows, int *order, int *chunk_start) {
    int *count = calloc((size_t)skip_slot + 1, sizeof(int));
    for (int t = 0; t < rows; t++)
        if (indices[t] != skip_slot) count[indices[t]]++;
    int total = 0;
    for (int64_t s = 0; s < skip_slot; s++) {
        const int n = count[s];
        count[s] = total;
        total += n;
    }
    for (int t = 0; t < rows; t++)
        if (indices[t] != skip_slot) order[count[indices[t]]++] = t;
    free(count);
    int chunks = 0;
    for (int i = 0; i < total; i++)
        if (i == 0 || indices[order[i]] != indices[order[i - 1]] || i - chunk_start[chunks - 1] == LORA_CHUNK)
            chunk_start[chunks++] = i;
    chunk_start[chunks] = total;
    return chunks;
}

/* The dots of one row of A with `m` rows of x, in blocks that unroll (`a_bf16` a constant at each call). */
static inline __attribute__((always_inline)) void lora_shrink_rows(const void *row_a, const int a_bf16,
                                                                   const float *const *rows_x, int m, int dim,
                                                                   float *dots) {
    if (LORA_DOT_ROWS == 1 || m == 1)  /* one row (batch 1): padded rows would only cost loads */
        dots[0] = lora_dot(row_a, a_bf16, rows_x[0], dim);
    else if (m == 2)
        lora_dots(row_a, a_bf16, rows_x, dim, dots, 2);
    else if (m <= 4)
        lora_dots(row_a, a_bf16, rows_x, dim, dots, 4);
    else
        lora_dots(row_a, a_bf16, rows_x, dim, dots, LORA_DOT_ROWS);
}

/* A bfloat16 pool's values, widened (exactly) into float32. */
static inline void lora_widen(const uint16_t *from, float *to, int64_t count) {
    for (int64_t i = 0; i < count; i++) to[i] = bf16_load(from + i);
}

#ifdef __AVX512BF16__
/* A bfloat16 model's shrink (x and the slots both bfloat16) on a CPU with AVX512-BF16: its dot instruction
 * multiplies pairs of bfloat16 exactly and adds them into 16 float32 lanes, 32 values an instruction, where the
 * path below widens both sides and does 16. The sums run in another order than lora_dot's (pairs, then 16 lanes
 * reduced as a tree), the same for every row whatever its chunk: a row's result does not depend on its
 * neighbours. `rows` (1, 2, 4 or LORA_DOT_ROWS) is a constant at each call, so that the sums stay in registers. */
static inline __attribute__((always_inline)) void lora_dots_bf16(const uint16_t *a, const uint16_t *const *x,
                                                                  int dim, float *out, const int rows) {
    __m512 acc[LORA_DOT_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= dim; k += 32) {
        /* the slot's next row of A, a cache line (32 values) a step: the pools are read cold each step, and the
         * hardware's prefetcher ramps up too late for rows this short */
        __builtin_prefetch(a + k + dim);
        const __m512bh av = (__m512bh)_mm512_loadu_si512(a + k);
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], av, (__m512bh)_mm512_loadu_si512(x[i] + k));
    }
    if (k < dim) {  /* the tail, zero-filled: zero pairs add nothing */
        const __mmask32 mask = (__mmask32)((1ull << (dim - k)) - 1);
        const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + k);
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], av, (__m512bh)_mm512_maskz_loadu_epi16(mask, x[i] + k));
    }
    for (int i = 0; i < rows; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

static void lora_shrink_chunk_bf16(const uint16_t *x, int64_t x_stride, const int *mine, int n, const uint16_t *a,
                                   int rank, int dim, float *out) {
    for (int i0 = 0; i0 < n; i0 += LORA_DOT_ROWS) {
        const int m = n - i0 < LORA_DOT_ROWS ? n - i0 : LORA_DOT_ROWS;
        const uint16_t *rows_x[LORA_DOT_ROWS];
        for (int i = 0; i < LORA_DOT_ROWS; i++) rows_x[i] = x + mine[i0 + (i < m ? i : m - 1)] * x_stride;
        for (int r = 0; r < rank; r++) {
            const uint16_t *row_a = a + (int64_t)r * dim;
            float dots[LORA_DOT_ROWS];
            if (m == 1)
                lora_dots_bf16(row_a, rows_x, dim, dots, 1);
            else if (m == 2)
                lora_dots_bf16(row_a, rows_x, dim, dots, 2);
            else if (m <= 4)
                lora_dots_bf16(row_a, rows_x, dim, dots, 4);
            else
                lora_dots_bf16(row_a, rows_x, dim, dots, LORA_DOT_ROWS);
            for (int i = 0; i < m; i++) out[(int64_t)mine[i0 + i] * rank + r] = dots[i];
        }
    }
}
#endif

void tandem_lora_shrink(const void *x, int x_bf16, int64_t x_stride, const void *a, int a_bf16,
                        const int64_t *indices, int64_t skip_slot, int rows, int rank, int dim, float *out,
                        int num_threads) {
    int *order = malloc(sizeof(int) * ((size_t)rows * 2 + 1)), *chunk_start = order + rows;
    for (int t = 0; t < rows; t++)
        if (indices[t] == skip_slot) memset(out + (int64_t)t * rank, 0, sizeof(float) * rank);
    const int chunks = lora_chunks(indices, skip_slot, rows, order, chunk_start);
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (chunks > 1 && num_threads > 1 && (int64_t)rows * rank * dim >= LORA_PARALLEL_MIN)
    for (int c = 0; c < chunks; c++) {
        const int *mine = order + chunk_start[c], n = chunk_start[c + 1] - chunk_start[c];
        const int64_t offset = indices[mine[0]] * rank * (int64_t)dim;
#ifdef __AVX512BF16__
        if (x_bf16 && a_bf16) {
            lora_shrink_chunk_bf16((const uint16_t *)x, x_stride, mine, n, (const uint16_t *)a + offset, rank, dim,
                                   out);
            continue;
        }
#endif
        /* bfloat16 rows are widened once per chunk, not once per rank row, nor by a float32 copy of x; a bfloat16
         * slot (a bfloat16 model's: half the bytes to read) is widened in registers as it is read. */
        float *wide = x_bf16 ? malloc(sizeof(float) * (size_t)n * dim) : NULL;
        for (int i = 0; wide && i < n; i++) {
            const uint16_t *row = (const uint16_t *)x + mine[i] * x_stride;
            for (int k = 0; k < dim; k++) wide[(int64_t)i * dim + k] = bf16_load(row + k);
        }
        for (int i0 = 0; i0 < n; i0 += LORA_DOT_ROWS) {
            const int m = n - i0 < LORA_DOT_ROWS ? n - i0 : LORA_DOT_ROWS;
            const float *rows_x[LORA_DOT_ROWS];
            for (int i = 0; i < LORA_DOT_ROWS; i++) {
                const int row = i0 + (i < m ? i : m - 1);
                rows_x[i] = wide ? wide + (int64_t)row * dim : (const float *)x + mine[row] * x_stride;
            }
            for (int r = 0; r < rank; r++) {
                const int64_t at = offset + (int64_t)r * dim;
                float dots[LORA_DOT_ROWS];
                if (a_bf16)
                    lora_shrink_rows((const uint16_t *)a + at, 1, rows_x, m, dim, dots);
                else
                    lora_shrink_rows((const float *)a + at, 0, rows_x, m, dim, dots);
                for (int i = 0; i < m; i++) out[(int64_t)mine[i0 + i] * rank + r] = dots[i];
            }
        }
        free(wide);
    }
    free(order);
}

/* `width` values of a pool from `offset`: in place for float32, widened into `wide` for bfloat16. */
static inline const float *lora_pool_row(const void *pool, int pool_bf16, int64_t offset, int width, float *wide) {
    if (!pool_bf16) return (const float *)pool + offset;
    lora_widen((const uint16_t *)pool + offset, wide, width);
    return wide;
}

/* delta[i][n] = bias[n] + sum_r s_i[r] B[r, n] for `rows` rows (1, or LORA_EXPAND_ROWS sharing B's reads as
 * independent chains) over one block of `width` features. Each output is the bias plus its terms in order of r,
 * however many rows. Full blocks of the blocked path keep their sums in registers (vector extension). */
static inline void lora_expand_rows(const float *const *rows_s, const void *pool, int pool_bf16, const float *add,
                                    int rank, int out_features, int width, float (*delta)[LORA_BLOCK_N],
                                    const int rows) {
    float wide[LORA_BLOCK_N];  /* a bfloat16 pool's row of the block, widened */
    if (LORA_EXPAND_ROWS > 1 && width == LORA_BLOCK_N) {  /* one row too (batch 1): B widened in registers */
        enum { VECS = LORA_BLOCK_N / LORA_LANES };
        lora_v16 acc[LORA_EXPAND_ROWS][VECS], wv[VECS];
        for (int v = 0; v < VECS; v++) memcpy(&wv[v], add + v * LORA_LANES, sizeof wv[v]);
        for (int i = 0; i < rows; i++)
            for (int v = 0; v < VECS; v++) acc[i][v] = wv[v];
        for (int r = 0; r < rank; r++) {
            /* widened in registers as it is read (the path below widens a block into memory first) */
            for (int v = 0; v < VECS; v++)
                lora_load16(&wv[v], pool, pool_bf16, (int64_t)r * out_features + v * LORA_LANES);
            /* the same row's block PREFETCH_BLOCKS tasks ahead (the next tasks take the next blocks) */
            __builtin_prefetch((const char *)pool + ((int64_t)r * out_features + LORA_PREFETCH_BLOCKS * LORA_BLOCK_N) *
                               (pool_bf16 ? 2 : 4));
            for (int i = 0; i < rows; i++) {
                const float sv = rows_s[i][r];
                for (int v = 0; v < VECS; v++) acc[i][v] += sv * wv[v];
            }
        }
        for (int i = 0; i < rows; i++) memcpy(delta[i], acc[i], sizeof acc[i]);
        return;
    }
    for (int i = 0; i < rows; i++)
        for (int n = 0; n < width; n++) delta[i][n] = add[n];
    for (int r = 0; r < rank; r++) {
        const float *w = lora_pool_row(pool, pool_bf16, (int64_t)r * out_features, width, wide);
        for (int i = 0; i < rows; i++) {
            const float sv = rows_s[i][r];
            for (int n = 0; n < width; n++) delta[i][n] += sv * w[n];
        }
    }
}

void tandem_lora_expand(const float *s, const void *b, int b_bf16, const float *bias, const int64_t *indices,
                        int64_t skip_slot, int rows, int rank, int out_features, void *y, int y_bf16,
                        int64_t y_stride, int num_threads) {
    int *order = malloc(sizeof(int) * ((size_t)rows * 2 + 1)), *chunk_start = order + rows;
    const int chunks = lora_chunks(indices, skip_slot, rows, order, chunk_start);
    const int blocks = (out_features + LORA_BLOCK_N - 1) / LORA_BLOCK_N;
    const int64_t tasks = (int64_t)chunks * blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (tasks > 1 && num_threads > 1 && ((int64_t)rows * rank * out_features >= LORA_PARALLEL_MIN || \
                                         (int64_t)rank * out_features >= LORA_PARALLEL_READ))
    for (int64_t task = 0; task < tasks; task++) {
        const int c = (int)(task / blocks), n0 = (int)(task % blocks) * LORA_BLOCK_N;
        const int n1 = n0 + LORA_BLOCK_N < out_features ? n0 + LORA_BLOCK_N : out_features;
        const int *mine = order + chunk_start[c], count = chunk_start[c + 1] - chunk_start[c], width = n1 - n0;
        const int64_t slot = indices[mine[0]];
        const int64_t offset = slot * (int64_t)rank * out_features + n0;
        const void *pool = b_bf16 ? (const void *)((const uint16_t *)b + offset)
                                  : (const void *)((const float *)b + offset);
        const float *add = bias + slot * out_features + n0;
        for (int i0 = 0; i0 < count; i0 += LORA_EXPAND_ROWS) {
            const int m = count - i0 < LORA_EXPAND_ROWS ? count - i0 : LORA_EXPAND_ROWS;
            const float *rows_s[LORA_EXPAND_ROWS];
            for (int i = 0; i < LORA_EXPAND_ROWS; i++) rows_s[i] = s + (int64_t)mine[i0 + (i < m ? i : m - 1)] * rank;
            float delta[LORA_EXPAND_ROWS][LORA_BLOCK_N];
            if (m == 1)  /* batch 1 (and a last odd row): padded rows would only add work */
                lora_expand_rows(rows_s, pool, b_bf16, add, rank, out_features, width, delta, 1);
            else
                lora_expand_rows(rows_s, pool, b_bf16, add, rank, out_features, width, delta, LORA_EXPAND_ROWS);
            for (int i = 0; i < m; i++) {
                const int64_t t = mine[i0 + i];
                if (y_bf16) {
                    uint16_t *p = (uint16_t *)y + t * y_stride + n0;
                    int n = 0;
                    for (; n + LORA_LANES <= width; n += LORA_LANES) lora_add16_bf16(p + n, delta[i] + n);
                    for (; n < width; n++) bf16_store(p + n, bf16_load(p + n) + delta[i][n]);
                } else {
                    float *p = (float *)y + t * y_stride + n0;
                    for (int n = 0; n < width; n++) p[n] += delta[i][n];
                }
            }
        }
    }
    free(order);
}
