/* The compiled layout of wick_stack.h's structs, for the loader's check of its ctypes mirrors
 * (kernels/cpu/abi.py): they are built from the header's text, and a C compiler may lay a
 * struct out otherwise than ctypes reads it (or abi.py may misread a declaration), which would
 * corrupt memory on the first call. The loader refuses the library when a size or offset
 * differs, and when a field of the header is missing from this table: a field added to a
 * struct there must be added here too (FIELD(Struct, field)). */
#include <stddef.h>
#include <stdint.h>

#include "wick_stack.h"

typedef struct {
  const char *type, *field; /* field "": the struct itself */
  int64_t offset, size;
} Row;

#define STRUCT(T) {#T, "", 0, (int64_t)sizeof(T)}
#define FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)}

static const Row ROWS[] = {
    STRUCT(WickLoRA),
    FIELD(WickLoRA, num_slices),
    FIELD(WickLoRA, max_loras),
    FIELD(WickLoRA, max_rank),
    FIELD(WickLoRA, k),
    FIELD(WickLoRA, n),
    FIELD(WickLoRA, a),
    FIELD(WickLoRA, b),
    FIELD(WickLoRA, ranks),
    FIELD(WickLoRA, slice_offset),
    FIELD(WickLoRA, slice_size),
    FIELD(WickLoRA, min_work_per_thread),
    FIELD(WickLoRA, weight_dtype),

    STRUCT(WickExpertsWNA16),
    FIELD(WickExpertsWNA16, codes),
    FIELD(WickExpertsWNA16, scales),
    FIELD(WickExpertsWNA16, offsets),
    FIELD(WickExpertsWNA16, n),
    FIELD(WickExpertsWNA16, k),
    FIELD(WickExpertsWNA16, bits),
    FIELD(WickExpertsWNA16, group_size),
    FIELD(WickExpertsWNA16, min_work_per_thread),

    STRUCT(WickLinear),
    FIELD(WickLinear, kind),
    FIELD(WickLinear, num_segments),
    FIELD(WickLinear, n),
    FIELD(WickLinear, k),
    FIELD(WickLinear, data),
    FIELD(WickLinear, bias),
    FIELD(WickLinear, min_work_per_thread),
    FIELD(WickLinear, segment_type),
    FIELD(WickLinear, segment_rows),
    FIELD(WickLinear, segment_blocks),
    FIELD(WickLinear, segment_q8),
    FIELD(WickLinear, scales),
    FIELD(WickLinear, offsets),
    FIELD(WickLinear, bits),
    FIELD(WickLinear, group_size),
    FIELD(WickLinear, lora),

    STRUCT(WickMoE),
    FIELD(WickMoE, num_experts),
    FIELD(WickMoE, top_k),
    FIELD(WickMoE, renormalize),
    FIELD(WickMoE, has_shared),
    FIELD(WickMoE, split_shared_add),
    FIELD(WickMoE, inter),
    FIELD(WickMoE, w13),
    FIELD(WickMoE, w2),
    FIELD(WickMoE, router),
    FIELD(WickMoE, shared_gate),
    FIELD(WickMoE, gemm_min_work),
    FIELD(WickMoE, experts_kind),
    FIELD(WickMoE, w13_wna16),
    FIELD(WickMoE, w2_wna16),

    STRUCT(WickLayer),
    FIELD(WickLayer, input_norm),
    FIELD(WickLayer, post_attention_norm),
    FIELD(WickLayer, attn_out_norm),
    FIELD(WickLayer, mlp_out_norm),
    FIELD(WickLayer, q_norm),
    FIELD(WickLayer, k_norm),
    FIELD(WickLayer, cos_sin),
    FIELD(WickLayer, qkv),
    FIELD(WickLayer, o),
    FIELD(WickLayer, gate_up),
    FIELD(WickLayer, down),
    FIELD(WickLayer, fuse_silu),
    FIELD(WickLayer, activation),
    FIELD(WickLayer, sliding_window),
    FIELD(WickLayer, logits_soft_cap),
    FIELD(WickLayer, kv_group),
    FIELD(WickLayer, num_slots),
    FIELD(WickLayer, k_cache),
    FIELD(WickLayer, v_cache),
    FIELD(WickLayer, k_scales),
    FIELD(WickLayer, v_scales),
    FIELD(WickLayer, kv_fixed_scale),
    FIELD(WickLayer, rotary_dim),
    FIELD(WickLayer, norm_kind),
    FIELD(WickLayer, input_norm_bias),
    FIELD(WickLayer, post_attention_norm_bias),
    FIELD(WickLayer, parallel_residual),
    FIELD(WickLayer, mlp_kind),
    FIELD(WickLayer, moe),

    STRUCT(WickStackStep),
    FIELD(WickStackStep, dtype),
    FIELD(WickStackStep, num_threads),
    FIELD(WickStackStep, num_tokens),
    FIELD(WickStackStep, hidden),
    FIELD(WickStackStep, num_heads),
    FIELD(WickStackStep, num_kv_heads),
    FIELD(WickStackStep, head_dim),
    FIELD(WickStackStep, intermediate),
    FIELD(WickStackStep, eps),
    FIELD(WickStackStep, scale),
    FIELD(WickStackStep, positions),
    FIELD(WickStackStep, max_position),
    FIELD(WickStackStep, slot_mapping),
    FIELD(WickStackStep, block_tables),
    FIELD(WickStackStep, bt_stride),
    FIELD(WickStackStep, sliding_slot_mapping),
    FIELD(WickStackStep, sliding_block_tables),
    FIELD(WickStackStep, sliding_bt_stride),
    FIELD(WickStackStep, query_start_loc),
    FIELD(WickStackStep, seq_lens),
    FIELD(WickStackStep, num_seqs),
    FIELD(WickStackStep, block_size),
    FIELD(WickStackStep, kv_format),
    FIELD(WickStackStep, status),
    FIELD(WickStackStep, first_layer),
    FIELD(WickStackStep, first_half),
    FIELD(WickStackStep, last_layer),
    FIELD(WickStackStep, last_half),
    FIELD(WickStackStep, residual_state),
    FIELD(WickStackStep, norm_min_work),
    FIELD(WickStackStep, attn_min_work),
    FIELD(WickStackStep, hidden_in),
    FIELD(WickStackStep, normed),
    FIELD(WickStackStep, qkv),
    FIELD(WickStackStep, q_normed),
    FIELD(WickStackStep, k_normed),
    FIELD(WickStackStep, q_rot),
    FIELD(WickStackStep, k_rot),
    FIELD(WickStackStep, attn),
    FIELD(WickStackStep, proj),
    FIELD(WickStackStep, sandwich),
    FIELD(WickStackStep, residual_a),
    FIELD(WickStackStep, residual_b),
    FIELD(WickStackStep, gate_up),
    FIELD(WickStackStep, mid),
    FIELD(WickStackStep, segment),
    FIELD(WickStackStep, hidden_out),
    FIELD(WickStackStep, lora_slots),
    FIELD(WickStackStep, moe_scratch),
};

int wick_abi_layout(const char **names, int64_t *values, int capacity) {
  const int rows = (int)(sizeof(ROWS) / sizeof(ROWS[0]));
  for (int i = 0; i < rows && i < capacity; i++) {
    names[2 * i] = ROWS[i].type;
    names[2 * i + 1] = ROWS[i].field;
    values[2 * i] = ROWS[i].offset;
    values[2 * i + 1] = ROWS[i].size;
  }
  return rows;
}
