#!/usr/bin/env bash
# The whole test suite from a fresh clone: sets up .venv, prepares the model, runs ruff, mypy
# (configured in pyproject.toml) and pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$RAGING_PY" -m engine >/dev/null
"$RAGING_PY" -m ruff check .
"$RAGING_PY" -m mypy
exec "$RAGING_PY" -m pytest -q -p no:cacheprovider "$@"
