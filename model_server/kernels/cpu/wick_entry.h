/* The kernels' entry points, declared once here: included by the files that define them, so the
 * compiler checks each definition against what its callers were told (decoder_stack.c runs
 * several), and read by the Python side, which binds every prototype of this header and of
 * wick_stack.h with ctypes types parsed from it (kernels/cpu/abi.py; see wick_stack.h for the C
 * subset it reads). An entry point declared here is bound at load with those types; a library
 * that lacks one is refused there. */
#ifndef WICK_ENTRY_H
#define WICK_ENTRY_H

#include <stdint.h>

#include "wick_cpu.h"

int wick_rms_norm(int dtype, const void *x, int64_t x_inner_rows, int64_t x_outer_stride,
                  int64_t x_inner_stride, const void *residual, int64_t r_inner_rows,
                  int64_t r_outer_stride, int64_t r_inner_stride, const void *weight, void *out,
                  void *sum_out, int64_t num_rows, int n, float eps, int num_threads,
                  int64_t min_work_per_thread);
int wick_layer_norm(int dtype, const void *x, int64_t x_inner_rows, int64_t x_outer_stride,
                    int64_t x_inner_stride, const void *residual, int64_t r_inner_rows,
                    int64_t r_outer_stride, int64_t r_inner_stride, const void *weight,
                    const void *bias, void *out, void *sum_out, int64_t num_rows, int n,
                    float eps, int num_threads, int64_t min_work_per_thread);
int wick_gelu(int dtype, const void *x, int64_t x_stride, void *out, int64_t num_rows, int d,
              int approximate, int num_threads, int64_t min_work_per_thread);
int wick_rotary_neox(int dtype, const int64_t *positions, int64_t num_tokens, const void *cos_sin,
                     int64_t max_position, const void *q, int64_t q_token_stride,
                     int64_t q_head_stride, void *q_out, const void *k, int64_t k_token_stride,
                     int64_t k_head_stride, void *k_out, int num_heads, int num_kv_heads,
                     int head_dim, int rotary_dim, int num_threads, int64_t min_work_per_thread);
int wick_silu_and_mul(int dtype, const void *x, int64_t x_stride, void *out, int64_t num_rows,
                      int d, int num_threads, int64_t min_work_per_thread);
int wick_gelu_tanh_and_mul(int dtype, const void *x, int64_t x_stride, void *out,
                           int64_t num_rows, int d, int num_threads,
                           int64_t min_work_per_thread);
int wick_paged_attention(int dtype, const void *q, void *k_cache, void *v_cache, const void *k,
                         const void *v, int64_t k_stride, int64_t v_stride,
                         const int64_t *slot_mapping, int64_t num_slots,
                         const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int num_threads,
                         int64_t min_work_per_thread, int kv_format, float *k_scales,
                         float *v_scales);
/* prefetch: 1 prefetches each panel stream in software, 0 leaves it to the hardware prefetcher
 * (the linear plan's native_panels / native_panels_hwpf); the same output bits either way. */
int wick_panel_gemm(const bf16_t *x, int64_t x_stride, const bf16_t *panels, const bf16_t *bias,
                    bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads,
                    int64_t min_work_per_thread, int prefetch);
int wick_panel_gemm_silu(const bf16_t *x, int64_t x_stride, const bf16_t *panels, bf16_t *y,
                         int64_t m, int64_t inter, int64_t k, int num_threads,
                         int64_t min_work_per_thread, int prefetch);
int wick_panel_f32_gemm(int dtype, const void *x, int64_t x_stride, const void *panels,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                        int num_threads, int64_t min_work_per_thread);
int wick_panel_f32_gemm_silu(int dtype, const void *x, int64_t x_stride, const void *panels,
                             void *y, int64_t m, int64_t inter, int64_t k, int num_threads,
                             int64_t min_work_per_thread);
int wick_gguf_gemm(const int type, const int dtype, const void *x, const int64_t x_stride,
                   const uint8_t *w, const void *bias, void *y, const int64_t m, const int64_t n,
                   const int64_t k, const int num_threads, const int64_t min_work_per_thread);
int wick_gguf_q8_gemm(const int type, const int dtype, const void *x, const int64_t x_stride,
                      const uint8_t *w, const void *bias, void *y, const int64_t m,
                      const int64_t n, const int64_t k, const int num_threads,
                      const int64_t min_work_per_thread);

/* paged_attention.c */
int wick_paged_attention_windowed(int dtype, const void *q, void *k_cache, void *v_cache,
                                  const void *k, const void *v, int64_t k_stride,
                                  int64_t v_stride, const int64_t *slot_mapping,
                                  int64_t num_slots, const int32_t *block_tables,
                                  int64_t bt_stride, const int32_t *query_start_loc,
                                  const int32_t *seq_lens, void *out, int num_seqs,
                                  int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  float scale, int num_threads, int64_t min_work_per_thread,
                                  int kv_format, float *k_scales, float *v_scales, int window,
                                  float soft_cap, float kv_fixed_scale);
const char *wick_isa(void);
/* layer_ops.c */
int wick_argmax(int dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t n,
                int64_t *out, int num_threads, int64_t min_work_per_thread);
/* gemm.c: wick_gemm_packed takes wick_gemm's arguments as one int64 array */
int wick_gemm(int dtype, const void *x, int64_t x_stride, const void *w, const void *bias,
              void *y, int M, int N, int K, int use_dpbf16, int num_threads,
              int64_t min_work_per_thread);
int wick_gemm_has_dpbf16(void);
int wick_gemm_packed(const int64_t *a);
/* panel_gemm.c, panel_gemm_f32.c */
int wick_panel_gemm_available(void);
int64_t wick_panel_elements(int64_t n, int64_t k);
void wick_panel_pack(const bf16_t *w, int64_t n, int64_t k, bf16_t *panels);
int wick_panel_f32_lanes(void);
int64_t wick_panel_f32_elements(int64_t n, int64_t k);
void wick_panel_f32_pack(int dtype, const void *w, int64_t n, int64_t k, void *panels);
/* wna16_gemm.c: wick_wna16_gemm_packed takes wick_wna16_gemm's arguments as one int64 array */
int wick_wna16_gemm(int dtype, const void *x, int64_t x_stride, const uint8_t *codes,
                    const float *scales, const float *offsets, const void *bias, void *y, int M,
                    int N, int K, int bits, int group_size, int num_threads,
                    int64_t min_work_per_thread);
int wick_wna16_gemm_packed(const int64_t *a);
int wick_wna16_dequantize(int dtype, const uint8_t *codes, const float *scales,
                          const float *offsets, void *w, int N, int K, int bits, int group_size,
                          int num_threads);
/* gguf_gemm.c, gguf_q8.c */
int wick_gguf_dequant(const int type, const int dtype, const uint8_t *w, const int64_t rows,
                      const int64_t k, void *out, const int num_threads);
int wick_gguf_q8_quantize(const int dtype, const void *x, const int64_t x_stride, const int64_t m,
                          const int64_t k, int8_t *q, float *d);
int wick_gguf_q8_supports(const int type);
int wick_gguf_q8_has_vnni(void);
/* varlen_attention.c */
int wick_varlen_attention(int dtype, const void *q, int64_t q_stride, const void *k,
                          int64_t k_stride, const void *v, int64_t v_stride, void *out,
                          int64_t out_stride, const int32_t *cu_seqlens, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, int causal,
                          int num_threads, int64_t min_work_per_thread);
/* memory_read.c: reads buf once on num_threads threads, `streams` interleaved streams each
 * (at most WICK_READ_MAX_STREAMS), for the measured read bandwidth of `bench latency` */
#define WICK_READ_MAX_STREAMS 8
int wick_memory_read(const void *buf, int64_t nbytes, int streams, int num_threads,
                     uint64_t *checksum);

#endif /* WICK_ENTRY_H */
