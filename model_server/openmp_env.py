"""OpenMP's thread waiting, set before torch (and with it libgomp) is loaded.

libgomp reads its environment once, when it is loaded. Unless told otherwise, its worker threads
spin 300,000 times after every parallel region before they sleep, and a decode step opens a few
hundred regions (torch's matmuls, the native kernels). On an idle CPU the spinning saves a wake-up
per region; on a CPU that other processes also use, the spinning workers take the cores that the
next region's workers need, and every fork/join waits for a scheduler tick. On a 2-core Zen 4:

    GOMP_SPINCOUNT               busy box: one bf16 matmul    idle box: decode step
                                 1 x 3072x576                 batch 1 / batch 16
    300,000 (libgomp's default)  20-24 ms                     15.8 / 27.8 ms
    10,000 (ours)                2.0 ms                       15.5 / 25.1 ms
    1,000                        0.3-0.45 ms                  18.7 / 30.7 ms
("busy": 7-9 other busy processes on the 2 cores.)

So the entry points (`python -m model_server`, the tests) set a short spin count unless the user
chose a wait policy or spin count of their own.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"


def set_openmp_wait_defaults(environ: dict[str, str] | None = None) -> bool:
    """GOMP_SPINCOUNT=SPIN_COUNT unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set. Returns whether
    it set it. Only has an effect before libgomp is loaded (before `import torch`)."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
