"""The OpenMP wait default (model_server/openmp_env.py): a short spin count unless the user chose
a wait policy or spin count, set by `python -m model_server` before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from model_server.openmp_env import SPIN_COUNT, set_openmp_wait_defaults

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_is_set_only_where_the_user_chose_nothing() -> None:
    env: dict[str, str] = {}
    assert set_openmp_wait_defaults(env) and env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not set_openmp_wait_defaults(env) and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "5"}
    assert not set_openmp_wait_defaults(env) and env == {"GOMP_SPINCOUNT": "5"}


def test_the_server_command_sets_it_before_torch_is_loaded() -> None:
    """`python -m model_server` runs the CLI with the default in its environment, and torch was
    not imported before (libgomp reads its environment when it loads)."""
    probe = (
        "import runpy, sys\n"
        "import model_server.openmp_env as m\n"
        "original = m.set_openmp_wait_defaults\n"
        "def spy(*a):\n"
        "    print('torch loaded before:', 'torch' in sys.modules)\n"
        "    return original(*a)\n"
        "m.set_openmp_wait_defaults = spy\n"
        "sys.argv = ['model_server', '--help']\n"
        "try:\n"
        "    runpy.run_module('model_server', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "import os\n"
        "print('GOMP_SPINCOUNT', os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "torch loaded before: False" in out
    assert f"GOMP_SPINCOUNT {SPIN_COUNT}" in out
