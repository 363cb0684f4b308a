"""The Dockerfiles: `hadolint -t warning` clean, and what every image must have (dockerfile-parse):
a BASE_IMAGE build arg, the non-root uid 1000, HEALTHCHECK, EXPOSE, the model cache volume."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.conftest import DEVICES, ROOT, hadolint_binary

DOCKER = ROOT / "docker"
MODEL_SERVER_FILES = [DOCKER / f"Dockerfile.{d}" for d in DEVICES]
ALL_FILES = [*MODEL_SERVER_FILES, DOCKER / "Dockerfile.microservice"]


def parse(path: Path) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


def final_stage(parser: DockerfileParser) -> list[dict[str, Any]]:
    """Instructions of the last stage (after the last FROM)."""
    structure = parser.structure
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    return structure[last_from + 1 :]


def instructions(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [ins["value"] for ins in stage if ins["instruction"] == name]


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check is not vacuous: hadolint's exit status reports warnings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run(
        [str(hadolint_binary()), "-t", "warning", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "DL3007" in proc.stdout


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_hadolint_clean(path: Path) -> None:
    proc = subprocess.run(
        [str(hadolint_binary()), "-t", "warning", "--no-color", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_image_contract(path: Path) -> None:
    parser = parse(path)
    structure = parser.structure
    # The base is a build arg, declared before the first FROM, used by every FROM.
    first_from = next(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    args = [ins["value"] for ins in structure[:first_from] if ins["instruction"] == "ARG"]
    assert any(re.match(r"BASE_IMAGE(=|$)", a) for a in args), args
    froms = [ins["value"] for ins in structure if ins["instruction"] == "FROM"]
    assert all(f.split()[0] == "${BASE_IMAGE}" for f in froms), froms

    stage = final_stage(parser)
    assert instructions(stage, "USER")[-1] in ("1000", "1000:1000")
    (healthcheck,) = instructions(stage, "HEALTHCHECK")
    assert "--start-period=" in healthcheck and healthcheck.split()[-1].endswith("]")
    cmd = json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())
    is_model_server = path in MODEL_SERVER_FILES
    assert ("/health" if is_model_server else "/v1/health_check") in " ".join(cmd)
    assert instructions(stage, "EXPOSE") == ["8008" if is_model_server else "9000"]
    entrypoint = json.loads(instructions(stage, "ENTRYPOINT")[-1])
    assert entrypoint == ["python3", "-m", "model_server" if is_model_server else "microservice"]
    if is_model_server:
        assert json.loads(instructions(stage, "VOLUME")[-1]) == ["/data"]
        env = parser.envs
        assert env["LLM_DEVICE"] == path.suffix[1:]
        assert env["HF_HOME"] == "/data/huggingface" and env["WICK_CACHE_DIR"] == "/data/wick"
        assert env["LLM_MODEL_SERVER_PORT"] == "8008"
        # The volume's mount point belongs to uid 1000 (a new named volume inherits it).
        assert any("chown 1000:1000 /data" in run for run in instructions(stage, "RUN"))


def test_gcu_base_has_no_default() -> None:
    """Enflame's TopsRider image is not public: it must be given, never guessed."""
    structure = parse(DOCKER / "Dockerfile.gcu").structure
    args = [ins["value"] for ins in structure if ins["instruction"] == "ARG"]
    assert "BASE_IMAGE" in args


def test_multi_stage_where_it_saves_size() -> None:
    """cpu and microservice build a venv in one stage and copy only it into the runtime."""
    for name in ("Dockerfile.cpu", "Dockerfile.microservice"):
        parser = parse(DOCKER / name)
        froms = [ins["value"] for ins in parser.structure if ins["instruction"] == "FROM"]
        assert len(froms) == 2 and froms[0].endswith("AS build")
        copies = instructions(final_stage(parser), "COPY")
        assert copies and all(c.startswith("--from=build /opt/venv") for c in copies)


def test_microservice_image_has_no_torch() -> None:
    text = (DOCKER / "Dockerfile.microservice").read_text()
    runs = " ".join(instructions(parse(DOCKER / "Dockerfile.microservice").structure, "RUN"))
    assert "torch" not in runs and "model-server" not in runs
    assert "COPY model_server" not in text and "COPY microservice ./microservice" in text


def test_dockerignore_keeps_secrets_and_clutter_out() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # An allowlist: everything is excluded, then only what the images need is let back in.
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "model_server", "microservice"}
    for path in allowed:
        assert (ROOT / path).exists()
