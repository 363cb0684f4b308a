"""LoRA pieces on their own: the flags, PEFT folders refused with their reason, the scheduler's
--max-loras admission, the prefix cache keyed by adapter, and vLLM's lora_requests_info gauge."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from model_server.config import EngineConfig
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.request import Request
from model_server.engine.core.scheduler import Scheduler, SchedulerConfig
from model_server.engine.stats import LoRAStats, SchedulerStats
from model_server.lora.config import LoRAConfig
from model_server.lora.peft import check_adapter_config, scaling_of
from model_server.lora.request import LoRARequest
from model_server.metrics import EngineMetrics
from model_server.sampling_params import SamplingParams
from model_server.settings_spec import parse_lora_modules

A1 = LoRARequest("a1", 1, "/a1")
A2 = LoRARequest("a2", 2, "/a2")
A3 = LoRARequest("a3", 3, "/a3")


# ---- flags --------------------------------------------------------------------------------


def test_lora_modules_take_name_path_and_vllm_json() -> None:
    text = parse_lora_modules(
        ["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}', "c=/p/c d=/p/d"]
    )
    assert parse_lora_modules(text) == text  # the canonical text reads back as itself
    config = LoRAConfig.from_engine_config(EngineConfig(enable_lora=True, lora_modules=text))
    assert config is not None
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in config.static_requests()] == [
        ("a", 1, "/p/a"),
        ("b", 2, "/p/b"),
        ("c", 3, "/p/c"),
        ("d", 4, "/p/d"),
    ]
    assert config.static_requests()[1].base_model_name == "m"
    assert config.max_cpu_loras == 1  # --max-loras' default


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a", "not name=path"),
        ("a=/x a=/y", "more than once"),
        ('{"name": "a"}', "non-empty name and path"),
        ('{"name": "a", "path": "/x", "rank": 8}', "unknown field"),
    ],
)
def test_bad_lora_modules_are_refused(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_lora_modules(value)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lora_modules": '[{"name":"a","path":"/a","base_model_name":null}]'}, "--enable-lora"),
        ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
        ({"enable_lora": True, "tensor_parallel_size": 2, "device_ids": None}, "one rank"),
        (
            {"enable_lora": True, "kv_events_config": '{"enable_kv_cache_events": true}'},
            "kv-events-config",
        ),
    ],
)
def test_lora_flags_that_cannot_be_honoured_are_refused(options: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        EngineConfig(**options).validate()


def test_max_lora_rank_takes_vllms_values() -> None:
    from model_server.settings import ServerSettings

    assert ServerSettings(max_lora_rank=64).max_lora_rank == 64
    with pytest.raises(ValueError, match="max_lora_rank"):
        ServerSettings(max_lora_rank=12)


# ---- PEFT configs ---------------------------------------------------------------------------

GOOD = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target module 'lm_head'"),
        ({"target_modules": ["embed_tokens"]}, "target module 'embed_tokens'"),
        ({"r": 32}, "above --max-lora-rank 16"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LORA"),
    ],
)
def test_unsupported_peft_configs_are_refused(change: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_adapter_config(A1, {**GOOD, **change}, max_rank=16)
    check_adapter_config(A1, GOOD, max_rank=16)


def test_scaling_is_alpha_over_r_or_over_its_root_with_rslora() -> None:
    assert scaling_of({"r": 16, "lora_alpha": 32}) == 2.0
    assert scaling_of({"r": 16, "lora_alpha": 32, "use_rslora": True}) == 8.0


def test_a_folder_without_an_adapter_config_is_refused(tmp_path: Path) -> None:
    from model_server.lora.peft import read_adapter_config

    with pytest.raises(ValueError, match="no such folder"):
        read_adapter_config(LoRARequest("x", 1, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        read_adapter_config(LoRARequest("x", 1, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="not a JSON object"):
        read_adapter_config(LoRARequest("x", 1, str(tmp_path)))


# ---- scheduler and prefix cache -----------------------------------------------------------


def _request(rid: str, lora: LoRARequest | None, prompt: list[int], t: float) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), arrival_time=t, lora_request=lora)


def test_the_scheduler_runs_at_most_max_loras_adapters() -> None:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=True,
        block_size=4,
        speculative=None,
        max_loras=2,
    )
    scheduler = Scheduler(config, KVCacheManager(64, 4, enable_prefix_caching=False))
    loras = [A1, A2, A3, None, A1]
    for i, lora in enumerate(loras):
        scheduler.add_request(_request(f"r{i}", lora, [10 * i + k for k in range(5)], float(i)))
    out = scheduler.schedule()
    # a3's request waits (two adapters hold the slots); the base one and a1's second do not.
    assert [r.request_id for r in out.scheduled_requests] == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    assert scheduler.lora_adapter_names() == (("a1", "a2"), ("a3",))


def test_prefix_cache_blocks_are_keyed_by_adapter() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(13))
    first = _request("base", None, prompt, 0.0)
    assert kv.allocate_slots(first, 13)
    kv.cache_blocks(first, 13)
    for lora, expected in ((None, 12), (A1, 0), (LoRARequest("a1", 9, "/a1"), 0)):
        assert kv.get_computed_blocks(_request("x", lora, prompt, 1.0))[1] == expected
    adapter = _request("a1", A1, prompt, 2.0)
    assert kv.allocate_slots(adapter, 13)
    kv.cache_blocks(adapter, 13)
    assert kv.get_computed_blocks(_request("y", A1, prompt, 3.0))[1] == 12
    assert kv.get_computed_blocks(_request("z", A2, prompt, 3.0))[1] == 0
    kv.free(first)
    kv.free(adapter)
    assert kv.num_free_blocks == kv.num_blocks


# ---- metrics --------------------------------------------------------------------------------


def _lora_series(m: EngineMetrics) -> list[tuple[dict[str, str], float]]:
    (family,) = [f for f in m.registry.collect() if f.name == "vllm:lora_requests_info"]
    return [(s.labels, s.value) for s in family.samples]


def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    m = EngineMetrics("m", include_process_metrics=False)
    before = time.time()
    m.record(SchedulerStats(2, 1, lora=LoRAStats(("a1", "a2"), ("a3",), 2)), None)
    ((labels, value),) = _lora_series(m)
    assert labels == {
        "max_lora": "2",
        "waiting_lora_adapters": "a3",
        "running_lora_adapters": "a1,a2",
    }
    assert before <= value <= time.time()
    m.record(SchedulerStats(0, 0, lora=LoRAStats((), (), 2)), None)
    ((labels, _),) = _lora_series(m)  # one series: the latest
    assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""
    text = m.render()[0].decode()
    assert 'vllm:lora_requests_info{max_lora="2"' in text


# ---- bench serve ----------------------------------------------------------------------------


def test_bench_serve_mixes_the_lora_modules_evenly() -> None:
    from model_server.benchmarks.serve import run_serve_benchmark
    from tests.benchmarks.test_bench_serve import _args
    from tests.fake_openai_server import FakeOpenAI, serve

    fake = FakeOpenAI()
    with serve(fake) as url:
        args = _args(
            url,
            *("--num-prompts", "8", "--random-input-len", "3", "--random-output-len", "2"),
            *("--lora-modules", "a", "b", "c", "d", "--ready-check-timeout-sec", "0"),
        )
        assert run_serve_benchmark(args) == 0
    models = [r["model"] for r in fake.requests]
    assert sorted(models) == ["a", "a", "b", "b", "c", "c", "d", "d"]


def test_lora_batch_runs_long_runs_alone_and_masks_the_short_ones() -> None:
    from model_server.kernels.batched_lora_torch import MIN_SEGMENT_ROWS
    from model_server.lora.layers import LoRABatch

    batch = LoRABatch()
    long = MIN_SEGMENT_ROWS
    # Decodes (slots 0, 1, base, 0) first, then a base prefill and two chunks of slots 1 and 2.
    slots = [0, 1, -1, 0] + [-1] * long + [1] * long + [2] * (long + 3)
    batch.set(slots, 3, "cpu")
    assert batch.active and batch.rows is not None
    assert batch.rows.slots.tolist() == slots  # the kernels' per-row slots, on the device
    groups = batch.rows.groups()
    assert groups is batch.rows.groups()  # made once per step
    assert groups.masked == (0, 4)
    assert groups.segments == [(4 + long, 4 + 2 * long, 1), (4 + 2 * long, 7 + 3 * long, 2)]
    assert groups.onehot is not None
    assert groups.onehot.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert groups.mask(2).tolist()[1] == [0, 0, 1, 1, 0, 0]
    batch.set([-1] * 5, 3, "cpu")
    assert not batch.active and batch.rows is None
    batch.native = True  # the native kernel reads the host slots alone
    batch.set(slots, 3, "cpu")
    assert batch.active and batch.rows is None and batch.token_slots is not None


def test_slots_are_reused_least_recently_used_first_and_removed_ones_first(
    tmp_path: Path,
) -> None:
    import torch

    from model_server.engine.llm import LLM
    from model_server.lora.manager import LoRAModelManager
    from tests.lora.helpers import make_adapter, save_base

    save_base(tmp_path / "base", "llama")
    paths = [
        make_adapter(tmp_path / "base", tmp_path / f"a{i}", r=4, alpha=8, seed=i).path
        for i in range(3)
    ]
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True, max_loras=2)
    manager = llm.engine.core.model_runner.lora_manager
    assert isinstance(manager, LoRAModelManager)
    a, b, c = (LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths))
    manager.prepare_batch([(a, 1), (b, 1)])
    assert manager.slots == [1, 2]
    manager.prepare_batch([(b, 1), (None, 3)])
    manager.prepare_batch([(c, 1)])  # a's slot is the least recently used
    assert manager.slots == [3, 2]
    assert manager.remove_adapter(2) and not manager.remove_adapter(99)
    manager.prepare_batch([(a, 1)])  # the removed adapter's slot goes first
    assert manager.slots == [3, 1]
    layer = next(iter(manager.layers.values()))
    assert torch.count_nonzero(layer.lora_a[1]) > 0
    manager.clear_batch()
    llm.shutdown()
