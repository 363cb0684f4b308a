"""`--quantization-param-path` (vLLM's per-layer KV cache scales): every K and V row a layer
stores takes the layer's scale. Calibrated here as a quantizer would: the largest per-row scale
each layer used in a run with per-row scales, on the real embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_server.engine.llm import LLM
from model_server.kernels.kv_cache_dtype import QuantizedKVCache
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

_OPTS = {"dtype": "float32", "kv_cache_dtype": "int8", "kv_cache_memory": 32 * 1024**2}
PROMPTS = [[1, 330, 2096, 314, 6553, 28], [1, 4237, 28, 1812, 4219, 30, 3134, 1659, 288, 30, 2]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)


def _write(path: Path, dtype: str, per_rank: list[list[float]]) -> Path:
    factors = {
        str(r): {str(i): s for i, s in enumerate(layers)} for r, layers in enumerate(per_rank)
    }
    path.write_text(
        json.dumps({"model_type": "llama", "kv_cache": {"dtype": dtype, "scaling_factor": factors}})
    )
    return path


def _caches(llm: LLM) -> list[QuantizedKVCache]:
    caches = llm.engine.core.model_runner.kv_caches
    assert all(isinstance(c, QuantizedKVCache) for c in caches)
    return caches


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """(a scales file from a per-row run's largest scale per layer, that run's outputs)."""
    llm = LLM(**_OPTS)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        layer_scales = [float(c.scales.max()) for c in _caches(llm)]
    finally:
        llm.shutdown()
    assert all(s > 0 for s in layer_scales)
    path = _write(tmp_path_factory.mktemp("scales") / "kv.json", "int8", [layer_scales])
    return path, outs


def test_every_stored_row_takes_its_layers_scale(calibrated) -> None:
    path, dynamic = calibrated
    want = json.loads(path.read_text())["kv_cache"]["scaling_factor"]["0"]
    llm = LLM(quantization_param_path=str(path), **_OPTS)
    try:
        runner = llm.engine.core.model_runner
        step = runner.native_step
        runs = []
        for enabled in (True, False):  # the native step and the modules store alike
            runner.native_step = step if enabled else None
            runs.append(llm.generate(PROMPTS, GREEDY))
            for i, cache in enumerate(_caches(llm)):
                assert cache.fixed_scale == want[str(i)]
                used = cache.scales[cache.scales != 0]  # slots this run wrote
                assert used.numel() > 0 and bool((used == want[str(i)]).all()), i
        runner.native_step = step
    finally:
        llm.shutdown()
    native, modules = ([o.outputs[0] for o in outs] for outs in runs)
    assert step is not None
    assert [o.token_ids for o in native] == [o.token_ids for o in modules]
    assert [[lp.logprob for lp in o.logprobs] for o in native] == [
        [lp.logprob for lp in o.logprobs] for o in modules
    ]
    # One int8 scale per layer is coarser than each row's own (the first token's keys set a
    # layer's largest; the first sampled logprob moved by 0.38): the same first tokens, then
    # the texts may part.
    for static, own in zip(native, (o.outputs[0] for o in dynamic), strict=True):
        assert static.token_ids[:2] == own.token_ids[:2]


def test_a_file_that_does_not_fit_the_engine_is_one_clear_error(tmp_path: Path) -> None:
    thirty = [[0.05] * 30]
    fp8 = _write(tmp_path / "fp8.json", "float8_e4m3fn", thirty)
    with pytest.raises(ValueError, match=r"scales are for float8_e4m3fn KV caches; serve with "
                       r"--kv-cache-dtype fp8_e4m3 \(not int8\)"):  # fmt: skip
        LLM(quantization_param_path=str(fp8), **_OPTS)
    two_ranks = _write(tmp_path / "tp2.json", "int8", thirty * 2)
    with pytest.raises(ValueError, match=r"scales for 2 tensor-parallel rank\(s\), but the "
                       r"engine runs 1"):  # fmt: skip
        LLM(quantization_param_path=str(two_ranks), **_OPTS)
    short = _write(tmp_path / "short.json", "int8", [[0.05] * 7])
    with pytest.raises(ValueError, match="scales for 7 layers, but the model has 30"):
        LLM(quantization_param_path=str(short), **_OPTS)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype int8 \(not auto\)"):
        float_cache = {**_OPTS, "kv_cache_dtype": "auto"}
        LLM(quantization_param_path=str(_write(tmp_path / "f.json", "int8", thirty)), **float_cache)
