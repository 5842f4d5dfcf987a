/* Tandem's native CPU kernels: the Mamba decode steps, in place on the state pool, one pass each, and the
 * norms, activations, rotary embedding, decode attention and small-batch linears around them.
 *
 * Built on first use by native_build.py (the host's C compiler, -O3 for this CPU, -fopenmp) with
 * ops.cpp, which checks every tensor and registers each function as a torch operator. Small inputs
 * arrive as contiguous float32 arrays (the launchers convert them: a few kilobytes per step); states
 * stay in the pool, in float32 or bfloat16, addressed by slot. The math is the torch references'
 * (selective_state_update_ref, causal_conv1d_update_ref, ...), in float32, and the tests hold these
 * functions to those references on random inputs.
 */

#define _GNU_SOURCE /* syscall: the AMX permission */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "panel.h"
#include "tandem_cpu.h"

static inline float silu_f(float x) { return x / (1.0f + expf(-x)); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for 8 floats, within 2 ulp of expf (Cephes' polynomial): libm's expf is scalar, and the
 * SiLU of a prefill's conv and norm outputs calls it millions of times. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.5f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

#if defined(__AVX512F__)
/* exp8 on 16 lanes: the same polynomial, so the same result per value. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.5f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}
#endif

static void silu_inplace(float *v, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        /* exp overflows to infinity below x = -88; capped, its reciprocal is 0 (or tiny) instead of the
         * NaN that Newton's step makes of infinity times 0. */
        const __m512 denominator = _mm512_min_ps(
            _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))), _mm512_set1_ps(FLT_MAX));
        /* x / denominator as x times its reciprocal, refined once (Newton: 14 -> about 24 good bits): a 512-bit
         * division occupies the divider for about 10 cycles, and was most of a prefill conv's time. */
        const __m512 estimate = _mm512_rcp14_ps(denominator);
        const __m512 reciprocal = _mm512_mul_ps(estimate, _mm512_fnmadd_ps(denominator, estimate, _mm512_set1_ps(2.0f)));
        _mm512_storeu_ps(v + i, _mm512_mul_ps(x, reciprocal));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
        _mm256_storeu_ps(v + i, _mm256_div_ps(x, denominator));
    }
    for (; i < n; i++) v[i] = silu_f(v[i]);
}
#else
static void silu_inplace(float *v, int n) {
    for (int i = 0; i < n; i++) v[i] = silu_f(v[i]);
}
#endif

/* One state row through one token: s = s * decay + xdt * b, in place; returns s . c. */
#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 v);

static inline float update_row(float *s, const float *b, const float *c, float decay, float xdt, int n) {
    const __m256 vd = _mm256_set1_ps(decay), vx = _mm256_set1_ps(xdt);
    /* Two accumulators: one would chain every multiply-add of the row on the previous one's latency. */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 s0 = _mm256_fmadd_ps(vx, _mm256_loadu_ps(b + i), _mm256_mul_ps(_mm256_loadu_ps(s + i), vd));
        const __m256 s1 = _mm256_fmadd_ps(vx, _mm256_loadu_ps(b + i + 8), _mm256_mul_ps(_mm256_loadu_ps(s + i + 8), vd));
        _mm256_storeu_ps(s + i, s0);
        _mm256_storeu_ps(s + i + 8, s1);
        acc0 = _mm256_fmadd_ps(s0, _mm256_loadu_ps(c + i), acc0);
        acc1 = _mm256_fmadd_ps(s1, _mm256_loadu_ps(c + i + 8), acc1);
    }
    float acc = sum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) {
        s[i] = s[i] * decay + xdt * b[i];
        acc += s[i] * c[i];
    }
    return acc;
}
#else
static inline float update_row(float *s, const float *b, const float *c, float decay, float xdt, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) {
        s[i] = s[i] * decay + xdt * b[i];
        acc += s[i] * c[i];
    }
    return acc;
}
#endif

/* x . y over n floats. */
#if defined(__AVX2__) && defined(__FMA__)
static inline float dot_product(const float *x, const float *y, int n) {
    /* Two accumulators, as update_row: one would wait on each multiply-add's latency in turn. */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), acc1);
    }
    float total = sum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) total += x[i] * y[i];
    return total;
}
#else
static inline float dot_product(const float *x, const float *y, int n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) total += x[i] * y[i];
    return total;
}
#endif

/* value rounded to bfloat16 and widened back: an intermediate that torch rounds to the model's dtype. */
static inline float bf16_round(float value) {
    uint16_t rounded;
    bf16_store(&rounded, value);
    return bf16_load(&rounded);
}

/* bf16_round over a row, 16 values at a time where the CPU has AVX-512 (the same rounding and NaN): the
 * scalar function's branch kept its loops from vectorising, and bfloat16 SiLU-and-multiply spent most of
 * its time there. */
static inline void bf16_round_row(float *v, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 value = _mm512_loadu_ps(v + i);
        const __m512i bits = _mm512_castps_si512(value);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
        const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
        const __m512i chosen = _mm512_mask_blend_epi32(nan, rounded, quiet);
        _mm512_storeu_ps(v + i, _mm512_castsi512_ps(_mm512_and_si512(chosen, _mm512_set1_epi32((int)0xffff0000u))));
    }
#endif
    for (; i < n; i++) v[i] = bf16_round(v[i]);
}

/* One row of a state (d_state values) in float32, wherever the pool keeps it. */
static inline void row_load(const void *pool, int bf16, int64_t offset, float *row, int n) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)pool + offset;
        for (int i = 0; i < n; i++) row[i] = bf16_load(src + i);
    } else {
        memcpy(row, (const float *)pool + offset, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* bf16_store for 8 values at once: the same rounding and the same NaN, without a branch per value. */
static inline void bf16_store8(uint16_t *p, __m256 value) {
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    /* Pack the 8 halves (in-lane), then put lane 1's four after lane 0's. */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

static inline void row_store(void *pool, int bf16, int64_t offset, const float *row, int n) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)pool + offset;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) bf16_store8(dst + i, _mm256_loadu_ps(row + i));
#endif
        for (; i < n; i++) bf16_store(dst + i, row[i]);
    } else {
        memcpy((float *)pool + offset, row, (size_t)n * sizeof(float));
    }
}

/* A verify's decode rows come in waves (runtime/waves.py): wave i is rows of the first waves[i] sequences,
 * and sequence s reads its state from page slots[i][s] and writes it to slots[i + 1][s], so that the state
 * after each of its positions lies in a page of its own. Without waves (NULL), one wave of num_seqs rows in
 * place: slots is (S,). A sequence's waves run in order inside one work item, its state between them in
 * the cache. */
typedef struct {
    const int64_t *slots, *waves;
    int num_waves, num_seqs;
} wave_chains;

static wave_chains chains_of(const int64_t *slots, int num_seqs, const int64_t *waves, int num_waves) {
    wave_chains c = {slots, waves, waves ? num_waves : 1, num_seqs};
    return c;
}

static int in_wave(const wave_chains *c, int wave, int seq) {
    return wave < c->num_waves && (c->waves ? seq < c->waves[wave] : 1);
}

static int64_t wave_source(const wave_chains *c, int wave, int seq) {
    return c->slots[c->waves ? (int64_t)wave * c->num_seqs + seq : seq];
}

static int64_t wave_target(const wave_chains *c, int wave, int seq) {
    return c->slots[c->waves ? (int64_t)(wave + 1) * c->num_seqs + seq : seq];
}

static int64_t wave_rows(const wave_chains *c, int wave) { return c->waves ? c->waves[wave] : c->num_seqs; }

/* Mamba-2 decode. states: the pool, (slot, H, P, N) with (P, N) contiguous inside each head and
 * strides slot_stride, head_stride in elements. slots: (S,), -1 = padding (output zero, no access), or a
 * verify's page chains (waves, above). x: (R, H, P), dt: (R, H), B, C: (R, G, N) for R rows, all float32 or
 * all bfloat16 (in_bf16), each with its own row stride and the rest contiguous (slices of the input
 * projection and the conv output, read where they lie); dt is raw: dt' = softplus(dt + dt_bias) (clamped to
 * [dt_min, dt_max] if clamp) here, as time_step. A: (H,); D: (H, P); dt_bias: (H,) or NULL, float32.
 * y: (R, H, P) contiguous, float32 or bfloat16 (y_bf16). One (sequence, head) per iteration: the state is
 * read, decayed, updated, seen through C and written back while it is in the cache. */
void tandem_ssm_state_update(void *states, int bf16, int64_t slot_stride, int64_t head_stride,
                             const int64_t *slots, int num_seqs, const int64_t *waves, int num_waves,
                             int num_heads, int head_dim, int d_state, int num_groups, int in_bf16, const void *x,
                             int64_t x_stride, const void *dt, int64_t dt_stride, const float *dt_bias, int clamp,
                             float dt_min, float dt_max, const float *A, const void *B, int64_t b_stride,
                             const void *C, int64_t c_stride, const float *D, void *y, int y_bf16,
                             int num_threads) {
    const int heads_per_group = num_heads / num_groups;
    const wave_chains chains = chains_of(slots, num_seqs, waves, num_waves);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_heads; item++) {
        const int seq = (int)(item / num_heads), head = (int)(item % num_heads);
        const int group = head / heads_per_group;
        int64_t seq_row = seq;
        for (int wave = 0; in_wave(&chains, wave, seq); seq_row += wave_rows(&chains, wave), wave++) {
            const int64_t row = seq_row * num_heads + head; /* in x and y, heads inside rows */
            float y_head[head_dim];
            const int64_t source = wave_source(&chains, wave, seq), target = wave_target(&chains, wave, seq);
            if (source < 0) {
                memset(y_head, 0, sizeof y_head);
                row_store(y, y_bf16, row * head_dim, y_head, head_dim);
                continue;
            }
            float raw, x_head[head_dim], b[d_state], c[d_state];
            row_load(dt, in_bf16, seq_row * dt_stride + head, &raw, 1);
            raw += dt_bias ? dt_bias[head] : 0.0f;
            float step = raw > 20.0f ? raw : log1pf(expf(raw)); /* softplus, with torch's threshold */
            if (clamp) step = fminf(fmaxf(step, dt_min), dt_max);
            const float decay = expf(step * A[head]);
            row_load(x, in_bf16, seq_row * x_stride + (int64_t)head * head_dim, x_head, head_dim);
            row_load(B, in_bf16, seq_row * b_stride + (int64_t)group * d_state, b, d_state);
            row_load(C, in_bf16, seq_row * c_stride + (int64_t)group * d_state, c, d_state);
            const int64_t from = source * slot_stride + head * head_stride;
            const int64_t to = target * slot_stride + head * head_stride;
            float scratch[d_state];
            const int64_t elem = bf16 ? 2 : 4;
            /* The next item's state (this thread's next, under the static schedule) is fetched a row per row
             * done here: items are slots scattered over the pool, where the hardware prefetcher does not
             * follow. A verify's later waves read the page the last one wrote, in the cache. */
            const int64_t next_seq = (item + 1) / num_heads, next_head = (item + 1) % num_heads;
            const int64_t next = !waves && item + 1 < (int64_t)num_seqs * num_heads && slots[next_seq] >= 0
                                     ? slots[next_seq] * slot_stride + next_head * head_stride : -1;
            /* A float32 pool updated in place is updated where it lies; otherwise a row goes through float32
             * scratch, read from the source page and written to the target. */
            const int in_place = !bf16 && from == to;
            for (int p = 0; p < head_dim; p++) {
                const int64_t offset = (int64_t)p * d_state;
                if (next >= 0)
                    for (int64_t byte = 0; byte < d_state * elem; byte += 64)
                        __builtin_prefetch((const char *)states + (next + (int64_t)p * d_state) * elem + byte);
                float *state_row = in_place ? (float *)states + to + offset : scratch;
                if (!in_place) row_load(states, bf16, from + offset, state_row, d_state);
                const float acc = update_row(state_row, b, c, decay, x_head[p] * step, d_state);
                if (!in_place) row_store(states, bf16, to + offset, state_row, d_state);
                y_head[p] = acc + D[head * head_dim + p] * x_head[p];
            }
            row_store(y, y_bf16, row * head_dim, y_head, head_dim);
        }
    }
}

/* Depthwise causal conv, one token per sequence. states: the pool, (slot, W-1, dim) with rows of
 * `dim` contiguous values, slot_stride in elements. x: (R, dim) float32 or bfloat16 (x_bf16), rows
 * x_stride apart (a slice of the input projection, read where it lies); out: (R, dim) contiguous, in x's
 * type; weight: (dim, W) float32; bias: (dim,) or NULL; silu: apply x * sigmoid(x). slots: (S,), -1 =
 * padding (output zero, no access), or a verify's page chains (waves, above).
 * The state shifts by one row: its oldest input leaves and x enters. */
void tandem_conv_update(void *states, int bf16, int64_t slot_stride, const int64_t *slots, int num_seqs,
                        const int64_t *waves, int num_waves, int dim, int width, const void *x, int x_bf16,
                        int64_t x_stride, const float *weight, const float *bias, int silu, void *out,
                        int num_threads) {
    const int block = 256; /* channels per work item: a few cache lines per state row */
    const int blocks = (dim + block - 1) / block;
    const wave_chains chains = chains_of(slots, num_seqs, waves, num_waves);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < (int64_t)num_seqs * blocks; item++) {
        const int seq = (int)(item / blocks);
        const int first = (int)(item % blocks) * block;
        const int count = dim - first < block ? dim - first : block;
        int64_t row = seq;
        for (int wave = 0; in_wave(&chains, wave, seq); row += wave_rows(&chains, wave), wave++) {
            const int64_t source = wave_source(&chains, wave, seq), target = wave_target(&chains, wave, seq);
            float o[block];
            if (source < 0) {
                memset(o, 0, sizeof o);
                row_store(out, x_bf16, row * dim + first, o, count);
                continue;
            }
            float window[width][block];
            for (int k = 0; k < width - 1; k++)
                row_load(states, bf16, source * slot_stride + (int64_t)k * dim + first, window[k], count);
            row_load(x, x_bf16, row * x_stride + first, window[width - 1], count);
            for (int d = 0; d < count; d++) {
                const float *w = weight + (int64_t)(first + d) * width;
                float acc = bias ? bias[first + d] : 0.0f;
                for (int k = 0; k < width; k++) acc += w[k] * window[k][d];
                o[d] = acc;
            }
            if (silu) silu_inplace(o, count); /* vectorised: a scalar expf per channel was most of the step */
            row_store(out, x_bf16, row * dim + first, o, count); /* out has x's type */
            for (int k = 0; k < width - 1; k++)
                row_store(states, bf16, target * slot_stride + (int64_t)k * dim + first, window[k + 1], count);
        }
    }
}

/* The prefill scan's register tile: SCAN_VW channels (p) x SCAN_NB state entries (n) of one head's
 * state, vectorised over the channels. GCC's vector types compile to 512-bit registers where the CPU
 * has AVX-512 and to 256-bit ones where it has AVX2; the tile fills about half the register file. */
#if defined(__AVX512F__)
typedef float scan_vec __attribute__((vector_size(64)));
#define SCAN_VW 16
#define SCAN_NB 16
#elif defined(__AVX2__) && defined(__FMA__)
typedef float scan_vec __attribute__((vector_size(32)));
#define SCAN_VW 8
#define SCAN_NB 8
#else
#define SCAN_VW 0
#endif
#define SCAN_TOKENS 128 /* tokens a block, through every tile */

#if SCAN_VW
static inline scan_vec scan_load(const float *p) {
    scan_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void scan_store(float *p, scan_vec v) { memcpy(p, &v, sizeof v); }

/* One tile through the tokens of one sequence, held in registers all along: a token costs
 * broadcasts of B_t[n] and C_t[n] and three multiply-adds per register, and its share of
 * y_t = state . C_t needs no sum across lanes (a register per state row needs one per channel and
 * token, which was most of the old loop). tile: [n][lane], in and out. xdt (x * dt'), y: the tile's
 * channels of token 0, rows x_stride apart; decay: token 0's, decay_stride apart; b, c: token 0's
 * entries n0.., bc_stride apart. y accumulates. */
static void scan_tile(float *tile, int64_t length, const float *xdt, int64_t x_stride, const float *decay,
                      int64_t decay_stride, const float *b, const float *c, int64_t bc_stride, float *y) {
    scan_vec s[SCAN_NB];
#pragma GCC unroll 16
    for (int j = 0; j < SCAN_NB; j++) s[j] = scan_load(tile + j * SCAN_VW);
    for (int64_t t = 0; t < length; t++) {
        const scan_vec u = scan_load(xdt + t * x_stride);
        const float a = decay[t * decay_stride];
        const float *bt = b + t * bc_stride, *ct = c + t * bc_stride;
        /* Two accumulators: the next token's updates need only the states, so the sums overlap them. */
        scan_vec acc0 = {0}, acc1 = {0};
#pragma GCC unroll 16
        for (int j = 0; j < SCAN_NB; j += 2) {
            s[j] = s[j] * a + u * bt[j];
            s[j + 1] = s[j + 1] * a + u * bt[j + 1];
            acc0 += s[j] * ct[j];
            acc1 += s[j + 1] * ct[j + 1];
        }
        float *yt = y + t * x_stride;
        scan_store(yt, scan_load(yt) + acc0 + acc1);
    }
#pragma GCC unroll 16
    for (int j = 0; j < SCAN_NB; j++) scan_store(tile + j * SCAN_VW, s[j]);
}

/* state ([p][n], row-major) to tiles ([p block][n block][n][lane]) and back, a tile at a time with no
 * division per element: for a 128-token sequence a per-element index computation cost half as much as
 * the scan itself. */
static void to_tiles(const float *state, float *tiles, int head_dim, int d_state) {
    for (int p0 = 0; p0 < head_dim; p0 += SCAN_VW)
        for (int n0 = 0; n0 < d_state; n0 += SCAN_NB, tiles += SCAN_NB * SCAN_VW)
            for (int lane = 0; lane < SCAN_VW; lane++) {
                const float *row = state + (int64_t)(p0 + lane) * d_state + n0;
                for (int j = 0; j < SCAN_NB; j++) tiles[j * SCAN_VW + lane] = row[j];
            }
}

static void from_tiles(const float *tiles, float *state, int head_dim, int d_state) {
    for (int p0 = 0; p0 < head_dim; p0 += SCAN_VW)
        for (int n0 = 0; n0 < d_state; n0 += SCAN_NB, tiles += SCAN_NB * SCAN_VW)
            for (int lane = 0; lane < SCAN_VW; lane++) {
                float *row = state + (int64_t)(p0 + lane) * d_state + n0;
                for (int j = 0; j < SCAN_NB; j++) row[j] = tiles[j * SCAN_VW + lane];
            }
}
#endif

/* Mamba-2 prefill as the plain recurrence, token by token (vLLM's CPU design): linear in tokens, and
 * each (sequence, head) state stays in the core's cache for the whole sequence. x: (T, H, P), float32
 * or bfloat16 (x_bf16), token rows x_stride elements apart, each head's P channels contiguous (a slice
 * of the conv output, read where it lies); y: (T, H, P) contiguous, float32 or bfloat16 (y_bf16);
 * dt: (T, H) already dt'; decays: (T, H) exp(dt' A); B, C: (T, G, N) float32; starts: (S+1,) token
 * offsets; resume: (S,) start from the pool's state (else zeros); slots: (S,), -1 = padding (no read,
 * no write; outputs still computed from zeros, as the reference does). The final state of each
 * sequence is written to its slot. */
void tandem_ssm_scan(void *states, int bf16, int64_t slot_stride, int64_t head_stride, const int64_t *slots,
                     const int32_t *starts, const uint8_t *resume, int num_seqs, int num_heads, int head_dim,
                     int d_state, int num_groups, const void *x, int x_bf16, int64_t x_stride, const float *dt,
                     const float *decays, const float *B, const float *C, const float *D, void *y, int y_bf16,
                     int num_threads) {
    const int heads_per_group = num_heads / num_groups;
    const int64_t state_size = (int64_t)head_dim * d_state, bc_stride = (int64_t)num_groups * d_state;
#pragma omp parallel num_threads(num_threads)
    {
        float *state = (float *)malloc((size_t)state_size * 2 * sizeof(float));
        float *tiles = state + state_size;
        (void)tiles; /* unused where there is no vector tile (no AVX2) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)num_seqs * num_heads; item++) {
            const int seq = (int)(item / num_heads), head = (int)(item % num_heads);
            const int group = head / heads_per_group;
            const int64_t slot = slots[seq];
            const int64_t base = slot * slot_stride + head * head_stride;
            const int64_t first = starts[seq], length = starts[seq + 1] - starts[seq];
            if (slot >= 0 && resume[seq]) {
                for (int p = 0; p < head_dim; p++)
                    row_load(states, bf16, base + (int64_t)p * d_state, state + (int64_t)p * d_state, d_state);
            } else {
                memset(state, 0, (size_t)state_size * sizeof(float));
            }
            /* The head's x * dt and D * x for the sequence, (length, P) each: the scan then streams
             * compact float32 rows whatever x's type and layout. */
            float *xdt = (float *)malloc((size_t)2 * length * head_dim * sizeof(float));
            float *ys = xdt + length * head_dim;
            for (int64_t i = 0; i < length; i++) {
                const int64_t th = (first + i) * num_heads + head;
                float *row = xdt + i * head_dim;
                row_load(x, x_bf16, (first + i) * x_stride + (int64_t)head * head_dim, row, head_dim);
                for (int p = 0; p < head_dim; p++) {
                    ys[i * head_dim + p] = D[head * head_dim + p] * row[p];
                    row[p] *= dt[th];
                }
            }
            const float *b = B + (first * num_groups + group) * d_state, *c = C + (first * num_groups + group) * d_state;
            const float *decay = decays + first * num_heads + head;
#if SCAN_VW
            if (head_dim % SCAN_VW == 0 && d_state % SCAN_NB == 0) {
                if (slot >= 0 && resume[seq]) to_tiles(state, tiles, head_dim, d_state);
                else memset(tiles, 0, (size_t)state_size * sizeof(float));
                /* A block of tokens at a time through every tile: the block's x, y, B and C rows stay in
                 * L1/L2 across the tiles, where a whole long sequence's (3 MiB at 2,048 tokens) did not:
                 * one hybrid layer, 8 x 2,048 tokens, float32 135 -> 97 ms, bfloat16 123 -> 88 ms. */
                for (int64_t t0 = 0; t0 < length; t0 += SCAN_TOKENS) {
                    const int64_t count = length - t0 < SCAN_TOKENS ? length - t0 : SCAN_TOKENS;
                    const float *bt = b + t0 * bc_stride, *ct = c + t0 * bc_stride;
                    for (int p0 = 0; p0 < head_dim; p0 += SCAN_VW)
                        for (int n0 = 0; n0 < d_state; n0 += SCAN_NB) {
                            float *tile = tiles + ((int64_t)(p0 / SCAN_VW) * (d_state / SCAN_NB) + n0 / SCAN_NB) *
                                                      SCAN_NB * SCAN_VW;
                            scan_tile(tile, count, xdt + t0 * head_dim + p0, head_dim, decay + t0 * num_heads,
                                      num_heads, bt + n0, ct + n0, bc_stride, ys + t0 * head_dim + p0);
                        }
                }
                from_tiles(tiles, state, head_dim, d_state);
            } else
#endif
            for (int64_t i = 0; i < length; i++) {
                for (int p = 0; p < head_dim; p++)
                    ys[i * head_dim + p] += update_row(state + (int64_t)p * d_state, b + i * bc_stride, c + i * bc_stride,
                                                       decay[i * num_heads], xdt[i * head_dim + p], d_state);
            }
            for (int64_t i = 0; i < length; i++)
                row_store(y, y_bf16, ((first + i) * num_heads + head) * head_dim, ys + i * head_dim, head_dim);
            free(xdt);
            if (slot >= 0) {
                for (int p = 0; p < head_dim; p++)
                    row_store(states, bf16, base + (int64_t)p * d_state, state + (int64_t)p * d_state, d_state);
            }
        }
        free(state);
    }
}

/* n channels of a sequence's conv input at `position` into row: x's row there (x_first: the sequence's
 * first row, at the block's first channel), or before the sequence (position < 0) the state's row
 * W-1+position (state_first: the slot's first row, at that channel) when resuming, else zeros. */
static inline void conv_input(float *row, int64_t position, const void *x, int x_bf16, int64_t x_first,
                              int64_t x_stride, const void *states, int bf16, int resuming, int64_t state_first,
                              int dim, int width, int n) {
    if (position >= 0)
        row_load(x, x_bf16, x_first + position * x_stride, row, n);
    else if (resuming)
        row_load(states, bf16, state_first + (width - 1 + position) * dim, row, n);
    else
        memset(row, 0, (size_t)n * sizeof(float));
}

/* Depthwise causal conv over packed prefill tokens. x: (T, dim) float32 or bfloat16 (x_bf16), rows x_stride
 * apart; out: (T, dim) contiguous, in x's type; starts: (S+1,); resume: (S,) start from the pool's state
 * (else zeros); slots: (S,), -1 = padding (no read, no write); weight_t: (W, dim), the weights
 * transposed. Each sequence's last W-1 inputs (shifting the old state for a sequence shorter than that)
 * become its state. */
void tandem_conv_fn(void *states, int bf16, int64_t slot_stride, const int64_t *slots, const int32_t *starts,
                    const uint8_t *resume, int num_seqs, int dim, int width, const void *x, int x_bf16,
                    int64_t x_stride, const float *weight_t, const float *bias, int silu, void *out,
                    int num_threads) {
    /* Work items are blocks of CONV_TOKENS tokens of one sequence, all channels, CONV_CHANNELS at a time:
     * each reads whole stretches of its input rows, where an item of one channel block through a whole
     * sequence read 256 bytes of every row, one 4 KiB page per token (8 x 2,048 tokens of the hybrid,
     * float32: 4.1 -> 2.6 ms a layer). A block reads the W-1 inputs before it from x, or from the state
     * for a sequence's first; the states are written after every block has read them. */
    enum { CONV_TOKENS = 32, CONV_CHANNELS = 256 };
    int64_t items = 0;
    for (int seq = 0; seq < num_seqs; seq++) items += (starts[seq + 1] - starts[seq] + CONV_TOKENS - 1) / CONV_TOKENS;
    int32_t *item_seq = (int32_t *)malloc((size_t)(items > 0 ? items : 1) * sizeof(int32_t));
    int64_t *item_first = (int64_t *)malloc((size_t)(items > 0 ? items : 1) * sizeof(int64_t));
    for (int seq = 0, item = 0; seq < num_seqs; seq++)
        for (int64_t t = 0; t < starts[seq + 1] - starts[seq]; t += CONV_TOKENS, item++)
            item_seq[item] = seq, item_first[item] = t;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int seq = item_seq[item];
            const int64_t t0 = item_first[item], slot = slots[seq], start = starts[seq];
            const int64_t length = starts[seq + 1] - start;
            const int count = length - t0 < CONV_TOKENS ? (int)(length - t0) : CONV_TOKENS;
            for (int c0 = 0; c0 < dim; c0 += CONV_CHANNELS) {
                const int n = dim - c0 < CONV_CHANNELS ? dim - c0 : CONV_CHANNELS;
                float in[CONV_TOKENS + width - 1][CONV_CHANNELS]; /* inputs t0 - (W-1) .. t0 + count - 1 */
                for (int r = 0; r < count + width - 1; r++)
                    conv_input(in[r], t0 - (width - 1) + r, x, x_bf16, start * x_stride + c0, x_stride, states,
                               bf16, slot >= 0 && resume[seq], slot * slot_stride + c0, dim, width, n);
                for (int i = 0; i < count; i++) {
                    float acc[CONV_CHANNELS];
                    for (int d = 0; d < n; d++) acc[d] = bias ? bias[c0 + d] : 0.0f;
                    for (int k = 0; k < width; k++) {
                        const float *w = weight_t + (int64_t)k * dim + c0, *row = in[i + k];
                        for (int d = 0; d < n; d++) acc[d] += w[d] * row[d];
                    }
                    if (silu) silu_inplace(acc, n);
                    row_store(out, x_bf16, (start + t0 + i) * dim + c0, acc, n); /* out has x's type */
                }
            }
        }
        /* Each sequence's last W-1 inputs become its state (shifting the old one for a sequence shorter
         * than that); all rows are read before any is written. */
#pragma omp for schedule(static)
        for (int seq = 0; seq < num_seqs; seq++) {
            const int64_t slot = slots[seq], start = starts[seq], length = starts[seq + 1] - start;
            if (slot < 0) continue;
            for (int c0 = 0; c0 < dim; c0 += CONV_CHANNELS) {
                const int n = dim - c0 < CONV_CHANNELS ? dim - c0 : CONV_CHANNELS;
                float kept[width - 1][CONV_CHANNELS];
                for (int j = 0; j < width - 1; j++)
                    conv_input(kept[j], length + j - (width - 1), x, x_bf16, start * x_stride + c0, x_stride,
                               states, bf16, resume[seq], slot * slot_stride + c0, dim, width, n);
                for (int j = 0; j < width - 1; j++)
                    row_store(states, bf16, slot * slot_stride + (int64_t)j * dim + c0, kept[j], n);
            }
        }
    }
    free(item_seq);
    free(item_first);
}

/* Gated RMSNorm (HF's MambaRMSNormGated; with no gate and one group, LlamaRMSNorm): h = x * silu(z) in
 * float32, normalised per group, rounded to the input dtype, times weight (rounded again). x, z, out,
 * weight share one dtype (bf16 or float32); x and z rows may be strided, out is contiguous. */
void tandem_rms_norm(const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *weight,
                     void *out, int bf16, int rows, int dim, int group_size, float eps, int num_threads) {
    const int groups = dim / group_size;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)rows * dim > 16384)
    for (int64_t item = 0; item < (int64_t)rows * groups; item++) {
        const int64_t row = item / groups;
        const int first = (int)(item % groups) * group_size;
        float h[group_size], w[group_size];
        row_load(x, bf16, row * x_stride + first, h, group_size);
        row_load(weight, bf16, first, w, group_size);
        if (z) {
            float gate[group_size];
            row_load(z, bf16, row * z_stride + first, gate, group_size);
            silu_inplace(gate, group_size);
            for (int i = 0; i < group_size; i++) h[i] *= gate[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < group_size; i++) squares += h[i] * h[i];
        const float scale = 1.0f / sqrtf(squares / (float)group_size + eps);
        for (int i = 0; i < group_size; i++) h[i] *= scale;
        if (bf16) { /* round to the input dtype before the weight multiply, as HF */
            bf16_round_row(h, group_size);
            for (int i = 0; i < group_size; i++) h[i] *= w[i];
        } else {
            for (int i = 0; i < group_size; i++) h[i] *= w[i];
        }
        row_store(out, bf16, row * (int64_t)dim + first, h, group_size);
    }
}

/* Rotary embedding, rotate-half form, as rotary_ref's torch ops compute it: each product rounded to the dtype,
 * then their sum, so the bits match. x: (T, H, D) with token and head strides, D contiguous; cos, sin:
 * (T, R) contiguous; out: (T, H, D) contiguous, the channels past R copied. One token per work item. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off") /* a fused multiply-add would round once where torch rounds twice */
void tandem_rotary(const void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                   void *out, int bf16, int tokens, int heads, int head_dim, int rotary_dim, int num_threads) {
    const int half = rotary_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)tokens * heads * head_dim > 16384)
    for (int64_t t = 0; t < tokens; t++) {
        float c[rotary_dim], s[rotary_dim], row[head_dim], rotated[head_dim];
        row_load(cos, bf16, t * rotary_dim, c, rotary_dim);
        row_load(sin, bf16, t * rotary_dim, s, rotary_dim);
        for (int h = 0; h < heads; h++) {
            row_load(x, bf16, t * token_stride + h * head_stride, row, head_dim);
            for (int i = 0; i < half; i++) {
                float a = row[i] * c[i], b = -row[i + half] * s[i];
                float d = row[i + half] * c[i + half], e = row[i] * s[i + half];
                if (bf16) {
                    a = bf16_round(a), b = bf16_round(b), d = bf16_round(d), e = bf16_round(e);
                }
                rotated[i] = a + b;
                rotated[i + half] = d + e;
            }
            for (int i = rotary_dim; i < head_dim; i++) rotated[i] = row[i];
            row_store(out, bf16, (t * heads + h) * (int64_t)head_dim, rotated, head_dim);
        }
    }
}
#pragma GCC pop_options

/* y = x W^T (+ bias) for a few rows of x: the single-sequence decode, where a linear only streams its
 * weights, so reading them at full bandwidth is all that counts. w: (N, K) float32 or bfloat16 (read
 * as is: half the bytes); x: (M, K), y: (M, N) float32; M <= GEMV_MAX_ROWS. Output rows in blocks
 * per thread, so each thread streams its own part of W once for all M rows. */
#define GEMV_MAX_ROWS TANDEM_GEMV_MAX_ROWS

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void *w, int bf16, int64_t offset) {
    if (bf16) {
        const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + offset));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)w + offset);
}

static inline float sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* The largest of v's 8 lanes. */
static inline float max8(__m256 v) {
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(four, _mm_shuffle_ps(four, four, 1)));
}

/* The 8 sums of a0..a7, as one vector. */
static inline __m256 sum8x8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* ROWS output features (rows of W) from n for all M rows of x, as ROWS * M independent accumulators:
 * one would chain every multiply-add on the previous one's latency and leave the memory bus idle.
 * ROWS * M <= 8 keeps them, a weight vector and an x vector in the 16 registers. */
static inline __attribute__((always_inline)) void gemv_block(const void *w, int bf16, int64_t n, int K,
                                                             const float *x, int M, int ROWS, float *dots) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) acc[i] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 weights[8];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) weights[r] = load8(w, bf16, (n + r) * K + k);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const __m256 xs = _mm256_loadu_ps(x + (int64_t)m * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) acc[m * ROWS + r] = _mm256_fmadd_ps(weights[r], xs, acc[m * ROWS + r]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ROWS * M; i++) {
        const int m = i / ROWS, r = i % ROWS;
        float total = sum8(acc[i]);
        for (int j = k; j < K; j++) {
            float weight;
            row_load(w, bf16, (n + r) * K + j, &weight, 1);
            total += weight * x[(int64_t)m * K + j];
        }
        dots[m * ROWS + r] = total;
    }
}

/* dots[m * rows + r]: W's rows n..n+rows-1 against x's M rows, with the widest block that fits. Inlined
 * where bf16 is a constant, so that every block is compiled for its type, sizes and unrolled. */
static inline __attribute__((always_inline)) void gemv_rows(const void *w, int bf16, int64_t n, int K, const float *x, int M, int rows, float *dots) {
    if (rows == 8 && M == 1) gemv_block(w, bf16, n, K, x, 1, 8, dots);
    else if (rows == 4 && M == 2) gemv_block(w, bf16, n, K, x, 2, 4, dots);
    else if (rows == 2 && M == 3) gemv_block(w, bf16, n, K, x, 3, 2, dots);
    else if (rows == 2 && M == 4) gemv_block(w, bf16, n, K, x, 4, 2, dots);
    else
        for (int r = 0; r < rows; r++) {
            float one[GEMV_MAX_ROWS];
            switch (M) {
            case 1: gemv_block(w, bf16, n + r, K, x, 1, 1, one); break;
            case 2: gemv_block(w, bf16, n + r, K, x, 2, 1, one); break;
            case 3: gemv_block(w, bf16, n + r, K, x, 3, 1, one); break;
            default: gemv_block(w, bf16, n + r, K, x, 4, 1, one); break;
            }
            for (int m = 0; m < M; m++) dots[m * rows + r] = one[m];
        }
}

/* dots[m]: W's row n against x's M <= 8 rows, one accumulator per row. */
static inline __attribute__((always_inline)) void dot_rows8(const void *w, int bf16, int64_t n, int K,
                                                            const float *x, int M, float *dots) {
    switch (M) {
    case 8: gemv_block(w, bf16, n, K, x, 8, 1, dots); break;
    case 7: gemv_block(w, bf16, n, K, x, 7, 1, dots); break;
    case 6: gemv_block(w, bf16, n, K, x, 6, 1, dots); break;
    case 5: gemv_block(w, bf16, n, K, x, 5, 1, dots); break;
    case 4: gemv_block(w, bf16, n, K, x, 4, 1, dots); break;
    case 3: gemv_block(w, bf16, n, K, x, 3, 1, dots); break;
    case 2: gemv_block(w, bf16, n, K, x, 2, 1, dots); break;
    default: gemv_block(w, bf16, n, K, x, 1, 1, dots); break;
    }
}
#else
static void gemv_rows(const void *w, int bf16, int64_t n, int K, const float *x, int M, int rows, float *dots);
static void dot_rows8(const void *w, int bf16, int64_t n, int K, const float *x, int M, float *dots) {
    gemv_rows(w, bf16, n, K, x, M, 1, dots);
}
static void gemv_rows(const void *w, int bf16, int64_t n, int K, const float *x, int M, int rows, float *dots) {
    for (int i = 0; i < M * rows; i++) dots[i] = 0.0f;
    float weights[256];
    for (int r = 0; r < rows; r++)
        for (int k0 = 0; k0 < K; k0 += 256) {
            const int count = K - k0 < 256 ? K - k0 : 256;
            row_load(w, bf16, (n + r) * K + k0, weights, count);
            for (int m = 0; m < M; m++)
                for (int j = 0; j < count; j++) dots[m * rows + r] += weights[j] * x[(int64_t)m * K + k0 + j];
        }
}
#endif

void tandem_gemv(const void *w, int bf16, const float *x, const float *bias, float *y, int M, int N, int K,
                 int num_threads) {
    if (M < 1) return; /* a step that samples nothing (every row a prompt chunk's middle) */
    const int rows = 8 / M; /* output features per block: 8, 4, 2, 2 */
    const int64_t blocks = (N + rows - 1) / rows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n = block * rows;
        const int count = N - n < rows ? (int)(N - n) : rows;
        float dots[8];
        if (bf16) gemv_rows(w, 1, n, K, x, M, count, dots);
        else gemv_rows(w, 0, n, K, x, M, count, dots);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < count; r++) y[(int64_t)m * N + n + r] = dots[m * count + r] + (bias ? bias[n + r] : 0.0f);
    }
}

/* y = x W^T (+ bias) for a decode batch of rows (up to a few dozen), where oneDNN's GEMM ran at half
 * the machine's float32 rate: each output feature is M dot products over K, 8 rows of x at a time (8
 * accumulators, x's 8 rows held in L1 across the tile). Threads split the output features in tiles
 * of about 128 KiB of weights, read from memory once and from L2 for the other blocks of rows. */
void tandem_small_gemm(const void *w, int bf16, const float *x, const float *bias, float *y, int M, int N, int K,
                       int num_threads) {
    if (M < 1) return;
    const int64_t fit = 131072 / ((int64_t)K * (bf16 ? 2 : 4)); /* output features in 128 KiB */
    const int64_t tile = fit > 8 ? fit : 8;
    const int64_t tiles = (N + tile - 1) / tile;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * tile, last = first + tile < N ? first + tile : N;
        for (int m0 = 0; m0 < M; m0 += 8) {
            const int rows = M - m0 < 8 ? M - m0 : 8;
            const float *xs = x + (int64_t)m0 * K;
            for (int64_t n = first; n < last; n++) {
                float dots[8];
                if (bf16) dot_rows8(w, 1, n, K, xs, rows, dots);
                else dot_rows8(w, 0, n, K, xs, rows, dots);
                const float b = bias ? bias[n] : 0.0f;
                for (int m = 0; m < rows; m++) y[(int64_t)(m0 + m) * N + n] = dots[m] + b;
            }
        }
    }
}

/* y = x W^T (+ bias) for a decode batch, on weights packed in panels of PANEL output features, where
 * the CPU has AVX-512: the outer-product form, a block of up to PANEL_ROWS rows x PANEL features in 24
 * registers, each step of k one load of the panel's row and a broadcast per row of x. A panel is read
 * from memory once, by the first block of rows, and from L2 by the others, while the next panel is
 * prefetched: where oneDNN's float32 GEMM ran at half the machine's rate at 32 rows and its bfloat16
 * one read the weights at 10-20 GB/s (docs/performance.md). float32 weights: (panels, K, PANEL);
 * bfloat16 weights (AVX-512 BF16): (panels, K / 2, PANEL, 2), pairs of k multiplied and summed by
 * vdpbf16ps, with x in bfloat16 too. The packed weights' features past N and k past K are zeros. */
#define PANEL TANDEM_PANEL
/* From how many rows of x the next panel is prefetched. Fewer rows do too little arithmetic per byte for the
 * prefetch to hide anything, and the hardware's own prefetcher follows one thread's run of panels better without
 * it (8192 x 2048 weights from memory, one thread of an AVX-512 EPYC, GB/s with and without: float32 1 row 20.3 /
 * 29.9, 4 rows 23.4 / 30.1, 5 rows 25.8 / 28.6, 6 rows 30.3 / 24.3; bfloat16 1 row 21.9 / 30.7, 4 rows 22.7 / 30.5;
 * two threads 4-8 % apart). */
#define PANEL_PREFETCH_MIN_ROWS 6

int tandem_panel_gemm_dtypes(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 3; /* float32 and bfloat16 */
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
static inline void panel_store(void *y, int64_t y_stride, int rows, int cols, __m512 acc[][2], const float *bias,
                               int y_bf16) {
    const __mmask16 mask0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v0 = _mm512_add_ps(acc[r][0], b0), v1 = _mm512_add_ps(acc[r][1], b1);
#if defined(__AVX512BF16__)
        if (y_bf16) {
            uint16_t *row = (uint16_t *)y + r * y_stride;
            _mm256_mask_storeu_epi16(row, mask0, (__m256i)_mm512_cvtneps_pbh(v0));
            _mm256_mask_storeu_epi16(row + 16, mask1, (__m256i)_mm512_cvtneps_pbh(v1));
            continue;
        }
#endif
        float *row = (float *)y + r * y_stride;
        _mm512_mask_storeu_ps(row, mask0, v0);
        _mm512_mask_storeu_ps(row + 16, mask1, v1);
    }
}

/* ROWS rows of x against one float32 panel; ROWS is a constant in each inlined copy, so the
 * accumulators stay in registers. next: the panel to prefetch into L2 (or NULL). */
static inline __attribute__((always_inline)) void panel_f32(const float *w, const float *x, int64_t x_stride,
                                                           int K, const float *next, int passes, __m512 acc[][2],
                                                           const int ROWS) {
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0, ahead = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16);
        if (next && k % passes == 0 && ahead < K) {
            _mm_prefetch((const char *)(next + ahead * PANEL), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + ahead * PANEL + 16), _MM_HINT_T1);
            ahead++;
        }
        for (int r = 0; r < ROWS; r++) {
            const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
            acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
        }
    }
}

#if defined(__AVX512BF16__)
/* As panel_f32 for a bfloat16 panel and bfloat16 x (panel.h's steps); K even. */
static inline __attribute__((always_inline)) void panel_bf16(const uint16_t *w, const uint16_t *x, int64_t x_stride,
                                                            int K, const uint16_t *next, int passes, __m512 acc[][2],
                                                            const int ROWS) {
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    panel_bf16_steps(w, x, x_stride, 0, K, next, passes, acc, ROWS);
}
#endif
#endif

/* x: (M, K) rows x_stride apart, in the weights' type; y: (M, N) float32 or bfloat16 (y_bf16), rows
 * N apart; bias: (N,) float32 or NULL. Threads take contiguous runs of panels, so each prefetches
 * its own next one (from PANEL_PREFETCH_MIN_ROWS rows). */
void tandem_panel_gemm(const void *w, int bf16, const void *x, int64_t x_stride, const float *bias, void *y,
                       int y_bf16, int M, int N, int K, int num_threads) {
#if defined(__AVX512F__)
    if (M < 1) return;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_size = (int64_t)PANEL * (bf16 ? K + K % 2 : K);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t panel = 0; panel < panels; panel++) {
        const int64_t n0 = panel * PANEL;
        const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        __m512 acc[PANEL_ROWS][2];
        for (int m0 = 0; m0 < M; m0 += PANEL_ROWS) {
            const int rows = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
            /* The blocks of rows share the prefetch of the next panel (the last panel prefetches
             * itself, harmlessly): each block reads the panel once, the first from memory. */
            const int passes = (M + PANEL_ROWS - 1) / PANEL_ROWS, pass = m0 / PANEL_ROWS;
            const int64_t ahead = panel + 1 < panels ? panel_size : 0;
            const int prefetch = M >= PANEL_PREFETCH_MIN_ROWS;
            const int64_t share = (bf16 ? (K + K % 2) / 2 : K) / passes * pass * PANEL * (bf16 ? 2 : 1);
            if (bf16) {
#if defined(__AVX512BF16__)
                const uint16_t *wp = (const uint16_t *)w + panel * panel_size;
                const uint16_t *xs = (const uint16_t *)x + m0 * x_stride;
                const uint16_t *next = prefetch ? wp + ahead + share : NULL;
#define PANEL_BF16(R) panel_bf16(wp, xs, x_stride, K, next, passes, acc, R)
                PANEL_CASES(PANEL_BF16)
#undef PANEL_BF16
#endif
            } else {
                const float *wp = (const float *)w + panel * panel_size;
                const float *xs = (const float *)x + m0 * x_stride;
                const float *next = prefetch ? wp + ahead + share : NULL;
#define PANEL_F32(R) panel_f32(wp, xs, x_stride, K, next, passes, acc, R)
                PANEL_CASES(PANEL_F32)
#undef PANEL_F32
            }
            const int64_t offset = (int64_t)m0 * N + n0;
            void *out = y_bf16 ? (void *)((uint16_t *)y + offset) : (void *)((float *)y + offset);
            panel_store(out, N, rows, cols, acc, bias ? bias + n0 : NULL, y_bf16);
        }
    }
#else
    (void)w; (void)bf16; (void)x; (void)x_stride; (void)bias; (void)y; (void)y_bf16; (void)M; (void)N; (void)K;
    (void)num_threads;
#endif
}

/* The bfloat16 panel GEMM on AMX tiles, for batches past a few rows, where vdpbf16ps runs at the float32
 * rate and oneDNN's AMX GEMM read the weights at about half the machine's bandwidth (docs/performance.md).
 * Blocks of 32 rows (x copied once into a zero-padded buffer) times one panel: four 16 x 16 float32
 * accumulator tiles, two tiles of x and two of the panel (its two halves of 16 features) per 32 values
 * of k, the next panel prefetched meanwhile. The panel layout is panel_gemm's: each pair of k of the 32
 * features is one 128-byte row, so a half is a 16-row tile of 64 bytes at a 128-byte stride. K must be a
 * multiple of 32. Linux grants a process the AMX state on request (tandem_amx_ready). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 32

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This thread's eight tiles: 16 rows of 64 bytes each (16 float32 sums, or 32 bfloat16 values). */
static inline void amx_configure_tiles(void) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

int tandem_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}

void tandem_amx_gemm(const uint16_t *w, const uint16_t *x, int64_t x_stride, const float *bias, uint16_t *y,
                     int M, int N, int K, int num_threads) {
    if (M < 1) return;
    const int blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t *padded = (uint16_t *)calloc((size_t)blocks * AMX_ROWS * K, sizeof(uint16_t));
    for (int m = 0; m < M; m++) memcpy(padded + (int64_t)m * K, x + m * x_stride, (size_t)K * sizeof(uint16_t));
    const int64_t panels = (N + PANEL - 1) / PANEL, panel_size = (int64_t)PANEL * K;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure_tiles();
        float out[AMX_ROWS][PANEL];
#pragma omp for schedule(static)
        for (int64_t panel = 0; panel < panels; panel++) {
            const uint16_t *wp = w + panel * panel_size;
            const uint16_t *next = wp + (panel + 1 < panels ? panel_size : 0);
            const int64_t n0 = panel * PANEL;
            const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            for (int block = 0; block < blocks; block++) {
                const uint16_t *xs = padded + (int64_t)block * AMX_ROWS * K;
                const int rows = M - block * AMX_ROWS < AMX_ROWS ? M - block * AMX_ROWS : AMX_ROWS;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int k = 0; k < K; k += 32) {
                    if (block == 0)  /* 2 KiB of the next panel per 2 KiB of this one */
                        for (int line = 0; line < 1024; line += 32)
                            _mm_prefetch((const char *)(next + k * PANEL + line), _MM_HINT_T1);
                    _tile_loadd(4, xs + k, K * 2);
                    _tile_loadd(6, wp + k * PANEL, PANEL * 4);
                    _tile_loadd(7, wp + k * PANEL + 32, PANEL * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rows > 16) {
                        _tile_loadd(5, xs + 16 * K + k, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, &out[0][0], PANEL * 4);
                _tile_stored(1, &out[0][16], PANEL * 4);
                if (rows > 16) {
                    _tile_stored(2, &out[16][0], PANEL * 4);
                    _tile_stored(3, &out[16][16], PANEL * 4);
                }
                __m512 acc[AMX_ROWS][2];
                for (int r = 0; r < rows; r++) {
                    acc[r][0] = _mm512_loadu_ps(out[r]);
                    acc[r][1] = _mm512_loadu_ps(out[r] + 16);
                }
                panel_store(y + (int64_t)block * AMX_ROWS * N + n0, N, rows, cols, acc, bias ? bias + n0 : NULL, 1);
            }
        }
        _tile_release();
    }
    free(padded);
}

/* 32 quantized values of one row from k (a multiple of 32), as 16 pairs of bfloat16 in 16 lanes: int8 as stored,
 * int4 unpacked (two blocks of 16 in 16 bytes) and shifted by -8. Small integers are exact in bfloat16. */
static inline __m512i amx_quant_pairs(const uint8_t *row, int format, int k) {
    __m128i lo, hi;
    if (format == TANDEM_QUANT_INT8) {
        lo = _mm_loadu_si128((const __m128i *)(row + k));
        hi = _mm_loadu_si128((const __m128i *)(row + k + 16));
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + k / 2)), mask = _mm_set1_epi8(0x0f);
        const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(_mm_unpacklo_epi64(low, high), eight);  /* block 0: its values 0-7, then 8-15 */
        hi = _mm_sub_epi8(_mm_unpackhi_epi64(low, high), eight);  /* block 1 */
    }
    const __m256bh a = _mm512_cvtneps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)a), (__m256i)b, 1);
}

/* Rows n0 .. n0 + 32 of a quantized weight as bfloat16 rows (32, K), the values q themselves, exact (rows past
 * `cols` zero); the scales are applied to the tiles' sums, per group. */
static void amx_quant_rows(const uint8_t *w, int format, int64_t row_bytes, int64_t n0, int cols, int K,
                           uint16_t *rows) {
    for (int c = 0; c < PANEL; c++) {
        uint16_t *dst = rows + (int64_t)c * K;
        if (c >= cols) {
            memset(dst, 0, (size_t)K * sizeof(uint16_t));
            continue;
        }
        const uint8_t *row = w + (n0 + c) * row_bytes;
        for (int k = 0; k < K; k += 32) _mm512_storeu_si512(dst + k, amx_quant_pairs(row, format, k));
    }
}

/* x's rows in blocks of 16 tokens as AMX's second operand: pairs of k of the 16 tokens, one 64-byte row each,
 * (blocks, K / 2, 16, 2), tokens past M zero. */
static uint16_t *amx_token_pairs(const uint16_t *x, int64_t x_stride, int M, int K, int blocks16) {
    uint16_t *pairs = (uint16_t *)calloc((size_t)blocks16 * 16 * K, sizeof(uint16_t));
    for (int m = 0; m < M; m++) {
        uint16_t *block = pairs + (int64_t)(m / 16) * 16 * K + (m % 16) * 2;
        const uint16_t *row = x + m * x_stride;
        for (int k = 0; k < K; k += 2) {
            block[(int64_t)(k / 2) * 32] = row[k];
            block[(int64_t)(k / 2) * 32 + 1] = row[k + 1];
        }
    }
    return pairs;
}

/* y = x W^T (+ bias) for a bfloat16 x and an int8 or int4 weight (quant.c's layouts, scales per group of
 * group_size k, no offsets), on AMX tiles, as W x^T: each panel of 32 output features converted once to
 * bfloat16 rows (exact: the values q) is the tiles' first operand as it lies, x's tokens in pairs of k the
 * second (converted once per call); per group, four 16 x 16 float32 tiles (32 features x 32 tokens), their sums
 * times the features' scales. The same sums as quant_gemm's up to their order, at AMX's rate where quant_gemm
 * multiplies in float32. K and group_size multiples of 32. */
void tandem_amx_quant_gemm(const uint8_t *w, int format, const float *scales, int group_size, const uint16_t *x,
                           int64_t x_stride, const float *bias, float *y, int M, int N, int K, int num_threads) {
    if (M < 1) return;
    const int group = group_size < K ? group_size : K, groups = (K + group - 1) / group;
    const int64_t row_bytes = format == TANDEM_QUANT_INT4 ? (int64_t)(K + 15) / 16 * 8 : K;
    const int blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t *tokens = amx_token_pairs(x, x_stride, M, K, blocks * 2);
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure_tiles();
        uint16_t *rows = (uint16_t *)malloc((size_t)PANEL * K * sizeof(uint16_t));
        float out[PANEL][AMX_ROWS], total[PANEL][AMX_ROWS];  /* features x tokens */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * PANEL;
            const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            amx_quant_rows(w, format, row_bytes, n0, cols, K, rows);
            for (int block = 0; block < blocks; block++) {
                const uint16_t *t0 = tokens + (int64_t)block * 2 * 16 * K, *t1 = t0 + 16 * K;
                const int count = M - block * AMX_ROWS < AMX_ROWS ? M - block * AMX_ROWS : AMX_ROWS;
                memset(total, 0, sizeof total);
                for (int g = 0; g < groups; g++) {
                    const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int k = k0; k < k1; k += 32) {
                        _tile_loadd(4, rows + k, K * 2);           /* features 0-15 */
                        _tile_loadd(5, rows + 16 * K + k, K * 2);  /* features 16-31 */
                        _tile_loadd(6, t0 + (int64_t)k * 16, 64);  /* tokens 0-15 */
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 5, 6);
                        if (count > 16) {
                            _tile_loadd(7, t1 + (int64_t)k * 16, 64);  /* tokens 16-31 */
                            _tile_dpbf16ps(2, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, &out[0][0], AMX_ROWS * 4);
                    _tile_stored(1, &out[16][0], AMX_ROWS * 4);
                    if (count > 16) {
                        _tile_stored(2, &out[0][16], AMX_ROWS * 4);
                        _tile_stored(3, &out[16][16], AMX_ROWS * 4);
                    }
                    for (int c = 0; c < cols; c++) {
                        const float scale = scales[(n0 + c) * groups + g];
                        for (int r = 0; r < AMX_ROWS; r++) total[c][r] += out[c][r] * scale;
                    }
                }
                for (int r = 0; r < count; r++) {
                    float *dst = y + ((int64_t)block * AMX_ROWS + r) * N + n0;
                    for (int c = 0; c < cols; c++) dst[c] = total[c][r] + (bias ? bias[n0 + c] : 0.0f);
                }
            }
        }
        free(rows);
        _tile_release();
    }
    free(tokens);
}
#else
int tandem_amx_ready(void) { return 0; }

void tandem_amx_gemm(const uint16_t *w, const uint16_t *x, int64_t x_stride, const float *bias, uint16_t *y,
                     int M, int N, int K, int num_threads) {
    (void)w; (void)x; (void)x_stride; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
}

void tandem_amx_quant_gemm(const uint8_t *w, int format, const float *scales, int group_size, const uint16_t *x,
                           int64_t x_stride, const float *bias, float *y, int M, int N, int K, int num_threads) {
    (void)w; (void)format; (void)scales; (void)group_size; (void)x; (void)x_stride; (void)bias; (void)y; (void)M;
    (void)N; (void)K; (void)num_threads;
}
#endif

/* Decode attention over the paged cache: one new token per sequence attends its seq_len cached keys.
 * k, v: the cache views, (pages, block_size, Hkv, D) with the given element strides (D contiguous);
 * block_table: (S, table_stride) page ids; q, out: (S, Hq, D) float32. One (sequence, KV head) per
 * work item: its keys and values are read once, in place, for the Hq / Hkv query heads that share them. */
#define VALUES_PREFETCH 256 /* value rows prefetched before the score pass */
#define ATTEND_HEADS 8 /* query heads of a group held in registers at once (the V pass) */

/* Softmax of each of the group's score rows, in place, in float32. */
static void softmax_rows(float *scores, int rows, int length) {
    for (int j = 0; j < rows; j++) {
        float *s = scores + (int64_t)j * length, top = s[0], total = 0.0f;
        int pos = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; pos + 8 <= length; pos += 8) top = fmaxf(top, max8(_mm256_loadu_ps(s + pos)));
#endif
        for (; pos < length; pos++) top = s[pos] > top ? s[pos] : top;
        pos = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 sums = _mm256_setzero_ps();
        for (; pos + 8 <= length; pos += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + pos), _mm256_set1_ps(top)));
            _mm256_storeu_ps(s + pos, e);
            sums = _mm256_add_ps(sums, e);
        }
        total = sum8(sums);
#endif
        for (; pos < length; pos++) total += (s[pos] = expf(s[pos] - top));
        const float inverse = 1.0f / total;
        for (pos = 0; pos < length; pos++) s[pos] *= inverse;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define ATTEND_AHEAD 16 /* positions ahead that the values pass prefetches */

/* One key or value row into L1 (or, to_l2, into L2 only). */
static inline void prefetch_row(const void *cache, int bf16, int64_t offset, int head_dim, int to_l2) {
    const char *first = (const char *)cache + offset * (bf16 ? 2 : 4);
    const int bytes = head_dim * (bf16 ? 2 : 4);
    for (int line = 0; line < bytes; line += 64) {
        if (to_l2)
            _mm_prefetch(first + line, _MM_HINT_T1);
        else
            _mm_prefetch(first + line, _MM_HINT_T0);
    }
}

/* Query heads whose scores one pass over the keys computes: 8 positions x SCORE_HEADS accumulators,
 * the positions' key chunk loaded (and widened) once for all of them. */
#if defined(__AVX512F__)
#define SCORE_HEADS 3 /* 24 accumulators: AVX-512 has 32 registers for them */
#else
#define SCORE_HEADS 1
#endif

/* scores[j * length + pos] = scale * q_j . k_pos for SCORE_HEADS heads (HEADS of them real) at once. */
static inline __attribute__((always_inline)) void score_block(const void *k, int bf16, const int64_t *offsets,
                                                               const float *q, int head_dim, float scale,
                                                               float *scores, int64_t length, const int HEADS) {
    __m256 acc[SCORE_HEADS][8];
    for (int j = 0; j < HEADS; j++)
        for (int p = 0; p < 8; p++) acc[j][p] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8) {
        if (HEADS == 1) { /* AVX2's 16 registers: the loaded chunks would spill */
            const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) acc[0][p] = _mm256_fmadd_ps(qv, load8(k, bf16, offsets[p] + d), acc[0][p]);
            continue;
        }
        __m256 row[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) row[p] = load8(k, bf16, offsets[p] + d);
        for (int j = 0; j < HEADS; j++) {
            const __m256 qv = _mm256_loadu_ps(q + (int64_t)j * head_dim + d);
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) acc[j][p] = _mm256_fmadd_ps(qv, row[p], acc[j][p]);
        }
    }
    for (int j = 0; j < HEADS; j++)
        _mm256_storeu_ps(scores + j * length, _mm256_mul_ps(sum8x8(acc[j]), _mm256_set1_ps(scale)));
}

/* scores[j * length + pos] = scale * q_j . k_pos for the group's heads, 8 positions at a time: one
 * accumulator per position and head, summed across lanes together (sum8x8), not one horizontal sum per dot
 * product; each key chunk is loaded once for up to SCORE_HEADS heads. */
static void attend_scores(const void *k, int bf16, const int64_t *rows, int length, const float *q_group, int group,
                          int head_dim, float scale, float *scores) {
    int pos = 0;
    for (; pos + 8 <= length; pos += 8) {
        const int64_t *offsets = rows + pos;
        /* The rows two blocks ahead, scattered over pages: the hardware prefetcher cannot guess them. */
        for (int p = 16; p < 24 && pos + p < length; p++) prefetch_row(k, bf16, offsets[p], head_dim, 0);
        for (int j = 0; j < group; j += SCORE_HEADS) {
            const float *q = q_group + (int64_t)j * head_dim;
            float *out = scores + (int64_t)j * length + pos;
            switch (group - j < SCORE_HEADS ? group - j : SCORE_HEADS) {
            case 1: score_block(k, bf16, offsets, q, head_dim, scale, out, length, 1); break;
#if SCORE_HEADS == 3
            case 2: score_block(k, bf16, offsets, q, head_dim, scale, out, length, 2); break;
            default: score_block(k, bf16, offsets, q, head_dim, scale, out, length, 3); break;
#endif
            }
        }
    }
    for (; pos < length; pos++) {
        const int64_t offset = rows[pos];
        for (int j = 0; j < group; j++) {
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q_group + (int64_t)j * head_dim + d), load8(k, bf16, offset + d),
                                      acc);
            scores[(int64_t)j * length + pos] = sum8(acc) * scale;
        }
    }
}

/* o_j = sum over positions of p_j[pos] v_pos, 8 features at a time with up to ATTEND_HEADS heads' sums in
 * registers: the item's values (a few tens of KiB) stay in L1 across the feature blocks. */
static void attend_values(const void *v, int bf16, const int64_t *rows, int length, const float *probs, int group,
                          int head_dim, float *o) {
    for (int j0 = 0; j0 < group; j0 += ATTEND_HEADS) {
        const int heads = group - j0 < ATTEND_HEADS ? group - j0 : ATTEND_HEADS;
        for (int d = 0; d < head_dim; d += 8) {
            __m256 acc[ATTEND_HEADS];
            for (int j = 0; j < heads; j++) acc[j] = _mm256_setzero_ps();
            for (int pos = 0; pos < length; pos++) {
                if (d == 0 && pos + ATTEND_AHEAD < length) prefetch_row(v, bf16, rows[pos + ATTEND_AHEAD], head_dim, 0);
                const __m256 row = load8(v, bf16, rows[pos] + d);
                for (int j = 0; j < heads; j++)
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(probs[(int64_t)(j0 + j) * length + pos]), row, acc[j]);
            }
            for (int j = 0; j < heads; j++) _mm256_storeu_ps(o + (int64_t)(j0 + j) * head_dim + d, acc[j]);
        }
    }
}

#endif

#if defined(__AVX512F__)
/* The AVX-512 passes, for head dims that are whole 16-lane vectors: a key or value row of 64 features is
 * one or four registers, not eight 8-lane chunks, so each position costs a quarter of the loads and half
 * the multiply-adds. One Llama layer, 32 sequences of ~170 positions in the engine's page layout, bfloat16:
 * 0.48 -> 0.33 ms with the cache warm, 0.57 -> 0.45 ms cold (with the score pass on vdpbf16ps below). */
static inline __m512 load16(const void *base, int bf16, int64_t offset) {
    if (bf16) {
        const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

/* o_j, features d .. d + 16 NV, for HEADS heads (<= 4) from j0: one pass over the positions, each value
 * chunk loaded once for all of them, HEADS x NV sums in registers. */
static inline __attribute__((always_inline)) void values_block16(const void *v, int bf16, const int64_t *rows,
                                                                 int length, const float *probs, int head_dim,
                                                                 int d, float *o, const int HEADS, const int NV) {
    __m512 acc[4][4];
    for (int j = 0; j < HEADS; j++)
        for (int i = 0; i < NV; i++) acc[j][i] = _mm512_setzero_ps();
    for (int pos = 0; pos < length; pos++) {
        if (d == 0 && pos + ATTEND_AHEAD < length) prefetch_row(v, bf16, rows[pos + ATTEND_AHEAD], head_dim, 0);
        __m512 row[4];
        for (int i = 0; i < NV; i++) row[i] = load16(v, bf16, rows[pos] + d + 16 * i);
        for (int j = 0; j < HEADS; j++) {
            const __m512 p = _mm512_set1_ps(probs[(int64_t)j * length + pos]);
            for (int i = 0; i < NV; i++) acc[j][i] = _mm512_fmadd_ps(p, row[i], acc[j][i]);
        }
    }
    for (int j = 0; j < HEADS; j++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(o + (int64_t)j * head_dim + d + 16 * i, acc[j][i]);
}

#define VALUES_CASE(H, N) values_block16(v, bf16, rows, length, p, head_dim, d, out, H, N)
#define VALUES_NV(H) \
    switch (nv) { case 1: VALUES_CASE(H, 1); break; case 2: VALUES_CASE(H, 2); break; \
                  case 3: VALUES_CASE(H, 3); break; default: VALUES_CASE(H, 4); break; }

/* attend_values on 16-lane vectors; head_dim a multiple of 16. */
static void attend_values16(const void *v, int bf16, const int64_t *rows, int length, const float *probs, int group,
                            int head_dim, float *o) {
    for (int j0 = 0; j0 < group; j0 += 4) {
        const int heads = group - j0 < 4 ? group - j0 : 4;
        const float *p = probs + (int64_t)j0 * length;
        float *out = o + (int64_t)j0 * head_dim;
        for (int d = 0; d < head_dim; d += 64) {
            const int nv = (head_dim - d) / 16 < 4 ? (head_dim - d) / 16 : 4;
            switch (heads) {
            case 1: VALUES_NV(1); break;
            case 2: VALUES_NV(2); break;
            case 3: VALUES_NV(3); break;
            default: VALUES_NV(4); break;
            }
        }
    }
}
#undef VALUES_NV
#undef VALUES_CASE
#endif

#if defined(__AVX512BF16__)
/* The scores of a bfloat16 cache against bfloat16 queries with vdpbf16ps: products of two bfloat16 values
 * are exact in float32, so this is the float32 dot product up to summation order, 32 features a
 * instruction. 8 positions x HEADS (<= 3) accumulators; each key row chunk is loaded once for the heads. */
static inline __attribute__((always_inline)) void score_block_dp(const uint16_t *k, const int64_t *offsets,
                                                                  const uint16_t *q, int head_dim, float scale,
                                                                  float *scores, int64_t length, const int HEADS) {
    __m512 acc[3][8];
    for (int j = 0; j < HEADS; j++)
        for (int p = 0; p < 8; p++) acc[j][p] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 32) {
        __m512bh qv[3];
        for (int j = 0; j < HEADS; j++) qv[j] = (__m512bh)_mm512_loadu_si512(q + (int64_t)j * head_dim + d);
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) {
            const __m512bh row = (__m512bh)_mm512_loadu_si512(k + offsets[p] + d);
            for (int j = 0; j < HEADS; j++) acc[j][p] = _mm512_dpbf16_ps(acc[j][p], row, qv[j]);
        }
    }
    for (int j = 0; j < HEADS; j++) {
        __m256 halves[8];
        for (int p = 0; p < 8; p++)
            halves[p] = _mm256_add_ps(_mm512_castps512_ps256(acc[j][p]),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j][p]), 1)));
        _mm256_storeu_ps(scores + j * length, _mm256_mul_ps(sum8x8(halves), _mm256_set1_ps(scale)));
    }
}

/* attend_scores for a bfloat16 cache and queries whose values are bfloat16 (q_bf16: the group's queries
 * rounded, exactly); head_dim a multiple of 32. */
static void attend_scores_dp(const uint16_t *k, const int64_t *rows, int length, const uint16_t *q_bf16, int group,
                             int head_dim, float scale, float *scores) {
    int pos = 0;
    for (; pos + 8 <= length; pos += 8) {
        const int64_t *offsets = rows + pos;
        for (int p = 16; p < 24 && pos + p < length; p++) prefetch_row(k, 1, offsets[p], head_dim, 0);
        for (int j = 0; j < group; j += 3) {
            const uint16_t *q = q_bf16 + (int64_t)j * head_dim;
            float *out = scores + (int64_t)j * length + pos;
            switch (group - j < 3 ? group - j : 3) {
            case 1: score_block_dp(k, offsets, q, head_dim, scale, out, length, 1); break;
            case 2: score_block_dp(k, offsets, q, head_dim, scale, out, length, 2); break;
            default: score_block_dp(k, offsets, q, head_dim, scale, out, length, 3); break;
            }
        }
    }
    for (; pos < length; pos++)
        for (int j = 0; j < group; j++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < head_dim; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + rows[pos] + d),
                                       (__m512bh)_mm512_loadu_si512(q_bf16 + (int64_t)j * head_dim + d));
            scores[(int64_t)j * length + pos] = _mm512_reduce_add_ps(acc) * scale;
        }
}
#endif

/* attend_scores on vdpbf16ps where it can run (a bfloat16 cache, queries whose values are bfloat16, head_dim
 * a multiple of 32): returns 1 if it did, 0 to leave the scores to attend_scores. */
static int attend_scores_bf16(const void *k, int bf16, int q_bf16, const int64_t *rows, int length,
                              const float *q_group, int group, int head_dim, float scale, float *scores) {
#if defined(__AVX512BF16__)
    if (bf16 && q_bf16 && head_dim % 32 == 0) {
        uint16_t q_round[group * head_dim]; /* the queries' own values, as bfloat16 */
        for (int i = 0; i < group * head_dim; i += 32)
            _mm512_storeu_si512(q_round + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q_group + i + 16),
                                                                           _mm512_loadu_ps(q_group + i)));
        attend_scores_dp((const uint16_t *)k, rows, length, q_round, group, head_dim, scale, scores);
        return 1;
    }
#endif
    (void)k; (void)bf16; (void)q_bf16; (void)rows; (void)length; (void)q_group; (void)group; (void)head_dim;
    (void)scale; (void)scores;
    return 0;
}

/* The same two passes a dot product and a row at a time: head dims that are not a multiple of 8, or no AVX2. */
static void attend_item_scalar(const void *k, const void *v, int bf16, const int64_t *rows, int length,
                               const float *q_group, int group, int head_dim, float scale, float *scores, float *o) {
    float row[head_dim];
    for (int pos = 0; pos < length; pos++) {
        row_load(k, bf16, rows[pos], row, head_dim);
        for (int j = 0; j < group; j++)
            scores[j * length + pos] = dot_product(q_group + j * head_dim, row, head_dim) * scale;
    }
    softmax_rows(scores, group, length);
    memset(o, 0, (size_t)group * head_dim * sizeof(float));
    for (int pos = 0; pos < length; pos++) {
        row_load(v, bf16, rows[pos], row, head_dim);
        for (int j = 0; j < group; j++) {
            const float p = scores[j * length + pos];
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[j * head_dim + d] += p * row[d];
        }
    }
}

void tandem_decode_attention(const void *k, const void *v, int bf16, int64_t page_stride, int64_t token_stride,
                             int64_t head_stride, int block_size, const int32_t *block_table, int64_t table_stride,
                             const int32_t *seq_lens, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                             const float *q, int q_bf16, float scale, float *out, int num_threads) {
    const int group = num_q_heads / num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int seq = (int)(item / num_kv_heads), kv_head = (int)(item % num_kv_heads);
        const int length = seq_lens[seq];
        const int32_t *pages = block_table + seq * table_stride;
        /* Where each position's key and value rows start: computed once, not once per pass and feature block. */
        int64_t *rows = (int64_t *)malloc((size_t)length * sizeof(int64_t));
        for (int pos = 0, page = 0; pos < length; page++) /* a page at a time: no division per position */
            for (int in_page = 0; in_page < block_size && pos < length; in_page++, pos++)
                rows[pos] = pages[page] * page_stride + (int64_t)in_page * token_stride + kv_head * head_stride;
        float *scores = (float *)malloc((size_t)length * group * sizeof(float));
        const float *q_group = q + ((int64_t)seq * num_q_heads + (int64_t)kv_head * group) * head_dim;
        float *o = out + ((int64_t)seq * num_q_heads + (int64_t)kv_head * group) * head_dim;
#if defined(__AVX2__) && defined(__FMA__)
        if (head_dim % 8 == 0) {
            /* The first value rows into L2 while the scores are computed (the values pass prefetches the
             * rest as it goes; all of a long sequence's at once was slower: 2,100 positions 1.5 -> 1.8 ms). */
            for (int pos = 0; pos < length && pos < VALUES_PREFETCH; pos++) prefetch_row(v, bf16, rows[pos], head_dim, 1);
            if (!attend_scores_bf16(k, bf16, q_bf16, rows, length, q_group, group, head_dim, scale, scores))
                attend_scores(k, bf16, rows, length, q_group, group, head_dim, scale, scores);
            softmax_rows(scores, group, length);
#if defined(__AVX512F__)
            if (head_dim % 16 == 0)
                attend_values16(v, bf16, rows, length, scores, group, head_dim, o);
            else
#endif
                attend_values(v, bf16, rows, length, scores, group, head_dim, o);
        } else
#endif
            attend_item_scalar(k, v, bf16, rows, length, q_group, group, head_dim, scale, scores, o);
        free(rows);
        free(scores);
    }
}

#define SILU_BLOCK 512 /* elements of a row at a time, on the stack */

/* silu(gate) * up per element, in float32, rounded as torch's two ops round (silu's result to the dtype,
 * then the product); gate, up: (rows, dim) with row strides, out: (rows, dim) contiguous. */
void tandem_silu_and_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out, int bf16,
                         int rows, int dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)rows * dim > 16384)
    for (int64_t row = 0; row < rows; row++) {
        float g[SILU_BLOCK], u[SILU_BLOCK];
        for (int first = 0; first < dim; first += SILU_BLOCK) {
            const int n = dim - first < SILU_BLOCK ? dim - first : SILU_BLOCK;
            row_load(gate, bf16, row * gate_stride + first, g, n);
            row_load(up, bf16, row * up_stride + first, u, n);
            silu_inplace(g, n);
            if (bf16) {
                bf16_round_row(g, n);
                for (int i = 0; i < n; i++) g[i] *= u[i];
            } else {
                for (int i = 0; i < n; i++) g[i] *= u[i];
            }
            row_store(out, bf16, row * (int64_t)dim + first, g, n);
        }
    }
}

/* The new tokens' keys and values into their cache slots (store_kv_ref), copied as they are: key, value and
 * the caches share one element type of elem_bytes bytes, and D is contiguous in all four. Strides in elements:
 * the inputs' per token and per head, the caches' per page, token (in its page) and head. Slot -1: skipped. */
void tandem_store_kv(const void *key, int64_t key_token_stride, int64_t key_head_stride, const void *value,
                     int64_t value_token_stride, int64_t value_head_stride, void *k_cache, void *v_cache,
                     int64_t page_stride, int64_t token_stride, int64_t head_stride, int block_size,
                     const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim, int elem_bytes,
                     int num_threads) {
    const size_t row_bytes = (size_t)head_dim * elem_bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens > 256)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t place = (slot / block_size) * page_stride + (slot % block_size) * token_stride;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t to = (place + h * head_stride) * elem_bytes;
            memcpy((char *)k_cache + to, (const char *)key + (t * key_token_stride + h * key_head_stride) * elem_bytes,
                   row_bytes);
            memcpy((char *)v_cache + to,
                   (const char *)value + (t * value_token_stride + h * value_head_stride) * elem_bytes, row_bytes);
        }
    }
}
