"""`--hf-overrides`: HF config fields set after the config is read (a dummy preset shrunk to a
few layers for a CPU benchmark), and bad values refused in one line."""

from __future__ import annotations

import pytest

from model_server.config import EngineConfig
from model_server.loader import ModelLoadError, load_model_source
from model_server.settings_spec import parse_hf_overrides


def test_overrides_apply_to_a_dummy_preset() -> None:
    plain = load_model_source("qwen3-30b-a3b", "dummy")
    small = load_model_source("qwen3-30b-a3b", "dummy", hf_overrides='{"num_hidden_layers": 2}')
    assert plain.hf_config.num_hidden_layers == 48
    assert small.hf_config.num_hidden_layers == 2
    assert small.hf_config.num_experts == 128  # everything else as the preset says
    assert EngineConfig(hf_overrides='{"num_hidden_layers": 2}').hf_overrides is not None


@pytest.mark.parametrize(
    ("text", "needle"),
    [("{num_hidden_layers: 2}", "must be a JSON object"), ("[1, 2]", "JSON object of config")],
)
def test_bad_overrides_are_clear_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_hf_overrides(text)
    with pytest.raises(ModelLoadError, match=needle):
        load_model_source("qwen3-0.6b", "dummy", hf_overrides=text)
    assert parse_hf_overrides("") is None and parse_hf_overrides(None) is None
