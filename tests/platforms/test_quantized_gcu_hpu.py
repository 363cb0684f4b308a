"""Quantized weights on gcu and hpu: `-q int8`, a GPTQ and an AWQ checkpoint, and a GPTQ MoE
checkpoint load and generate through the whole engine (`LLM`) on the faked Enflame and Habana
runtimes (their platforms as they are, the tensors on the CPU underneath), through the portable
kernel table's dequantizing matmuls, with the same greedy tokens as the CPU's portable path."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.kernels import portable
from model_server.kernels.table import TORCH_KERNELS
from model_server.platforms import cpu, gcu, platform_class
from model_server.platforms.interface import Platform
from model_server.sampling_params import SamplingParams
from tests.layers.quantization.checkpoints import VOCAB, Format, save_pair

ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=64,
    block_size=4,
    kv_cache_memory=2 * 1024**2,
    max_num_batched_tokens=16,
    attention_backend="torch",
)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(13)], [(11 * i + 5) % VOCAB for i in range(21)]]


def _fake_gcu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_gcu", types.ModuleType("torch_gcu"))
    fake = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        set_device=lambda i: None,
        synchronize=lambda: None,
        mem_get_info=lambda device: (2**30, 2**31),
    )
    monkeypatch.setattr(torch, "gcu", fake, raising=False)
    monkeypatch.setattr(gcu, "enflame_triton_available", lambda: False)


def _fake_hpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = types.ModuleType("habana_frameworks")
    torch_pkg = types.ModuleType("habana_frameworks.torch")
    core = types.ModuleType("habana_frameworks.torch.core")
    core.mark_step = lambda: None  # type: ignore[attr-defined]
    hthpu = types.ModuleType("habana_frameworks.torch.hpu")
    hthpu.is_available = lambda: True  # type: ignore[attr-defined]
    hthpu.device_count = lambda: 1  # type: ignore[attr-defined]
    hthpu.set_device = lambda i: None  # type: ignore[attr-defined]
    hthpu.synchronize = lambda: None  # type: ignore[attr-defined]
    hthpu.mem_get_info = lambda: (2**30, 2**31)  # type: ignore[attr-defined]
    pkg.torch = torch_pkg  # type: ignore[attr-defined]
    torch_pkg.core, torch_pkg.hpu = core, hthpu  # type: ignore[attr-defined]
    for name, module in [
        ("habana_frameworks", pkg),
        ("habana_frameworks.torch", torch_pkg),
        ("habana_frameworks.torch.core", core),
        ("habana_frameworks.torch.hpu", hthpu),
    ]:
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Fake the runtime of `device` (gcu or hpu); its platform's tensors live on the CPU."""

    def fake(device: str) -> None:
        {"gcu": _fake_gcu, "hpu": _fake_hpu}[device](monkeypatch)
        module = {"gcu": "torch_gcu", "hpu": "habana_frameworks"}[device]
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda n, *a, **k: object() if n == module else real_find_spec(n, *a, **k),
        )
        monkeypatch.setattr(platform_class(device), "device_type", "cpu")

    return fake


@pytest.fixture
def portable_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU platform on the portable path: the torch kernel table, no planned weights, no
    native decoder step (with ENGINE_ARGS' torch attention)."""
    for name in ("kernel_table", "plan_linears", "native_decoder_step"):
        monkeypatch.setattr(cpu.CpuPlatform, name, getattr(Platform, name))


def _greedy(model: Path | str, device: str, **kwargs: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model), device=device, **{**ENGINE_ARGS, **kwargs})
    try:
        assert llm.engine.core.model_runner.platform.name == device
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of kernels/portable.py's `name` (what its dequantizing matmuls call)."""
    calls: list[int] = []
    real = getattr(portable, name)

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(portable, name, counted)
    return calls


@pytest.mark.parametrize("device", ["gcu", "hpu"])
def test_platform_offers_the_portable_dequantizing_matmuls(device: str) -> None:
    cls = platform_class(device)
    assert set(cls.quantization_methods) == {"int8", "gptq", "awq"}
    table = cls().kernel_table()
    assert table is TORCH_KERNELS
    assert table.int8_linear is portable.int8_linear_dequant
    assert table.wna16_linear is portable.wna16_linear_dequant
    cls().check_quantization("gptq")
    with pytest.raises(ValueError, match=f"quantization fp8 is not supported on {device}"):
        cls().check_quantization("fp8")


@pytest.mark.parametrize("device", ["gcu", "hpu"])
@pytest.mark.parametrize("fmt", [Format("gptq", 4, 32), Format("awq", 4, 32)], ids=lambda f: f.name)
def test_checkpoint_generates_as_on_the_cpu(
    device: str,
    fmt: Format,
    tmp_path: Path,
    faked: Callable[[str], None],
    portable_cpu: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    qfolder, _ = save_pair(tmp_path, fmt)
    expected = _greedy(qfolder, "cpu")
    faked(device)
    calls = _counting(monkeypatch, "dequantize_wna16")
    assert _greedy(qfolder, device) == expected
    assert calls  # the weights stayed quantized and ran the portable wNa16 matmul


@pytest.mark.parametrize("device", ["gcu", "hpu"])
def test_int8_generates_as_on_the_cpu(
    device: str,
    tmp_path: Path,
    faked: Callable[[str], None],
    portable_cpu: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, ffolder = save_pair(tmp_path, Format("gptq", 4, 32))  # its float twin
    expected = _greedy(ffolder, "cpu", quantization="int8")
    faked(device)
    calls = _counting(monkeypatch, "dequantize_int8")
    assert _greedy(ffolder, device, quantization="int8") == expected
    assert calls


def test_quantized_moe_experts_generate_as_on_the_cpu(
    tmp_path: Path,
    faked: Callable[[str], None],
    portable_cpu: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from model_server.layers.quantization.wna16_moe import WNA16Experts
    from tests.models.test_wna16_moe_checkpoints import save_float, wick_quantize

    float_folder = save_float("mixtral", tmp_path / "float")
    qfolder = wick_quantize(float_folder, tmp_path / "gptq", "--group-size", "32")
    expected = _greedy(qfolder, "cpu")
    faked("gcu")
    calls: list[int] = []
    real = WNA16Experts.expert_linear

    def counted(self: WNA16Experts, *args: object) -> torch.Tensor:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(WNA16Experts, "expert_linear", counted)
    assert _greedy(qfolder, "gcu") == expected
    assert calls  # the experts stayed quantized: the portable experts path ran them
