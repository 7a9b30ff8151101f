#!/usr/bin/env bash
# The GPU check of issue 17, prepared to run unattended on one H200 (no network) within 8 minutes:
#   1. bf16 forward-cost curves, n = 1..128 at 1k and 8k tokens of context, dynamic cache and static
#      cache + torch.compile, Llama-3.2-1B and Llama-3.1-8B shapes (random weights, nothing downloaded);
#   2. forced replay of the shared sets' recorded large-model outputs on the 1B, 8B and Mistral-7B shapes
#      (plain generate, transformers' prompt lookup, lookup_decode chain and tree), outputs checked.
# Writes tables (.md), raw numbers (.json) and a plot into $OUT_DIR (default benchmarks/results/gpu_check).
#
#   bash benchmarks/micro/gpu_check.sh                  # on the GPU machine, from the repository root
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/micro/gpu_check.sh   # tiny shapes on a CPU (tests/test_gpu_check.py)
#
# Needs torch, transformers, numpy, numba, matplotlib. Missing ones are installed from wheels in
# $WHEELS (default shared/wheels) without a network, if that folder exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu_check}
WHEELS=${WHEELS:-shared/wheels}
mkdir -p "$OUT_DIR"

missing=$(python - <<'PY'
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "numpy", "numba", "matplotlib")
               if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    if [ -d "$WHEELS" ]; then
        pip install --no-index --find-links "$WHEELS" $missing
    else
        echo "missing packages: $missing (no wheel folder $WHEELS to install them from)" >&2
        exit 2
    fi
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
    COSTS=(--shapes tiny --contexts 64 --sizes 1 4 --repeats 1 --dtype float32 --device cpu --backend eager)
    REPLAY_1B=(--shapes tiny --sets cnn_dm code_edit --limit 1 --max-new 24 --dtype float32 --device cpu)
    REPLAY_8B=(--shapes tiny/2 --sets code_edit --limit 1 --max-new 16 --dtype float32 --device cpu
               --methods plain lookup_decode)
    REPLAY_MISTRAL=(--shapes tiny/4 --sets cnn_dm --limit 1 --max-new 16 --dtype float32 --device cpu
                    --methods plain lookup_decode)
    T_COSTS=600; T_1B=600; T_8B=600; T_MISTRAL=600
else
    COSTS=(--shapes llama-3.2-1b llama-3.1-8b --contexts 1024 8192 --sizes 1 2 4 8 12 16 24 32 48 64 96 128
           --repeats 5 --dtype bfloat16 --device cuda --static-budget-s 30)
    REPLAY_1B=(--shapes llama-3.2-1b --sets cnn_dm code_edit hagrid editeval --limit 2 --max-new 256
               --dtype bfloat16 --device cuda)
    REPLAY_8B=(--shapes llama-3.1-8b --sets cnn_dm code_edit --limit 1 --max-new 256 --dtype bfloat16 --device cuda)
    REPLAY_MISTRAL=(--shapes mistral-7b --sets cnn_dm --limit 3 --max-new 256 --dtype bfloat16 --device cuda)
    T_COSTS=180; T_1B=110; T_8B=90; T_MISTRAL=70        # 450 s in all, under the 8-minute slot
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/gpu.txt" 2>/dev/null || true
status=0
# Each part has its own time limit (the sum stays under 8 minutes); each writes as it goes.
timeout "$T_COSTS" python -m benchmarks.micro.gpu_costs "${COSTS[@]}" --out "$OUT_DIR" || status=$?
timeout "$T_1B" python -m benchmarks.replay.forced "${REPLAY_1B[@]}" --out "$OUT_DIR" || status=$?
timeout "$T_8B" python -m benchmarks.replay.forced "${REPLAY_8B[@]}" --out "$OUT_DIR" || status=$?
timeout "$T_MISTRAL" python -m benchmarks.replay.forced "${REPLAY_MISTRAL[@]}" --out "$OUT_DIR" || status=$?
ls -l "$OUT_DIR"
exit $status
