"""The container smoke test's prerequisite check (runs everywhere; the smoke test is opt-in)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deploy.test_container import APT_PACKAGES, missing_prerequisites


def _tool(folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n")
    (folder / name).chmod(0o755)


@pytest.fixture
def no_sbin(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check also looks in the sbin folders, where this machine may have iptables.
    monkeypatch.setattr("tests.deploy.test_container._SBIN", "")


def test_every_missing_binary_is_named(tmp_path: Path, no_sbin: None) -> None:
    bin_dir, helpers = tmp_path / "bin", tmp_path / "podman"
    _tool(bin_dir, "podman")
    _tool(helpers, "aardvark-dns")
    missing = missing_prerequisites(str(bin_dir), (str(helpers),))
    assert missing == ["runc", "debootstrap", "netavark", "iptables or nft"]


@pytest.mark.parametrize("firewall", ["iptables", "nft"])
def test_nothing_missing_with_either_firewall(tmp_path: Path, no_sbin: None, firewall: str) -> None:
    bin_dir, helpers = tmp_path / "bin", tmp_path / "podman"
    for name in ("podman", "runc", "debootstrap", firewall):
        _tool(bin_dir, name)
    for name in ("netavark", "aardvark-dns"):
        _tool(helpers, name)
    assert missing_prerequisites(str(bin_dir), (str(helpers),)) == []
    os.chmod(helpers / "netavark", 0o644)  # present but not executable
    assert missing_prerequisites(str(bin_dir), (str(helpers),)) == ["netavark"]


def test_the_readme_installs_what_the_check_names() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f"apt-get install {APT_PACKAGES}" in " ".join(readme.split())
