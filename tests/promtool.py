"""Debian's prometheus package for tests: `promtool check metrics` (lint a Prometheus text
exposition) and the server binary (`prometheus_binary`, for the dashboard's queries).

vLLM's metric names (`vllm:…`) contain a colon, which promtool's linter reserves for recording
rules ("metric names should not contain ':'", exit code 3). That naming is deliberate (existing
dashboards and autoscaling rules use it), so that one lint is accepted; every other lint problem
and every parse error (exit code 1) is reported.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

INSTALL_HINT = (
    "promtool is not installed; install Debian's prometheus package: "
    "`apt-get update && apt-get install -y --no-install-recommends prometheus`"
)
SERVER_INSTALL_HINT = INSTALL_HINT.replace("promtool is", "the prometheus server is")
# promtool's exit codes: 0 clean, 1 failure (parse error), 3 lint problems only.
_LINT_EXIT_CODE = 3
_ACCEPTED_LINT = "metric names should not contain ':'"


def prometheus_binary() -> str:
    """The Prometheus server (the same Debian package as promtool; scripts/setup.sh installs
    it for the test extra). Fails the calling test, with how to install it, when absent."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail(SERVER_INSTALL_HINT)
    return exe


def promtool_check_metrics(exposition: bytes) -> list[str]:
    """Problems promtool finds in `exposition`, minus the accepted colon lint (empty = pass).

    Fails the calling test (with how to install it) when promtool is absent."""
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(INSTALL_HINT)
    proc = subprocess.run(
        [exe, "check", "metrics"], input=exposition, capture_output=True, timeout=60
    )
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    if proc.returncode not in (0, _LINT_EXIT_CODE):
        return [f"promtool exited {proc.returncode}: {output.strip()}"]
    return [
        line
        for line in output.splitlines()
        if line.strip() and not line.rstrip().endswith(_ACCEPTED_LINT)
    ]
