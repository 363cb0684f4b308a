#!/usr/bin/env bash
# Download into .whl/ (git-ignored; run where pip reaches a package index) the wheels that
# scripts/gpu_check.sh and scripts/bench_gpu.sh install on a lent GPU machine, which reaches none.
# That image has python 3.12 with torch, triton, transformers, tokenizers, safetensors,
# huggingface_hub, numpy, tqdm, pyyaml, jinja2, psutil, prometheus-client, httpx, pytest and
# pytest-xdist, but not the rest of the model-server extra.
#
# `bench throughput`, `bench latency`, tools/gpu_parity.py and the gpu tests need nothing beyond
# that image (the `serve` flags, which import pydantic, are not built for `bench`). These wheels
# are for the rest of the CLI: pydantic and pydantic-settings (`serve` flags, settings; the
# compiled pydantic-core as its cp312 manylinux wheel) and gguf (.gguf models), with the newer
# typing-extensions pydantic needs (torch pins none); tools/gpu_wheels.py's REQUIRED_WHEELS lists
# them and checks the folder afterwards (about 3 MiB; a device call carries 64 MiB). Versions:
# those this repo is tested with. fastapi and uvicorn (the HTTP server) are left out.
#
# Usage: bash scripts/fetch_gpu_wheels.sh [NAME==VERSION ...]   (extra wheels to add)
# Environment: PYTHON (python3, with pip), WHEEL_DIR (.whl), WHEEL_PYTHON_VERSION (3.12).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DEST="${WHEEL_DIR:-$ROOT/.whl}"
PYVER="${WHEEL_PYTHON_VERSION:-3.12}"

WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5          # compiled: the cp312 manylinux wheel
  pydantic-settings==2.16.3
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  python-dotenv==1.2.4
  gguf==0.19.0                   # imports numpy and pyyaml only (requests: its scripts only)
)

mkdir -p "$DEST"
# --no-deps: the list above is the closure over what the image lacks. Pure-python wheels
# (py3-none-any) satisfy any --platform.
"$PY" -m pip download --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}" "$@"
echo "wheels in $DEST:"
ls -1 "$DEST"
cd "$ROOT" && "$PY" -m tools.gpu_wheels "$DEST"
