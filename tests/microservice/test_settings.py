"""Settings: DESIGN.md's environment names, defaults, flags over the environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from microservice.__main__ import FLAGS, SWITCHES, load_settings
from microservice.settings import MicroserviceSettings


def test_defaults() -> None:
    s = MicroserviceSettings()
    assert (s.host, s.port) == ("0.0.0.0", 9000)
    assert s.model_server_endpoint == "http://localhost:8008"
    assert s.connector == "generic" and s.model_name is None
    assert not s.disable_streaming and not s.openai_format_streaming
    assert s.api_key_value is None and s.usvc_api_key_value is None
    assert s.connect_timeout < 2  # a dead model server is reported within 2 s
    assert s.read_timeout == 300 and s.health_cache_seconds == 3


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "LLM_USVC_HOST": "127.0.0.1",
        "LLM_USVC_PORT": "9100",
        "LLM_MODEL_SERVER_ENDPOINT": "http://ms:8008",
        "LLM_CONNECTOR": "LangChain",
        "LLM_MODEL_NAME": "org/model",
        "LLM_DISABLE_STREAMING": "true",
        "LLM_OPENAI_FORMAT_STREAMING": "1",
        "LLM_API_KEY": "upstream-key",
        "LLM_USVC_API_KEY": "own-key",
        "LLM_MODEL_SERVER_CONNECT_TIMEOUT": "0.5",
        "LLM_MODEL_SERVER_READ_TIMEOUT": "12",
        "LLM_HEALTH_CHECK_CACHE_SECONDS": "0",
        "LLM_USVC_LOG_LEVEL": "debug",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = MicroserviceSettings()
    assert (s.host, s.port, s.model_server_endpoint) == ("127.0.0.1", 9100, "http://ms:8008")
    assert (s.connector, s.model_name) == ("langchain", "org/model")
    assert s.disable_streaming and s.openai_format_streaming
    assert (s.api_key_value, s.usvc_api_key_value) == ("upstream-key", "own-key")
    assert (s.connect_timeout, s.read_timeout, s.health_cache_seconds) == (0.5, 12, 0)
    assert s.log_level == "debug"
    assert "upstream-key" not in repr(s)  # secrets stay out of logs


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLM_MODEL_NAME", "LLM_USVC_PORT", "LLM_API_KEY", "LLM_CONNECTOR"):
        monkeypatch.setenv(name, "")
    s = MicroserviceSettings()
    assert (s.model_name, s.port, s.api_key, s.connector) == (None, 9000, None, "generic")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://ms:8008/", "http://ms:8008"),
        ("http://ms:8008/v1", "http://ms:8008"),
        ("https://ms.example/llm/v1/", "https://ms.example/llm"),
    ],
)
def test_endpoint_is_normalized(given: str, expected: str) -> None:
    assert MicroserviceSettings(model_server_endpoint=given).model_server_endpoint == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("connector", "tgi"),
        ("model_server_endpoint", "ms:8008"),
        ("port", 70000),
        ("connect_timeout", 0),
        ("health_cache_seconds", -1),
    ],
)
def test_bad_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        MicroserviceSettings(**{field: value})


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_USVC_PORT", "9200")
    monkeypatch.setenv("LLM_DISABLE_STREAMING", "true")
    monkeypatch.setenv("LLM_CONNECTOR", "langchain")
    s = load_settings(["--port", "9100", "--no-disable-streaming", "--read-timeout", "7"])
    assert (s.port, s.disable_streaming, s.read_timeout) == (9100, False, 7)
    assert s.connector == "langchain"  # not overridden: the environment's


def test_bad_flag_value_exits_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(["--connector", "tgi"])
    assert info.value.code == 2
    assert "connector" in capsys.readouterr().err


def test_help_names_every_flag_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, (_, env, _) in {**FLAGS, **SWITCHES}.items():
        assert flag in text and env in text
    assert "LLM_API_KEY" in text and "LLM_USVC_API_KEY" in text
