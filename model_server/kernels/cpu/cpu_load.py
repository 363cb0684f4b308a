"""How much of the machine's CPU other processes used while we timed kernels.

Kernel timings taken while something else runs are wrong in a lasting way: on a 2-core box with
one busy neighbour a two-thread kernel gets one core and looks twice as slow, so a plan timed
then favours single-thread kernels. The tuner still uses such timings for the start that took
them, but caches only timings taken on a quiet machine (kernels/cpu/linear_tuning.py).

Linux: the machine's busy CPU time (/proc/stat: everything but idle and iowait, steal included,
since a hypervisor taking our cores slows us just the same) minus this process's own CPU time,
over the window. Elsewhere: the 1-minute load average less one runnable task (ourselves).

A process that times on fewer threads than the machine has cores (a tensor-parallel rank, which
gets its share of the node's cores, or `--num-threads`) leaves the other cores to others: load
there is expected and does not count. The node's other ranks time their own shapes at the same
moment, and run beside this one when serving; counted as a neighbour, they made every
tensor-parallel start on one machine look busy, so its timings were never cached.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

# Other processes' share of all cores above which a machine counts as busy for timing.
BUSY_SHARE = 0.25


def _busy_seconds() -> float | None:
    """CPU-seconds all cores spent busy since boot (/proc/stat), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _num_cpus() -> int:
    try:
        return os.cpu_count() or 1
    except NotImplementedError:  # pragma: no cover
        return 1


def _own_seconds() -> float:
    """CPU-seconds of this process and its reaped children: the compiler that builds the native
    kernels on first use (kernels/cpu/native.py) runs inside the window and is ours, not a
    neighbour's (counted as others, it made every first start look busy)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


@dataclass(slots=True)
class LoadWindow:
    """Opened before timing, read after: `others_share()` is the share of all cores that other
    processes kept busy in between (0 = idle apart from us, 1 = every core busy). `threads`:
    the cores the timing runs on (torch's threads, which the native kernels take too)."""

    threads: int = field(default_factory=torch.get_num_threads)
    wall: float = field(default_factory=time.perf_counter)
    own: float = field(default_factory=_own_seconds)
    busy: float | None = field(default_factory=_busy_seconds)

    def others_share(self) -> float:
        wall = time.perf_counter() - self.wall
        busy = _busy_seconds()
        if self.busy is None or busy is None or wall < 0.05:
            # Too short for /proc/stat's 10 ms ticks, or not Linux: the load average.
            try:
                load = os.getloadavg()[0]
            except OSError:
                return 0.0
            return max(0.0, load - 1.0) / _num_cpus()
        others = (busy - self.busy) - (_own_seconds() - self.own)
        return min(1.0, max(0.0, others / (wall * _num_cpus())))

    def busy_machine(self) -> bool:
        """Whether others kept more than BUSY_SHARE of the cores we time on busy: the cores
        beyond our threads are theirs to use (see the module docstring)."""
        ours = min(max(self.threads, 1), _num_cpus()) / _num_cpus()
        return self.others_share() > (1.0 - ours) + BUSY_SHARE * ours
