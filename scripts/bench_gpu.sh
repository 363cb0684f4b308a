#!/usr/bin/env bash
# The GPU measurement of issue #6 in one command, on a CUDA machine. Steps, in order:
#   tests       the GPU tests: pytest -m gpu tests/kernels (and any other file with gpu tests)
#   throughput  bench throughput, nano-vllm's workload, Qwen3-0.6B (dummy weights), HF baseline
#   latency     bench latency, Llama-3.1-8B bf16 (dummy weights), batch 1, HF baseline
#   eager       the same latency with --enforce-eager (no CUDA graphs), without the baseline
#   int8        the same latency with --quantization int8 (w8a16 Triton kernel), no baseline
#   summary     a table of the figures next to the references (nano-vllm/vLLM 1.053x; ~200 tok/s)
# Each step's output goes to $BENCH_LOG_DIR/<step>.log and everything to bench_gpu.log there.
#
# Usage: bash scripts/bench_gpu.sh [--dry-run] [STEP ...]     (no STEP: all of them)
#   --dry-run  print the commands, run nothing (works without a GPU)
#   STEP ...   run only these (e.g. to split the work across calls; `summary` reads the step logs
#              already in $BENCH_LOG_DIR)
#
# It runs the system python (with torch, triton and transformers) on the source tree
# (PYTHONPATH=repo root): no venv, no network (./wick would build a CPU venv). When .whl/ holds
# wheels (scripts/fetch_gpu_wheels.sh), they are installed first into $SITE_DIR, which goes first
# on PYTHONPATH. .whl/ is git-ignored: a tool that copies the work tree must carry it explicitly.
#
# Environment: PYTHON (python3), BENCH_LOG_DIR (bench_results/gpu), WHEEL_DIR (.whl),
# SITE_DIR (/tmp/site).
# Exit status: 0 when every step ran cleanly, 1 when one failed, 2 when no CUDA device is visible.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LOG_DIR="${BENCH_LOG_DIR:-$ROOT/bench_results/gpu}"
WHEEL_DIR="${WHEEL_DIR:-$ROOT/.whl}"
SITE_DIR="${SITE_DIR:-/tmp/site}"
ALL_STEPS=(tests throughput latency eager int8 summary)

DRY_RUN=0
STEPS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    tests|throughput|latency|eager|int8|summary) STEPS+=("$arg") ;;
    *) echo "bench_gpu.sh: unknown argument '$arg' (steps: ${ALL_STEPS[*]}; --dry-run)" >&2; exit 2 ;;
  esac
done
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=("${ALL_STEPS[@]}")

cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Files outside tests/kernels that hold gpu-marked tests (collected only when there are some).
other_gpu_tests() {
  grep -rlE --include='test_*.py' 'mark\.gpu\b' tests 2>/dev/null | grep -v '^tests/kernels/' | sort
}

# Sets CMD to the command of step $1.
set_command() {
  local bench=("$PY" -m model_server bench)
  local llama=(--load-format dummy --model llama-3.1-8b --device cuda --dtype bfloat16)
  case "$1" in
    tests)
      local others
      mapfile -t others < <(other_gpu_tests)
      CMD=("$PY" -m pytest -m gpu tests/kernels "${others[@]}" -q -p no:cacheprovider) ;;
    throughput)
      CMD=("${bench[@]}" throughput --workload nano-vllm --load-format dummy --model qwen3-0.6b
           --device cuda --baseline transformers) ;;
    latency)
      CMD=("${bench[@]}" latency "${llama[@]}" --batch-size 1 --baseline transformers) ;;
    eager)
      CMD=("${bench[@]}" latency "${llama[@]}" --batch-size 1 --enforce-eager) ;;
    int8)
      CMD=("${bench[@]}" latency "${llama[@]}" --batch-size 1 --quantization int8) ;;
    summary)
      CMD=("$PY" -m model_server.benchmarks.gpu_summary "$LOG_DIR") ;;
  esac
}

have_wheels() { compgen -G "$WHEEL_DIR/*.whl" >/dev/null; }

if [[ $DRY_RUN -eq 1 ]]; then
  if have_wheels; then
    echo "$PY -m pip install --no-index --no-deps --upgrade --target $SITE_DIR $WHEEL_DIR/*.whl"
    echo "export PYTHONPATH=$SITE_DIR:$PYTHONPATH"
  fi
  for step in "${STEPS[@]}"; do set_command "$step"; echo "${CMD[*]}"; done
  exit 0
fi

needs_gpu=0
for step in "${STEPS[@]}"; do [[ $step != summary ]] && needs_gpu=1; done
if [[ $needs_gpu -eq 1 ]]; then
  reason="$("$PY" - 2>&1 <<'EOF'
try:
    import torch
except Exception as exc:
    print(f"torch does not import ({type(exc).__name__}: {exc})")
else:
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
EOF
)" || reason="${reason:-$PY failed}"
  if [[ -n "$reason" ]]; then
    echo "bench_gpu.sh: no CUDA device for $PY: ${reason//$'\n'/ }; run it on a GPU machine (--dry-run prints the commands)" >&2
    exit 2
  fi
fi

mkdir -p "$LOG_DIR" || exit 2
LOG="$LOG_DIR/bench_gpu.log"

if have_wheels; then
  mkdir -p "$SITE_DIR"
  installed=1
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE_DIR" \
      "$WHEEL_DIR"/*.whl 2>&1 | tee -a "$LOG" || installed=0
  else
    # No pip: a wheel is a zip whose root belongs on sys.path.
    for wheel in "$WHEEL_DIR"/*.whl; do
      "$PY" -m zipfile -e "$wheel" "$SITE_DIR" 2>&1 | tee -a "$LOG" || installed=0
    done
  fi
  if [[ $installed -eq 1 ]]; then
    export PYTHONPATH="$SITE_DIR:$PYTHONPATH"
  else
    echo "bench_gpu.sh: could not install the wheels in $WHEEL_DIR; going on without them" \
      | tee -a "$LOG" >&2
  fi
fi

{
  echo "== bench_gpu.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) steps: ${STEPS[*]}"
  if commit="$(git rev-parse --short HEAD 2>/dev/null)"; then
    git diff --quiet HEAD 2>/dev/null || commit+=" (with local changes)"
    echo "git: $commit"
  fi
  if [[ $needs_gpu -eq 1 ]]; then
    "$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
    command -v nvidia-smi >/dev/null \
      && nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv,noheader
  fi
} 2>&1 | tee -a "$LOG"

failed=()
for step in "${STEPS[@]}"; do
  set_command "$step"
  echo "== [$step] ${CMD[*]}" | tee -a "$LOG"
  start=$SECONDS
  if [[ $step == summary ]]; then
    "${CMD[@]}" 2>&1 | tee -a "$LOG"
  else
    "${CMD[@]}" 2>&1 | tee "$LOG_DIR/$step.log" | tee -a "$LOG"
  fi
  status=${PIPESTATUS[0]}
  echo "== [$step] exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
  [[ $status -ne 0 ]] && failed+=("$step")
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "bench_gpu.sh: failed steps: ${failed[*]} (log: $LOG)" | tee -a "$LOG" >&2
  exit 1
fi
echo "bench_gpu.sh: done (log: $LOG)"
