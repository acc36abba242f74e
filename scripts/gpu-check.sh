#!/usr/bin/env bash
# The GPU path, checked on a machine with an NVIDIA GPU and a CUDA build of torch (no network
# needed): the CUDA tests, a 1P+1D cluster on the GPU, and the GPU figures. Results go to OUT.
#   scripts/gpu-check.sh OUT [STEP...]   (steps: prepare tests decode transfer ttft; default all)
# Packages the machine lacks may travel as wheels in .whl/ (`scripts/bench.sh gpu bundle` makes
# it where there is network; installed here into a scratch folder),
# with the default model's tokenizer and config in .whl/tokenizer/: the weights are random ones
# of its shape, and of Llama-3.2-1B's layers, made there (bench/gpu.py prepare).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:?usage: scripts/gpu-check.sh OUT [STEP...]}" && cd "$1" && pwd)"
shift
STEPS=" ${*:-prepare tests decode transfer ttft} "
cd "$ROOT"
PY="${RAGING_PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/raging-site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/raging-site:$ROOT"
fi
export RAGING_PYTHON="$PY" RAGING_INSTALL=none  # launch.sh runs this python as it is
TOKENIZER="${RAGING_TOKENIZER:-.whl/tokenizer}"
MODELS=/tmp/raging-gpu-models
BIG="$MODELS/llama-1b-shape"

step() {  # step NAME TIMEOUT_S COMMAND...: run it, its output to OUT/NAME.log, its status noted
  local name="$1" limit="$2"; shift 2
  [[ "$STEPS" == *" $name "* ]] || return 0
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - started)) s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
}

{ date -u; nvidia-smi -L; "$PY" -c 'import torch; print("torch", torch.__version__,
  torch.cuda.get_device_name())'; } >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
step prepare 60 "$PY" -m bench gpu prepare --tokenizer "$TOKENIZER" --out "$MODELS"
# RAGING_GPU_TESTS: other pytest arguments instead (a few tests, to look into one).
read -ra TESTS <<<"${RAGING_GPU_TESTS:-tests/engine/test_devices.py -k cuda \
tests/engine/model/test_graphs.py::test_replayed_cuda_graphs_give_the_eager_logits \
tests/kvtransfer/test_cuda_ipc.py tests/e2e/test_cuda_cluster.py}"
step tests 200 "$PY" -m pytest -q -p no:cacheprovider -rs --basetemp=/tmp/raging-pytest "${TESTS[@]}"
step decode 90 "$PY" -m bench gpu decode --model "$BIG" --batch-sizes 1,64
step transfer 60 "$PY" -m bench transfer --tokens 2048,8192 --repeats 3 --backends shm,cuda_ipc
step ttft 120 "$PY" -m bench gpu ttft --model "$BIG" --input-len 2000 --repeats 5
# The clusters' own logs (tests and benchmarks), the end of each, in one file.
for log in /tmp/raging-pytest/*/*/*.log /tmp/raging-pytest/*/*.log /tmp/raging-bench-*/*.log; do
  [[ -f "$log" ]] && { echo "=== $log"; tail -n 40 "$log"; }
done >"$OUT/cluster-logs.txt" 2>&1
