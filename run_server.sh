#!/usr/bin/env bash
# Starts the whole Wick stack (model server + LLM microservice) for LLM_DEVICE.
#
#   ./run_server.sh                  # LLM_DEVICE=cpu (default), cuda, gcu or hpu
#   ./run_server.sh --native         # never use containers
#   ./run_server.sh -d --build       # compose mode: extra arguments go to `docker compose up`
#
# Settings: the environment, then .env (WICK_ENV_FILE), then compose/<device>.env; the first one
# that sets a name wins, and an empty value means the service's default. See .env.example.
#
# With a reachable Docker engine and compose (and no --native) it runs, like OPEA's run_vllm.sh,
#   docker compose -f compose/docker-compose.yaml --env-file compose/<device>.env [--env-file .env]
#       --profile <device> up
# Otherwise it runs natively: scripts/setup.sh prepares .venv on first use, the model server and
# the microservice start in the background (logs in WICK_LOG_DIR), and once /health and
# /v1/health_check answer 200 it prints the URLs and a curl to try. Ctrl-C or SIGTERM stops both.
# LLM_EMBEDDING_MODEL / LLM_RERANK_MODEL add the RAG pipeline's embedding / reranking model server
# and OPEA microservice (compose: the `rag` profile; natively: two more processes per model).
#
# Errors (unsupported LLM_DEVICE, a missing device runtime, a busy port, ...) are one line on
# stderr and a non-zero exit status.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEVICES="cpu cuda gcu hpu"

die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}
log() { printf '[wick] %s\n' "$*" >&2; }

usage() {
  sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

MODE=auto
EXTRA=()
for arg in "$@"; do
  case "$arg" in
    --native) MODE=native ;;
    --compose) MODE=compose ;;
    -h | --help) usage; exit 0 ;;
    *) EXTRA+=("$arg") ;;
  esac
done

# ---------------------------------------------------------------- settings
# KEY=VALUE lines; `#` comments, `export `, quotes and inline comments (after unquoted values)
# are handled. A name already in the environment is kept; empty values are skipped (= default).
load_env_file() {
  local file="$1" line key value n=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    line="${line%$'\r'}"
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    [[ "$line" =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*=(.*)$ ]] ||
      die "$file:$n: not a KEY=VALUE line: $line"
    key="${BASH_REMATCH[2]}"
    value="${BASH_REMATCH[3]}"
    value="${value#"${value%%[![:space:]]*}"}"
    if [[ "$value" =~ ^\"(.*)\"[[:space:]]*(#.*)?$ || "$value" =~ ^\'(.*)\'[[:space:]]*(#.*)?$ ]]; then
      value="${BASH_REMATCH[1]}"
    else
      value="${value%%[[:space:]]#*}"
      value="${value%"${value##*[![:space:]]}"}"
    fi
    [[ -n "${!key+x}" || -z "$value" ]] && continue
    export "$key=$value"
  done <"$file"
}

ENV_FILE="${WICK_ENV_FILE:-$ROOT/.env}"
if [[ -f "$ENV_FILE" ]]; then
  load_env_file "$ENV_FILE"
elif [[ -n "${WICK_ENV_FILE:-}" ]]; then
  die "WICK_ENV_FILE=$WICK_ENV_FILE does not exist"
fi

LLM_DEVICE="${LLM_DEVICE:-cpu}"
LLM_DEVICE="${LLM_DEVICE,,}"
[[ " $DEVICES " == *" $LLM_DEVICE "* ]] ||
  die "unsupported LLM_DEVICE '$LLM_DEVICE' (use one of: ${DEVICES// /, })"
export LLM_DEVICE
DEVICE_ENV_FILE="$ROOT/compose/$LLM_DEVICE.env"
[[ -f "$DEVICE_ENV_FILE" ]] && load_env_file "$DEVICE_ENV_FILE"

command -v python3 >/dev/null 2>&1 || die "python3 (>= 3.10) is required and is not on PATH"

check_port() { # name value
  local name="$1" port="$2"
  [[ "$port" =~ ^[0-9]+$ ]] && ((port >= 1 && port <= 65535)) ||
    die "$name must be a port number (1-65535), got '$port'"
  # Bind the way the servers will (all interfaces, SO_REUSEADDR): fails if anything listens there.
  python3 - "$port" <<'PY' 2>/dev/null ||
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
PY
    die "port $port ($name) is already in use; stop what listens there or set $name to a free port"
}

MS_PORT="${LLM_MODEL_SERVER_PORT:-${LLM_VLLM_PORT:-8008}}"
USVC_PORT="${LLM_USVC_PORT:-9000}"
[[ "$MS_PORT" != "$USVC_PORT" ]] ||
  die "LLM_MODEL_SERVER_PORT and LLM_USVC_PORT are both $MS_PORT; give them different ports"

# ---------------------------------------------------------------- mode
COMPOSE=()
NATIVE_NOTE=""
find_compose() {
  command -v docker >/dev/null 2>&1 || return 1
  timeout 15 docker info >/dev/null 2>&1 || return 1
  if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
  elif command -v docker-compose >/dev/null 2>&1 && docker-compose version >/dev/null 2>&1; then
    COMPOSE=(docker-compose)
  else
    return 1
  fi
}

if [[ "$MODE" != native ]]; then
  if find_compose; then
    MODE=compose
  elif [[ "$MODE" == compose ]]; then
    die "--compose: no reachable Docker engine with compose (docker info / docker compose version failed)"
  else
    MODE=native
    NATIVE_NOTE="no reachable container engine with compose: running natively"
  fi
fi

# ---------------------------------------------------------------- compose mode
if [[ "$MODE" == compose ]]; then
  case "$LLM_DEVICE" in
    cuda) command -v nvidia-smi >/dev/null 2>&1 ||
      die "LLM_DEVICE=cuda needs the NVIDIA driver and container toolkit, but nvidia-smi is not on PATH" ;;
    hpu) command -v hl-smi >/dev/null 2>&1 ||
      die "LLM_DEVICE=hpu needs the Intel Gaudi driver and habana container runtime, but hl-smi is not on PATH" ;;
    gcu)
      compgen -G "/dev/gcu[0-9]*" >/dev/null ||
        die "LLM_DEVICE=gcu needs the Enflame GCU driver, but there is no /dev/gcu* device"
      [[ -n "${GCU_BASE_IMAGE:-}" ]] ||
        die "LLM_DEVICE=gcu needs GCU_BASE_IMAGE (Enflame's TopsRider torch_gcu image) in .env or compose/gcu.env"
      ;;
  esac
  check_port LLM_MODEL_SERVER_PORT "$MS_PORT"
  check_port LLM_USVC_PORT "$USVC_PORT"
  args=(-f "$ROOT/compose/docker-compose.yaml" --env-file "$DEVICE_ENV_FILE")
  [[ -f "$ENV_FILE" ]] && args+=(--env-file "$ENV_FILE")
  profiles=(--profile "$LLM_DEVICE")
  export COMPOSE_PROFILES="$LLM_DEVICE" LLM_MODEL_SERVER_PORT="$MS_PORT" LLM_USVC_PORT="$USVC_PORT"
  # Either RAG model turns on the `rag` profile (the other one takes compose's default).
  if [[ -n "${LLM_EMBEDDING_MODEL:-}${LLM_RERANK_MODEL:-}" ]]; then
    profiles+=(--profile rag)
    COMPOSE_PROFILES="$LLM_DEVICE,rag"
  fi
  log "starting the $LLM_DEVICE stack with ${COMPOSE[*]} (model server :$MS_PORT, microservice :$USVC_PORT)"
  log "once it is up, chat in a browser at http://localhost:$MS_PORT/"
  exec "${COMPOSE[@]}" "${args[@]}" "${profiles[@]}" up "${EXTRA[@]}"
fi

# ---------------------------------------------------------------- native mode
((${#EXTRA[@]} == 0)) || die "unknown argument '${EXTRA[0]}' (natively only --native and --help)"
VENV="${WICK_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || PY=python3

python_has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

case "$LLM_DEVICE" in
  cuda) command -v nvidia-smi >/dev/null 2>&1 ||
    die "LLM_DEVICE=cuda needs the NVIDIA driver, but nvidia-smi is not on PATH" ;;
  hpu) python_has habana_frameworks ||
    die "LLM_DEVICE=hpu needs Intel Gaudi's PyTorch (habana_frameworks), which $PY cannot import" ;;
  gcu) python_has torch_gcu ||
    die "LLM_DEVICE=gcu needs Enflame's torch_gcu (TopsRider), which $PY cannot import" ;;
esac
check_port LLM_MODEL_SERVER_PORT "$MS_PORT"
check_port LLM_USVC_PORT "$USVC_PORT"
# The RAG pipeline's models, each with its model server and OPEA microservice:
# "kind model model-server-port microservice-port" (see spawn_rag below).
RAG_SPECS=()
if [[ -n "${LLM_EMBEDDING_MODEL:-}" ]]; then
  RAG_SPECS+=("embedding $LLM_EMBEDDING_MODEL ${LLM_EMBEDDING_MODEL_SERVER_PORT:-8009} ${EMBEDDING_USVC_PORT:-6000}")
  check_port LLM_EMBEDDING_MODEL_SERVER_PORT "${LLM_EMBEDDING_MODEL_SERVER_PORT:-8009}"
  check_port EMBEDDING_USVC_PORT "${EMBEDDING_USVC_PORT:-6000}"
fi
if [[ -n "${LLM_RERANK_MODEL:-}" ]]; then
  RAG_SPECS+=("reranking $LLM_RERANK_MODEL ${LLM_RERANK_MODEL_SERVER_PORT:-8010} ${RERANKING_USVC_PORT:-8000}")
  check_port LLM_RERANK_MODEL_SERVER_PORT "${LLM_RERANK_MODEL_SERVER_PORT:-8010}"
  check_port RERANKING_USVC_PORT "${RERANKING_USVC_PORT:-8000}"
fi

[[ -n "$NATIVE_NOTE" ]] && log "$NATIVE_NOTE"
"$ROOT/scripts/setup.sh" "model-server,microservice" ||
  die "setting up $VENV failed (see the messages above)"
PY="$VENV/bin/python"
for module in model_server microservice; do
  python_has "$module.__main__" || die "$PY cannot import $module; is the checkout complete?"
done

LOG_DIR="${WICK_LOG_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/wick}"
mkdir -p "$LOG_DIR" || die "cannot create the log folder $LOG_DIR (set WICK_LOG_DIR)"
MS_LOG="$LOG_DIR/model-server.log"
USVC_LOG="$LOG_DIR/microservice.log"
READY_TIMEOUT="${WICK_READY_TIMEOUT:-900}"
[[ "$READY_TIMEOUT" =~ ^[0-9]+$ ]] || die "WICK_READY_TIMEOUT must be a number of seconds, got '$READY_TIMEOUT'"

export LLM_MODEL_SERVER_PORT="$MS_PORT" LLM_USVC_PORT="$USVC_PORT"
export LLM_MODEL_SERVER_ENDPOINT="${LLM_MODEL_SERVER_ENDPOINT:-http://127.0.0.1:$MS_PORT}"

MS_PID=""
USVC_PID=""
RAG_PIDS=()  # the RAG model servers' and microservices' pids
RAG_NAMES=() # "embedding model server", ... (parallel to RAG_PIDS)
RAG_LOGS=()
RAG_URLS=() # each one's readiness URL
alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

# SIGTERM both, give them the model server's drain time (+ margin), then SIGKILL what is left.
stop_all() {
  local pid deadline=$((SECONDS + ${LLM_DRAIN_TIMEOUT%.*} + 15))
  for pid in $USVC_PID $MS_PID ${RAG_PIDS[@]+"${RAG_PIDS[@]}"}; do
    alive "$pid" && kill -TERM "$pid" 2>/dev/null
  done
  for pid in $USVC_PID $MS_PID ${RAG_PIDS[@]+"${RAG_PIDS[@]}"}; do
    while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
    if alive "$pid"; then
      log "process $pid did not stop in time: killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  MS_PID=""
  USVC_PID=""
  RAG_PIDS=()
}
on_signal() {
  trap - INT TERM
  log "stopping the model server and the microservice"
  stop_all
  log "stopped"
  exit 0
}
LLM_DRAIN_TIMEOUT="${LLM_DRAIN_TIMEOUT:-30}"
trap on_signal INT TERM
trap stop_all EXIT

# Own sessions (setsid): a terminal's Ctrl-C reaches only this script, which then stops both
# services once, cleanly, instead of each getting the signal twice.
spawn() { # log-file command...
  local logfile="$1"
  shift
  if command -v setsid >/dev/null 2>&1; then
    setsid "$@" >"$logfile" 2>&1 </dev/null &
  else
    "$@" >"$logfile" 2>&1 </dev/null &
  fi
}

log "starting natively on $LLM_DEVICE (logs in $LOG_DIR)"
spawn "$MS_LOG" "$PY" -m model_server serve
MS_PID=$!
spawn "$USVC_LOG" "$PY" -m microservice
USVC_PID=$!

# A RAG model's server runs without the LLM's settings (its model, limits, KV cache, CPU kernel
# tuning: what a pooling server refuses or would misread); the device, key, log settings and
# HF_* stay.
RAG_UNSET=()
for name in $(compgen -e); do
  case "$name" in
    LLM_DEVICE | LLM_API_KEY | LLM_LOG_LEVEL | LLM_ACCESS_LOG) ;;
    LLM_* | VLLM_* | WICK_CPU_* | WICK_GGUF_* | WICK_NO_GGUF_CACHE) RAG_UNSET+=(-u "$name") ;;
  esac
done
spawn_rag() { # kind model model-server-port microservice-port
  local kind="$1" model="$2" ms_port="$3" usvc_port="$4" upper="${1^^}"
  spawn "$LOG_DIR/$kind-model-server.log" env ${RAG_UNSET[@]+"${RAG_UNSET[@]}"} \
    "$PY" -m model_server serve --model "$model" --port "$ms_port"
  RAG_PIDS+=("$!")
  RAG_NAMES+=("$kind model server")
  RAG_LOGS+=("$LOG_DIR/$kind-model-server.log")
  RAG_URLS+=("http://127.0.0.1:$ms_port/health")
  spawn "$LOG_DIR/$kind-microservice.log" env "${upper}_USVC_PORT=$usvc_port" \
    "${upper}_MODEL_SERVER_ENDPOINT=http://127.0.0.1:$ms_port" "$PY" -m "microservice.$kind"
  RAG_PIDS+=("$!")
  RAG_NAMES+=("$kind microservice")
  RAG_LOGS+=("$LOG_DIR/$kind-microservice.log")
  RAG_URLS+=("http://127.0.0.1:$usvc_port/v1/health_check")
}
for spec in ${RAG_SPECS[@]+"${RAG_SPECS[@]}"}; do
  # shellcheck disable=SC2086  # "kind model port port": word-split on purpose
  spawn_rag $spec
done

http_ok() { # url
  "$PY" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(urllib.request.urlopen(sys.argv[1], timeout=5).status != 200)
except Exception:
    sys.exit(1)
PY
}

exited() { # name pid logfile
  local code=0
  wait "$2" 2>/dev/null || code=$?
  case "$1" in
    "model server") MS_PID="" ;;
    microservice) USVC_PID="" ;;
  esac
  printf 'error: the %s exited with status %s before it was ready; its log (%s) ends with:\n' \
    "$1" "$code" "$3" >&2
  tail -n 15 "$3" | sed 's/^/  | /' >&2
  exit 1
}

MS_URL="http://localhost:$MS_PORT"
USVC_URL="http://localhost:$USVC_PORT"
deadline=$((SECONDS + READY_TIMEOUT))
rag_ready() {
  local url
  for url in ${RAG_URLS[@]+"${RAG_URLS[@]}"}; do http_ok "$url" || return 1; done
}
until http_ok "http://127.0.0.1:$MS_PORT/health" && http_ok "http://127.0.0.1:$USVC_PORT/v1/health_check" && rag_ready; do
  alive "$MS_PID" || exited "model server" "$MS_PID" "$MS_LOG"
  alive "$USVC_PID" || exited "microservice" "$USVC_PID" "$USVC_LOG"
  for i in "${!RAG_PIDS[@]}"; do
    alive "${RAG_PIDS[$i]}" || exited "${RAG_NAMES[$i]}" "${RAG_PIDS[$i]}" "${RAG_LOGS[$i]}"
  done
  ((SECONDS < deadline)) ||
    die "not ready after ${READY_TIMEOUT}s (WICK_READY_TIMEOUT); see $MS_LOG and $USVC_LOG"
  sleep 1
done

cat <<EOF
Wick is ready on $LLM_DEVICE (native).
  chat page     $MS_URL/   open it in a browser
  model server  $MS_URL   OpenAI API (/v1/chat/completions, /v1/completions), /health, /metrics
                log: $MS_LOG
  microservice  $USVC_URL   OPEA chat API (/v1/chat/completions), /v1/health_check, /metrics
                log: $USVC_LOG
Try:
  curl $USVC_URL/v1/health_check
  curl $USVC_URL/v1/chat/completions -X POST -H 'Content-Type: application/json' \\
    -d '{"messages": {"system": "You are a helpful assistant.", "user": "What is Deep Learning?"}, "max_new_tokens": 32, "streaming": false}'
Press Ctrl-C to stop both.
EOF
for spec in ${RAG_SPECS[@]+"${RAG_SPECS[@]}"}; do
  read -r kind model ms_port usvc_port <<<"$spec"
  path=embeddings
  [[ "$kind" == reranking ]] && path=reranking
  printf '  %s: model server http://localhost:%s (%s), microservice http://localhost:%s/v1/%s\n' \
    "$kind" "$ms_port" "$model" "$usvc_port" "$path"
done

# Serve until a signal (on_signal) or until one of the two exits on its own.
set +e
wait -n "$MS_PID" "$USVC_PID" ${RAG_PIDS[@]+"${RAG_PIDS[@]}"}
code=$?
set -e
name="microservice" logfile="$USVC_LOG"
if ! alive "$MS_PID"; then
  name="model server" logfile="$MS_LOG"
fi
for i in "${!RAG_PIDS[@]}"; do
  alive "${RAG_PIDS[$i]}" || { name="${RAG_NAMES[$i]}" logfile="${RAG_LOGS[$i]}"; }
done
printf 'error: the %s exited with status %s; stopping the stack (log: %s)\n' "$name" "$code" "$logfile" >&2
exit 1
