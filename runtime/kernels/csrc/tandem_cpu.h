/* The C core of Tandem's native CPU kernels (cpu_native.c): its constants and functions, one statement
 * of each. ops.cpp checks every tensor against these contracts and registers the torch operators
 * (tandem::...); cpu_native.py reads the constants from this file, so they are written once.
 *
 * The functions trust their arguments: pointers and strides are in elements, slots and pages index the
 * pools the caller addresses, and num_threads is OpenMP's team size. */
#ifndef TANDEM_CPU_H
#define TANDEM_CPU_H

#include <stdint.h>

#define TANDEM_GEMV_MAX_ROWS 4    /* rows of x tandem_gemv takes: its accumulators live in registers */
#define TANDEM_PANEL 32           /* output features per panel of packed weights (panel_gemm, amx_gemm) */
#define TANDEM_AMX_K_MULTIPLE 32  /* amx_gemm's K: whole tiles of 32 bfloat16 values */

#ifdef __cplusplus
extern "C" {
#endif

void tandem_ssm_state_update(void *states, int bf16, int64_t slot_stride, int64_t head_stride,
                             const int64_t *slots, int num_seqs, const int64_t *waves, int num_waves,
                             int num_heads, int head_dim, int d_state, int num_groups, int in_bf16, const void *x,
                             int64_t x_stride, const void *dt, int64_t dt_stride, const float *dt_bias, int clamp,
                             float dt_min, float dt_max, const float *A, const void *B, int64_t b_stride,
                             const void *C, int64_t c_stride, const float *D, void *y, int y_bf16,
                             int num_threads);
void tandem_conv_update(void *states, int bf16, int64_t slot_stride, const int64_t *slots, int num_seqs,
                        const int64_t *waves, int num_waves, int dim, int width, const void *x, int x_bf16,
                        int64_t x_stride, const float *weight, const float *bias, int silu, void *out,
                        int num_threads);
void tandem_ssm_scan(void *states, int bf16, int64_t slot_stride, int64_t head_stride, const int64_t *slots,
                     const int32_t *starts, const uint8_t *resume, int num_seqs, int num_heads, int head_dim,
                     int d_state, int num_groups, const void *x, int x_bf16, int64_t x_stride, const float *dt,
                     const float *decays, const float *B, const float *C, const float *D, void *y, int y_bf16,
                     int num_threads);
void tandem_conv_fn(void *states, int bf16, int64_t slot_stride, const int64_t *slots, const int32_t *starts,
                    const uint8_t *resume, int num_seqs, int dim, int width, const void *x, int x_bf16,
                    int64_t x_stride, const float *weight_t, const float *bias, int silu, void *out,
                    int num_threads);
void tandem_rms_norm(const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *weight,
                     void *out, int bf16, int rows, int dim, int group_size, float eps, int num_threads);
void tandem_rotary(const void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                   void *out, int bf16, int tokens, int heads, int head_dim, int rotary_dim, int num_threads);
void tandem_gemv(const void *w, int bf16, const float *x, const float *bias, float *y, int M, int N, int K,
                 int num_threads);
void tandem_small_gemm(const void *w, int bf16, const float *x, const float *bias, float *y, int M, int N, int K,
                       int num_threads);
int tandem_panel_gemm_dtypes(void);
void tandem_panel_gemm(const void *w, int bf16, const void *x, int64_t x_stride, const float *bias, void *y,
                       int y_bf16, int M, int N, int K, int num_threads);
int tandem_amx_ready(void);
void tandem_amx_gemm(const uint16_t *w, const uint16_t *x, int64_t x_stride, const float *bias, uint16_t *y,
                     int M, int N, int K, int num_threads);
/* amx_gemm for an int8 or int4 weight (quant.c's layouts, no offsets) and a bfloat16 x: float32 y (M, N). */
void tandem_amx_quant_gemm(const uint8_t *w, int format, const float *scales, int group_size, const uint16_t *x,
                           int64_t x_stride, const float *bias, float *y, int M, int N, int K, int num_threads);
#define TANDEM_INT4_BLOCK 16 /* int4 values per block of 8 bytes (quant.c); an int4 group is whole blocks */

/* quant.c's weight formats: int8 (N, K); int4 (N, ceil(K / 16) * 8), blocks of 16 values in 8 bytes, byte j
 * holding value j in its low nibble and j + 8 in its high one, each q + 8; FP8 e4m3fn (N, K). */
#define TANDEM_QUANT_INT8 8
#define TANDEM_QUANT_INT4 4
#define TANDEM_QUANT_FP8 1
/* quant.c: y = x W^T (+ bias), W = q * scale (+ offset) with scales and offsets (or NULL) float32 (N, groups of
 * group_size k; the last may be partial); group_size a multiple of 16 for int4, or at least K. */
void tandem_quant_gemm(const uint8_t *w, int format, const float *scales, const float *offsets, int group_size,
                       const float *x, const float *bias, float *y, int M, int N, int K, int num_threads);
/* quant.c: tandem_quant_gemm with x and y bfloat16 (y rounded to nearest even from the float32 sums). */
void tandem_quant_gemm_bf16(const uint8_t *w, int format, const float *scales, const float *offsets,
                            int group_size, const uint16_t *x, const float *bias, uint16_t *y, int M, int N, int K,
                            int num_threads);
/* quant_x16.c: tandem_quant_gemm for int4 weights against x quantized in blocks of 32 (d = max|x| / 127, x / d = q +
 * r / 256 with q and r 8-bit integers), integer products per block: where tandem_quant_x16_runs(format, group_size,
 * K), K a multiple of 64 and groups multiples of 64, of 32, or the whole row. */
int tandem_quant_x16_runs(int format, int group_size, int K);
void tandem_quant_x16_gemm(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                          const float *x, const float *bias, float *y, int M, int N, int K, int num_threads);
/* quant_x16.c: tandem_quant_x16_gemm with x and y bfloat16 (y rounded to nearest even from the float32 sums). */
void tandem_quant_x16_gemm_bf16(const uint8_t *w, const float *scales, const float *offsets, int group_size,
                               const uint16_t *x, const float *bias, uint16_t *y, int M, int N, int K,
                               int num_threads);
/* quant.c: whether tandem_quant_gemm runs batches past 16 rows on expanded panels here (AVX2 without AVX-512),
 * prefills included. */
int tandem_quant_expands(void);
/* quant.c: W dequantized into out, float32 (N, K). */
void tandem_quant_dequantize(const uint8_t *w, int format, const float *scales, const float *offsets,
                             int group_size, float *out, int N, int K, int num_threads);
void tandem_decode_attention(const void *k, const void *v, int bf16, int64_t page_stride, int64_t token_stride,
                             int64_t head_stride, int block_size, const int32_t *block_table, int64_t table_stride,
                             const int32_t *seq_lens, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                             const float *q, int q_bf16, float scale, float *out, int num_threads);
void tandem_silu_and_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out,
                         int bf16, int rows, int dim, int num_threads);
void tandem_store_kv(const void *key, int64_t key_token_stride, int64_t key_head_stride, const void *value,
                     int64_t value_token_stride, int64_t value_head_stride, void *k_cache, void *v_cache,
                     int64_t page_stride, int64_t token_stride, int64_t head_stride, int block_size,
                     const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim, int elem_bytes,
                     int num_threads);

/* lora.c: batched LoRA over float32 or bfloat16 slot pools (runtime/kernels/lora.py); rows in skip_slot are left
 * alone. */
void tandem_lora_shrink(const void *x, int x_bf16, int64_t x_stride, const void *a, int a_bf16,
                        const int64_t *indices, int64_t skip_slot, int rows, int rank, int dim, float *out,
                        int num_threads);
void tandem_lora_expand(const float *s, const void *b, int b_bf16, const float *bias, const int64_t *indices,
                        int64_t skip_slot, int rows, int rank, int out_features, void *y, int y_bf16,
                        int64_t y_stride, int num_threads);

#ifdef __cplusplus
}
#endif

#endif
