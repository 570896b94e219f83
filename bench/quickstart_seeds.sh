#!/usr/bin/env bash
# bench/quickstart_seeds.sh — the README's Quickstart check: does ES learn, for three seeds, more than its noise?
# The Quickstart's es.py command with --seed 0, 1, 2 (about 10 minutes each on 2 CPU cores), then every final
# checkpoint and the base side by side on the same 200 held-out arith problems (eval_passk.py, greedy; the seeds are
# labelled es@SEED, so its passk.md also pools them as es@*), and the paired greedy reward and accuracy differences
# against the base (bench/paired_greedy.py). Rerunning skips finished runs.
#
#   bash bench/quickstart_seeds.sh                   # writes runs/quickstart-seeds/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/quickstart-seeds}
QUICKSTART="--task arith --chat-template --pop 8 --prompts-per-iter 8 --max-new-tokens 24 --sigma 5e-3 --alpha 5e-3
  --iterations 6 --eval-every 3 --eval-prompts 64"
MODELS="base=smollm2-135m"
for SEED in 0 1 2; do
  RUN=$OUT/seed$SEED
  [ -d "$RUN/checkpoints/step_000006" ] || $PY es.py $QUICKSTART --seed $SEED --out-dir "$RUN"
  MODELS="$MODELS es@$SEED=$RUN/checkpoints/step_000006"
done
[ -f "$OUT/eval/samples.jsonl" ] || $PY eval_passk.py --task arith --chat-template --models $MODELS --num-problems 200 \
  --n 1 --max-new-tokens 24 --out-dir "$OUT/eval"
$PY bench/paired_greedy.py --run "$OUT/eval" --base base
