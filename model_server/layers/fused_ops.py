"""Switch the layers' small elementwise ops to fused Triton kernels.

`RMSNorm` (with and without the residual add) and `SiluAndMul` run PyTorch by default: several
kernels per call, each reading and writing the whole activation. `enable_triton_fused_ops()`
installs one-pass Triton kernels (`kernels/rms_norm.py`, `kernels/activation.py`) for every
instance in this process; call it where compiled Triton supports the model's device (CUDA), or
under TRITON_INTERPRET=1 (tests), before the model runs (and before CUDA graphs are captured).
The hooks are per process: each tensor-parallel worker calls it in its own platform `prepare()`.
"""

from __future__ import annotations

from model_server.layers.activation import set_silu_and_mul_impl
from model_server.layers.norm import set_rms_norm_impl


def enable_triton_fused_ops() -> None:
    """Route every RMSNorm and SiluAndMul through the fused Triton kernels (imports triton)."""
    from model_server.kernels.activation import silu_and_mul
    from model_server.kernels.rms_norm import fused_add_rms_norm, rms_norm

    set_rms_norm_impl(rms_norm, fused_add_rms_norm)
    set_silu_and_mul_impl(silu_and_mul)


def disable_triton_fused_ops() -> None:
    """Restore the PyTorch implementations."""
    set_rms_norm_impl(None, None)
    set_silu_and_mul_impl(None)
