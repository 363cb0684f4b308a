"""The test folders mirror the packages they test, so a module's tests are found by its path."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Suites that cut across packages: whole processes, deployment files, examples.
CROSS_CUTTING = {"e2e", "deploy", "examples"}


def test_every_test_folder_mirrors_a_package() -> None:
    strays = []
    for folder in sorted(p for p in (ROOT / "tests").rglob("*") if p.is_dir()):
        rel = folder.relative_to(ROOT / "tests")
        if rel.parts[0] in CROSS_CUTTING or "__pycache__" in rel.parts:
            continue
        if rel.parts[0] == "microservice" and rel.parts[1:] == ("opea",):
            continue  # the real opea-comps client's own venv helper and scripts
        if not any((ROOT / top / rel).is_dir() for top in ("model_server", ".")):
            strays.append(str(rel))
    assert strays == [], f"test folders with no package of that path: {strays}"
