"""What a linear layer's weight holds once the engine planned it (kernels/planned_weight.py)."""

from __future__ import annotations

from typing import Any

import torch

from model_server.kernels.planned_weight import PlannedWeight


def held(weight: Any) -> Any:
    """The checkpoint's weight behind a planned one (the float tensor or the quantized weight),
    the planned weight itself where only its packed copy holds the values, else `weight`."""
    if isinstance(weight, PlannedWeight) and weight.source is not None:
        return weight.source
    return weight


def holds_float(weight: Any) -> bool:
    """Whether a linear's weight is a float matrix: a tensor, or a planned weight without a
    quantized source (the tuner may keep only its packed copy: then `source` is None)."""
    if isinstance(weight, PlannedWeight):
        return weight.method == "" and not isinstance(weight.source, torch.nn.Module)
    return isinstance(weight, torch.Tensor)
