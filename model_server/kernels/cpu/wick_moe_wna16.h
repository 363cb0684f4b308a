/* Mixture-of-experts layers whose routed experts are kept as GPTQ / AWQ codes (moe_wna16.c),
 * declared once: moe_wna16.c and decoder_stack.c include this header (through wick_stack.h:
 * WickMoE holds two WickExpertsWNA16), and the Python side mirrors the struct and binds the
 * functions from it (kernels/cpu/abi.py; the C subset it reads is described at the top of
 * wick_stack.h; abi_layout.c lists every field). Both paths call wick_moe_wna16_experts with the
 * same arguments: the CPU kernel table's `fused_experts` on `WNA16Experts`
 * (kernels/cpu/moe_wna16.py) under the modules, and decoder_stack.c's MoE layers.
 *
 * One projection of every expert, W_e [n, k], in wna16_gemm.c's layout stacked over experts
 * (layers/quantization/wna16_moe.py's WNA16Experts; act-order experts multiply their input's
 * columns in the order their codes are stored, as the modules' index_select does): */
#ifndef WICK_MOE_WNA16_H
#define WICK_MOE_WNA16_H

#include <stdint.h>

typedef struct {
  const uint8_t *codes;          /* [E, n, k / 2] (4 bits) or [E, n, k] (8 bits) */
  const float *scales, *offsets; /* [E, n, G] fp32, G = ceil(k / group_size) */
  int64_t n, k;                  /* each expert's W [n, k] */
  int32_t bits, group_size;      /* 4 or 8; a multiple of 32, as k */
  int64_t min_work_per_thread;   /* multiply-adds worth another thread (wna16.py's) */
  const int64_t *perm;           /* [E, k] act-order: expert e's stored column i is input
                                  * feature perm[e, i] (NULL: in input order) */
} WickExpertsWNA16;

/* The bytes of wick_moe_wna16_experts' scratch for these sizes. */
int64_t wick_moe_wna16_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                                     int64_t inter);

/* wick_moe_experts' contract (wick_moe.h) on quantized experts: w13 [E, 2I, H] (each expert's
 * gate rows, then its up rows; n = 2I, k = H), w2 [E, H, I] (n = H, k = I). The (token, slot)
 * pairs grouped by expert (stable), each expert's two matmuls once over its rows (wna16_gemm.c's
 * wick_wna16_gemm on its slice of the codes, outputs rounded to the dtype; layer_ops.c's SiLU and
 * mul between), each pair's row times its weight in fp32, a token's k rows summed in slot order
 * in fp32 and rounded once. x, out [T, H] fp32 (dtype 0) or bf16 (1). `scratch`:
 * wick_moe_wna16_scratch_bytes of them. Returns 0; -2 for an expert id outside [0, E); -3 when
 * w13 and w2 do not fit (w13 n != 2 w2 k or w2 n != w13 k); a matmul's error otherwise
 * (-2: a layout wna16_gemm.c refuses, -1: out of memory, an act-order gather's buffer too). */
int wick_moe_wna16_experts(int dtype, const void *x, int64_t num_tokens,
                           const WickExpertsWNA16 *w13, const WickExpertsWNA16 *w2,
                           int num_experts, const float *weights, const int64_t *ids, int top_k,
                           void *out, void *scratch, int num_threads, int64_t act_min_work);

#endif /* WICK_MOE_WNA16_H */
