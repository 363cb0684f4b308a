"""Bounds on the two per-shape caches behind PyTorch's oneDNN matmuls on CPU.

Every bf16 (and oneDNN-packed) matmul of a new shape creates a oneDNN primitive, kept in
oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and in ideep's LRU cache of
computations (`LRU_CACHE_CAPACITY`), 1024 entries each by default. A server's prefill steps have
a new row count nearly every time (prompt lengths less prefix-cache hits, plus the decodes
batched with them), so both caches fill to their capacity; at SmolLM2's shapes an entry holds
0.4-0.6 MB (generated kernels, scratchpad), so a full pair is about 1 GB of resident memory that
looked like a leak in the 20-minute soak (docs/benchmarks.md#soak). Row counts that never come
back gain nothing from being cached, and those that do (decode batch sizes, whose first 64 rows
run the native kernel anyway) are few: DEFAULT_CAPACITY entries each keep the caches to about
a tenth of that.

Both libraries read their variable once, at their first matmul: `bound_onednn_caches()` must
run before the process's first oneDNN call (the CPU platform's `prepare` and `auto_dtype` call
it). A value the user set is kept. A capacity of 0 crashes ideep (torch 2.13): the floor is 1.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"
DEFAULT_CAPACITY = 128


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Set both cache capacities to `capacity` where the environment does not already say;
    returns the values in force (which, once a matmul has run, may already be fixed)."""
    value = str(max(1, capacity))
    for name in (ONEDNN_CACHE_ENV, IDEEP_CACHE_ENV):
        current = os.environ.get(name, "").strip()
        if not current.isdigit() or (name == IDEEP_CACHE_ENV and int(current) < 1):
            os.environ[name] = value
    return {name: os.environ[name] for name in (ONEDNN_CACHE_ENV, IDEEP_CACHE_ENV)}
