"""Which vector ISA the native CPU kernels are built for, chosen from the CPU's flags at run time.

The CPU's flags are read here (the `flags` line of /proc/cpuinfo, replaced by `WICK_CPU_FLAGS`
when set), for the kernels and for platforms/cpu.py (which sits above kernels). `WICK_CPU_ISA`
forces a lower path than the CPU allows, e.g. `avx2` on an AVX-512 machine to test both paths
there; a forced path the CPU cannot run is refused with a warning and the best one is used.
Both are settings (`--cpu-flags`, `--cpu-isa`, settings_spec.py) that configure the process:
the entry points export a given flag to its variable before anything loads, and this module
reads the variable, in every process (tensor-parallel workers inherit it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

logger = logging.getLogger(__name__)

# Replaces the flags read from /proc/cpuinfo (space-separated): runs the native-bf16 branches
# on a CPU without it (or the fp32 ones on a CPU with it), e.g. to test both on one machine.
CPU_FLAGS_ENV = "WICK_CPU_FLAGS"
CPU_ISA_ENV = "WICK_CPU_ISA"


@dataclass(frozen=True)
class Isa:
    name: str
    # Compiler flags of this build: explicit, never -march=native, so that the build is what the
    # name says and a forced lower path really runs the lower instructions.
    cflags: tuple[str, ...]
    # /proc/cpuinfo flags the CPU needs to run it.
    requires: frozenset[str]


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
# Best first; `generic` is plain -O3 for the compiler's default target (any architecture).
ISAS: tuple[Isa, ...] = (
    # Every CPU with avx512_bf16 (Cooper Lake, Sapphire Rapids, Zen 4) has avx512_vnni, which
    # the GGUF int8 matmul uses (gguf_q8.c); the plain avx512 build does without.
    Isa(
        "avx512_bf16",
        (*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mprefer-vector-width=512"),
        _AVX512_FLAGS | {"avx512_bf16", "avx512_vnni"},
    ),
    Isa("avx512", (*_AVX512, "-mprefer-vector-width=512"), _AVX512_FLAGS),
    Isa("avx2", _AVX2, _AVX2_FLAGS),
    Isa("generic", (), frozenset()),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)


def cpu_flags() -> frozenset[str]:
    faked = os.environ.get(CPU_FLAGS_ENV, "")
    if faked.strip():  # empty counts as unset, as every setting's variable
        return frozenset(faked.split())
    return read_cpu_flags("/proc/cpuinfo")


@cache
def read_cpu_flags(cpuinfo: str) -> frozenset[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def hardware_isas(isas: Sequence[Isa]) -> tuple[Isa, ...]:
    """`isas` less the paths this CPU's hardware cannot run. WICK_CPU_FLAGS may name flags the
    CPU lacks (to take another CPU's decisions: --dtype auto, the tuning cache's key), but code
    built for them dies on an illegal instruction at its first call, so the builds follow the
    flags /proc/cpuinfo reports (warned once). Nothing is removed where it cannot be read."""
    hardware = read_cpu_flags("/proc/cpuinfo")
    if not hardware:
        return tuple(isas)
    kept = tuple(isa for isa in isas if isa.requires <= hardware)
    if isas and kept[:1] != tuple(isas[:1]):
        _warn_lacking(isas[0].name, kept[0].name if kept else "none")
    return kept


@cache
def _warn_lacking(wanted: str, used: str) -> None:
    logger.warning(
        "%s names flags this CPU lacks: the native kernels are built for %s, not %s (the "
        "faked flags still decide everything else)",
        CPU_FLAGS_ENV,
        used,
        wanted,
    )


def supported_isas(flags: frozenset[str]) -> list[Isa]:
    """The paths a CPU with `flags` can run, best first (always ends with `generic`)."""
    return [isa for isa in ISAS if isa.requires <= flags]


def choose_isas() -> list[Isa]:
    """The paths to try, best first: the CPU's, capped by `WICK_CPU_ISA` when it is set."""
    return _choose(cpu_flags(), os.environ.get(CPU_ISA_ENV, "").strip().lower())


@cache
def _choose(flags: frozenset[str], forced: str) -> list[Isa]:
    runnable = supported_isas(flags)
    if forced in ("", "auto"):
        return runnable
    if forced not in ISA_NAMES:
        logger.warning(
            "%s=%s is not one of %s: using %s", CPU_ISA_ENV, forced, ISA_NAMES, runnable[0].name
        )
        return runnable
    names = [isa.name for isa in runnable]
    if forced not in names:
        logger.warning(
            "%s=%s: this CPU lacks %s; using %s",
            CPU_ISA_ENV,
            forced,
            " ".join(sorted(next(i for i in ISAS if i.name == forced).requires - flags)),
            names[0],
        )
        return runnable
    return runnable[names.index(forced) :]
