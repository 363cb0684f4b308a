"""The CPU kernels' settings (settings_spec.py, `everywhere`): each a flag of every engine command
and its old WICK_* variable, read by every command; the per-model ones reach the platform as
`KernelOptions` (resolved once per engine), the process ones are exported to their variables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_server.config import EngineConfig, KernelOptions
from model_server.entrypoints.cli import build_parser
from model_server.entrypoints.openai.cli_args import settings_from_args
from model_server.kernels.cpu import isa
from model_server.settings_spec import (
    PROCESS_SETTINGS,
    SETTINGS_BY_NAME,
    export_process_settings,
    resolve_setting,
    settings_of,
)

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SETTINGS = [s for s in settings_of("engine") if s.everywhere]
VARIABLES = [s.env_names[0] for s in KERNEL_SETTINGS]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith(("LLM_", "VLLM_")) or name in VARIABLES:
            monkeypatch.delenv(name)


def test_the_eight_settings_keep_their_variables() -> None:
    assert {s.name: s.env_names for s in KERNEL_SETTINGS} == {
        "cpu_linear_tuning": ("WICK_CPU_LINEAR_TUNING",),
        "cpu_linear_tuning_budget": ("WICK_CPU_LINEAR_TUNING_BUDGET_S",),
        "cpu_auto_dtype": ("WICK_CPU_AUTO_DTYPE",),
        "gguf_int8_dot": ("WICK_GGUF_INT8_DOT",),
        "cpu_isa": ("WICK_CPU_ISA",),
        "cpu_flags": ("WICK_CPU_FLAGS",),
        "cache_dir": ("WICK_CACHE_DIR",),
        "gguf_weight_cache": ("WICK_NO_GGUF_CACHE",),
    }
    # None: "not given" (the variable decides), under every command and in EngineConfig.
    assert all(s.default is None for s in KERNEL_SETTINGS)
    assert set(PROCESS_SETTINGS) <= {s.name for s in KERNEL_SETTINGS}
    assert SETTINGS_BY_NAME["cpu_isa"].choices == ("auto", *isa.ISA_NAMES)


FLAGS = [
    (["--cpu-linear-tuning"], "cpu_linear_tuning", True),
    (["--no-cpu-linear-tuning"], "cpu_linear_tuning", False),
    (["--cpu-linear-tuning-budget", "2.5"], "cpu_linear_tuning_budget", 2.5),
    (["--cpu-auto-dtype", "float32"], "cpu_auto_dtype", "float32"),
    (["--cpu-auto-dtype", "bfloat16"], "cpu_auto_dtype", "bfloat16"),
    (["--gguf-int8-dot", "off"], "gguf_int8_dot", "off"),
    (["--cpu-isa", "avx2"], "cpu_isa", "avx2"),
    (["--cpu-flags", "avx2 fma f16c"], "cpu_flags", "avx2 fma f16c"),
    (["--cache-dir", "/tmp/w"], "cache_dir", "/tmp/w"),
    (["--no-gguf-weight-cache"], "gguf_weight_cache", False),
]


@pytest.mark.parametrize(("argv", "name", "expected"), FLAGS)
def test_each_flag_parses_under_generate_and_serve(argv: list[str], name: str, expected) -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "hi", *argv])
    assert getattr(args, name) == expected
    assert getattr(EngineConfig.from_attrs(args), name) == expected
    serve = settings_from_args(parser.parse_args(["serve", *argv]))
    assert getattr(serve, name) == expected
    assert getattr(serve.engine_config(), name) == expected


@pytest.mark.parametrize(
    ("variable", "text", "name", "expected"),
    [
        ("WICK_CPU_LINEAR_TUNING", "0", "cpu_linear_tuning", False),
        ("WICK_CPU_LINEAR_TUNING", "off", "cpu_linear_tuning", False),
        ("WICK_CPU_LINEAR_TUNING", "1", "cpu_linear_tuning", True),
        ("WICK_CPU_LINEAR_TUNING_BUDGET_S", "3", "cpu_linear_tuning_budget", 3.0),
        ("WICK_CPU_AUTO_DTYPE", "fp32", "cpu_auto_dtype", "float32"),
        ("WICK_GGUF_INT8_DOT", "1", "gguf_int8_dot", "on"),
        ("WICK_CPU_ISA", "generic", "cpu_isa", "generic"),
        ("WICK_CPU_FLAGS", "sse2 avx2", "cpu_flags", "sse2 avx2"),
        ("WICK_CACHE_DIR", "/var/cache/w", "cache_dir", "/var/cache/w"),
        ("WICK_NO_GGUF_CACHE", "1", "gguf_weight_cache", False),  # negated: 1 is off
        ("WICK_NO_GGUF_CACHE", "0", "gguf_weight_cache", True),
    ],
)
def test_the_variable_sets_it_for_every_command(
    monkeypatch: pytest.MonkeyPatch, variable: str, text: str, name: str, expected
) -> None:
    monkeypatch.setenv(variable, text)
    # serve: through the settings layer, as every LLM_* variable.
    assert getattr(settings_from_args(build_parser().parse_args(["serve"])), name) == expected
    # generate, worker, bench and LLM(...): the flag is unset (None), the variable decides.
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert getattr(args, name) is None
    assert resolve_setting(name, getattr(args, name)) == expected


def test_a_flag_wins_over_the_variable_and_unset_is_the_declared_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KernelOptions.resolve(EngineConfig()) == KernelOptions(True, 10.0, "measure", "auto")
    monkeypatch.setenv("WICK_CPU_LINEAR_TUNING", "0")
    monkeypatch.setenv("WICK_GGUF_INT8_DOT", "on")
    options = KernelOptions.resolve(EngineConfig(cpu_linear_tuning=True))
    assert options.linear_tuning and options.gguf_int8_dot == "on"
    assert KernelOptions.resolve() == KernelOptions(False, 10.0, "measure", "on")


@pytest.mark.parametrize(
    ("variable", "text", "needle"),
    [
        ("WICK_CPU_LINEAR_TUNING", "maybe", "cpu_linear_tuning"),
        ("WICK_CPU_LINEAR_TUNING_BUDGET_S", "-1", "cpu_linear_tuning_budget"),
        ("WICK_CPU_LINEAR_TUNING_BUDGET_S", "soon", "cpu_linear_tuning_budget"),
        ("WICK_CPU_AUTO_DTYPE", "float16", "cpu_auto_dtype"),
        ("WICK_GGUF_INT8_DOT", "sometimes", "gguf_int8_dot"),
        ("WICK_CPU_ISA", "sse9", "cpu_isa"),
        ("WICK_NO_GGUF_CACHE", "perhaps", "gguf_weight_cache"),
    ],
)
def test_a_bad_variable_is_a_clear_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, text: str, needle: str
) -> None:
    monkeypatch.setenv(variable, text)
    flag = SETTINGS_BY_NAME[needle].flag
    with pytest.raises(ValueError, match="invalid settings") as serve:
        settings_from_args(build_parser().parse_args(["serve"]))
    assert f"{variable}={text!r} ({flag})" in str(serve.value)
    assert str(serve.value).count(variable) == 1, serve.value
    with pytest.raises(ValueError) as other:  # generate, LLM(...): when the engine validates
        resolve_setting(needle)
    assert f"{variable}={text!r} ({flag})" in str(other.value)
    if needle not in PROCESS_SETTINGS:
        with pytest.raises(ValueError, match=variable):
            EngineConfig().validate()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--cpu-auto-dtype", "float16"], "--cpu-auto-dtype"),
        (["--gguf-int8-dot", "maybe"], "--gguf-int8-dot"),
        (["--cpu-isa", "sse9"], "--cpu-isa"),
        (["--cpu-linear-tuning-budget", "soon"], "--cpu-linear-tuning-budget"),
    ],
)
def test_a_bad_flag_is_an_error_naming_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", *argv])
    assert needle in capsys.readouterr().err


def test_bad_values_given_in_code_are_errors_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="cpu_auto_dtype"):
        EngineConfig(cpu_auto_dtype="float16").validate()
    with pytest.raises(ValueError, match="cpu_linear_tuning_budget"):
        EngineConfig(cpu_linear_tuning_budget=-2.0).validate()


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_them_with_their_variables(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    with pytest.raises(SystemExit):
        build_parser(command).parse_args([command, "--help"])
    out = capsys.readouterr().out
    for s in KERNEL_SETTINGS:
        assert s.flag in out and s.env_names[0] in out, s.name
    for negated in ("--no-cpu-linear-tuning", "--no-gguf-weight-cache"):
        assert negated in out
    # --dtype says what auto does on a CPU.
    assert "avx512_bf16 or AMX" in " ".join(out.split())


def test_the_configuration_doc_lists_them() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for s in KERNEL_SETTINGS:
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{s.flag}`"))
        assert f"`{s.env_names[0]}`" in row


def test_process_settings_given_are_exported_to_their_variables(tmp_path: Path) -> None:
    given = ["--cpu-isa", "avx2", "--cache-dir", str(tmp_path), "--no-gguf-weight-cache"]
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", *given, "--cpu-flags", "sse2 avx2 fma f16c"]
    )
    env: dict[str, str] = {"WICK_CPU_ISA": "generic"}
    assert (
        export_process_settings(args, env)
        == env
        == {
            "WICK_CPU_ISA": "avx2",  # the flag wins over the variable
            "WICK_CPU_FLAGS": "sse2 avx2 fma f16c",
            "WICK_CACHE_DIR": str(tmp_path),
            "WICK_NO_GGUF_CACHE": "1",  # off
        }
    )
    # Nothing given: nothing written, and the variables already set are checked.
    none = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert export_process_settings(none, {"WICK_CACHE_DIR": "/x"}) == {}
    with pytest.raises(ValueError, match="WICK_CPU_ISA"):
        export_process_settings(none, {"WICK_CPU_ISA": "sse9"})
    assert export_process_settings(EngineConfig(gguf_weight_cache=True), env) == {
        "WICK_NO_GGUF_CACHE": "0"
    }


def test_the_readers_see_the_exported_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from model_server.kernels.cpu import native, tuning_cache
    from model_server.loader import weight_cache

    given = ["--cache-dir", str(tmp_path), "--no-gguf-weight-cache"]
    args = build_parser().parse_args(["serve", *given, "--cpu-flags", "sse2 avx2 fma f16c"])
    for name in PROCESS_SETTINGS:  # restored after the test
        monkeypatch.setenv(SETTINGS_BY_NAME[name].env_names[0], "")
    export_process_settings(args)
    assert tuning_cache.cache_root() == tmp_path == weight_cache.cache_dir()
    assert native._cache_dirs()[0] == tmp_path / "kernels"
    assert weight_cache.cache_file_for(__file__) is None  # --no-gguf-weight-cache
    assert isa.cpu_flags() == frozenset({"sse2", "avx2", "fma", "f16c"})
    monkeypatch.setenv("WICK_CPU_FLAGS", "")  # empty counts as unset: the CPU's own flags
    assert isa.cpu_flags() == isa.read_cpu_flags("/proc/cpuinfo")


# ------------------------------------------------------------------------------------ engines

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def tiny_engine(folder: Path, **options):
    from model_server.engine.llm import LLM

    (folder / "config.json").write_text(json.dumps(TINY))
    return LLM(
        str(folder),
        load_format="dummy",
        device="cpu",
        block_size=8,
        kv_cache_memory=2 * 1024**2,
        max_model_len=64,
        seed=3,
        **options,
    )


def test_no_cpu_linear_tuning_plans_no_weights_and_auto_dtype_float32_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flags reach the model-preparation stage as values: with the variables saying the
    opposite, --no-cpu-linear-tuning plans nothing and --cpu-auto-dtype float32 gives a float32
    model on a CPU with native bf16 (its flags plus AMX's, faked: the ISA choice is the same)."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(
        "WICK_CPU_FLAGS", " ".join(isa.read_cpu_flags("/proc/cpuinfo") | {"amx_bf16"})
    )
    monkeypatch.setenv("WICK_CPU_LINEAR_TUNING", "1")
    monkeypatch.setenv("WICK_CPU_AUTO_DTYPE", "bfloat16")
    llm = tiny_engine(tmp_path, dtype="auto", cpu_linear_tuning=False, cpu_auto_dtype="float32")
    try:
        prepared = llm.engine.core.model_runner.prepared
        assert prepared.linear_plan.weights == {}
        assert prepared.native_step is None and "--no-cpu-linear-tuning" in prepared.native_reason
        assert prepared.resolved.dtype == torch.float32
        assert prepared.resolved.kernel_options == KernelOptions(False, 10.0, "float32", "auto")
        assert "cpu linear tuning off" in prepared.describe()
        assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids  # and it runs
    finally:
        llm.shutdown()
    # Without the pin, auto with tuning off is bf16 on the (faked) native bf16 flags alone.
    from model_server.platforms import get_platform

    options = KernelOptions(False, 10.0, "measure", "auto")
    assert get_platform("cpu").resolve_dtype("auto", [(64, 64, 1)], options) == torch.bfloat16
