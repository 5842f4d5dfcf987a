/* Batched LoRA for the CPU (Punica's BGMV; runtime/kernels/lora.py holds the torch reference and the contract):
 * every token row multiplies by the adapter in its own slot of a float32 pool; x and y are float32 or bfloat16.
 *
 *   shrink: s[t, r] = sum_k x[t, k] A[slot[t], r, k]
 *   expand: y[t, n] += sum_r s[t, r] B[slot[t], r, n] + bias[slot[t], n]     (B stored (R, out): rows of it added)
 *
 * Rows in `skip_slot` (the pool's zero slot, the base model's rows) are skipped: the shrink writes zeros and
 * the expand leaves y as it is, which is what adding the zero slot's zeros gives, bit for bit. Threads split
 * the chunks of rows (shrink) and chunks times blocks of output features (expand), for calls large enough to
 * pay; the shrink's sums run over 16 lanes and the expand adds rows of B, which GCC vectorises as written. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem_cpu.h"

#define LORA_LANES 16
#define LORA_BLOCK_N 64 /* output features per expand task */
#define LORA_CHUNK 8    /* rows of one slot that share one read of its weights */
/* Below this many multiply-adds a call runs on one thread: waking the team costs more than it saves (a decode
 * step calls the two kernels for every linear of the model, and a 32-row rank-16 call is ~0.1 ms of one core;
 * on a loaded machine each parallel region waits for a descheduled thread, which measured ~8 ms a call). */
#define LORA_PARALLEL_MIN 4194304

static inline float lora_bf16_load(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Round to nearest even, as torch's float32 -> bfloat16 conversion (NaN stays NaN). */
static inline uint16_t lora_bf16_store(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float lora_dot(const float *a, const float *x, int n) {
    float lanes[LORA_LANES] = {0};
    int i = 0;
    for (; i + LORA_LANES <= n; i += LORA_LANES)
        for (int j = 0; j < LORA_LANES; j++) lanes[j] += a[i + j] * x[i + j];
    float total = 0.0f;
    for (int j = 0; j < LORA_LANES; j++) total += lanes[j];
    for (; i < n; i++) total += a[i] * x[i];
    return total;
}

/* lora_dot over a bfloat16 row, each value widened (exactly) as it is read: no float32 copy of x per call. */
static inline float lora_dot_bf16(const float *a, const uint16_t *x, int n) {
    float lanes[LORA_LANES] = {0};
    int i = 0;
    for (; i + LORA_LANES <= n; i += LORA_LANES)
        for (int j = 0; j < LORA_LANES; j++) lanes[j] += a[i + j] * lora_bf16_load(x + i + j);
    float total = 0.0f;
    for (int j = 0; j < LORA_LANES; j++) total += lanes[j];
    for (; i < n; i++) total += a[i] * lora_bf16_load(x + i);
    return total;
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

void tandem_lora_shrink(const void *x, int x_bf16, int64_t x_stride, const float *a, const int64_t *indices,
                        int64_t skip_slot, int rows, int rank, int dim, float *out, int num_threads) {
    int *order = malloc(sizeof(int) * ((size_t)rows * 2 + 1)), *chunk_start = order + rows;
    for (int t = 0; t < rows; t++)
        if (indices[t] == skip_slot) memset(out + (int64_t)t * rank, 0, sizeof(float) * rank);
    const int chunks = lora_chunks(indices, skip_slot, rows, order, chunk_start);
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (chunks > 1 && num_threads > 1 && (int64_t)rows * rank * dim >= LORA_PARALLEL_MIN)
    for (int c = 0; c < chunks; c++) {
        const int *mine = order + chunk_start[c], n = chunk_start[c + 1] - chunk_start[c];
        const float *pool = a + indices[mine[0]] * rank * (int64_t)dim;
        for (int r = 0; r < rank; r++) {
            const float *ar = pool + (int64_t)r * dim;
            for (int i = 0; i < n; i++) {
                const int64_t row = mine[i] * x_stride;
                out[(int64_t)mine[i] * rank + r] = x_bf16 ? lora_dot_bf16(ar, (const uint16_t *)x + row, dim)
                                                          : lora_dot(ar, (const float *)x + row, dim);
            }
        }
    }
    free(order);
}

void tandem_lora_expand(const float *s, const float *b, const float *bias, const int64_t *indices, int64_t skip_slot,
                        int rows, int rank, int out_features, void *y, int y_bf16, int64_t y_stride,
                        int num_threads) {
    int *order = malloc(sizeof(int) * ((size_t)rows * 2 + 1)), *chunk_start = order + rows;
    const int chunks = lora_chunks(indices, skip_slot, rows, order, chunk_start);
    const int blocks = (out_features + LORA_BLOCK_N - 1) / LORA_BLOCK_N;
    const int64_t tasks = (int64_t)chunks * blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (tasks > 1 && num_threads > 1 && (int64_t)rows * rank * out_features >= LORA_PARALLEL_MIN)
    for (int64_t task = 0; task < tasks; task++) {
        const int c = (int)(task / blocks), n0 = (int)(task % blocks) * LORA_BLOCK_N;
        const int n1 = n0 + LORA_BLOCK_N < out_features ? n0 + LORA_BLOCK_N : out_features;
        const int *mine = order + chunk_start[c], count = chunk_start[c + 1] - chunk_start[c];
        const int64_t slot = indices[mine[0]];
        const float *pool = b + slot * (int64_t)rank * out_features, *add = bias + slot * out_features;
        for (int i = 0; i < count; i++) {
            const int t = mine[i];
            const float *sr = s + (int64_t)t * rank;
            float delta[LORA_BLOCK_N];
            for (int n = n0; n < n1; n++) delta[n - n0] = add[n];
            for (int r = 0; r < rank; r++) {
                const float sv = sr[r], *w = pool + (int64_t)r * out_features;
                for (int n = n0; n < n1; n++) delta[n - n0] += sv * w[n];
            }
            for (int n = n0; n < n1; n++) {
                if (y_bf16) {
                    uint16_t *p = (uint16_t *)y + t * y_stride + n;
                    *p = lora_bf16_store(lora_bf16_load(p) + delta[n - n0]);
                } else {
                    float *p = (float *)y + t * y_stride + n;
                    *p += delta[n - n0];
                }
            }
        }
    }
    free(order);
}
