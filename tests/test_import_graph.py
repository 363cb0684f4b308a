"""The packages import only downwards and without cycles (read from the source: see
tests/import_graph.py; deferred imports inside functions count too).

Layers, low to high: a module may import its own package and anything in a lower layer.
"""

from __future__ import annotations

import ast

import pytest

from tests.import_graph import cycles, import_graph, longest_chain, module_files

LAYERS: list[tuple[str, ...]] = [
    # Plain values every layer shares; the settings' declarations (config's defaults).
    (
        "sampling_params",
        "config",
        "settings_spec",
        "settings_aliases",
        "engine.outputs",
        "structured_output.params",
        "lora.request",  # which adapter a request runs with
        "lora.config",
    ),
    ("openmp_env",),  # set by the entry points before torch loads; imports nothing of ours
    ("distributed", "kernels"),
    ("platforms",),  # devices, and the kernel table each hands the model builder
    ("layers", "structured_output"),  # grammar engine: compiles, matchers, bitmasks
    ("models",),
    ("loader",),
    ("lora",),  # LoRA adapters: PEFT folders, the wrapped layers, the slots
    ("engine.spec_decode",),  # draft proposers (token lists only) and their counters
    ("engine.core",),  # pure bookkeeping: requests, scheduler, KV blocks
    ("engine.execution",),  # executors, workers, the model runner
    ("engine",),  # the fronts: EngineCore, LLMEngine, AsyncLLM, LLM, output processing
    ("settings", "metrics"),
    ("benchmarks",),
    ("entrypoints", "__main__"),
]
RANK = {f"model_server.{name}": rank for rank, names in enumerate(LAYERS) for name in names}
GRAPH = import_graph()


def package_of(module: str) -> str:
    """The most specific entry of LAYERS that holds `module`."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        candidate = ".".join(parts[:n])
        if candidate in RANK:
            return candidate
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == []
    assert len(longest_chain(GRAPH)) > 5  # the reader finds real chains


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("model_server.")))
def test_imports_point_down(module: str) -> None:
    rank = RANK[package_of(module)]
    upward = [
        target
        for target in sorted(GRAPH[module])
        if target.startswith("model_server.") and RANK[package_of(target)] > rank
    ]
    assert not upward, f"{module} (layer {rank}) imports from higher layers: {upward}"


def test_the_microservice_never_imports_the_model_server() -> None:
    # It is deployed on its own (no torch in its image): it speaks HTTP to the model server.
    leaks = {m: t for m, t in GRAPH.items() if m.startswith("microservice") and any(
        x.startswith("model_server") for x in t)}  # fmt: skip
    assert not leaks


def _imported_roots(path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_bookkeeping_needs_no_torch_and_nothing_imports_the_tools() -> None:
    files = module_files()
    pure = [
        m
        for m in files
        if m.startswith(("model_server.engine.core", "model_server.engine.outputs"))
    ]
    assert len(pure) >= 4
    assert [m for m in pure if "torch" in _imported_roots(files[m])] == []
    assert [m for m, path in files.items() if "tools" in _imported_roots(path)] == []


def test_the_reader_sees_deferred_imports_and_skips_type_checking_ones(tmp_path) -> None:
    pkg = tmp_path / "model_server"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from model_server import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model_server.a import f\n"
        "from . import c\n"
    )
    (pkg / "c.py").write_text("import model_server.a\n")
    graph = import_graph(("model_server",), tmp_path)
    assert graph["model_server.a"] == {"model_server.b"}
    assert graph["model_server.b"] == {"model_server.c"}
    assert cycles(graph) == [["model_server.a", "model_server.b", "model_server.c"]]


def test_models_never_import_the_cpu_kernels() -> None:
    """A model describes its layers (kernels/stack_layer.py); which of them run natively, and
    how, is the platform's decision (platforms/, kernels/cpu/), never the model's."""
    leaks = {
        m: sorted(t for t in targets if t.startswith("model_server.kernels.cpu"))
        for m, targets in GRAPH.items()
        if m.startswith("model_server.models")
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_every_kernel_table_slot_is_one_op() -> None:
    """The kernel table holds one function per op a layer calls; a whole-model executor (the
    native decoder step) is the runner's fast path, planned by the platform, never a slot.
    A new slot is added here with the op it computes."""
    import dataclasses

    from model_server.kernels.table import KernelTable

    one_op_slots = {
        "linear", "int8_linear", "wna16_linear", "gguf_linear", "gguf_dequantize", "rms_norm",
        "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding",
        "fused_experts", "argmax", "layer_norm", "fused_add_layer_norm", "gelu",
        "varlen_attention", "moe_softmax_topk", "shared_expert_add", "lora_add",
        "moe_grouped_topk",
    }  # fmt: skip
    assert {f.name for f in dataclasses.fields(KernelTable)} == one_op_slots
