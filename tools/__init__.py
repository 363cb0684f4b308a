"""Developer tools, not part of the installed package (run them from the repository root):

  - `python -m tools.kernel_bench`: times the Triton kernels against the PyTorch ones on a CUDA GPU.
  - `python -m tools.cpu_attention_bench`: times the native CPU paged attention on decode steps.
  - `python -m tools.moe_bench`: times the grouped CPU mixture-of-experts against a per-token loop.
  - `python -m tools.compile_check`: compiles every Triton kernel variant the engine launches for
    NVIDIA targets (sm_80/89/90) without a GPU, with Triton's bundled ptxas.

They sit above the whole stack (they may import the engine, the layers and the kernels); nothing
under `model_server` imports them.
"""
