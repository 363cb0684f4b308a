/* LoRA adapters' products on one linear layer (lora.c), declared once: lora.c and
 * decoder_stack.c include this header through wick_stack.h (WickLinear holds a WickLoRA), and
 * the Python side mirrors the struct and binds the function from it (kernels/cpu/abi.py; the
 * C subset it reads is described at the top of wick_stack.h; abi_layout.c lists every field).
 *
 * One layer's adapters live in device slots (--max-loras S, --max-lora-rank R), their weights
 * fp32 or bf16 (`weight_dtype`; a bf16 model keeps them in bf16, as vLLM does, which halves
 * what a step reads; the products are summed in fp32 either way). PEFT trains
 * q/k/v (gate/up) separately, so a fused layer holds one *slice* per sub-module, slice i
 * writing columns [slice_offset[i], slice_offset[i] + slice_size[i]) of y. Per slot s:
 *   a [S, num_slices R, k]  slice i's A (its rank's rows of R) in rows [i R, i R + rank)
 *   b [S, R, n]             slice i's B transposed, the adapter's scale folded in: row c,
 *                           columns of slice i = scale * B_i[:, c]
 *   ranks [S, num_slices]   the rows of A (and of b) each slot's slice runs: its adapter's
 *                           rank, 0 where the slot is empty or the adapter leaves the slice
 * The tensors stay at fixed addresses (a slot is overwritten in place when an adapter loads),
 * so a WickLoRA is filled once per layer. */
#ifndef WICK_LORA_H
#define WICK_LORA_H

#include <stdint.h>

#define MAX_LORA_SLICES 3

typedef struct {
  int32_t num_slices; /* 0: no adapters on this layer (nothing is added) */
  int32_t max_loras, max_rank; /* S, R */
  int64_t k, n;                /* x [T, k], y [T, n] */
  const void *a, *b;           /* see above, in weight_dtype */
  const int32_t *ranks;        /* [S, num_slices] */
  int64_t slice_offset[MAX_LORA_SLICES], slice_size[MAX_LORA_SLICES];
  int64_t min_work_per_thread; /* multiply-adds worth another thread */
  int32_t weight_dtype;        /* a and b: 0 fp32, 1 bf16 */
} WickLoRA;

/* y[t] += b[s] (a[s] x[t]) for every row t whose slot s = token_slots[t] is >= 0 (-1: the base
 * model, y[t] untouched), slice by slice; x [m, k] and y [m, n] fp32 (dtype 0) or bf16 (1),
 * rows x_stride / y_stride elements apart. The product is summed in fp32 and added to y with one
 * rounding to y's dtype. Rows are grouped by slot, so a slot's weights are read once per call
 * per thread, whatever its rows' order. The bits do not depend on num_threads. Returns 0, -1
 * when out of memory, -2 for a slot outside [-1, S), -3 for a malformed WickLoRA. */
int wick_lora_add(int dtype, const void *x, int64_t x_stride, void *y, int64_t y_stride,
                  int64_t m, const int32_t *token_slots, const WickLoRA *lora, int num_threads);

#endif /* WICK_LORA_H */
