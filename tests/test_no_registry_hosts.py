"""No package-registry host is written in the repository: indexes and mirrors come from
variables (WICK_TORCH_INDEX_URL, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, WICK_DEBIAN_MIRROR; see
docs/deployment.md), and when none is set each tool uses its own default."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Package registries and their download hosts (pip, PyTorch's wheel index, Debian/Ubuntu apt,
# npm, conda), and the Kubernetes SIG project sites that serve manifests and charts. Written as
# patterns so that this file does not name them itself.
REGISTRY_HOSTS = re.compile(
    r"pypi\.org|pypi\.python\.org|pythonhost(?:ed)\.org|download\.pytorch\.org"
    r"|deb\.debian\.org|security\.debian\.org|ftp\.debian\.org|archive\.ubuntu\.com"
    r"|registry\.npmjs\.org|registry\.yarnpkg\.com|conda\.anaconda\.org|repo\.anaconda\.com"
    r"|[a-z0-9-]+\.sigs\.k8s\.io",
    re.IGNORECASE,
)


def repository_files() -> list[Path]:
    """Tracked files plus untracked ones git does not ignore (what a commit would hold)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [ROOT / name for name in out.decode().split("\0") if name]


def registry_hosts(path: Path) -> list[str]:
    """`file:line: host` for every registry host in a text file (binary files are skipped)."""
    try:
        text = path.read_text()
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return []
    return [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for number, line in enumerate(text.splitlines(), 1)
        for match in REGISTRY_HOSTS.finditer(line)
    ]


def test_no_registry_host_in_the_repository() -> None:
    files = repository_files()
    assert len(files) > 50  # really the repository
    found = [hit for path in files for hit in registry_hosts(path)]
    assert found == [], "registry hosts (use a variable instead):\n" + "\n".join(found)


def test_the_check_finds_a_host(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    host = ".".join(("download", "pytorch", "org"))  # joined: this file names no host itself
    bad = tmp_path / "setup.sh"
    bad.write_text(f"ok\npip install torch --index-url https://{host}/whl/cpu\n")
    assert registry_hosts(bad) == [f"setup.sh:2: {host}"]
