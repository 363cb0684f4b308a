"""The memory-bandwidth bound of a decode step, for `bench latency`.

At small batches a decode step is bound by memory bandwidth: it must stream every weight once
(and the KV cache of every sequence) from device memory, whatever the kernels do. So
`bandwidth / bytes per step` steps per second is the ceiling; the benchmark prints how close the
engine gets, against three bandwidths: the device's datasheet figure, a measured device copy
(bytes read plus bytes written) and a measured read. A decode step reads its weights and writes
almost nothing, so the read is the roof it can reach; the copy, whose writes cost the memory
more than reads (and on CPUs a read for ownership), is a lower one.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of import time
    import torch
    from torch import nn

# Peak memory bandwidth in GB/s (1e9 bytes/s) by `torch.cuda.get_device_name()`. A row matches
# when every one of its words appears among the name's words (lowercase, split on anything but
# letters and digits), so "NVIDIA A100-SXM4-80GB" and "a100 80gb" both match ("a100", "80gb").
# The first matching row wins: more specific rows come first ("L4" is a whole word, so it never
# matches "L40S"). Sources: NVIDIA's datasheets for the data-center parts; the GDDR parts are
# bus width x data rate.
PEAK_BANDWIDTH_GBS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h100", "nvl"), 3900.0),  # H100 NVL 94 GB HBM3
    (("h100", "pcie"), 2000.0),  # H100 PCIe 80 GB HBM2e
    (("h100",), 3350.0),  # H100 SXM5 80 GB HBM3, named "NVIDIA H100 80GB HBM3"
    (("h200",), 4800.0),  # H200 (SXM and NVL) 141 GB HBM3e
    (("a100", "80gb", "pcie"), 1935.0),  # A100 80 GB PCIe HBM2e
    (("a100", "80gb"), 2039.0),  # A100-SXM4-80GB HBM2e
    (("a100",), 1555.0),  # A100 40 GB (SXM4 and PCIe) HBM2
    (("l40s",), 864.0),  # L40S 48 GB GDDR6, 384-bit at 18 Gbps
    (("l4",), 300.0),  # L4 24 GB GDDR6, 192-bit
    (("4090", "laptop"), 576.0),  # RTX 4090 Laptop: 256-bit GDDR6 at 18 Gbps
    (("4090",), 1008.0),  # RTX 4090: 384-bit GDDR6X at 21 Gbps
    (("4070", "laptop"), 256.0),  # RTX 4070 Laptop (nano-vllm's bench GPU): 128-bit at 16 Gbps
    (("4070", "ti", "super"), 672.0),  # RTX 4070 Ti Super: 256-bit GDDR6X at 21 Gbps
    (("4070",), 504.0),  # RTX 4070 / 4070 Ti / 4070 Super: 192-bit GDDR6X at 21 Gbps
)

GB = 1e9
# The copy buffer: large enough to defeat caches (50 MB L2 on an H100, tens of MB of L3 on CPUs)
# and to make launch and timer overheads negligible.
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 256 << 20
# The read buffer on CPUs, and the stream counts each thread reads interleaved (kernels/cpu/
# memory_read.c): a GEMV at one row keeps several weight rows or panels in flight per core (the
# panels: up to 8), and one stream per core stays latency bound. Which count reads fastest
# differs by CPU and by run, so each is timed and the best counts: with 4 alone the "roof" was
# below what decodes reached (Zen 3, bf16 Llama-3.2-1B shape: 23.3 GB/s against a 22.1 GB/s
# roof, 105 %; 8 streams read 25.0 GB/s in the same minute; on a Zen 5 both servers read 53 GB/s
# against a 48.6 GB/s roof).
CPU_READ_BYTES = 256 << 20
CPU_READ_STREAMS: tuple[int, ...] = (2, 4, 8)
# Each timed trial lasts at least this long (several passes over a small or fast buffer), so
# that the timer and synchronize overheads stay small against it.
MIN_TRIAL_S = 0.02
# Timed trials of the read, of which the best counts: twice the copy's, since on a loaded
# machine (a neighbour's burst, a descheduled thread) a short trial reads low far more often
# than it reads high (2 cores, load 4: best of 5 ranged 25-39 GB/s between runs).
READ_TRIALS = 10


def peak_bandwidth_gbs(device_name: str | None) -> float | None:
    """The datasheet bandwidth (GB/s) of a device named like `torch.cuda.get_device_name()`, or
    None when the name is unknown (the measured-copy bound is still printed then)."""
    if not device_name:
        return None
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for required, gbs in PEAK_BANDWIDTH_GBS:
        if words.issuperset(required):
            return gbs
    return None


@dataclass(slots=True)
class StepBytes:
    """Bytes one decode step must read from device memory (this rank's share)."""

    weights: int
    kv_cache: int
    mean_context: float

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def weight_bytes_per_step(model: nn.Module, batch_size: int) -> int:
    """Parameter bytes a decode step of `batch_size` sequences reads: every parameter once,
    except an input embedding table that is not shared with the LM head, of which the step only
    gathers `batch_size` rows. A tied table is read whole by the LM head. Under tensor
    parallelism `model` holds this rank's shards, so this is this rank's share."""
    import torch

    from model_server.kernels.planned_weight import PlannedWeight, bucket_index
    from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    # A planned head (kernels/planned_weight.py) reads its source: the tied table itself.
    head_weights = {
        id(getattr(m.weight, "source", m.weight))
        for m in model.modules()
        if isinstance(m, ParallelLMHead)
    }
    gathered: dict[int, int] = {}  # id(embedding weight) -> bytes the step reads of it
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead):
            w = m.weight
            if id(w) not in head_weights:
                rows = min(batch_size, w.shape[0])
                if isinstance(w, torch.Tensor):
                    gathered[id(w)] = rows * w[0].numel() * w.element_size()
                else:  # a table kept quantized (GGUF): its rows' share of its bytes
                    for p in w.parameters():
                        gathered[id(p)] = rows * p.numel() * p.element_size() // w.shape[0]
    # A GGUF weight beside its float twin reads one of the two at this row count.
    unread: set[int] = set()  # ids of parameters and planned weights the step does not read
    for m in model.modules():
        if isinstance(m, PlannedWeight) and m.twin is not None:
            read = m.at_bucket(bucket_index(batch_size, len(m.kernel_names)))
            idle = m.twin if read is m else m.source
            assert idle is not None
            unread.update(id(x) for x in (idle, *idle.modules(), *idle.parameters()))
    # parameters() yields a shared (tied) parameter once. A weight whose values live only in an
    # opaque packed tensor (oneDNN's layout: no parameter) reads its matrix's bytes.
    opaque = sum(
        m.shape.numel() * m.dtype.itemsize
        for m in model.modules()
        if isinstance(m, PlannedWeight)
        and m.source is None
        and not hasattr(m, "packed_data")
        and id(m) not in unread
    )
    return opaque + sum(
        gathered.get(id(p), 0 if id(p) in unread else p.numel() * p.element_size())
        for p in model.parameters()
    )


def decode_step_bytes(
    model: nn.Module,
    batch_size: int,
    input_len: int,
    output_len: int,
    kv_bytes_per_token: int,
) -> StepBytes:
    """Bytes of the average decode step of `batch_size` sequences with `input_len` prompt and
    `output_len` output tokens. Decode step j (1..output_len-1) attends to input_len + j tokens,
    so the mean context is input_len + output_len / 2. `kv_bytes_per_token`: K and V of one
    token over all layers on this rank."""
    mean_context = input_len + output_len / 2
    kv = round(batch_size * mean_context * kv_bytes_per_token)
    return StepBytes(weight_bytes_per_step(model, batch_size), kv, mean_context)


def measure_copy_bandwidth(
    device: torch.device,
    synchronize: Callable[[], None],
    nbytes: int | None = None,
    trials: int = 5,
    *,
    host_memory: bool = False,
) -> float:
    """Achieved device-memory bandwidth in bytes/s of copying a large buffer: bytes read plus
    bytes written over the best of `trials` timings. `nbytes` defaults to 1 GiB on accelerators
    and 256 MiB on CPUs (`host_memory`). Needs 2 x `nbytes` of free device memory."""
    import torch

    if nbytes is None:
        nbytes = CPU_COPY_BYTES if host_memory else GPU_COPY_BYTES
    # Filled, not empty: untouched CPU pages would all read the shared zero page.
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst, first-launch costs
    return 2 * nbytes / _best_pass_seconds(lambda: dst.copy_(src), synchronize, trials)


def _best_pass_seconds(
    run: Callable[[], object], synchronize: Callable[[], None], trials: int
) -> float:
    """Seconds of one `run` (a pass over a buffer), the best of one timing and `trials` more.
    Each timing repeats the pass until it lasts MIN_TRIAL_S (a GPU copies 2 GiB in under a
    millisecond), so the host timer and synchronize overhead stay small against it."""
    synchronize()
    start = time.perf_counter()
    run()
    synchronize()
    single = time.perf_counter() - start
    repeats = max(1, min(50, math.ceil(MIN_TRIAL_S / max(single, 1e-9))))
    best = single
    for _ in range(trials):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        synchronize()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


@dataclass(slots=True)
class ReadBandwidth:
    """A measured read bandwidth and how it was measured (printed beside it)."""

    bytes_per_s: float
    # "native 2 threads x 2/4/8 streams (fastest 8), 256 MiB, best of 10 each", "torch sum, ..."
    method: str


def measure_read_bandwidth(
    device: torch.device,
    synchronize: Callable[[], None],
    nbytes: int | None = None,
    trials: int = READ_TRIALS,
    *,
    host_memory: bool = False,
    num_threads: int | None = None,
    streams: Sequence[int] = CPU_READ_STREAMS,
) -> ReadBandwidth:
    """Achieved read bandwidth in bytes/s: `nbytes` read once per pass over the best of `trials`
    timings (the best, as for the copy: the bound is what the memory can give, and a loaded
    machine only ever slows a pass down; on a quiet one the median is within a few percent).

    On the host CPU (`host_memory`) the native read kernel (kernels/cpu/memory_read.c) reads a
    filled buffer of `nbytes` (default CPU_READ_BYTES) on `num_threads` threads (default torch's
    count, which the engine set for its kernels), timed at each count of interleaved `streams`
    per thread; the fastest counts (method names it). Where the native kernels cannot be built,
    torch sums the buffer. On accelerators a torch sum over a 1 GiB float32 buffer: it reads
    every byte and writes one value."""
    import torch

    if nbytes is None:
        nbytes = CPU_READ_BYTES if host_memory else GPU_COPY_BYTES
    threads = num_threads or torch.get_num_threads()
    if host_memory:
        from model_server.kernels.cpu.native import load_kernels

        native = load_kernels()
    else:
        native = None
    size = f"{nbytes / (1 << 20):g} MiB"
    if native is None:
        buf = torch.full((nbytes // 4,), 1.0, dtype=torch.float32, device=device)
        buf.sum()  # first-launch costs
        best = _best_pass_seconds(buf.sum, synchronize, trials)
        return ReadBandwidth(nbytes / best, f"torch sum, {size}, best of {trials}")
    import ctypes

    # Filled, not empty: untouched pages would all read the shared zero page.
    buf = torch.full((nbytes,), 1, dtype=torch.uint8)
    checksum = ctypes.c_uint64()
    address = buf.data_ptr()
    seconds: dict[int, float] = {}
    for count in streams:
        read_once = functools.partial(
            native.lib.wick_memory_read, address, nbytes, count, threads, ctypes.addressof(checksum)
        )
        if read_once() != 0:
            raise ValueError(f"cannot read {nbytes} bytes as {threads} threads x {count} streams")
        seconds[count] = _best_pass_seconds(read_once, synchronize, trials)
    fastest = min(seconds, key=seconds.__getitem__)
    counts = "/".join(str(c) for c in seconds)
    timed = f"{counts} streams (fastest {fastest})" if len(seconds) > 1 else f"{fastest} streams"
    return ReadBandwidth(
        nbytes / seconds[fastest],
        f"native {threads} threads x {timed}, {size}, best of {trials} each",
    )


def bound_tokens_per_s(bandwidth_bytes_per_s: float, step: StepBytes, batch_size: int) -> float:
    """Output tokens/s of the whole batch if every step ran at `bandwidth`."""
    return batch_size * bandwidth_bytes_per_s / step.total
