"""Platforms: the CPU skinny-batch matmul equals F.linear; each platform's kernel table; KV
memory comes back zeroed; every
platform module's contract (descriptions, missing-runtime errors, `auto` selection, device ids,
step hooks) with the vendor runtimes absent or faked."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_server.config import parse_device_ids
from model_server.kernels.cpu import isa, layer_ops
from model_server.kernels.cpu import linear as cpu_linear
from model_server.kernels.cpu.linear import int8_linear, skinny_linear
from model_server.kernels.table import TORCH_KERNELS
from model_server.platforms import (
    AUTO_ORDER,
    Platform,
    PlatformUnavailable,
    get_platform,
    platform_class,
    resolve_device,
)
from model_server.platforms import cpu as cpu_platform


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


@pytest.mark.parametrize("rows", [2, 8, 64])
def test_skinny_linear_in_blocks_of_rows(monkeypatch, rows: int) -> None:
    # Blocks of 5 output rows (of 97, the last one partial) for a "large" matrix.
    monkeypatch.setattr(cpu_linear, "_BLOCK_BYTES", 5 * 48 * 4)
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 48), torch.randn(97, 48), torch.randn(97)
    got = skinny_linear(x, w, b)
    assert got.shape == (rows, 97) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_skinny_linear_single_row_uses_all_threads_split() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x, w = torch.randn(1, 16), torch.randn(10, 16)
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_kernel_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU runs its own matmuls (float and int8: the fixed ones for weights without a plan;
    # the planned ones are the weights' own, see tests/kernels/test_cpu_linear.py) and the
    # native C norms, activation and rotary (tests/kernels/test_cpu_layer_ops.py); the platforms
    # without kernels of their own hand out the portable table.
    # (CUDA's Triton table is tested in tests/kernels/test_fused_ops.py, under the interpreter.)
    monkeypatch.setenv("WICK_CPU_LINEAR_TUNING", "1")
    cpu = get_platform("cpu").kernel_table()
    assert (cpu.linear, cpu.int8_linear) == (skinny_linear, int8_linear)
    native_ops = (cpu.rms_norm, cpu.fused_add_rms_norm, cpu.silu_and_mul, cpu.rotary_embedding)
    assert [op.func for op in native_ops] == [
        layer_ops.rms_norm,
        layer_ops.fused_add_rms_norm,
        layer_ops.silu_and_mul,
        layer_ops.rotary_embedding,
    ]
    assert TORCH_KERNELS.linear is F.linear
    for name in ("gcu", "hpu"):
        assert platform_class(name)().kernel_table() is TORCH_KERNELS
    with pytest.raises(AttributeError):  # frozen: a table cannot be changed under a model
        cpu.linear = F.linear  # type: ignore[misc]


def test_cpu_kv_memory_is_zeroed() -> None:
    platform = get_platform("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        t = platform.allocate_zeros((2, 64, 16, 3, 8), dtype)
        assert t.dtype == dtype and t.shape == (2, 64, 16, 3, 8)
        assert not t.any()


def test_cpu_kv_memory_is_resident_from_the_start() -> None:
    """The whole pool is faulted in at allocation: a lazily faulted pool showed up as resident
    memory creeping up for hours under traffic, as the prefix cache's LRU reached every block."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    t = get_platform("cpu").allocate_zeros((2, 512, 16, 4, 64), torch.bfloat16)  # 8 MiB
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0
    assert sum(b & 1 for b in vec) == pages
    assert not t.any()


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        get_platform("tpu")


# ---------------------------------------------------------------- the platform contract


def _no_runtime(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make `modules` unimportable, as on a machine without the vendor stack."""
    real_find_spec = importlib.util.find_spec
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError

    def find_spec(name: str, *args: object, **kwargs: object):
        if name.split(".")[0] in modules:
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_importing_every_platform_module_does_no_work() -> None:
    code = (
        "import sys\n"
        "from model_server.platforms import DEVICES, platform_class\n"
        "classes = [platform_class(d) for d in DEVICES if d != 'auto']\n"
        "assert not {'torch_gcu', 'habana_frameworks'} & set(sys.modules), sys.modules.keys()\n"
        "print(' '.join(c.__name__ for c in classes))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CpuPlatform", "CudaPlatform", "GcuPlatform", "HpuPlatform"]


@pytest.mark.parametrize(
    ("device", "modules", "needles"),
    [
        ("gcu", ("torch_gcu",), ("device gcu", "torch_gcu", "TopsRider", "TOPS_VISIBLE_DEVICES")),
        ("hpu", ("habana_frameworks",), ("device hpu", "habana_frameworks", "Gaudi")),
    ],
)
def test_missing_runtime_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, device: str, modules: tuple[str, ...], needles: tuple
) -> None:
    _no_runtime(monkeypatch, *modules)
    with pytest.raises(PlatformUnavailable) as info:
        get_platform(device)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    for needle in needles:
        assert needle in message
    assert not platform_class(device).is_available()


def test_missing_cuda_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlatformUnavailable, match=r"no CUDA device is visible.*NVIDIA driver"):
        get_platform("cuda")


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ((), "cpu"),
        (("gcu",), "gcu"),
        (("hpu", "gcu"), "hpu"),
        (("cuda", "hpu", "gcu"), "cuda"),
        (("cuda",), "cuda"),
    ],
)
def test_auto_picks_the_best_device_present(
    monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...], expected: str
) -> None:
    for name in AUTO_ORDER:
        available = name in present
        monkeypatch.setattr(
            platform_class(name), "is_available", classmethod(lambda c, a=available: a)
        )
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu"  # an explicit choice is never second-guessed


def test_auto_on_this_machine_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_runtime(monkeypatch, "torch_gcu", "habana_frameworks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_platform("auto").name == "cpu"


@pytest.mark.parametrize(
    ("device", "backend", "visible_env", "default_dtype"),
    [
        ("cpu", "gloo", None, None),
        ("cuda", "nccl", "CUDA_VISIBLE_DEVICES", None),
        ("gcu", "eccl", "TOPS_VISIBLE_DEVICES", torch.bfloat16),
        ("hpu", "hccl", "HABANA_VISIBLE_MODULES", torch.bfloat16),
    ],
)
def test_platform_descriptions(
    device: str, backend: str, visible_env: str | None, default_dtype: torch.dtype | None
) -> None:
    cls = platform_class(device)
    assert cls.name == cls.device_type == device
    assert cls.dist_backend == backend and cls.visible_devices_env == visible_env
    if default_dtype is not None:  # no runtime needed to answer
        platform = cls.__new__(cls)
        Platform.__init__(platform)
        assert platform.default_dtype() == default_dtype
        assert default_dtype in platform.supported_dtypes()


# /proc/cpuinfo's flags line of three CPUs (abridged): an AVX2 Xeon, a Zen 4 EPYC, a
# Sapphire Rapids Xeon with AMX.
AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
ZEN4_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
AMX_FLAGS = ZEN4_FLAGS + " amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(AVX2_FLAGS, torch.float32), (ZEN4_FLAGS, torch.bfloat16), (AMX_FLAGS, torch.bfloat16)],
    ids=["avx2", "avx512_bf16", "amx"],
)
def test_cpu_auto_dtype_is_bf16_only_with_native_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, expected: torch.dtype
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert isa.read_cpu_flags(str(cpuinfo)) == frozenset(flags.split())
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: frozenset(flags.split()))
    platform = get_platform("cpu")
    assert platform.resolve_dtype("auto") == expected
    assert platform.resolve_dtype("float32") == torch.float32  # a pinned dtype is kept
    assert platform.resolve_dtype("bfloat16") == torch.bfloat16


@pytest.mark.parametrize(
    ("flags", "stored", "expected"),
    [
        (AVX2_FLAGS, "bfloat16", "bfloat16"),
        (AVX2_FLAGS, "float32", "float32"),
        (ZEN4_FLAGS, "bfloat16", "bfloat16"),
        (ZEN4_FLAGS, "float32", "bfloat16"),
    ],
)
def test_faked_cpu_flags_reach_the_engine(
    monkeypatch: pytest.MonkeyPatch, flags: str, stored: str, expected: str
) -> None:
    """WICK_CPU_FLAGS stands in for /proc/cpuinfo (subprocesses inherit it): the engine built
    with `--dtype auto` runs in the dtype those flags and the checkpoint's stored dtype call
    for, whatever this CPU is. bf16 is measured against fp32 with native bf16 whatever the
    checkpoint, and without it only for a checkpoint stored in bf16 (the native panels read its
    weights as they are); the measured winner is pinned to bf16 here
    (tests/kernels/test_cpu_linear.py fakes the measurement both ways)."""
    from model_server.engine.llm import LLM

    monkeypatch.setenv(isa.CPU_FLAGS_ENV, flags)
    monkeypatch.setenv("WICK_CPU_AUTO_DTYPE", "bfloat16")
    assert cpu_platform._cpu_flags() == frozenset(flags.split())
    llm = LLM(
        "smollm2-135m",
        load_format="dummy",
        kv_cache_memory=8 << 20,
        max_model_len=64,
        hf_overrides={"dtype": stored},
    )
    assert str(llm.engine.core.model_runner.dtype) == f"torch.{expected}"
    assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids  # and it runs


def test_cpu_platform_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = get_platform("cpu")
    assert platform.device == torch.device("cpu") and not platform.supports_graphs
    assert platform.default_dtype() in platform.supported_dtypes()
    free, total = platform.mem_get_info()
    assert 0 < free <= total
    platform.synchronize()
    platform.mark_step()
    platform.select_device(1, [0, 1])  # every rank computes on the host
    assert platform.device == torch.device("cpu")
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    try:
        platform.prepare(None, local_world_size=2)  # two ranks share 8 cores
        assert torch.get_num_threads() == 4
        platform.prepare(None, local_world_size=16)
        assert torch.get_num_threads() == 1
        platform.prepare(3, local_world_size=2)  # an explicit count is per rank
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


class _FakeGcu(types.SimpleNamespace):
    pass


@pytest.fixture
def fake_torch_gcu(monkeypatch: pytest.MonkeyPatch) -> _FakeGcu:
    """A stand-in for Enflame's runtime: `torch_gcu` importable, `torch.gcu` a cuda look-alike."""
    calls: list[tuple] = []
    gcu = _FakeGcu(
        calls=calls,
        is_available=lambda: True,
        device_count=lambda: 2,
        set_device=lambda i: calls.append(("set_device", i)),
        synchronize=lambda: calls.append(("synchronize",)),
        mem_get_info=lambda device: (3 * 2**30, 16 * 2**30),
    )
    monkeypatch.setitem(sys.modules, "torch_gcu", types.ModuleType("torch_gcu"))
    # torch_gcu names torch's out-of-tree device slot "gcu"; that can happen once per process
    # and touches nothing else here.
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        torch.utils.rename_privateuse1_backend("gcu")
    monkeypatch.setattr(torch, "gcu", gcu, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: object() if name == "torch_gcu" else real_find_spec(name, *a, **k),
    )
    return gcu


def test_gcu_platform_with_a_runtime(
    fake_torch_gcu: _FakeGcu, monkeypatch: pytest.MonkeyPatch
) -> None:
    from model_server.platforms import gcu

    platform = get_platform("gcu")
    assert platform.device_count() == 2
    platform.select_device(1, None)
    assert platform.device == torch.device("gcu", 1)
    assert ("set_device", 1) in fake_torch_gcu.calls
    assert platform.mem_get_info() == (3 * 2**30, 16 * 2**30)
    assert platform.default_kv_cache_memory(1024) == int(3 * 2**30 * 0.8)
    platform.synchronize()
    assert ("synchronize",) in fake_torch_gcu.calls
    monkeypatch.setattr(gcu, "enflame_triton_available", lambda: False)
    assert platform.default_attention_backend == "torch"
    monkeypatch.setattr(gcu, "enflame_triton_available", lambda: True)
    assert platform.default_attention_backend == "triton"
    with pytest.raises(ValueError, match="gcu device 2 does not exist: 2 visible"):
        platform.select_device(1, [0, 2])


def test_gcu_without_enflame_triton_uses_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_server.platforms import gcu

    gcu.enflame_triton_available.cache_clear()
    _no_runtime(monkeypatch, "triton_gcu")
    try:
        # Stock triton (if any) has no gcu backend.
        assert gcu.enflame_triton_available() is False
    finally:
        gcu.enflame_triton_available.cache_clear()


def test_hpu_marks_a_step_through_htcore(monkeypatch: pytest.MonkeyPatch) -> None:
    marks: list[int] = []
    pkg = types.ModuleType("habana_frameworks")
    torch_pkg = types.ModuleType("habana_frameworks.torch")
    core = types.ModuleType("habana_frameworks.torch.core")
    core.mark_step = lambda: marks.append(1)  # type: ignore[attr-defined]
    hpu = types.ModuleType("habana_frameworks.torch.hpu")
    hpu.is_available = lambda: True  # type: ignore[attr-defined]
    hpu.device_count = lambda: 8  # type: ignore[attr-defined]
    hpu.set_device = lambda i: None  # type: ignore[attr-defined]
    pkg.torch = torch_pkg  # type: ignore[attr-defined]
    torch_pkg.core, torch_pkg.hpu = core, hpu  # type: ignore[attr-defined]
    for name, module in [
        ("habana_frameworks", pkg),
        ("habana_frameworks.torch", torch_pkg),
        ("habana_frameworks.torch.core", core),
        ("habana_frameworks.torch.hpu", hpu),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a, **k: object() if n == "habana_frameworks" else real_find_spec(n, *a, **k),
    )
    platform = get_platform("hpu")
    assert platform.default_dtype() == torch.bfloat16 and platform.dist_backend == "hccl"
    platform.select_device(3, [4, 5, 6, 7])
    assert platform.device == torch.device("hpu", 7)
    platform.mark_step()
    platform.mark_step()
    assert marks == [1, 1]


def test_visible_devices_and_device_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = platform_class("cuda").__new__(platform_class("cuda"))
    Platform.__init__(cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert cuda.visible_device_ids() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda.visible_device_ids() is None
    assert parse_device_ids("0,1") == [0, 1] and parse_device_ids("") is None
    for bad in ("0,a", "1,1", "-1"):
        with pytest.raises(ValueError, match="device ids"):
            parse_device_ids(bad)


def test_no_device_name_branches_outside_platforms() -> None:
    """Nothing outside model_server/platforms branches on a device name (kernels/, which hold
    per-device implementations, and the CUDA-only kernel benchmark excepted)."""
    root = Path(__file__).parents[2] / "model_server"
    pattern = re.compile(r"""(device\w*|\.type)\s*(==|!=|\bin\b)\s*\(?\s*["'](cuda|cpu|gcu|hpu)""")
    offenders = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in root.rglob("*.py")
        if not {"platforms", "kernels"} & set(path.relative_to(root).parts)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders
