"""CPU platform: the skinny-batch matmul equals F.linear; KV memory comes back zeroed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_server.platforms import get_platform
from model_server.platforms.cpu import skinny_linear


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 64, 65, 300])
@pytest.mark.parametrize("out_features", [96, 97])  # even and odd splits across threads
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(rows: int, out_features: int, bias: bool) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 48)
    w = torch.randn(out_features, 48)
    b = torch.randn(out_features) if bias else None
    got = skinny_linear(x, w, b)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_skinny_linear_single_row_uses_all_threads_split() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x, w = torch.randn(1, 16), torch.randn(10, 16)
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_cpu_kv_memory_is_zeroed() -> None:
    platform = get_platform("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        t = platform.allocate_zeros((2, 64, 16, 3, 8), dtype)
        assert t.dtype == dtype and t.shape == (2, 64, 16, 3, 8)
        assert not t.any()


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        get_platform("tpu")
