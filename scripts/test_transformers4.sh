#!/usr/bin/env bash
# The hook's exactness tests (greedy on tiny Llama, GPT-2, Qwen2 + the sampling tests) against the oldest
# supported transformers, in a fresh virtual environment, so the 4.x shim (cache.py, hf.py) stays tested.
# Run by .ci/run after the main suite; TRANSFORMERS=... picks another release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-${TMPDIR:-/tmp}/lookup-decode-transformers4}"
TRANSFORMERS="${TRANSFORMERS:-transformers==4.57.*}"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "torch==2.13.0" "$TRANSFORMERS" scipy
"$VENV/bin/pip" install --quiet -e ".[test]" "$TRANSFORMERS"
"$VENV/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
# test_return_dict_with_scores_and_logits reads `out.cache`, the 5.x name (4.x: out.past_key_values).
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_decode.py tests/test_sampling.py \
    -k "not test_return_dict_with_scores_and_logits"
