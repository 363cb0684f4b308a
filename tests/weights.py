"""What a linear layer's weight holds once the engine planned it (kernels/planned_weight.py)."""

from __future__ import annotations

from typing import Any

from model_server.kernels.planned_weight import PlannedWeight


def held(weight: Any) -> Any:
    """The checkpoint's weight behind a planned one (the float tensor or the quantized weight),
    the planned weight itself where only its packed copy holds the values, else `weight`."""
    if isinstance(weight, PlannedWeight) and weight.source is not None:
        return weight.source
    return weight
