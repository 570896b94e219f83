#!/usr/bin/env bash
# bench/gpu.sh — the GPU check (bench/gpu_check.py) on a GPU machine, in under 8 minutes.
#
# Nothing to prepare: no wheels, no tokenizer, no model download. The box needs only Python 3 with torch and
# transformers; tyro, trl, datasets, vllm, math_verify and matplotlib are optional (a check that needs one says
# "skipped: <reason>"). The models are random-init ones built there from a config (bench/util.py).
#
#   GPU box, from the repo root:   bash bench/gpu.sh
#   CPU dry run, tiny sizes:       DRY=1 OUT=/tmp/gpu-dry bash bench/gpu.sh     (~1 min; tests/test_gpu_check.py)
#
# OUT (default runs/gpu-check, relative to the repo root) gets gpu-check.md (machine line, one section per check,
# a summary) and gpu-check.log (everything printed, tracebacks included). PYTHON picks the interpreter (python3).
# The script stops itself at 440 s; `timeout 470` is the backstop (gpu-check.md then holds the checks done).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
dry=""
[ "${DRY:-0}" = 1 ] && dry=--dry
PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  timeout 470 "${PYTHON:-python3}" bench/gpu_check.py --out "$OUT" $dry "$@" 2>&1 | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && printf '\n**stopped by bench/gpu.sh: timeout 470 s**\n' >> "$OUT/gpu-check.md"
echo
cat "$OUT/gpu-check.md" 2>/dev/null || echo "no $OUT/gpu-check.md (exit status $rc)"
exit "$rc"
