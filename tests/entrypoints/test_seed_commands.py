"""The seeds' `serve` command lines as their READMEs spell them (../shared/seeds/), parsed by
`serve` into Wick's settings without loading a model; the positional model type checked against
the model; the server-wide sampling defaults and --generation-config applied to requests."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_server.entrypoints.cli import build_parser
from model_server.entrypoints.openai.cli_args import settings_from_args
from model_server.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from model_server.entrypoints.openai.sampling_defaults import (
    SamplingDefaults,
    generation_config_defaults,
    resolve_sampling_defaults,
)
from model_server.entrypoints.seed_flags import check_model_type
from model_server.loader.model_info import model_architectures
from model_server.settings import ServerSettings
from tests.entrypoints.conftest import TINY_CONFIG

MIB = 1024**2
CHUNKED = "enable_chunked_prefill"


def serve(line: str) -> tuple[Any, ServerSettings]:
    """`line` after the seed's launcher (`cargo run ... --`, `python3 -m vllm...api_server`)."""
    args = build_parser().parse_args(["serve", *shlex.split(line)])
    return args, settings_from_args(args)


# (seed, the line as its README writes it after the launcher, what Wick's settings become)
SEED_LINES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "candle-vllm",
        "--port 2000 --weight-path /home/llama2_7b/ llama",
        {"port": 2000, "model": "/home/llama2_7b/", "model_type": "llama"},
    ),
    (
        "candle-vllm",
        "--port 2000 --model-id meta-llama/Llama-2-7b-chat-hf llama",
        {"model": "meta-llama/Llama-2-7b-chat-hf", "model_type": "llama"},
    ),
    (
        "candle-vllm",
        "--port 2000 --weight-path /home/Meta-Llama-3.1-8B-Instruct/ llama3",
        {"model": "/home/Meta-Llama-3.1-8B-Instruct/", "model_type": "llama3"},
    ),
    (
        "candle-vllm",
        "--port 2000 --weight-path /home/mistral_7b/ mistral --repeat-last-n 64 --penalty 1.1 "
        "--temperature 0.7",
        {
            "model_type": "mistral",
            "repeat_last_n": 64,
            "repetition_penalty": 1.1,
            "temperature": 0.7,
        },
    ),
    (
        "candle-vllm-gcu",
        "--port 2000 --dtype bf16 --weight-path /home/weights/Meta-Llama-3.1-8B-Instruct/ llama3 "
        "--temperature 0. --penalty 1.",
        {"dtype": "bf16", "temperature": 0.0, "repetition_penalty": 1.0, "model_type": "llama3"},
    ),
    (
        "candle-vllm-gcu",
        "--log --dtype bf16 --p 2000 --d 0,1 --mem 8192 --w /home/weights/QwQ-32B/",
        {
            "access_log": True,
            "log_level": "info",
            "port": 2000,
            "device_ids": "0,1",
            "tensor_parallel_size": 2,  # candle shards over every id
            "kv_cache_memory": 8192 * MIB,  # MiB, candle's unit
            "model": "/home/weights/QwQ-32B/",
        },
    ),
    (
        "candle-vllm-gcu",
        "--p 2000 --w /home/DeepSeek-R1-Distill-Llama-8B/",
        {"port": 2000, "model": "/home/DeepSeek-R1-Distill-Llama-8B/", "model_type": None},
    ),
    (
        "candle-vllm-gcu",
        "--p 2000 --d 0,1 --weight-path /path/to/model",
        {"device_ids": "0,1", "tensor_parallel_size": 2, "model": "/path/to/model"},
    ),
    (
        "vLLM-GCU",
        "--model DIR --tensor-parallel-size 2 --max-model-len 32768 --disable-log-requests "
        "--block-size=64 --dtype=float16 --device gcu --trust-remote-code",
        {
            "model": "DIR",
            "tensor_parallel_size": 2,
            "max_model_len": 32768,
            "access_log": False,
            "block_size": 64,
            "dtype": "float16",
            "device": "gcu",
        },
    ),
]


@pytest.mark.parametrize(("seed", "line", "expected"), SEED_LINES, ids=[s for s, *_ in SEED_LINES])
def test_seed_serve_line_parses_into_the_settings(
    seed: str, line: str, expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LLM_ACCESS_LOG", "LLM_LOG_LEVEL", "LLM_TP_SIZE", "LLM_MODEL_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args, settings = serve(line)
    for name, value in expected.items():
        got = args.model_type if name == "model_type" else getattr(settings, name)
        assert got == value, (seed, name)


def test_trust_remote_code_is_accepted_and_said_once() -> None:
    args, _ = serve("--model DIR --trust-remote-code")
    notes = [n for n in args.startup_notes if "--trust-remote-code" in n]
    assert len(notes) == 1 and "never runs" in notes[0]


@pytest.mark.parametrize(
    "line",
    [
        "llama3 --w /m --temperature 0.5",  # first, as `vllm serve MODEL` users write it
        "--w /m llama3 --temperature 0.5",  # in the middle, as candle-vllm's README
        "--w /m --temperature 0.5 llama3",  # last
        "--w /m --temperature 0.5 --served-model-name a b -- llama3",  # after the names
        "llama3 --served-model-name a b --w /m --temperature 0.5",
    ],
)
def test_positional_model_type_in_any_position(line: str) -> None:
    args, settings = serve(line)
    assert args.model_type == "llama3" and settings.model == "/m"
    assert settings.temperature == 0.5


def test_model_type_swallowed_by_served_model_name_is_noted() -> None:
    args, settings = serve("--w /m --served-model-name a llama3")
    assert args.model_type is None and settings.model_names == ["a", "llama3"]
    assert any("before --served-model-name" in n for n in args.startup_notes)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("--f model.Q4_K_M.gguf --w /models/", "/models/model.Q4_K_M.gguf"),
        ("--f /abs/m.gguf --w /models/", "/abs/m.gguf"),
        ("--f m.gguf", "m.gguf"),
    ],
)
def test_gguf_file_is_taken_in_the_weight_path(line: str, expected: str) -> None:
    assert serve(line)[1].model == expected


@pytest.mark.parametrize(
    ("line", "settings"),
    [
        ("--prefill-chunk-size 1024", {"max_num_batched_tokens": 1024, CHUNKED: True}),
        ("--prefill-chunk-size 0", {CHUNKED: False, "max_num_batched_tokens": None}),
        ("--mem 8GiB", {"kv_cache_memory": 8 << 30}),
        ("--mem 512", {"kv_cache_memory": 512 * MIB}),
        ("--d 0,1 -tp 2", {"tensor_parallel_size": 2}),
        ("--max-gen-tokens 64", {"max_tokens": 64}),
    ],
)  # fmt: skip
def test_alias_values(line: str, settings: dict[str, Any]) -> None:
    got = serve(line)[1]
    for name, value in settings.items():
        assert getattr(got, name) == value, name


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("--w /a --model /b", "disagree"),
        ("--w /a --m owner/b", "two models"),
        ("--mem lots", "--mem: cannot parse"),
        ("--prefill-chunk-size -5", "non-negative"),
        ("--temperature -1", "temperature must be at least 0"),
        ("--top-p 0", "top_p must be in (0, 1]"),
        ("--penalty 0", "repetition_penalty must be positive"),
        ("--repeat-last-n -2", "repeat_last_n must be at least 0"),
    ],
)
def test_bad_alias_or_default_is_one_clear_error(line: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        serve(line)
    assert needle in str(exc.value)


# ------------------------------------------------------------------ model type vs the model


def hf_folder(path: Path, architecture: str, generation: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, "architectures": [architecture]}
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_model_type_matching_the_architecture_is_accepted(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "llama", "LlamaForCausalLM")
    archs = model_architectures(str(folder))
    assert archs == ["LlamaForCausalLM"]
    for model_type in ("llama", "llama3", "yi"):
        check_model_type(model_type, archs)
    with pytest.raises(ValueError, match="does not match the model, which is LlamaForCausalLM"):
        check_model_type("qwen3", archs)


def test_dummy_preset_architecture() -> None:
    assert model_architectures("qwen3-0.6b", "dummy") == ["Qwen3ForCausalLM"]


@pytest.mark.slow
def test_wrong_model_type_exits_with_one_error_line(tmp_path: Path) -> None:
    """Refused before the model loads: exit 1 (the serve CLI's code for a bad setting)."""
    from tests.loopback import free_port

    folder = hf_folder(tmp_path / "m", "LlamaForCausalLM")
    proc = subprocess.run(
        [sys.executable, "-m", "model_server", "serve", "--p", str(free_port()),
         "--w", str(folder), "qwen3", "--temperature", "0."],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model type 'qwen3'"), proc.stderr
    assert "LlamaForCausalLM" in lines[0]


# ------------------------------------------------------------- sampling defaults, generation config

GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7,
              "repetition_penalty": 1.05, "do_sample": True, "eos_token_id": 2}  # fmt: skip


def test_generation_config_auto_reads_the_models_folder(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "m", "LlamaForCausalLM", GENERATION)
    found, path = generation_config_defaults("auto", str(folder))
    assert path == str(folder / "generation_config.json")
    assert found == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7,
                     "repetition_penalty": 1.05}  # fmt: skip
    assert generation_config_defaults("none", str(folder)) == ({}, None)
    other = hf_folder(tmp_path / "other", "LlamaForCausalLM", {"temperature": 0.3})
    assert generation_config_defaults(str(other), str(folder))[0] == {"temperature": 0.3}
    with pytest.raises(ValueError, match="no such folder"):
        generation_config_defaults(str(tmp_path / "missing"), str(folder))


def test_out_of_range_generation_config_fields_are_dropped(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "m", "LlamaForCausalLM", {"top_p": 0.0, "temperature": 0.2})
    assert generation_config_defaults("auto", str(folder))[0] == {"temperature": 0.2}


def test_defaults_apply_where_the_request_leaves_a_field_unset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = hf_folder(tmp_path / "m", "LlamaForCausalLM", GENERATION)
    settings = ServerSettings(model=str(folder), top_k=5, repeat_last_n=64)  # flags win
    with caplog.at_level("INFO"):
        defaults = resolve_sampling_defaults(settings)
    assert defaults == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=5, repetition_penalty=1.05, max_tokens=7,
        repeat_last_n=64,
    )  # fmt: skip
    assert "generation_config.json: sampling defaults temperature=0.6" in caplog.text
    assert "top_k=20" not in caplog.text  # the flag's 5 applies, not the file's 20

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = chat.to_sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.95, 5, 1.05, 7,
    )  # fmt: skip
    assert p.repeat_last_n == 64
    own = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.0, top_p=0.5, top_k=3, repetition_penalty=1.2, max_tokens=30,
    )  # fmt: skip
    p = own.to_sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (
        0.0, 0.5, 3, 1.2, 30,
    )  # fmt: skip
    # Completions: OpenAI's 16 only without any default; an explicit value always wins.
    assert CompletionRequest(prompt="x").to_sampling_params(defaults).max_tokens == 7
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=3).to_sampling_params(defaults).max_tokens == 3
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params(
        SamplingDefaults()
    ).max_tokens is None  # fmt: skip


@pytest.mark.slow
def test_server_applies_generation_config_and_request_fields_win(
    tiny_config: Path, tmp_path: Path
) -> None:
    """Through HTTP to a real engine: what the engine receives for each request."""
    from model_server.engine.async_engine import AsyncLLM
    from model_server.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import MODEL_NAME, AppClient, tiny_settings

    folder = hf_folder(tmp_path / "gen", "LlamaForCausalLM", GENERATION)
    settings = tiny_settings(tiny_config, generation_config=str(folder), repetition_penalty=1.3)
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    seen: list[Any] = []
    generate = llm.generate

    def spy(prompt: Any, params: Any, request_id: str) -> Any:
        seen.append(params)
        return generate(prompt, params, request_id)

    llm.generate = spy  # type: ignore[method-assign]
    client = AppClient(build_app(llm, settings, resolve_sampling_defaults(settings)))
    try:
        client.call(llm.wait_until_ready(60))
        body = {"model": MODEL_NAME, "prompt": "hello", "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 7  # max_new_tokens
        r = client.post("/v1/completions", json={**body, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        client.close()
    first, second = seen
    assert (first.temperature, first.top_p, first.top_k) == (0.6, 0.95, 20)
    assert first.repetition_penalty == 1.3  # the server's flag over the file's 1.05
    assert (second.temperature, second.max_tokens, second.top_p) == (0.0, 2, 0.95)


def test_candle_quant_maps_onto_quantization() -> None:
    line = "--w /home/Llama-GPTQ/ llama3 --temperature 0. --penalty 1. --quant gptq"
    assert serve(line)[1].quantization == "gptq"
    assert serve("--w /m llama3 --quant q8_0")[1].quantization == "int8"
    with pytest.raises(ValueError, match="'q4k' is not supported"):
        serve("--w /m --quant q4k")


@pytest.mark.slow
def test_conflicting_quantization_exits_with_one_error_line(tmp_path: Path) -> None:
    """vLLM-GCU's `--quantization awq` on a GPTQ checkpoint: refused before the weights load."""
    from tests.loopback import free_port

    folder = hf_folder(tmp_path / "gptq", "LlamaForCausalLM")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                     "desc_act": False, "sym": True}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "model_server", "serve", "--port", str(free_port()),
         "--model", str(folder), "--load-format", "dummy", "--quantization", "awq",
         "--skip-warmup", "--log-level", "warning", "--kv-cache-memory", "8MiB"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if " ERROR " in ln or ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "--quantization awq does not match the model, a gptq w4 g32 checkpoint" in errors[0]


@pytest.mark.slow
def test_candle_line_serves_with_its_sampling_defaults(tmp_path: Path) -> None:
    """candle-vllm's README line (`--weight-path DIR mistral --repeat-last-n 64 --penalty 1.1
    --temperature 0.7`, Llama-layout weights so `llama`) as a real server on a loopback port."""
    import time

    import httpx

    from tests.loopback import free_port

    folder = hf_folder(tmp_path / "llama2_7b", "LlamaForCausalLM", {"top_k": 40})
    port = free_port()
    line = (f"--p {port} --weight-path {folder}/ llama --repeat-last-n 64 --penalty 1.1 "
            "--temperature 0.7 --mem 16 --load-format dummy --skip-warmup --max-model-len 256 "
            "--host 127.0.0.1 --num-threads 1")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "model_server", "serve", *shlex.split(line)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.5)
        body = {"model": f"{folder}/", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "sampling defaults top_k=40" in stderr  # from generation_config.json
    assert (
        "sampling defaults for requests that leave them unset: temperature=0.7, top_k=40, "
        "repetition_penalty=1.1, repeat_last_n=64"
    ) in stderr


# ------------------------------------------------- vLLM-GCU's --quantization-param-path

# vLLM's QuantParamSchema, as AMMO's quantizer writes it: per TP rank, per layer, one scale.
KV_SCALES = {
    "model_type": "llama",
    "kv_cache": {
        "dtype": "float8_e4m3fn",
        "scaling_factor": {"0": {"0": 0.0408, "1": 0.0503}, "1": {"0": 0.0391, "1": 0.0488}},
    },
}


def _scales_file(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "kv_cache_scales.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_kv_cache_scales_file_is_read_strictly(tmp_path: Path) -> None:
    from model_server.settings_spec import read_kv_cache_scales

    dtype, scales = read_kv_cache_scales(str(_scales_file(tmp_path, KV_SCALES)))
    assert dtype == "float8_e4m3fn" and scales[1] == {0: 0.0391, 1: 0.0488}
    int8 = {"kv_cache": {**KV_SCALES["kv_cache"], "dtype": "int8"}}
    assert read_kv_cache_scales(str(_scales_file(tmp_path, int8)))[0] == "int8"
    kv = KV_SCALES["kv_cache"]
    for data, needle in [
        ("{", "not valid JSON"),
        ([1], "the top level is not an object"),
        ({**KV_SCALES, "extra": 1}, "unknown field 'extra'"),
        ({"model_type": 3, "kv_cache": kv}, "model_type is not a string"),
        ({"model_type": "llama"}, "no kv_cache object"),
        ({"kv_cache": {**kv, "dtype": "fp16"}}, "kv_cache.dtype is 'fp16', not one of"),
        ({"kv_cache": {**kv, "scaling_factor": {}}}, "not a non-empty object of TP ranks"),
        ({"kv_cache": {**kv, "scaling_factor": {"a": {"0": 1.0}}}}, "TP rank 'a'"),
        ({"kv_cache": {**kv, "scaling_factor": {"0": {"0": -1}}}}, "0.0 is -1, not a positive"),
        ({"kv_cache": {**kv, "scaling_factor": {"0": {"0": "x"}}}}, "not a positive number"),
        ({"kv_cache": {**kv, "scaling_factor": {"0": {"1": 1.0}}}}, "layers are not 0..0"),
        ({"kv_cache": {**kv, "scaling_factor": {"1": {"0": 1.0}}}}, "TP ranks are not 0..0"),
        (
            {"kv_cache": {**kv, "scaling_factor": {"0": {"0": 1.0}, "1": {"0": 1, "1": 1}}}},
            "different numbers of layers",
        ),
    ]:
        path = _scales_file(tmp_path, data)
        with pytest.raises(ValueError) as exc:
            read_kv_cache_scales(str(path))
        assert needle in str(exc.value) and str(path) in str(exc.value), (data, str(exc.value))
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="cannot read the file"):
        read_kv_cache_scales(str(tmp_path / "missing.json"))


def test_quantization_param_path_flag_reads_the_file_while_parsing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A valid file is taken (the engine checks it against the cache dtype, ranks and layers);
    a malformed one ends `serve` with one `error:` line and exit 2."""
    good = _scales_file(tmp_path, KV_SCALES)
    _, settings = serve(f"--model DIR --kv-cache-dtype fp8_e4m3 --quantization-param-path {good}")
    assert settings.quantization_param_path == str(good)
    assert settings.engine_config().quantization_param_path == str(good)
    bad = _scales_file(tmp_path, "[")
    with pytest.raises(SystemExit) as done:
        serve(f"--quantization-param-path={bad}")
    assert done.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: --quantization-param-path: {bad}: not valid JSON (")


def test_quantization_param_path_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _scales_file(tmp_path, KV_SCALES)
    monkeypatch.setenv("LLM_QUANTIZATION_PARAM_PATH", str(good))
    assert serve("--model DIR")[1].quantization_param_path == str(good)
    monkeypatch.setenv("LLM_QUANTIZATION_PARAM_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"LLM_QUANTIZATION_PARAM_PATH: .*cannot read the file"):
        serve("--model DIR")
    monkeypatch.setenv("LLM_QUANTIZATION_PARAM_PATH", "")
    assert serve("--model DIR")[1].quantization_param_path is None


def test_quantization_param_path_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = {"kv_cache": {**KV_SCALES["kv_cache"], "scaling_factor": {"0": {"0": 0}}}}
    proc = subprocess.run(
        [sys.executable, "-m", "model_server", "serve", "--model", "DIR",
         "--quantization-param-path", str(_scales_file(tmp_path, bad))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "0.0 is 0, not a positive number" in lines[0], proc.stderr
