"""Container smoke test (marker `container`, opt-in: `./wick test tests/deploy -m container`).

Builds the cpu model-server image and the microservice image with podman on a Debian base made by
debootstrap (no registry is needed), brings the stack up with the real compose v2 binary on
podman's Docker-compatible socket, sends a chat request through the microservice's port and tears
everything down. Needs root and Debian's `podman buildah runc debootstrap netavark aardvark-dns
iptables` (checked first, every missing one named); a package index (pip's default, or
PIP_INDEX_URL / PIP_EXTRA_INDEX_URL) for the images' packages and a Debian mirror (debootstrap's
default, or WICK_DEBIAN_MIRROR) for the base and gcc. The CPU torch wheel comes from
WICK_WHEELS_DIR (/opt/wheels) when it holds one, else from WICK_TORCH_INDEX_URL (one of the two
is required, so that the image never gets the CUDA build). Everything podman stores goes to its
own folder, WICK_CONTAINER_WORKDIR (/var/tmp/wick-container-test: vfs storage, networks, logs/ with
each step's output), so the host's podman setup is untouched; the base image and the built images
stay there (about 2.5 GB; `podman system reset` with CONTAINERS_STORAGE_CONF=<workdir>/storage.conf
removes them), and WICK_CONTAINER_REUSE=1 skips rebuilding images that exist. About 6 minutes on
2 cores (base 1, model-server image 2.5, microservice image 1, stack up 1, chat and teardown under
0.5); peak disk use about 6 GB.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.deploy.conftest import ROOT, clean_env, compose_binary, free_port

pytestmark = [pytest.mark.container, pytest.mark.slow]

WORK = Path(os.environ.get("WICK_CONTAINER_WORKDIR", "/var/tmp/wick-container-test"))
BASE_IMAGE = "localhost/wick-debootstrap:bookworm"
TAG = "smoke"
# Empty: debootstrap's own default mirror (no host is written here).
MIRROR = os.environ.get("WICK_DEBIAN_MIRROR", "")
# A CPU torch wheel on local disk (pip's find-links), mounted read-only into the build; else the
# CPU build comes from WICK_TORCH_INDEX_URL.
WHEELS = os.environ.get("WICK_WHEELS_DIR", "/opt/wheels")
TORCH_INDEX_URL = os.environ.get("WICK_TORCH_INDEX_URL", "")
# WICK_CONTAINER_REUSE=1 keeps images built by an earlier run (the base is always reused).
REUSE = os.environ.get("WICK_CONTAINER_REUSE", "") == "1"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")  # fmt: skip
    return proc.stdout


def run_logged(cmd: list[str], log: Path, timeout: float, **kw) -> str:
    """Run `cmd` with its output going to `log` (`tail -f` it to follow a long build)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kw)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} -> {proc.returncode} (log: {log})\n{text[-4000:]}"
    )
    return text


def host_ca_bundle() -> str | None:
    """The CA bundle the host's pip trusts (a TLS-intercepting proxy's CA lives there)."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):  # fmt: skip
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def phase(timings: dict[str, float], name: str, start: float) -> None:
    timings[name] = round(time.monotonic() - start, 1)
    print(f"\n[container smoke] {name}: {timings[name]:.0f} s", flush=True)


# What the test runs, by the Debian package that brings it. netavark and aardvark-dns are podman's
# helpers (not on PATH); netavark sets up networks through iptables or nft.
APT_PACKAGES = "podman buildah runc debootstrap netavark aardvark-dns iptables"
_ON_PATH = ("podman", "runc", "debootstrap")
_PODMAN_HELPERS = ("netavark", "aardvark-dns")
PODMAN_HELPER_DIRS = ("/usr/libexec/podman", "/usr/lib/podman", "/usr/local/libexec/podman",
                      "/usr/local/lib/podman")  # fmt: skip
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def missing_prerequisites(
    path: str | None = None, helper_dirs: tuple[str, ...] = PODMAN_HELPER_DIRS
) -> list[str]:
    """Every binary the smoke test needs and cannot find (`iptables or nft` counts as one)."""
    search = f"{path if path is not None else os.environ.get('PATH', '')}:{_SBIN}"
    missing = [tool for tool in _ON_PATH if shutil.which(tool, path=search) is None]
    for helper in _PODMAN_HELPERS:
        if not any(os.access(Path(d) / helper, os.X_OK) for d in helper_dirs):
            missing.append(helper)
    if not any(shutil.which(tool, path=search) for tool in ("iptables", "nft")):
        missing.append("iptables or nft")
    return missing


def check_prerequisites() -> None:
    """One line naming everything missing, before anything is built."""
    missing = missing_prerequisites()
    assert not missing, f"missing: {', '.join(missing)}; on Debian: apt-get install {APT_PACKAGES}"
    assert os.geteuid() == 0, "the container smoke test runs rootful podman"


@pytest.fixture(scope="module")
def podman_env() -> dict[str, str]:
    check_prerequisites()
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{WORK}/storage"\nrunroot = "{WORK}/run"\n'
    )
    (WORK / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
        '[network]\nnetwork_backend = "netavark"\n'
        f'network_config_dir = "{WORK}/networks"\n[engine]\nruntime = "runc"\n'
        'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
        f'tmp_dir = "{WORK}/tmp"\n'
    )
    return clean_env(
        CONTAINERS_STORAGE_CONF=str(WORK / "storage.conf"),
        CONTAINERS_CONF=str(WORK / "containers.conf"),
    )


@pytest.fixture(scope="module")
def images(podman_env: dict[str, str]) -> dict[str, float]:
    """Build (or reuse) the base and the two images; returns seconds per step."""
    # The CPU torch wheel from local disk (pip prefers torch==<version>+cpu there over the CUDA
    # build of its index), else the CPU wheel index the environment names.
    torch_args: list[str] = []
    if Path(WHEELS).is_dir() and any(Path(WHEELS).glob("torch-*+cpu-*.whl")):
        torch_args = ["-v", f"{WHEELS}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels"]
    elif TORCH_INDEX_URL:
        torch_args = ["--build-arg", f"TORCH_INDEX_URL={TORCH_INDEX_URL}"]
    else:
        pytest.fail(
            f"no CPU torch wheel in WICK_WHEELS_DIR ({WHEELS}) and no WICK_TORCH_INDEX_URL: "
            "set one, or the cpu image would get the CUDA build of torch"
        )
    timings: dict[str, float] = {}
    logs = WORK / "logs"
    start = time.monotonic()
    exists = subprocess.run(["podman", "image", "exists", BASE_IMAGE], env=podman_env)
    if exists.returncode != 0:
        rootfs = WORK / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        debootstrap = ["debootstrap", "--variant=minbase",
                       "--include=python3,python3-venv,ca-certificates",
                       "bookworm", str(rootfs), *([MIRROR] if MIRROR else [])]  # fmt: skip
        run_logged(debootstrap, logs / "debootstrap.log", timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(["podman", "import", "-", BASE_IMAGE], timeout=600, env=podman_env, stdin=tar.stdout)
        assert tar.wait() == 0
        shutil.rmtree(rootfs, ignore_errors=True)
    phase(timings, "base", start)
    # --layers=false: with the vfs driver every layer is a full copy of the tree (tens of GB
    # for the torch image otherwise); one layer per stage keeps it to a few GB. --format docker
    # keeps HEALTHCHECK (OCI image configs have no field for it).
    build = ["podman", "build", "--layers=false", "--format", "docker", "--network", "host",
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]  # fmt: skip
    # A TLS-intercepting proxy's CA: pip in the build trusts it through PIP_CERT.
    ca = host_ca_bundle()
    if ca:
        build += ["-v", f"{ca}:/host-ca.crt:ro", "--build-arg", "PIP_CERT=/host-ca.crt"]
    # Package indexes from the environment only (empty: pip's default inside the build).
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        if os.environ.get(name):
            build += ["--build-arg", f"{name}={os.environ[name]}"]
    steps = [("model-server-cpu", "Dockerfile.cpu", torch_args),
             ("llm-microservice", "Dockerfile.microservice", [])]  # fmt: skip
    for name, dockerfile, extra in steps:
        start = time.monotonic()
        image = f"wick/{name}:{TAG}"
        if (
            REUSE
            and subprocess.run(["podman", "image", "exists", image], env=podman_env).returncode == 0
        ):
            continue
        cmd = [*build, *extra, "-f", f"docker/{dockerfile}", "-t", image, "."]
        log = run_logged(cmd, logs / f"build-{name}.log", timeout=2400, env=podman_env, cwd=ROOT)
        phase(timings, f"build {name}", start)
        # The CPU build of torch only: never the CUDA one with its nvidia-* wheels (GBs).
        assert "nvidia" not in log.lower(), f"the {name} build pulled CUDA packages"
    # A rebuild leaves the previous images untagged: drop them (vfs copies are GBs each).
    run(["podman", "image", "prune", "--force"], timeout=300, env=podman_env)
    sizes = run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"],
                timeout=60, env=podman_env)  # fmt: skip
    print(f"\n[container smoke] images:\n{sizes}", flush=True)
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


# How long the stack may take to become healthy (the model server's load and warm-up included).
HEALTHY_TIMEOUT_S = 900


def project_containers(env: dict[str, str], project: str) -> list[str]:
    return subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
         "--format", "{{.Names}}"],
        env=env, capture_output=True, text=True, timeout=60,
    ).stdout.split()  # fmt: skip


def container_logs(env: dict[str, str], names: list[str]) -> str:
    """The last lines of each container's log, headed by its name and state."""
    parts = []
    for name in names:
        state = subprocess.run(
            ["podman", "inspect", "--format",
             "{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}}", name],
            env=env, capture_output=True, text=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        log = subprocess.run(["podman", "logs", "--tail", "80", name], env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        parts.append(f"--- {name} ({state})\n{log.stdout}{log.stderr}")
    return "\n".join(parts)


def crashed(env: dict[str, str], names: list[str]) -> list[str]:
    """Containers that exited or were restarted (a crash loop shows as restarts > 0)."""
    out = []
    for name in names:
        state = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Status}} {{.RestartCount}}", name],
            env=env, capture_output=True, text=True, timeout=60,
        ).stdout.split()  # fmt: skip
        if len(state) == 2 and (state[0] in ("exited", "dead") or int(state[1]) > 0):
            out.append(name)
    return out


def wait_until_healthy(
    env: dict[str, str], project: str, usvc_port: int, up: subprocess.Popen, up_log: Path
) -> None:
    """Until the microservice's health check answers 200; fails at a container's first crash or
    when `compose up` fails, with the containers' logs."""
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    while True:
        try:
            health = httpx.get(f"http://127.0.0.1:{usvc_port}/v1/health_check", timeout=5)
            if health.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        names = project_containers(env, project)
        down = crashed(env, names)
        if down:
            pytest.fail(f"{', '.join(down)} crashed:\n{container_logs(env, names)}")
        if up.poll() not in (None, 0):
            pytest.fail(f"compose up -> {up.returncode}:\n"
                        f"{up_log.read_text(errors='replace')[-3000:]}\n"
                        f"{container_logs(env, names)}")  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"not healthy in {HEALTHY_TIMEOUT_S} s:\n{container_logs(env, names)}")
        time.sleep(2)


@dataclass(slots=True)
class Stack:
    """A compose project being brought up: `wait_healthy()` waits for it."""

    env: dict[str, str]
    project: str
    usvc_port: int
    up: subprocess.Popen
    up_log: Path

    def wait_healthy(self) -> None:
        wait_until_healthy(self.env, self.project, self.usvc_port, self.up, self.up_log)
        self.up.wait(120)
        assert self.up.returncode == 0, self.up_log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def compose_stack(
    podman_env: dict[str, str], podman_socket: str, timings: dict[str, float], **settings: str
) -> Iterator[Stack]:
    """`compose up -d` of the cpu profile with `settings` (LLM_* variables) in the background;
    `compose down` and a check that nothing is left on the way out."""
    project = f"wick-smoke-{os.getpid()}-{next(_projects)}"
    ms_port, usvc_port = free_port(), free_port()
    env = {**podman_env, "DOCKER_HOST": podman_socket, "COMPOSE_PROJECT_NAME": project,
           "WICK_TAG": TAG, "LLM_MODEL_SERVER_PORT": str(ms_port),
           "LLM_USVC_PORT": str(usvc_port), "LLM_KV_CACHE_MEMORY": "256MiB",
           "LLM_MAX_MODEL_LEN": "2048", **settings}  # fmt: skip
    compose = [str(compose_binary()), "-f", str(ROOT / "compose" / "docker-compose.yaml"),
               "--env-file", str(ROOT / "compose" / "cpu.env"), "--profile", "cpu"]  # fmt: skip
    stop = threading.Event()
    driver = threading.Thread(target=drive_healthchecks, args=(env, project, stop), daemon=True)
    driver.start()
    up_log = WORK / "logs" / f"compose-up-{project}.log"
    up_log.parent.mkdir(parents=True, exist_ok=True)
    with up_log.open("w") as out:
        # `up -d` returns once the microservice has started, i.e. after the model server is
        # healthy (depends_on: service_healthy); meanwhile a crashing container fails the wait
        # at once, with its log, instead of after compose's.
        up = subprocess.Popen([*compose, "up", "-d", "--no-build"], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # fmt: skip
    try:
        yield Stack(env, project, usvc_port, up, up_log)
    finally:
        stop.set()
        if up.poll() is None:
            up.terminate()
            up.wait(60)
        start = time.monotonic()
        subprocess.run([*compose, "down", "-v", "--timeout", "40"], env=env, cwd=ROOT,
                       capture_output=True, timeout=300)  # fmt: skip
        phase(timings, "teardown", start)
    assert project_containers(env, project) == []


_projects = itertools.count()


def test_stack_in_containers(
    images: dict[str, float], podman_env: dict[str, str], podman_socket: str
) -> None:
    timings = dict(images)
    start = time.monotonic()
    with compose_stack(podman_env, podman_socket, timings) as stack:
        stack.wait_healthy()
        phase(timings, "compose up to healthy", start)
        env, project = stack.env, stack.project
        start = time.monotonic()
        answer = httpx.post(
            f"http://127.0.0.1:{stack.usvc_port}/v1/chat/completions",
            json={"messages": {"system": "You are a helpful assistant.",
                               "user": "What is the capital of France?"},
                  "max_new_tokens": 16, "temperature": 0.01, "streaming": False},
            timeout=120,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        text = answer.json()["text"]
        assert text.strip()
        phase(timings, "chat", start)
        print(f"[container smoke] answer: {text!r}", flush=True)
        ps = run(["podman", "ps", "--format", "{{.Names}} {{.Status}}"], 60, env=env)
        assert f"{project}-model-server-cpu-1" in ps and f"{project}-llm-microservice-1" in ps
        for service in ("model-server-cpu", "llm-microservice"):
            # The containers run as uid 1000.
            whoami = run(["podman", "exec", f"{project}-{service}-1", "id", "-u"], 60, env=env)
            assert whoami.strip() == "1000", service
        # The CPU build of torch (no CUDA), and no torch at all in the microservice.
        probe = "import importlib.util as u; print(u.find_spec('torch') is not None)"
        version = "import torch; print(torch.__version__, torch.version.cuda)"
        cuda = run(["podman", "exec", f"{project}-model-server-cpu-1", "python3", "-c", version],
                   120, env=env)  # fmt: skip
        assert cuda.split()[-1] == "None" and "+cpu" in cuda, cuda
        no_torch = run(["podman", "exec", f"{project}-llm-microservice-1", "python3", "-c", probe],
                       60, env=env)  # fmt: skip
        assert no_torch.strip() == "False"
    print(f"\n[container smoke] timings (s): {timings}", flush=True)


def test_a_crashing_model_server_fails_fast_with_its_log(
    images: dict[str, float], podman_env: dict[str, str], podman_socket: str
) -> None:
    """The wait gives up at the model server's first crash (here: a model that is not there),
    not after compose's wait for a healthy container, and shows the container's log."""
    timings: dict[str, float] = {}
    start = time.monotonic()
    with compose_stack(
        podman_env, podman_socket, timings, LLM_MODEL="/data/no-such-model"
    ) as stack:
        with pytest.raises(pytest.fail.Exception) as failure:
            stack.wait_healthy()
        elapsed = time.monotonic() - start
    message = str(failure.value)
    assert "model-server-cpu-1" in message and "crashed" in message, message
    assert "could not load the model" in message and "/data/no-such-model" in message, message
    assert elapsed < 120, f"the crash was reported after {elapsed:.0f} s"
    print(f"\n[container smoke] crash reported after {elapsed:.0f} s", flush=True)
