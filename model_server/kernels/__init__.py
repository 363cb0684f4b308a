"""Triton kernels for the GPU attention path and their pure-PyTorch references.

Modules (import them directly; this package imports nothing, so CPU-only installs never load
triton by accident):
  - `store_kv`: write new K/V into the paged cache by slot mapping (`store_kv_cache`).
  - `paged_decode`: decode attention, GQA groups via tl.dot, split-K + reduce
    (`paged_decode_attention`, `choose_num_splits`).
  - `paged_prefill`: causal attention for chunked prefills / prefix-cache hits, K/V read from the
    paged cache (`paged_prefill_attention`).
  - `attention_tile`: the online-softmax tile step both attention kernels share.
  - `rms_norm`, `activation`: one-pass RMSNorm (+ residual add) and SiluAndMul, installed on
    CUDA by `layers.fused_ops.enable_triton_fused_ops`.
  - `reference`: slow per-request PyTorch references the tests compare against.
  - `bench`: `python -m model_server.kernels.bench` times the kernels against the torch backend.
  - `compile_check`: `python -m model_server.kernels.compile_check` compiles every variant the
    engine launches for NVIDIA targets (sm_80/89/90) without a GPU, with Triton's ptxas.
"""
