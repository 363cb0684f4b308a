"""Model-server settings: LLM_* names, OPEA aliases, CLI flags over the environment."""

from __future__ import annotations

import argparse

import pytest

from model_server.entrypoints.cli import build_parser
from model_server.entrypoints.openai.cli_args import add_serve_args, settings_from_args
from model_server.settings import DEFAULT_MODEL_NAME, ServerSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith(("LLM_", "VLLM_")):
            monkeypatch.delenv(name)


def serve_settings(*argv: str) -> ServerSettings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults() -> None:
    s = serve_settings()
    assert (s.host, s.port, s.model, s.model_name) == ("0.0.0.0", 8008, None, DEFAULT_MODEL_NAME)
    assert not s.skip_warmup and s.api_key is None and s.kv_cache_memory is None
    config = s.engine_config()
    assert config.model is None and config.max_num_seqs == 256 and config.block_size == 16


def test_llm_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "LLM_MODEL": "/models/x.gguf",
        "LLM_MODEL_SERVER_PORT": "9001",
        "LLM_SERVED_MODEL_NAME": "x",
        "LLM_DTYPE": "float32",
        "LLM_MAX_MODEL_LEN": "4096",
        "LLM_MAX_NUM_SEQS": "8",
        "LLM_MAX_NUM_BATCHED_TOKENS": "512",
        "LLM_BLOCK_SIZE": "32",
        "LLM_KV_CACHE_MEMORY": "512MiB",
        "LLM_TP_SIZE": "1",
        "LLM_ENABLE_PREFIX_CACHING": "false",
        "LLM_SKIP_WARMUP": "true",
        "LLM_API_KEY": "k",
        "LLM_DEVICE": "cpu",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = serve_settings()
    assert (s.model, s.port, s.model_name, s.dtype) == ("/models/x.gguf", 9001, "x", "float32")
    assert (s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (4096, 8, 512)
    assert s.block_size == 32 and s.kv_cache_memory == 512 * 2**20
    assert not s.enable_prefix_caching and s.skip_warmup and s.api_key_value == "k"


def test_opea_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_VLLM_MODEL_NAME", "mistralai/Mistral-7B-Instruct-v0.1")
    monkeypatch.setenv("LLM_VLLM_PORT", "8010")
    monkeypatch.setenv("VLLM_DTYPE", "bfloat16")
    monkeypatch.setenv("VLLM_MAX_NUM_SEQS", "128")
    monkeypatch.setenv("VLLM_TP_SIZE", "1")
    monkeypatch.setenv("VLLM_SKIP_WARMUP", "true")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")  # GiB, as in OPEA's .env
    s = serve_settings()
    assert s.model == s.model_name == "mistralai/Mistral-7B-Instruct-v0.1"
    assert (s.port, s.dtype, s.max_num_seqs, s.skip_warmup) == (8010, "bfloat16", 128, True)
    assert s.kv_cache_memory == 40 * 2**30


def test_llm_names_win_over_opea_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_VLLM_PORT", "8010")
    monkeypatch.setenv("LLM_MODEL_SERVER_PORT", "8020")
    assert serve_settings().port == 8020


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_MODEL_SERVER_PORT", "8020")
    monkeypatch.setenv("LLM_SKIP_WARMUP", "true")
    monkeypatch.setenv("LLM_MAX_NUM_SEQS", "4")
    s = serve_settings("--port", "9999", "--no-skip-warmup", "--kv-cache-memory", "1GiB")
    assert (s.port, s.skip_warmup, s.kv_cache_memory) == (9999, False, 2**30)
    assert s.max_num_seqs == 4  # not given as a flag: the environment's value stays


def test_tensor_parallel_settings_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TP_SIZE", "2")  # OPEA's name
    monkeypatch.setenv("LLM_DEVICE_IDS", "2,3")
    config = serve_settings().engine_config()
    assert config.tensor_parallel_size == 2 and config.device_ids == [2, 3]
    monkeypatch.setenv("LLM_TP_SIZE", "4")  # LLM_* wins over the alias
    assert serve_settings("--device-ids", "0,1").engine_config().device_ids == [0, 1]
    assert serve_settings().tensor_parallel_size == 4


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_MAX_MODEL_LEN", "")
    monkeypatch.setenv("LLM_MODEL", "")
    s = serve_settings()
    assert s.max_model_len is None and s.model is None


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--tensor-parallel-size", "0"], {}, "--tensor-parallel-size: tensor_parallel_size"),
        ([], {"LLM_DEVICE_IDS": "0,x"}, "device ids must be comma-separated integers"),
        (["--device-ids", "1,1"], {}, "--device-ids: device ids must be distinct"),
        ([], {"LLM_MODEL_SERVER_PORT": "abc"}, "LLM_MODEL_SERVER_PORT"),
        ([], {"LLM_KV_CACHE_MEMORY": "lots"}, "cannot parse memory size"),
        (["--kv-cache-dtype", "fp8"], {}, "kv_cache_dtype 'fp8' is not supported"),
        (["--drain-timeout", "-1"], {}, "drain_timeout must be non-negative"),
    ],
)
def test_bad_settings_are_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict, needle: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="invalid settings") as info:
        serve_settings(*argv)
    assert needle in str(info.value)


def test_serve_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--model", "--host", "--port", "--dtype", "--max-model-len", "--max-num-seqs",
        "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
        "--enable-prefix-caching", "--served-model-name", "--api-key", "--skip-warmup",
        "--drain-timeout", "--tensor-parallel-size", "--device-ids", "LLM_MODEL_SERVER_PORT",
        "LLM_TP_SIZE", "LLM_DEVICE_IDS",
        "VLLM_CPU_KVCACHE_SPACE",
    ):  # fmt: skip
        assert flag in out, flag
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    undocumented = [a.option_strings for a in serve._actions if not a.help]
    assert not undocumented


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        ([], {}, [DEFAULT_MODEL_NAME]),
        (["--model", "/m/x.gguf"], {}, ["/m/x.gguf"]),
        (["--served-model-name", "a"], {}, ["a"]),
        (["--served-model-name", "a", "b", "c"], {}, ["a", "b", "c"]),  # vLLM's spelling
        (["--served-model-name", "a,b"], {}, ["a", "b"]),
        ([], {"LLM_SERVED_MODEL_NAME": "a, b"}, ["a", "b"]),
        ([], {"LLM_SERVED_MODEL_NAME": "a b a"}, ["a", "b"]),  # a repeated name once
        (["--served-model-name", "x"], {"LLM_SERVED_MODEL_NAME": "a,b"}, ["x"]),  # flag wins
    ],
)
def test_served_model_names_are_aliases_the_first_reported(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict, names: list[str]
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = serve_settings(*argv)
    assert s.model_names == names and s.model_name == names[0]


def test_accept_any_model_name_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not serve_settings().accept_any_model_name  # vLLM's 404 stays the default
    assert serve_settings("--accept-any-model-name").accept_any_model_name
    monkeypatch.setenv("LLM_ACCEPT_ANY_MODEL_NAME", "true")
    assert serve_settings().accept_any_model_name
    assert not serve_settings("--no-accept-any-model-name").accept_any_model_name


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--device-ids", "0,1"], {}),
        ([], {"LLM_DEVICE_IDS": "0,1"}),
        (["--device-ids", "0,1,2,3", "-tp", "2"], {}),
    ],
)
def test_more_device_ids_than_ranks_says_to_add_tp(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict
) -> None:
    """It served on the first device alone, silently."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as info:
        serve_settings(*argv)
    message = str(info.value)
    n = len(message.split("--device-ids ")[1].split()[0].split(","))
    assert f"add -tp {n}" in message, message
    assert "\n" not in message


def test_device_ids_matching_the_ranks_are_accepted() -> None:
    assert serve_settings("--device-ids", "2,3", "-tp", "2").engine_config().device_ids == [2, 3]
    assert serve_settings("--device-ids", "1").engine_config().device_ids == [1]


def test_engine_config_refuses_more_device_ids_than_ranks() -> None:
    """generate, bench and worker build EngineConfig from flags without ServerSettings."""
    from model_server.config import EngineConfig

    with pytest.raises(ValueError, match="add -tp 2"):
        EngineConfig(device_ids=[0, 1]).validate()
    EngineConfig(device_ids=[0, 1], tensor_parallel_size=2).validate()
