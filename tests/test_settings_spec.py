"""The settings declarations (model_server/settings_spec.py) and everything derived from them:
flags of every subcommand, ServerSettings, EngineConfig, docs/configuration.md, .env.example."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from microservice.pooling_settings import EmbeddingSettings, RerankingSettings
from microservice.settings import MicroserviceSettings
from model_server.config import EngineConfig
from model_server.entrypoints.cli import build_parser
from model_server.entrypoints.openai.cli_args import settings_from_args
from model_server.settings import ServerSettings
from model_server.settings_spec import (
    GROUP_COMMANDS,
    SETTINGS,
    configuration_markdown,
    settings_of,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith(("LLM_", "VLLM_")):
            monkeypatch.delenv(name)


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for word in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def test_configuration_doc_is_generated_from_the_declarations() -> None:
    assert DOCS.read_text() == configuration_markdown(), (
        "docs/configuration.md is out of date: run "
        "`python -m model_server.settings_spec docs/configuration.md`"
    )


def test_every_setting_has_flag_variable_help_and_doc_entry() -> None:
    doc = DOCS.read_text()
    serve = subparser(build_parser(), "serve")
    actions = {a.dest: a for a in serve._actions}
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    for s in SETTINGS:
        action = actions[s.name]
        assert s.flag in action.option_strings and set(s.aliases) <= set(action.option_strings)
        # LLM_*, or the WICK_* name the CPU kernels have always read (every command reads it).
        assert s.env_names[0].startswith("WICK_" if s.everywhere else "LLM_"), s.name
        assert (
            s.help.endswith(".")
            and action.help
            and f"Env: {', '.join(s.env_names)}." in (action.help)
        )
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{s.flag}`"))
        assert all(f"`{n}`" in row for n in s.env_names), row
    env = [n for s in SETTINGS for n in s.env_names]
    assert len(set(env)) == len(env)
    assert {n for s in SETTINGS for n in s.opea} == {
        "LLM_VLLM_MODEL_NAME", "LLM_VLLM_PORT", "VLLM_DTYPE", "VLLM_MAX_NUM_SEQS",
        "VLLM_TP_SIZE", "VLLM_SKIP_WARMUP", "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    }  # fmt: skip


def test_each_command_has_its_groups_flags_with_the_declared_defaults() -> None:
    parser = build_parser()
    commands = {c for cs in GROUP_COMMANDS.values() for c in cs}
    for command in commands:
        dests = {a.dest for a in subparser(parser, command)._actions}
        for group, having in GROUP_COMMANDS.items():
            names = {s.name for s in settings_of(group)}
            assert (names <= dests) == (command in having), (command, group)
    for command in commands - {"serve"}:
        argv = [*command.split(), *(["--prompt", "hi"] if command == "generate" else [])]
        args = parser.parse_args(argv)
        for s in settings_of("engine"):
            assert getattr(args, s.name) == s.default, (command, s.name)
    # `serve`: nothing given, nothing in the namespace but None (the environment decides).
    args = parser.parse_args(["serve"])
    assert all(getattr(args, s.name) is None for s in SETTINGS)


def test_engine_config_fields_and_defaults_are_the_engine_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = settings_of("engine")
    fields = dataclasses.fields(EngineConfig)
    assert [f.name for f in fields] == [s.name for s in engine]
    assert [f.default for f in fields] == [s.default for s in engine]
    for s in SETTINGS:  # the defaults, not this machine's exports (WICK_CPU_ISA=avx2 runs)
        for env in s.env_names:
            monkeypatch.delenv(env, raising=False)
    assert ServerSettings().engine_config() == EngineConfig()


def test_the_scheduler_takes_its_limits_from_the_declarations() -> None:
    from model_server.config import EngineConfig
    from model_server.engine.core.scheduler import SchedulerConfig

    # No defaults of its own: every limit comes from an EngineConfig, whose defaults are declared.
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(SchedulerConfig))
    # The token budget's default is the platform's (None until EngineCore resolves it).
    limits = SchedulerConfig.from_engine_config(
        EngineConfig(max_num_batched_tokens=777), max_model_len=4096
    )
    declared = {s.name: s.default for s in SETTINGS}
    assert declared["max_num_batched_tokens"] is None and limits.max_num_batched_tokens == 777
    for name in ("max_num_seqs", "enable_chunked_prefill", "block_size"):
        assert getattr(limits, name) == declared[name], name
    with pytest.raises(ValueError, match="unresolved"):
        SchedulerConfig.from_engine_config(EngineConfig(), max_model_len=4096)


def test_attention_backend_choices_are_the_backends() -> None:
    from model_server.layers.attention import ATTENTION_BACKENDS

    assert next(s for s in SETTINGS if s.name == "attention_backend").choices == tuple(
        ATTENTION_BACKENDS
    )


def test_help_imports_neither_torch_nor_pydantic_for_engine_commands() -> None:
    code = (
        "import sys; from model_server.entrypoints.cli import build_parser; "
        "build_parser('generate'); assert 'pydantic' not in sys.modules; build_parser(); "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, False),
        ([], {"VLLM_SKIP_WARMUP": "true"}, True),
        ([], {"VLLM_SKIP_WARMUP": "true", "LLM_SKIP_WARMUP": "false"}, False),
        (["--skip-warmup"], {"LLM_SKIP_WARMUP": "false"}, True),
        (["--no-skip-warmup"], {"LLM_SKIP_WARMUP": "true"}, False),
        ([], {"LLM_SKIP_WARMUP": "", "VLLM_SKIP_WARMUP": "true"}, True),  # empty: unset
    ],
)
def test_precedence_flag_llm_opea_default(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], expected: bool
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["serve", *argv])
    assert settings_from_args(args).skip_warmup is expected


def test_store_true_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_ENFORCE_EAGER", "true")
    assert settings_from_args(build_parser().parse_args(["serve"])).enforce_eager
    monkeypatch.setenv("LLM_ENFORCE_EAGER", "false")
    assert settings_from_args(build_parser().parse_args(["serve", "--enforce-eager"])).enforce_eager


def env_example() -> dict[str, str]:
    text = (ROOT / ".env.example").read_text()
    return dict(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", text, re.MULTILINE))


def test_env_example_names_only_real_variables_with_the_declared_defaults() -> None:
    example = env_example()
    server = {n: s for s in SETTINGS for n in s.env_names}
    # The LLM microservice's, and its embedding and reranking siblings'.
    services = (MicroserviceSettings, EmbeddingSettings, RerankingSettings)
    fields = [f for cls in services for f in cls.model_fields.values()]
    usvc = {str(c) for f in fields for c in f.validation_alias.choices}
    compose = (ROOT / "compose" / "docker-compose.yaml").read_text()
    read_elsewhere = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", compose))
    for reader in ("run_server.sh", "tests/deploy/test_container.py"):  # the smoke test's mirror
        read_elsewhere |= {n for n in example if n in (ROOT / reader).read_text()}
    read_elsewhere |= {"COMPOSE_FILE", "COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME"}  # compose's
    assert set(example) - set(server) - usvc - read_elsewhere == set()
    # Every setting by its LLM_* name (OPEA's are mentioned in a comment only).
    assert {s.env_names[0] for s in SETTINGS} <= set(example)
    assert not {n for s in SETTINGS for n in s.opea} & set(example)
    for name, value in example.items():
        if name in server and value:
            s = server[name]
            assert getattr(ServerSettings(**{s.name: value}), s.name) == s.default, name


@pytest.mark.parametrize(("flag", "expected"), [("100B", 100), ("2GiB", 2 << 30), ("4", 4 << 30)])
def test_serve_parses_a_size_flag_once(flag: str, expected: int) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-memory", flag])
    assert settings_from_args(args).kv_cache_memory == expected
