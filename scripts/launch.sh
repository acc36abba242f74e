#!/usr/bin/env bash
# Runs the whole server on one host: 1 gateway + N prefill + M decode workers.
#   scripts/launch.sh --prefill 2 --decode 6 [--host H] [--port P] [--config FILE] [--model M]
#                     [--prefill-cpus 0] [--decode-cpus 1-3] [--pin|--no-pin] [--kv-backend shm]
#                     [--api-key KEY[:TENANT]]... [--api-key-file FILE] [--set SECTION.KEY=V]...
#                     [--otlp-endpoint URL] [--log-format text|json]
#                     [--tool-call-parser hermes|llama3_json] [--served-model-name NAME]...
#                     [--reasoning-parser qwen3|deepseek_r1]
#                     [--allowed-origins ORIGIN]...  (browser pages' CORS; default: any)
#                     [--restarts N] [--restart-window S]
# A worker that crashes (killed, or exits with an error) is started again under its id, at most
# --restarts times in a row (default 3; 0: never), after 1, 2, 4... s: its requests have resumed
# elsewhere (or waited for it), and it rejoins its pool. One that then runs for
# --restart-window seconds (default 600) without crashing has its restarts back, so that
# crashes days apart never use them up, while one that crashes as it starts is given up on.
# One that stops (SIGINT) or drains (SIGTERM) is not restarted. A crashed gateway is restarted
# the same way: the workers register with the new one as it comes up (requests it was serving
# are lost with their connections).
#   scripts/launch.sh --colocated 2: no prefill pool; each worker prefills (in chunks) and decodes
#   --model sim (or sim:PROFILE): the real processes with a simulated model's step times and
#   tokens (docs/simulation.md), for many workers and streams on a small host
# Across hosts (docs/scaling.md):
#   scripts/launch.sh --gateway-only --control tcp://0.0.0.0:8100 --keys DIR [--host 0.0.0.0]
#       a gateway that waits for workers; DIR gets the cluster's CURVE keys (copy it to the
#       other hosts)
#   scripts/launch.sh --join tcp://GATEWAY:8100 --keys DIR --prefill N --decode M [--advertise IP]
#       workers that join that gateway; decode workers receive KV on IP (default: this host's
#       address on the route to the gateway). SIGTERM to launch.sh drains them: they take no
#       new work, finish what they hold, and leave.
# --autoscale MIN:MAX: each pool sized by the gateway's raging_pool_desired_workers, between MIN
#   and MAX workers, by starting workers on this host and draining them (docs/scaling.md)
# Sets up .venv and the model on first use, waits until every worker is ready, prints the URL,
# and stops every process it started on Ctrl-C or SIGTERM. Logs: runs/<time>/<process>.log
# Each worker is pinned to its share of its pool's CPUs (an even slice, or one CPU each, round
# robin, where the workers outnumber them): by default the first half of the CPUs serve prefill
# and the rest decode, so a prefill burst cannot steal decode's cores. As many workers as the
# host has CPUs or more (--prefill 1 --decode 1 or --colocated 2 on two cores) are not pinned
# unless --pin or --prefill-cpus/--decode-cpus says so: every worker runs on every CPU, and the
# gateway packs each pool's work onto as few workers as the CPUs run at once (docs/scheduling.md,
# "Workers sharing CPUs"). Pinned workers beyond a pool's CPUs share them (a warning says how
# many), packed the same way. Workers on the same CPUs compute in turn (lock files in
# <run>/turns), each step at the full width of those CPUs.
# --kv-backend picks how prefill hands KV to decode: auto (default: cuda_ipc from a worker on a
# GPU, else shm), shm (one host), zmq, cuda_ipc. On a host with several GPUs, workers spread
# over them round robin, prefill first (unless --set model.device=... says where).
# Internal sockets are authenticated and encrypted (CURVE) with keys made fresh in <run>/curve
# (or those of --keys DIR).
# --api-key / --api-key-file go to the gateway only; with neither (nor auth: in the config)
# the API is open. Prefer the file: other users can read command lines with ps.
# --otlp-endpoint: every process exports its spans of each request to this OTLP/HTTP collector.
set -euo pipefail
if (( BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1) )); then
  echo "launch.sh needs bash 5.1 or newer" >&2; exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFILL="" DECODE="" HOST=127.0.0.1 PORT=8000 CONFIG="$ROOT/configs/default.yaml" MODEL="" CONTROL=""
RUN_DIR="" PREFILL_CPUS="" DECODE_CPUS="" PIN=auto KV_BACKEND="" LOG_FORMAT=""
GATEWAY_AUTH=() SETTINGS=() COLOCATED=0 OTLP="" JOIN="" GATEWAY_ONLY=0 KEYS="" ADVERTISE=""
AUTOSCALE="" SERVED_NAMES=() ORIGINS=() RESTARTS=3 RESTART_WINDOW=600
usage() { sed -n '2,/^[^#]/{/^#/p}' "$0"; exit "${1:-0}"; }  # the comment block above
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefill) PREFILL="$2"; shift 2 ;;
    --decode) DECODE="$2"; shift 2 ;;
    --colocated) DECODE="$2"; PREFILL=0; COLOCATED=1; shift 2 ;;
    --set) SETTINGS+=(--set "$2"); shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --control) CONTROL="$2"; shift 2 ;;   # default: a socket in the run folder
    --join) JOIN="$2"; shift 2 ;;
    --gateway-only) GATEWAY_ONLY=1; shift ;;
    --keys) KEYS="$2"; shift 2 ;;
    --advertise) ADVERTISE="$2"; shift 2 ;;
    --autoscale) AUTOSCALE="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --prefill-cpus) PREFILL_CPUS="$2"; shift 2 ;;
    --decode-cpus) DECODE_CPUS="$2"; shift 2 ;;
    --pin) PIN=1; shift ;;
    --no-pin) PIN=0; shift ;;
    --kv-backend) KV_BACKEND="$2"; shift 2 ;;
    --otlp-endpoint) OTLP="$2"; shift 2 ;;
    --log-format) LOG_FORMAT="$2"; shift 2 ;;  # every process's log, json: a JSON object a line
    --api-key|--api-key-file) GATEWAY_AUTH+=("$1" "$2"); shift 2 ;;
    --tool-call-parser) SETTINGS+=(--set "gateway.tool_call_parser=$2"); shift 2 ;;  # as vLLM's
    --reasoning-parser) SETTINGS+=(--set "gateway.reasoning_parser=$2"); shift 2 ;;  # as vLLM's
    --restarts) RESTARTS="$2"; shift 2 ;;
    --restart-window) RESTART_WINDOW="$2"; shift 2 ;;
    --served-model-name) SERVED_NAMES+=("$2"); shift 2 ;;
    --allowed-origins) ORIGINS+=("$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown flag $1" >&2; usage 2 ;;
  esac
done
yaml_list() {  # "a" "b" -> ["a", "b"], for a --set of a list setting
  local item out=()
  for item in "$@"; do
    [[ "$item" != *[\"\\]* ]] || { echo "a name or origin may not hold \" or \\: $item" >&2; exit 2; }
    out+=("\"$item\"")
  done
  local IFS=,; echo "[${out[*]}]"
}
[[ ${#SERVED_NAMES[@]} -eq 0 ]] || SETTINGS+=(--set "gateway.served_model_name=$(yaml_list "${SERVED_NAMES[@]}")")
[[ ${#ORIGINS[@]} -eq 0 ]] || SETTINGS+=(--set "gateway.allowed_origins=$(yaml_list "${ORIGINS[@]}")")
DEFAULT_COUNT=$([[ -n "$JOIN" ]] && echo 0 || echo 1)  # a join starts only the workers it names
PREFILL="${PREFILL:-$DEFAULT_COUNT}" DECODE="${DECODE:-$DEFAULT_COUNT}"
[[ "$RESTARTS" =~ ^[0-9]+$ ]] || { echo "--restarts takes a count" >&2; exit 2; }
[[ "$RESTART_WINDOW" =~ ^[0-9]+$ ]] || { echo "--restart-window takes seconds" >&2; exit 2; }
[[ "$PREFILL" =~ ^[0-9]+$ && "$DECODE" =~ ^[0-9]+$ ]] || { echo "--prefill, --decode and --colocated take counts" >&2; exit 2; }
if [[ -n "$JOIN" ]]; then
  [[ -z "$AUTOSCALE" ]] || { echo "--autoscale runs beside a gateway, not with --join" >&2; exit 2; }
  [[ $GATEWAY_ONLY == 0 && -z "$CONTROL" ]] || { echo "--join starts workers only: no --gateway-only or --control" >&2; exit 2; }
  [[ -n "$KEYS" && -f "$KEYS/server.key" ]] || { echo "--join needs --keys DIR: the cluster's keys folder (from its gateway's host)" >&2; exit 2; }
  [[ $(( PREFILL + DECODE )) -gt 0 ]] || { echo "--join: nothing to start (--prefill N and/or --decode M)" >&2; exit 2; }
  CONTROL="$JOIN"
elif [[ $GATEWAY_ONLY == 1 ]]; then
  PREFILL=0 DECODE=0
else
  [[ $DECODE -gt 0 ]] || { echo "--decode and --colocated take positive counts" >&2; exit 2; }
  [[ $PREFILL -gt 0 || $COLOCATED == 1 ]] || { echo "--prefill 0: use --colocated N" >&2; exit 2; }
fi

source "$ROOT/scripts/setup.sh"
RUN_DIR="${RUN_DIR:-$ROOT/runs/$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$RUN_DIR"
CONTROL="${CONTROL:-ipc://$RUN_DIR/control.sock}"
WORKER_CONTROL="${CONTROL/\/\/0.0.0.0:/\/\/127.0.0.1:}"  # a gateway on every interface: reach it on loopback
# Workers on the same CPUs compute in turn (core/turns.py), unless the settings say otherwise.
COMMON=(--config "$CONFIG" --control-address "$CONTROL" --set "engine.cpu_turns_dir=$RUN_DIR/turns"
        "${SETTINGS[@]}")
[[ -n "$MODEL" ]] && COMMON+=(--model "$MODEL")
[[ -n "$KV_BACKEND" ]] && COMMON+=(--kv-backend "$KV_BACKEND")
[[ -n "$OTLP" ]] && COMMON+=(--otlp-endpoint "$OTLP")
[[ -n "$LOG_FORMAT" ]] && COMMON+=(--log-format "$LOG_FORMAT")
# CURVE keys (folder 0700, files 0600): only processes holding them may talk on the internal
# sockets (control and KV); see core/curve.py. Fresh for this run unless --keys names a folder
# (made there if it has none yet, so that workers on other hosts can join with a copy).
KEYS="${KEYS:-$RUN_DIR/curve}"
[[ -f "$KEYS/server.key" ]] || "$RAGING_PY" -m core.curve generate "$KEYS" >/dev/null
COMMON+=(--set internal.curve=true --set "internal.keys_dir=$KEYS")
# Decode workers receive KV on an address the prefill workers reach: loopback for a cluster on
# this host only, else this host's address on the route to the gateway (or --advertise).
if [[ -z "$ADVERTISE" && "$CONTROL" == tcp://* && "$CONTROL" != tcp://127.* && "$CONTROL" != tcp://localhost:* ]]; then
  ADVERTISE="$("$RAGING_PY" -m core.netaddr route-source "$CONTROL")"
fi
[[ -z "$ADVERTISE" || " ${SETTINGS[*]} " == *" decode.kv_bind="* ]] || COMMON+=(--set "decode.kv_bind=tcp://$ADVERTISE:*")

# Prepare the model once, with a progress bar, before any worker needs it.
"$RAGING_PY" -m engine --config "$CONFIG" ${MODEL:+--model "$MODEL"} "${SETTINGS[@]}" >/dev/null

expand_cpus() {  # "0,2-3" -> "0 2 3"
  local part out=()
  for part in ${1//,/ }; do
    if [[ "$part" == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
  done
  echo "${out[@]}"
}
CPUS=($(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))'))
HALF=$(( ${#CPUS[@]} / 2 > 0 ? ${#CPUS[@]} / 2 : 1 ))
[[ $COLOCATED == 1 ]] && HALF=0  # colocated workers share every CPU
PREFILL_POOL=($(expand_cpus "${PREFILL_CPUS:-$(echo "${CPUS[@]:0:$HALF}" | tr ' ' ,)}"))
DECODE_POOL=($(expand_cpus "${DECODE_CPUS:-$(echo "${CPUS[@]:$HALF}" | tr ' ' ,)}"))
[[ ${#DECODE_POOL[@]} -gt 0 ]] || DECODE_POOL=("${PREFILL_POOL[@]}")
WORKERS=$(( PREFILL + DECODE ))
# Simulated workers (--model sim, engine/sim) stand for GPUs: they sleep through their steps.
[[ $PIN == auto && ( "$MODEL" == sim || "$MODEL" == sim:* ) ]] && PIN=0
# Pinned, unless pinning would leave a worker one CPU of several (as many workers as CPUs or
# more) and none were named: one core per step, the others idle whenever its pool is.
if [[ $PIN == auto ]]; then
  PIN=1
  if [[ -z "$PREFILL_CPUS$DECODE_CPUS" && $WORKERS -gt 1 && $WORKERS -ge ${#CPUS[@]} ]]; then
    PIN=0
    echo "[launch] $WORKERS workers on ${#CPUS[@]} CPUs: each runs on all of them, they compute" \
      "in turn, and the gateway packs each pool's work onto as few workers as the CPUs run at" \
      "once (--pin keeps each worker on CPUs of its own)" >&2
  fi
fi
share_out() {  # share_out POOL_NAME COUNT: each worker's CPUs, a line each (core/cpus.py)
  local -n pool="$1"
  [[ $PIN == 1 && $2 -gt 0 ]] || return 0
  "$RAGING_PY" -m core.cpus share-out "$(echo "${pool[@]}" | tr ' ' ,)" "$2"
}
mapfile -t PREFILL_SHARES < <(share_out PREFILL_POOL "$PREFILL")
mapfile -t DECODE_SHARES < <(share_out DECODE_POOL "$DECODE")
if [[ $PIN == 1 && ( ${#PREFILL_SHARES[@]} != "$PREFILL" || ${#DECODE_SHARES[@]} != "$DECODE" ) ]]; then
  echo "launch.sh: cannot share out the CPUs (--prefill-cpus ${PREFILL_CPUS:-default}," \
    "--decode-cpus ${DECODE_CPUS:-default})" >&2
  exit 2
fi
pin_args() {  # pin_args SHARES_NAME INDEX: the --cpus flag for worker INDEX
  [[ $PIN == 1 ]] || return 0
  local -n shares="$1"
  echo "--cpus ${shares[$2]}"
}
warn_shared() {  # warn_shared ROLE COUNT POOL_NAME HOW: one line when workers outnumber CPUs
  local -n pool="$3"
  local cpus=${#pool[@]} role="$1" count="$2"
  [[ $PIN == 1 && $cpus -gt 0 && $count -gt $cpus ]] || return 0
  local least=$(( count / cpus )) most=$(( (count + cpus - 1) / cpus ))
  local where="1 CPU" each=""
  if [[ $cpus -gt 1 ]]; then
    where="$cpus CPUs" each=" $most to each,"
    [[ $least == "$most" ]] || each=" $least or $most to each,"
  fi
  echo "[launch] warning: $count $role workers share $where ($(echo "${pool[@]}" | tr ' ' ,)),$each" \
    "taking turns; $4" >&2
}
warn_shared prefill "$PREFILL" PREFILL_POOL "the gateway counts a CPU's queues as one and sends \
its prompts to the busiest worker with room (gateway.prefill_routing)"
warn_shared decode "$DECODE" DECODE_POOL "the gateway packs new sequences onto one worker per \
CPU, filling its batch before the next on that CPU gets any (gateway.decode_routing)"

GPUS=0  # GPUs to spread workers over: those CUDA_VISIBLE_DEVICES names, else nvidia-smi lists
if [[ " ${SETTINGS[*]} " != *" model.device="* ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -ra VISIBLE <<<"$CUDA_VISIBLE_DEVICES"; GPUS=${#VISIBLE[@]}
  else
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
fi
device_args() {  # device_args INDEX: where worker INDEX (over both pools) runs, if GPUs are many
  if [[ $GPUS -gt 1 ]]; then echo "--set model.device=cuda:$(( $1 % GPUS ))"; fi
}

PIDS=() BACKOFF=""  # BACKOFF: the sleep before a restart
stop_all() {
  local rc="${1:-$?}" signal=TERM tries=200
  trap '' INT TERM  # a second Ctrl-C must not cut the clean-up short and orphan processes
  trap - EXIT
  [[ ${#PIDS[@]} -gt 0 ]] || exit "$rc"
  if [[ -n "$JOIN" && $rc == 143 ]]; then  # SIGTERM to joined workers: they drain, then leave
    echo "[launch] draining ${#PIDS[@]} workers"
    tries=6000  # 5 minutes; each leaves by itself within its drain timeout
  else  # Ctrl-C, or the gateway goes too: workers stop at once, their requests resume elsewhere
    echo "[launch] stopping ${#PIDS[@]} processes"
    signal=INT
  fi
  kill -"$signal" "${PIDS[@]}" 2>/dev/null || true
  [[ -z "$BACKOFF" ]] || kill "$BACKOFF" 2>/dev/null || true
  for _ in $(seq "$tries"); do
    alive=0; for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break; sleep 0.05
  done
  kill -KILL "${PIDS[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  for pid in "${PIDS[@]}"; do rm -f /dev/shm/raging-kv-"$pid"-*; done  # staging left by a kill
  exit "$rc"
}
trap 'stop_all 130' INT
trap 'stop_all 143' TERM
trap stop_all EXIT

wait_workers() {  # until every process started has exited (the gateway's, unless restarted,
                  # ends the launch)
  local live=("${PIDS[@]}") done_pid name status
  while [[ ${#live[@]} -gt 0 ]]; do
    done_pid=""
    wait -n -p done_pid "${live[@]}" && status=0 || status=$?
    [[ -n "$done_pid" ]] || continue
    live=($(printf '%s\n' "${live[@]}" | grep -vx "$done_pid" || true))
    name="$(awk -v p="$done_pid" '$1 == p {print $2}' "$RUN_DIR/pids" | tail -n 1)"
    echo "[launch] $name exited (status $status); see $RUN_DIR/$name.log"
    if crashed "$name" "$status" && restart "$name"; then
      live+=("${PIDS[-1]}")
    elif [[ "$name" == gateway ]]; then
      exit 1
    fi
  done
  exit 0
}

declare -A COMMAND_OF=() RESTARTED=() STARTED_AT=()
start() {  # start NAME ARGS...: one process, logged to its own file
  local name="$1"; shift
  COMMAND_OF[$name]="$(printf '%q ' "$@")"
  STARTED_AT[$name]=$SECONDS
  (cd "$ROOT" && exec "$RAGING_PY" "$@") >>"$RUN_DIR/$name.log" 2>&1 &
  PIDS+=($!)
  echo "$! $name" >> "$RUN_DIR/pids"
}
crashed() {  # crashed NAME STATUS: a process that died, not one that stopped (0, SIGINT, SIGTERM)
  [[ "$1" != autoscaler && $2 != 0 && $2 != 130 && $2 != 143 ]]
}
restart() {  # restart NAME: start it again as it was first started, if it has restarts left
  local name="$1" count="${RESTARTED[$1]:-0}"
  if (( SECONDS - STARTED_AT[$name] >= RESTART_WINDOW )); then
    count=0  # it ran long enough since its last start: a crash now is not a crash loop
  fi
  if (( count >= RESTARTS )); then
    echo "[launch] $name is not restarted (--restarts $RESTARTS within --restart-window $RESTART_WINDOW s)" >&2
    return 1
  fi
  RESTARTED[$name]=$(( count + 1 ))
  sleep $(( 2 ** count )) & BACKOFF=$!  # waited on, not slept in: a signal's trap runs at once
  wait "$BACKOFF" || true
  BACKOFF=""
  echo "[launch] restarting $name ($(( count + 1 )) of $RESTARTS)"
  if [[ "$name" == gateway ]]; then  # it waits only for the workers still here (not the drained)
    COMMAND_OF[gateway]="$(sed -E "s/--expect-prefill [0-9]+/--expect-prefill $(running prefill)/;
      s/--expect-decode [0-9]+/--expect-decode $(running decode)/" <<<"${COMMAND_OF[gateway]}")"
  fi
  eval "start \"\$name\" ${COMMAND_OF[$name]}"
}
running() {  # running ROLE: how many of the ROLE workers started here run now
  awk -v role="$1" '{ newest[$2] = $1 } END { for (name in newest)
    if (index(name, role "-") == 1) print newest[name] }' "$RUN_DIR/pids" |
    while read -r pid; do kill -0 "$pid" 2>/dev/null && echo; done | wc -l
}

TAG=""  # joining workers' ids name their host and this launch, so ids never clash
[[ -z "$JOIN" ]] || TAG="$(hostname -s)-$$-"
if [[ -z "$JOIN" ]]; then
  EXPECT_DECODE=$(( GATEWAY_ONLY == 1 ? 1 : DECODE ))  # a lone gateway is ready once one joins
  start gateway -m gateway "${COMMON[@]}" --host "$HOST" --port "$PORT" \
    --expect-prefill "$PREFILL" --expect-decode "$EXPECT_DECODE" "${GATEWAY_AUTH[@]}"
fi
WORKER_ARGS=("${COMMON[@]}" --control-address "$WORKER_CONTROL")
for i in $(seq 0 $((PREFILL - 1))); do
  start "prefill-$TAG$i" -m prefill "${WORKER_ARGS[@]}" --worker-id "prefill-$TAG$i" \
    $(pin_args PREFILL_SHARES "$i") $(device_args "$i")
done
for i in $(seq 0 $((DECODE - 1))); do
  start "decode-$TAG$i" -m decode "${WORKER_ARGS[@]}" --worker-id "decode-$TAG$i" \
    $(pin_args DECODE_SHARES "$i") $(device_args "$((PREFILL + i))")
done

if [[ -n "$JOIN" ]]; then
  echo "[launch] $PREFILL prefill + $DECODE decode workers joining $JOIN (logs: $RUN_DIR)"
  wait_workers
fi
URL="http://$HOST:$PORT"
if [[ $GATEWAY_ONLY == 1 ]]; then
  echo "[launch] gateway waits for workers at $CONTROL: scripts/launch.sh --join" \
    "tcp://<this host>:${CONTROL##*:} --keys <a copy of $KEYS> --prefill N --decode M"
fi
echo "[launch] waiting for 1 gateway + $PREFILL prefill + $DECODE decode (logs: $RUN_DIR)"
HEALTH=""  # the last /health body (then its status on a line of its own)
answers() {  # whether the gateway is up: ready (/health), or up at all when it waits alone
  if [[ $GATEWAY_ONLY == 1 ]]; then
    [[ "$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "$URL/version")" != 000 ]]
  else
    HEALTH="$(curl -s --max-time 2 -w '\n%{http_code}' "$URL/health" || true)"
    [[ "${HEALTH##*$'\n'}" == 200 ]]
  fi
}
SHOWN=0
show_progress() {  # "[launch] N of M workers ready" each time more have registered
  local ready
  [[ "$HEALTH" =~ \"prefill\":([0-9]+),\"decode\":([0-9]+) ]] || return 0
  ready=$(( BASH_REMATCH[1] + BASH_REMATCH[2] ))
  (( ready > SHOWN )) || return 0
  SHOWN=$ready
  echo "[launch] $ready of $(( PREFILL + DECODE )) workers ready"
}
until answers; do
  [[ $GATEWAY_ONLY == 1 ]] || show_progress
  for pid in "${PIDS[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      name="$(awk -v p="$pid" '$1 == p {print $2}' "$RUN_DIR/pids")"
      echo "[launch] $name exited during start-up; its log ends:" >&2
      tail -n 20 "$RUN_DIR/$name.log" >&2
      exit 1
    fi
  done
  sleep 0.2
done
echo "[launch] ready: $URL (OpenAI API at $URL/v1); Ctrl-C stops everything"
if [[ -n "$AUTOSCALE" ]]; then  # workers it starts join like any other, on this host's CPUs
  JOIN_ARGS=(--config "$CONFIG" ${MODEL:+--model "$MODEL"} ${KV_BACKEND:+--kv-backend "$KV_BACKEND"}
             ${OTLP:+--otlp-endpoint "$OTLP"} ${LOG_FORMAT:+--log-format "$LOG_FORMAT"}
             --set "engine.cpu_turns_dir=$RUN_DIR/turns" "${SETTINGS[@]}")
  start autoscaler -m autoscaler --url "${URL/\/\/0.0.0.0:/\/\/127.0.0.1:}" \
    --control "$WORKER_CONTROL" --keys "$KEYS" --bounds "$AUTOSCALE" --base "$PREFILL:$DECODE" \
    --run-dir "$RUN_DIR" "${GATEWAY_AUTH[@]}" -- "${JOIN_ARGS[@]}"
fi
wait_workers
