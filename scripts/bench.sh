#!/usr/bin/env bash
# The benchmark tool in the project's venv (sets it up first): see `scripts/bench.sh --help`.
#   scripts/bench.sh serve --launch "--prefill 1 --decode 1" --workload chat --concurrency 8
#   scripts/bench.sh serve --url vllm=http://host:8000 --launch "ours=--prefill 1 --decode 1" \
#       --workload mixed --rates 0.5,1,2 --out runs/cmp/results.json
#   scripts/bench.sh runner [--quick]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
# Relative paths (--out, --tokenizer) stay relative to where it is run from.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$RAGING_PY" -m bench "$@"
