#!/usr/bin/env bash
# One command for a bare lent GPU machine: machine facts, the compiled kernel tests, end-to-end
# parity (HF vs Wick eager vs Wick graphs), the 8B batch-1 bound and the 0.6B latency and
# throughput figures, inside one 10-minute call (tools/gpu_check.py says what each stage does).
#
# Usage: bash scripts/gpu_check.sh [--dry-run] [--budget-s S] [--deadline-s S]
#   --dry-run  on a CPU (the test suite runs it): checks the plan and the carried wheels, runs
#              stages A-C small under TRITON_INTERPRET=1
#
# It uses the python3 already there (with torch, Triton and transformers): no venv, no package
# index. The few wheels the engine still needs come from $WHEEL_DIR (.whl/, git-ignored: a copy
# of the tree must carry it), filled on a machine with an index by scripts/fetch_gpu_wheels.sh,
# and are installed into $SITE_DIR, which goes on PYTHONPATH after the repository root.
#
# Environment: PYTHON (python3), OUT (results: summary.json, run.log, junit_kernels.xml;
# default bench_results/gpu_check), WHEEL_DIR (.whl), SITE_DIR (/tmp/wick-site).
# Exit status: 0 when every step that ran passed (and, dry, the plan and wheels are sound).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/bench_results/gpu_check}"
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
SITE_DIR="${SITE_DIR:-/tmp/wick-site}"

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done

cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR" || exit 2

# The dry run's python is not the machines' 3.12: tools/gpu_wheels.py checks the wheels there.
if [[ $DRY_RUN -eq 0 ]] && compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
  mkdir -p "$SITE_DIR"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE_DIR" \
      "$WHEEL_DIR"/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$SITE_DIR"
  else
    echo "gpu_check.sh: could not install the wheels in $WHEEL_DIR; going on without them" >&2
  fi
fi

exec "$PY" -m tools.gpu_check --out "$OUT_DIR" --wheel-dir "$WHEEL_DIR" "$@"
