"""Container smoke test (marker `container`, opt-in: `./wick test tests/deploy -m container`).

Builds the cpu model-server image and the microservice image with podman on a Debian base made
by debootstrap (no registry is needed), brings the stack up with the real compose v2 binary on
podman's Docker-compatible socket, sends a chat request through the microservice's port and
tears everything down. Needs root and Debian's `podman buildah runc debootstrap netavark
aardvark-dns`; PyPI (for the images' packages) and deb.debian.org (for the base). Everything
podman stores goes to its own folder (vfs driver, netavark for the compose network's DNS), so
the host's podman setup is untouched. Takes several minutes (see the README).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.conftest import ROOT, clean_env, compose_binary, free_port

pytestmark = [pytest.mark.container, pytest.mark.slow]

WORK = Path(os.environ.get("WICK_CONTAINER_WORKDIR", "/var/tmp/wick-container-test"))
BASE_IMAGE = "localhost/wick-debootstrap:bookworm"
TAG = "smoke"
MIRROR = os.environ.get("WICK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# A CPU torch wheel on local disk (pip's find-links), used when download.pytorch.org is not
# reachable; mounted read-only into the build.
WHEELS = os.environ.get("WICK_WHEELS_DIR", "/opt/wheels")


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")  # fmt: skip
    return proc.stdout


@pytest.fixture(scope="module")
def podman_env() -> dict[str, str]:
    for tool in ("podman", "debootstrap", "runc"):
        assert shutil.which(tool), f"{tool} is missing: apt-get install podman buildah runc ..."
    assert os.geteuid() == 0, "the container smoke test runs rootful podman"
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{WORK}/storage"\nrunroot = "{WORK}/run"\n'
    )
    (WORK / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
        '[network]\nnetwork_backend = "netavark"\n[engine]\nruntime = "runc"\n'
        'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
    )
    return clean_env(
        CONTAINERS_STORAGE_CONF=str(WORK / "storage.conf"),
        CONTAINERS_CONF=str(WORK / "containers.conf"),
    )


@pytest.fixture(scope="module")
def images(podman_env: dict[str, str]) -> dict[str, float]:
    """Build (or reuse) the base and the two images; returns seconds per step."""
    timings: dict[str, float] = {}
    start = time.monotonic()
    exists = subprocess.run(["podman", "image", "exists", BASE_IMAGE], env=podman_env)
    if exists.returncode != 0:
        rootfs = WORK / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", str(rootfs), MIRROR], timeout=1200)  # fmt: skip
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(["podman", "import", "-", BASE_IMAGE], timeout=600, env=podman_env, stdin=tar.stdout)
        assert tar.wait() == 0
        shutil.rmtree(rootfs, ignore_errors=True)
    timings["base"] = time.monotonic() - start
    # --layers=false: with the vfs driver every layer is a full copy of the tree (tens of GB
    # for the torch image otherwise); one layer per stage keeps it to a few GB.
    build = ["podman", "build", "--layers=false", "--network", "host",
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]  # fmt: skip
    # A TLS-intercepting proxy's CA (pip on the host trusts it through PIP_CERT).
    if os.environ.get("PIP_CERT") and Path(os.environ["PIP_CERT"]).is_file():
        build += ["-v", f"{os.environ['PIP_CERT']}:/host-ca.crt:ro",
                  "--build-arg", "PIP_CERT=/host-ca.crt"]  # fmt: skip
    if Path(WHEELS).is_dir():
        build += ["-v", f"{WHEELS}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels",
                  "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]  # fmt: skip
    for name, dockerfile in (("model-server-cpu", "Dockerfile.cpu"),
                             ("llm-microservice", "Dockerfile.microservice")):  # fmt: skip
        start = time.monotonic()
        run([*build, "-f", f"docker/{dockerfile}", "-t", f"wick/{name}:{TAG}", "."],
            timeout=2400, env=podman_env, cwd=ROOT)  # fmt: skip
        timings[name] = time.monotonic() - start
    return timings


@pytest.fixture
def podman_socket(podman_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    sock = tmp_path / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        env=podman_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert service.poll() is None and time.monotonic() < deadline, "no podman socket"
            time.sleep(0.2)
        yield f"unix://{sock}"
    finally:
        service.terminate()
        service.wait(30)


def drive_healthchecks(env: dict[str, str], project: str, stop: threading.Event) -> None:
    """Podman runs healthchecks from systemd timers; without systemd, run them here."""
    while not stop.wait(3):
        names = subprocess.run(
            ["podman", "ps", "--filter", f"label=com.docker.compose.project={project}",
             "--format", "{{.Names}}"],
            env=env, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        for name in names:
            subprocess.run(["podman", "healthcheck", "run", name], env=env, capture_output=True)


def test_stack_in_containers(
    images: dict[str, float], podman_env: dict[str, str], podman_socket: str
) -> None:
    project = f"wick-smoke-{os.getpid()}"
    ms_port, usvc_port = free_port(), free_port()
    env = {**podman_env, "DOCKER_HOST": podman_socket, "COMPOSE_PROJECT_NAME": project,
           "WICK_TAG": TAG, "LLM_MODEL_SERVER_PORT": str(ms_port),
           "LLM_USVC_PORT": str(usvc_port), "LLM_KV_CACHE_MEMORY": "256MiB",
           "LLM_MAX_MODEL_LEN": "2048"}  # fmt: skip
    compose = [str(compose_binary()), "-f", str(ROOT / "compose" / "docker-compose.yaml"),
               "--env-file", str(ROOT / "compose" / "cpu.env"), "--profile", "cpu"]  # fmt: skip
    stop = threading.Event()
    driver = threading.Thread(target=drive_healthchecks, args=(env, project, stop), daemon=True)
    driver.start()
    start = time.monotonic()
    try:
        # `up -d` returns once the microservice has started, i.e. after the model server is
        # healthy (depends_on: service_healthy).
        run([*compose, "up", "-d", "--no-build"], timeout=900, env=env, cwd=ROOT)
        deadline = time.monotonic() + 300
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{usvc_port}/v1/health_check", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, run([*compose, "logs"], 60, env=env, cwd=ROOT)
            time.sleep(2)
        up_seconds = time.monotonic() - start
        answer = httpx.post(
            f"http://127.0.0.1:{usvc_port}/v1/chat/completions",
            json={"messages": {"system": "You are a helpful assistant.",
                               "user": "What is the capital of France?"},
                  "max_new_tokens": 16, "temperature": 0.01, "streaming": False},
            timeout=120,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"].strip()
        ps = run(["podman", "ps", "--format", "{{.Names}} {{.Status}}"], 60, env=env)
        assert f"{project}-model-server-cpu-1" in ps and f"{project}-llm-microservice-1" in ps
        # The containers run as uid 1000.
        whoami = run(["podman", "exec", f"{project}-model-server-cpu-1", "id", "-u"], 60, env=env)
        assert whoami.strip() == "1000"
    finally:
        stop.set()
        subprocess.run([*compose, "down", "-v", "--timeout", "40"], env=env, cwd=ROOT,
                       capture_output=True, timeout=300)  # fmt: skip
    left = run(["podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
                "--format", "{{.Names}}"], 60, env=env)  # fmt: skip
    assert left.strip() == ""
    print(f"\ncontainer smoke timings (s): {images} stack up: {up_seconds:.0f}")
