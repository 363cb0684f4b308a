"""compose/docker-compose.yaml resolved by the real compose v2 binary (`config`) for every
profile with its dotenv file, the root .env.example, and an OPEA-style .env."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from microservice.settings import MicroserviceSettings
from model_server.settings import ServerSettings
from tests.deploy.conftest import DEVICES, ROOT, clean_env, compose_binary

COMPOSE_FILE = ROOT / "compose" / "docker-compose.yaml"
USVC = "llm-microservice"


def compose_config(
    *env_files: Path, profile: str | None = None, cwd: Path = ROOT, **env: str
) -> dict[str, Any]:
    cmd = [str(compose_binary())]
    if not env_files or profile:
        cmd += ["-f", str(COMPOSE_FILE)]
    for env_file in env_files:
        cmd += ["--env-file", str(env_file)]
    if profile:
        cmd += ["--profile", profile]
    cmd += ["config", "--format", "json"]
    proc = subprocess.run(
        cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def settings_env_names(cls: type) -> set[str]:
    return {str(c) for f in cls.model_fields.values() for c in f.validation_alias.choices}


def published(service: dict[str, Any]) -> dict[int, int]:
    return {int(p["target"]): int(p["published"]) for p in service["ports"]}


def healthcheck_url(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    match = re.search(r"http://127\.0\.0\.1:\d+/[\w/]+", " ".join(test))
    assert match, test
    return match.group(0)


def test_binary_is_the_real_compose() -> None:
    """Not the always-0 wrapper: a broken file fails."""
    broken = subprocess.run(
        [str(compose_binary()), "-f", "/dev/stdin", "config"],
        input="services:\n  a:\n    image: x\n    depends_on: [missing]\n",
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert broken.returncode != 0 and "missing" in broken.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_profile_resolves_with_its_env_file(device: str) -> None:
    env_file = ROOT / "compose" / f"{device}.env"
    text = env_file.read_text()
    assert re.search(rf"^COMPOSE_PROFILES={device}$", text, re.M)
    assert re.search(rf"^LLM_DEVICE={device}$", text, re.M)
    # From the repo root the env file alone is enough (COMPOSE_FILE + COMPOSE_PROFILES).
    config = compose_config(env_file)
    ms_name = f"model-server-{device}"
    assert set(config["services"]) == {ms_name, USVC}
    ms, usvc = config["services"][ms_name], config["services"][USVC]

    assert ms["image"] == f"wick/model-server-{device}:0.1.0"
    assert ms["build"]["dockerfile"] == f"docker/Dockerfile.{device}"
    assert Path(ms["build"]["context"]) == ROOT
    assert (ROOT / ms["build"]["dockerfile"]).is_file()
    assert "BASE_IMAGE" in ms["build"]["args"]
    assert usvc["build"]["dockerfile"] == "docker/Dockerfile.microservice"

    assert published(ms) == {8008: 8008} and published(usvc) == {9000: 9000}
    assert healthcheck_url(ms) == "http://127.0.0.1:8008/health"
    assert healthcheck_url(usvc) == "http://127.0.0.1:9000/v1/health_check"
    assert usvc["depends_on"][ms_name]["condition"] == "service_healthy"
    # One name for the model server whatever the device.
    assert "model-server" in ms["networks"]["default"]["aliases"]
    assert usvc["environment"]["LLM_MODEL_SERVER_ENDPOINT"] == "http://model-server:8008"
    assert ms["environment"]["LLM_DEVICE"] == device
    assert ms["environment"]["LLM_MODEL_SERVER_PORT"] == "8008"
    (volume,) = ms["volumes"]
    assert volume["target"] == "/data" and volume["source"] == "model-cache"
    assert "model-cache" in config["volumes"]

    reservations = ms.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices = reservations.get("devices", [])
    if device == "cuda":
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    else:
        assert devices == []
    assert (ms.get("runtime") == "habana") == (device == "hpu")
    if device == "hpu":
        assert ms["environment"]["HABANA_VISIBLE_DEVICES"] == "all"
        assert ms["environment"]["OMPI_MCA_btl_vader_single_copy_mechanism"] == "none"
        assert "SYS_NICE" in ms["cap_add"]
    gcu_devices = [d["source"] for d in ms.get("devices", [])]
    assert gcu_devices == (["/dev/gcu0"] if device == "gcu" else [])


@pytest.mark.parametrize("device", DEVICES)
def test_profile_flag_and_shell_overrides(device: str) -> None:
    """`--profile` from the compose folder's file; the shell's ports win over the env file."""
    config = compose_config(
        ROOT / "compose" / f"{device}.env", profile=device,
        LLM_MODEL_SERVER_PORT="8010", LLM_USVC_PORT="9010", NVIDIA_GPU_COUNT="all",
    )  # fmt: skip
    ms = config["services"][f"model-server-{device}"]
    assert published(ms) == {8008: 8010}
    assert published(config["services"][USVC]) == {9000: 9010}
    if device == "cuda":
        assert ms["deploy"]["resources"]["reservations"]["devices"][0]["count"] == -1  # all


def test_env_example_works_from_the_repo_root() -> None:
    config = compose_config(ROOT / ".env.example")
    assert set(config["services"]) == {"model-server-cpu", USVC}
    env = config["services"]["model-server-cpu"]["environment"]
    assert env["LLM_MAX_NUM_SEQS"] == "256" and env["LLM_DTYPE"] == "auto"


def test_opea_env_file_works(tmp_path: Path) -> None:
    """OPEA's names (LLM_VLLM_MODEL_NAME, LLM_VLLM_PORT, VLLM_*) pass through unchanged."""
    env_file = tmp_path / ".env"
    env_file.write_text(
        'LLM_VLLM_MODEL_NAME="mistralai/Mistral-7B-Instruct-v0.1"\nLLM_VLLM_PORT=8018\n'
        "VLLM_CPU_KVCACHE_SPACE=40\nVLLM_DTYPE=bfloat16\nVLLM_MAX_NUM_SEQS=128\n"
        "VLLM_SKIP_WARMUP=false\nVLLM_TP_SIZE=1\nHF_TOKEN=hf_x\n"
    )
    config = compose_config(env_file, profile="cpu")
    ms = config["services"]["model-server-cpu"]
    assert published(ms) == {8008: 8018}
    env = ms["environment"]
    assert env["LLM_VLLM_MODEL_NAME"] == "mistralai/Mistral-7B-Instruct-v0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "40" and env["VLLM_DTYPE"] == "bfloat16"
    assert env["HF_TOKEN"] == "hf_x"
    # HF_TOKEN is the model server's only: the microservice never sees it.
    assert "HF_TOKEN" not in config["services"][USVC]["environment"]


def test_every_setting_reaches_its_container() -> None:
    config = compose_config(ROOT / "compose" / "cpu.env")
    ms_env = set(config["services"]["model-server-cpu"]["environment"])
    usvc_env = set(config["services"][USVC]["environment"])
    # The listen address is fixed inside a container (0.0.0.0); the port is mapped.
    assert settings_env_names(ServerSettings) - {"LLM_VLLM_PORT"} <= ms_env
    assert settings_env_names(MicroserviceSettings) - {"LLM_USVC_HOST"} <= usvc_env


def test_env_example_documents_every_setting() -> None:
    lines = (ROOT / ".env.example").read_text().splitlines()
    names = {}
    for i, line in enumerate(lines):
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=", line)
        if match:
            names[match.group(1)] = lines[i - 1]
    expected = settings_env_names(ServerSettings) | settings_env_names(MicroserviceSettings)
    opea_aliases = {n for n in expected if n.startswith(("VLLM_", "LLM_VLLM_"))}
    assert expected - opea_aliases <= set(names)
    assert {"LLM_DEVICE", "COMPOSE_PROFILES", "COMPOSE_FILE", "HF_TOKEN"} <= set(names)
    undocumented = [n for n, above in names.items() if not above.startswith("#")]
    assert undocumented == []
    # Every ${NAME} the compose file reads is listed too.
    code = "\n".join(
        line for line in COMPOSE_FILE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", code))
    assert "OMPI_MCA_btl_vader_single_copy_mechanism" in used
    assert used - opea_aliases - {"LLM_VLLM_PORT"} <= set(names)


def test_monitoring_profile_scrapes_both_services_and_mounts_the_charts_dashboard() -> None:
    config = compose_config(ROOT / "compose" / "cpu.env", COMPOSE_PROFILES="cpu,monitoring")
    services = config["services"]
    assert set(services) == {"model-server-cpu", USVC, "prometheus", "grafana"}
    assert compose_config(ROOT / "compose" / "cpu.env")["services"].keys() == {
        "model-server-cpu",
        USVC,
    }  # fmt: skip  (off unless asked for)
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert published(prometheus) == {9090: 9090} and published(grafana) == {3000: 3000}

    def mounts(service: dict[str, Any]) -> dict[str, Path]:
        return {v["target"]: Path(v["source"]) for v in service["volumes"] if v["type"] == "bind"}

    scrape = yaml.safe_load(mounts(prometheus)["/etc/prometheus/prometheus.yml"].read_text())
    targets = {
        job["job_name"]: target
        for job in scrape["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    # The names compose gives the two services on its network.
    assert targets == {
        "wick-model-server": "model-server:8008",
        "wick-microservice": f"{USVC}:9000",
    }
    assert "model-server" in services["model-server-cpu"]["networks"]["default"]["aliases"]

    grafana_mounts = mounts(grafana)
    assert (
        grafana_mounts["/var/lib/grafana/dashboards/wick"] == ROOT / "helm" / "wick" / "dashboards"
    )
    provider = yaml.safe_load(
        grafana_mounts["/etc/grafana/provisioning/dashboards/wick.yaml"].read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/wick"
    datasource = yaml.safe_load(
        grafana_mounts["/etc/grafana/provisioning/datasources/wick.yaml"].read_text()
    )["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "helm" / "wick" / "dashboards" / Path(home).name).is_file()


def test_rag_profile_adds_embedding_and_reranking_servers_and_microservices() -> None:
    config = compose_config(ROOT / "compose" / "cpu.env", COMPOSE_PROFILES="cpu,rag")
    services = config["services"]
    rag = {"embedding-model-server", "reranking-model-server", "embedding-microservice",
           "reranking-microservice"}  # fmt: skip
    assert set(services) == {"model-server-cpu", USVC} | rag
    embed, rerank = services["embedding-model-server"], services["reranking-model-server"]
    # OPEA ChatQnA's models by default; each server on its own host port, alias and model.
    assert embed["environment"]["LLM_MODEL"] == "BAAI/bge-base-en-v1.5"
    assert rerank["environment"]["LLM_MODEL"] == "BAAI/bge-reranker-base"
    assert published(embed) == {8008: 8009} and published(rerank) == {8008: 8010}
    assert embed["networks"]["default"]["aliases"] == ["embedding-model-server"]
    assert healthcheck_url(embed) == "http://127.0.0.1:8008/health"
    usvc_embed, usvc_rerank = services["embedding-microservice"], services["reranking-microservice"]
    assert usvc_embed["entrypoint"] == ["python3", "-m", "microservice.embedding"]
    assert usvc_rerank["entrypoint"] == ["python3", "-m", "microservice.reranking"]
    env = usvc_embed["environment"]
    assert env["EMBEDDING_MODEL_SERVER_ENDPOINT"] == "http://embedding-model-server:8008"
    assert usvc_rerank["environment"]["RERANKING_MODEL_SERVER_ENDPOINT"] == (
        "http://reranking-model-server:8008"
    )
    assert published(usvc_embed) == {6000: 6000} and published(usvc_rerank) == {8000: 8000}
    assert healthcheck_url(usvc_rerank) == "http://127.0.0.1:8000/v1/health_check"
    # Each microservice reads exactly the settings of its own class (host aside: fixed).
    from microservice.pooling_settings import EmbeddingSettings, RerankingSettings

    for service, cls in [(usvc_embed, EmbeddingSettings), (usvc_rerank, RerankingSettings)]:
        own = {n for n in settings_env_names(cls) if not n.startswith(("LLM_", "TEI_"))}
        assert own - {n for n in own if n.endswith("_HOST")} <= set(service["environment"])
    # Chosen models and ports reach them.
    custom = compose_config(
        ROOT / "compose" / "cpu.env", COMPOSE_PROFILES="cpu,rag",
        LLM_EMBEDDING_MODEL="/data/minilm", EMBEDDING_USVC_PORT="16000",
    )  # fmt: skip
    custom_embed = custom["services"]["embedding-model-server"]
    assert custom_embed["environment"]["LLM_MODEL"] == "/data/minilm"
    assert published(custom["services"]["embedding-microservice"]) == {6000: 16000}
