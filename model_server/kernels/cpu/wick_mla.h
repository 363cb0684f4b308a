/* Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache (mla_attention.c),
 * declared once: mla_attention.c and decoder_stack.c include this header, and the Python side
 * binds its function with the types declared here (kernels/cpu/abi.py). Both paths call it with
 * the same arguments: layers/attention/mla.py's MLAAttention on the `cpu` backend
 * (kernels/cpu/mla_attention.py) under the modules, and decoder_stack.c's MLA layers.
 *
 * dtype 0: fp32, 1: bf16; the cache holds the activation dtype. Shapes (L = kv_lora_rank,
 * R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim, H heads of this rank):
 *   q_nope   [T, H, Dn] (token stride q_token_stride, head stride q_head_stride)
 *   q_pe     [T, H, R] contiguous, rotated
 *   latent   [T, L] (rows latent_stride apart), normalised
 *   k_pe     [T, R] (rows k_pe_stride apart), rotated
 *   w_kv_b   [H (Dn + Dv), L]: head h's rows Dn of W_uk then Dv of W_uv
 *   kv_cache [num_blocks, block_size, L + R]
 *   out      [T, H Dv] */
#ifndef WICK_MLA_H
#define WICK_MLA_H

#include <stdint.h>

/* Stores each row's [latent, k_pe] at its slot (slots < 0 skipped), then for every query row
 * (decodes and prefill rows alike) absorbed attention, in fp32 from the stored values:
 * q_lat = q_nope W_uk (per head, L values), scores (q_lat . c_j + q_pe . k_pe_j) * scale over
 * the row's causal context (the first seq_len - query_len + i + 1 positions of its sequence),
 * softmax, o_lat = sum_j p_j c_j, out = W_uv o_lat rounded once to the dtype. Each head's sums
 * run in a fixed order on one thread, so the bits do not depend on the thread count.
 * Returns 0; -1 when a scratch buffer could not be allocated; -2 on inconsistent lengths;
 * -3 on a slot past the cache; -4 on a dtype it does not run. */
int wick_mla_attention(int dtype, const void *q_nope, int64_t q_token_stride,
                       int64_t q_head_stride, const void *q_pe, const void *latent,
                       int64_t latent_stride, const void *k_pe, int64_t k_pe_stride,
                       const void *w_kv_b, void *kv_cache, const int64_t *slot_mapping,
                       int64_t num_slots, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                       int num_seqs, int num_heads, int qk_nope_head_dim, int qk_rope_head_dim,
                       int v_head_dim, int kv_lora_rank, int block_size, float scale,
                       int num_threads, int64_t min_work_per_thread);

#endif /* WICK_MLA_H */
