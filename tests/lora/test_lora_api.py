"""LoRA adapters over HTTP on a real loopback server: vLLM's /v1/models cards, the adapter
chosen by the request's `model`, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with
their errors, and no KV block left held after unloading an adapter under load.

The base model is a tiny random Llama written by transformers (float32) with the embedded
SmolLM2 tokenizer beside it; the adapters are PEFT's, random and non-zero, and a completion's
logprobs equal PEFT's merged model in transformers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.openai.api_server import build_app
from model_server.loader.embedded import embedded_model_available, embedded_model_path
from tests.entrypoints.conftest import MODEL_NAME, TINY_CONFIG, tiny_settings
from tests.loopback import serve_asgi
from tests.lora.helpers import Adapter, make_adapter, reference_logprobs

pytest.importorskip("peft")

TOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog because it wants to see"


@dataclass
class Served:
    url: str
    http: httpx.Client
    llm: AsyncLLM
    tokenizer: object
    base: transformers.PreTrainedModel
    adapters: dict[str, Adapter]
    bad: dict[str, Path]


def _base(folder: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = transformers.LlamaConfig(
        **{k: TINY_CONFIG[k] for k in keys},
        num_key_value_heads=2,
        vocab_size=TINY_CONFIG["vocab_size"],
        max_position_embeddings=512,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def _bad_adapters(root: Path, good: Path) -> dict[str, Path]:
    """Folders the server must refuse: no weights, a module the model lacks, DoRA."""
    from safetensors.torch import load_file, save_file

    out: dict[str, Path] = {}
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    out["no_weights"] = no_weights
    # Layer 7 of a two-layer model.
    missing = root / "missing_layer"
    missing.mkdir()
    (missing / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = {
        k.replace("layers.1.", "layers.7."): v
        for k, v in load_file(good / "adapter_model.safetensors").items()
    }
    save_file(tensors, missing / "adapter_model.safetensors")
    out["missing_layer"] = missing
    dora = root / "dora"
    dora.mkdir()
    config = json.loads((good / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (good / "adapter_model.safetensors").read_bytes()
    )
    out["dora"] = dora
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 (its tokenizer) is not installed")
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    root = tmp_path_factory.mktemp("lora-api")
    folder = root / "tiny-llama"
    base = _base(folder)
    tokenizer = gguf_tokenizer(read_gguf(embedded_model_path()))
    tokenizer.save_pretrained(folder)
    adapters = {
        "a1": make_adapter(folder, root / "a1", r=8, alpha=16, seed=1),
        "a2": make_adapter(folder, root / "a2", r=4, alpha=4, targets=["q_proj", "v_proj"], seed=2),
        "a3": make_adapter(folder, root / "a3", r=16, alpha=32, rslora=True, seed=3),
        "r32": make_adapter(folder, root / "r32", r=32, alpha=32, seed=4),
    }
    bad = _bad_adapters(root, adapters["a1"].path)
    settings = tiny_settings(
        folder,
        load_format="auto",
        dtype="float32",
        max_num_batched_tokens=32,
        enable_lora=True,
        lora_modules=[f"a1={adapters['a1'].path}"],
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
        allow_runtime_lora_updating=True,
    )
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        deadline = time.monotonic() + 120
        while h.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)
        yield Served(url, h, llm, tokenizer, base, adapters, bad)


def _complete(served: Served, model: str, max_tokens: int = 4) -> httpx.Response:
    return served.http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
        },
    )


def _check_against(served: Served, body: dict, model: transformers.PreTrainedModel) -> None:
    """The completion's tokens are the model's greedy ones, with its logprobs."""
    prompt_ids = list(served.tokenizer(PROMPT).input_ids)
    choice = body["choices"][0]
    text_ids = list(served.tokenizer(PROMPT + choice["text"]).input_ids)
    first_row = reference_logprobs(model, prompt_ids)[-1]
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(first_row.max().item(), abs=TOL)
    expected = reference_logprobs(model, text_ids)
    got = choice["logprobs"]["token_logprobs"]
    n = len(prompt_ids)
    # Re-tokenizing the text may merge tokens; compare while the ids still line up.
    for j, lp in enumerate(got[: len(text_ids) - n]):
        row = expected[n + j - 1]
        assert lp == pytest.approx(row[text_ids[n + j]].item(), abs=TOL)


def test_models_lists_the_adapters_with_their_parent(served: Served) -> None:
    data = served.http.get("/v1/models").json()["data"]
    assert data[0]["id"] == MODEL_NAME
    cards = {card["id"]: card for card in data}
    a1 = cards["a1"]
    assert a1["parent"] == MODEL_NAME and a1["root"] == str(served.adapters["a1"].path)


def test_the_model_name_chooses_the_adapter(served: Served) -> None:
    resp = _complete(served, "a1")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "a1"
    _check_against(served, body, served.adapters["a1"].merged)
    base = _complete(served, MODEL_NAME).json()
    assert base["model"] == MODEL_NAME
    _check_against(served, base, served.base)
    assert (
        base["choices"][0]["logprobs"]["token_logprobs"][0]
        != body["choices"][0]["logprobs"]["token_logprobs"][0]
    )


def test_an_unknown_model_name_is_404(served: Served) -> None:
    resp = _complete(served, "no-such-adapter")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def _load(served: Served, name: str, path: Path | str) -> httpx.Response:
    return served.http.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
    )


def _unload(served: Served, name: str) -> httpx.Response:
    return served.http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_load_use_and_unload_an_adapter(served: Served) -> None:
    resp = _load(served, "a2", served.adapters["a2"].path)
    assert resp.status_code == 200, resp.text
    assert "a2" in {card["id"] for card in served.http.get("/v1/models").json()["data"]}
    body = _complete(served, "a2").json()
    assert body["model"] == "a2"
    _check_against(served, body, served.adapters["a2"].merged)
    # The same name again, or the base model's name: 400.
    assert _load(served, "a2", served.adapters["a2"].path).status_code == 400
    assert _load(served, MODEL_NAME, served.adapters["a2"].path).status_code == 400
    resp = _unload(served, "a2")
    assert resp.status_code == 200, resp.text
    assert _complete(served, "a2").status_code == 404
    assert "a2" not in {card["id"] for card in served.http.get("/v1/models").json()["data"]}
    assert _unload(served, "a2").status_code == 404
    # Loaded again under the same name: served again (a new id, nothing stale reused).
    assert _load(served, "a2", served.adapters["a2"].path).status_code == 200
    _check_against(served, _complete(served, "a2").json(), served.adapters["a2"].merged)
    assert _unload(served, "a2").status_code == 200


@pytest.mark.parametrize(
    ("which", "words"),
    [
        ("no_such_folder", "no such folder"),
        ("no_weights", "adapter_model.safetensors"),
        ("missing_layer", "target module"),
        ("dora", "DoRA"),
        ("r32", "max-lora-rank"),
    ],
)
def test_bad_adapters_are_400_with_the_reason(served: Served, which: str, words: str) -> None:
    if which == "r32":
        path = served.adapters["r32"].path
    elif which == "no_such_folder":
        path = served.adapters["a1"].path.parent / "nowhere"
    else:
        path = served.bad[which]
    resp = _load(served, f"bad-{which}", path)
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]
    assert _complete(served, f"bad-{which}").status_code == 404


def _in_engine(scheduler, name: str) -> bool:
    try:
        requests = [*scheduler.running, *scheduler.waiting]
    except RuntimeError:  # the engine thread changed a queue meanwhile: look again
        return False
    return any(r.lora_request is not None and r.lora_request.lora_name == name for r in requests)


def test_unloading_under_load_leaves_no_block_held(served: Served) -> None:
    assert _load(served, "a3", served.adapters["a3"].path).status_code == 200
    results: list[int] = []

    def request(model: str) -> None:
        resp = _complete(served, model, max_tokens=64)
        results.append(resp.status_code)

    threads = [
        threading.Thread(target=request, args=(m,))
        for m in ["a3", "a3", "a1", MODEL_NAME, "a3", "a1"]
    ]
    for t in threads:
        t.start()
    # Unload while a3's requests are in the engine (read-only look at the scheduler's queues).
    scheduler = served.llm._engine.scheduler
    deadline = time.monotonic() + 30
    while not _in_engine(scheduler, "a3"):
        assert time.monotonic() < deadline, "a3's requests never reached the engine"
        time.sleep(0.001)
    assert _unload(served, "a3").status_code == 200
    for t in threads:
        t.join(timeout=120)
    # Requests sent before the unload finish with the adapter (200); any sent after it: 404.
    assert set(results) <= {200, 404} and len(results) == len(threads)
    assert results.count(200) >= 3
    engine = served.llm._engine
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kv = engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_runtime_updating_is_off_unless_allowed(tmp_path: Path, served: Served) -> None:
    folder = served.adapters["a1"].path.parent / "tiny-llama"
    settings = tiny_settings(
        folder, load_format="auto", dtype="float32", enable_lora=True, skip_warmup=True
    )
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        resp = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert resp.status_code == 404
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_app(
            AsyncLLM(tiny_settings(folder).engine_config()),
            tiny_settings(folder, allow_runtime_lora_updating=True),
        )
