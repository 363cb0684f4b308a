"""The on-disk cache of CPU kernel timings, so that only the first start on a machine times.

One JSON file per machine identity: the CPU's model name and feature flags, torch's version and
the thread count (what decides which kernel is fastest). It lives under
`${WICK_CACHE_DIR:-~/.cache/wick}/cpu_tuning/`, the root of the native kernels' builds
(kernels/cpu/native.py) and of the GGUF weight cache. Entries are keyed by what was timed
(kind, dtype, shape, row buckets) and hold raw timings, so every choice derived from them is
reproducible. A file that
cannot be read or parsed, or was written for another identity or format, is ignored with one
warning and rewritten on the next save.

Processes that time at the same moment (a node's tensor-parallel ranks, whose shapes differ when
heads split unevenly; two servers starting together) share the file: a save holds a lock on it,
reads what the others saved meanwhile and writes that with its own new entries, so no process's
timings are lost to another's write.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_server.settings_spec import wick_cache_dir

logger = logging.getLogger(__name__)

# Raised whenever the candidates or how they are timed change, so that older timings are taken
# again (2: the native skinny matmul; 3: float weights timed cold; 4: native up to 64 rows; 5:
# the native panel matmul; 6: GGUF weights kept quantized, with the int8 dot-product kernel; 7:
# the panels without software prefetch).
FORMAT_VERSION = 7


def cache_root() -> Path:
    """Wick's cache folder: --cache-dir ($WICK_CACHE_DIR), else ~/.cache/wick."""
    return wick_cache_dir()


def _cpuinfo_field(*names: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_identity(flags: frozenset[str] | None = None, isa: str | None = None) -> dict[str, str]:
    """What the timings depend on. `flags`: the CPU's feature flags (the platform's view, which
    WICK_CPU_FLAGS may fake); read from /proc/cpuinfo when None. `isa`: the native build the
    kernels run (WICK_CPU_ISA may pick a lower one than the flags allow: its kernels, and which
    of them exist, differ; None: no build)."""
    if flags is None:
        flags = frozenset(_cpuinfo_field("flags", "Features").split())
    flag_text = " ".join(sorted(flags))
    return {
        "cpu": _cpuinfo_field("model name") or os.uname().machine,
        "flags_sha": hashlib.sha256(flag_text.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "isa": isa or "none",
    }


@dataclass(slots=True)
class TuningCache:
    """Timings by key, loaded from and saved to one file (`path` None: memory only)."""

    path: Path | None
    identity: dict[str, str]
    entries: dict[str, Any] = field(default_factory=dict)
    # Keys put since the last save: what a save adds to the file as others left it.
    changed: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, identity: dict[str, str], root: Path | None = None) -> TuningCache:
        """The cache file of `identity` under `root` (default `cache_root()`), read if present."""
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        path = (root or cache_root()) / "cpu_tuning" / f"{digest}.json"
        cache = cls(path, identity)
        cache.entries = _read(path, identity)
        return cache

    def get(self, key: str) -> Any | None:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        self.changed.add(key)

    def save(self) -> None:
        """Add the entries put since the last save to the file as it is now (under a lock, so
        that concurrent savers each add theirs), written atomically (a concurrent reader sees
        the old or the new file); an unwritable folder only costs the timing at the next
        start."""
        if self.path is None or not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.parent / f"{self.path.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                saved = _read(self.path, self.identity, quiet=True)
                self.entries = {**saved, **{k: self.entries[k] for k in self.changed}}
                payload = {
                    "version": FORMAT_VERSION,
                    "identity": self.identity,
                    "entries": self.entries,
                }
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(payload, f, sort_keys=True)
                os.replace(tmp, self.path)
            self.changed.clear()
        except OSError as exc:
            logger.warning("cannot write the CPU tuning cache %s: %s", self.path, exc)


def _read(path: Path, identity: dict[str, str], quiet: bool = False) -> dict[str, Any]:
    """The file's entries; {} when it is missing or unusable (warned about unless `quiet`: a
    save replaces an unusable file without a second warning)."""
    if not path.exists():
        return {}
    try:
        payload = json.loads(path.read_text())
        if (
            not isinstance(payload, dict)
            or payload.get("version") != FORMAT_VERSION
            or payload.get("identity") != identity
            or not isinstance(payload.get("entries"), dict)
        ):
            raise ValueError("stale or foreign format")
        return payload["entries"]
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        if not quiet:
            logger.warning("ignoring the CPU tuning cache %s (%s): timing again", path, exc)
        return {}
