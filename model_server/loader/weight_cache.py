"""A dequantized copy of a GGUF's weights, kept as one safetensors file for fast reloads.

Location: `${WICK_CACHE_DIR:-~/.cache/wick}/gguf/<stem>-<key>.safetensors`, where the key hashes
the GGUF's real path, size, mtime and CACHE_FORMAT (so a change to name mapping or
un-permutation invalidates old copies). The file is written while the first load streams the
weights (no second pass, no extra memory: every tensor's dtype and shape is known up front, so
the safetensors header is written first) into a temporary file in the same folder, renamed into
place only once every tensor is in. `--no-gguf-weight-cache` (`WICK_NO_GGUF_CACHE=1`) turns it
off; `--cache-dir` (`WICK_CACHE_DIR`) moves it. Both configure the process: the entry points
export a given flag to its variable, which this module reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from model_server.loader.source import WeightIterator
from model_server.settings_spec import resolve_setting, wick_cache_dir

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the produced tensors would differ
MAX_CACHE_BYTES = 8 << 30  # bigger models are dequantized on every load instead
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(slots=True, frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * self.dtype.itemsize


def cache_dir() -> Path:
    return wick_cache_dir()


def cache_file_for(source: str) -> Path | None:
    """Where the copy of `source` lives (whether or not it exists); None when caching is off."""
    if not resolve_setting("gguf_weight_cache"):  # WICK_NO_GGUF_CACHE=1
        return None
    real = os.path.realpath(source)
    st = os.stat(real)
    identity = f"{real}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    return cache_dir() / "gguf" / f"{Path(real).stem}-{key[:16]}.safetensors"


def cached_weights(
    source: str, specs: list[TensorSpec], produce: Callable[[], WeightIterator]
) -> Callable[[], WeightIterator]:
    """A `weights()` callable: reads the cached copy when it is complete, else runs `produce()`
    (which must yield exactly `specs`, in order) and saves what it yields for next time."""

    def weights() -> WeightIterator:
        target = cache_file_for(source)
        if target is not None and target.is_file():
            try:
                return _read_cached(target, specs)
            except Exception as exc:  # a corrupt copy costs a reload, never a failure
                logger.warning("ignoring unreadable weight cache %s: %s", target, exc)
                target.unlink(missing_ok=True)
        if target is None or not _worth_caching(target, specs):
            return produce()
        return _produce_and_save(produce(), target, specs)

    return weights


def _read_cached(path: Path, specs: list[TensorSpec]) -> WeightIterator:
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")  # validates the header now, not mid-load
    if set(handle.keys()) != {s.name for s in specs}:
        raise ValueError("tensor names differ from the GGUF's")

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in specs:
            yield spec.name, handle.get_tensor(spec.name)

    return read()


def _worth_caching(target: Path, specs: list[TensorSpec]) -> bool:
    total = sum(s.nbytes for s in specs)
    if total > MAX_CACHE_BYTES:
        return False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target.parent).free
    except OSError as exc:
        logger.warning("not caching dequantized weights in %s: %s", target.parent, exc)
        return False
    return free > total + (1 << 30)  # leave a GiB for everyone else


def _produce_and_save(
    produced: WeightIterator, target: Path, specs: list[TensorSpec]
) -> WeightIterator:
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    except OSError as exc:
        logger.warning("not caching dequantized weights in %s: %s", target.parent, exc)
        yield from produced
        return
    tmp = Path(tmp_name)
    complete = False
    try:
        with os.fdopen(fd, "wb") as out:
            _write_header(out, specs)
            expected = iter(specs)
            for name, tensor in produced:
                spec = next(expected, None)
                if spec is None or (name, tensor.dtype, tuple(tensor.shape)) != (
                    spec.name,
                    spec.dtype,
                    spec.shape,
                ):
                    raise RuntimeError(f"weight {name} does not match the cache plan {spec}")
                out.write(tensor.contiguous().view(torch.uint8).numpy().data)
                yield name, tensor
            complete = next(expected, None) is None
        if complete:
            os.replace(tmp, target)  # atomic: readers see no file or a whole one
            logger.info("cached dequantized weights at %s", target)
    finally:
        if not complete:
            tmp.unlink(missing_ok=True)


def _write_header(out: IO[bytes], specs: list[TensorSpec]) -> None:
    # safetensors: u64 header length, JSON header, then the tensors back to back in offset order
    header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "wick"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned
    out.write(len(raw).to_bytes(8, "little"))
    out.write(raw)
