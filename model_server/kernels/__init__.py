"""Compute kernels: Triton kernels for the GPU path, CPU matmuls, the portable PyTorch ops, and
the `KernelTable` that says which of them a model runs.

Modules (import them directly; this package imports nothing, so CPU-only installs never load
triton by accident):
  - `table`: `KernelTable` (the matmul / norm / activation functions a model's layers call),
    `TORCH_KERNELS` (the portable table) and `triton_kernels()` (CUDA's). Platforms choose one
    (`Platform.kernel_table()`), the model builder hands it to every layer.
  - `portable`: the PyTorch implementations every other one must match.
  - `cpu`: the CPU matmuls (`cpu.linear`: skinny-batch float and int8 weight-only) and the native
    paged attention kernel for decodes and prefills, fp32 and bf16 (`cpu.native`, built per
    vector ISA chosen in `cpu.isa`).
  - `store_kv`: write new K/V into the paged cache by slot mapping (`store_kv_cache`).
  - `paged_decode`: decode attention, GQA groups via tl.dot, split-K + reduce
    (`paged_decode_attention`, `choose_num_splits`).
  - `paged_prefill`: causal attention for chunked prefills / prefix-cache hits, K/V read from the
    paged cache (`paged_prefill_attention`).
  - `attention_tile`: the online-softmax tile step both attention kernels share.
  - `rms_norm`, `activation`, `int8_linear`: one-pass RMSNorm (+ residual add), SiluAndMul and
    the w8a16 matmul, in CUDA's table (`table.triton_kernels`).
  - `reference`: slow per-request PyTorch references the tests compare against.

Kernels import nothing above them (no layers, no engine). The developer tools that time and
compile them live outside the package: `python -m tools.kernel_bench`,
`python -m tools.compile_check` (from the repository root).
"""
