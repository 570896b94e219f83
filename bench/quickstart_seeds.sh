#!/usr/bin/env bash
# bench/quickstart_seeds.sh — the README's Quickstart check: does ES learn, for three seeds, more than its noise?
# The Quickstart's command with --seed 0, 1, 2 (3–10 minutes each on the 2-core CPUs measured), then every final
# checkpoint and the base side by side on the same 200 held-out arith problems (eval_passk.py, greedy; the runs are
# labelled LABEL@SEED, so its passk.md also pools them as LABEL@*), and the paired greedy reward and accuracy
# differences against the base (bench/paired_greedy.py). Rerunning skips finished runs.
#
#   bash bench/quickstart_seeds.sh                   # es.py, writes runs/quickstart-seeds/
#   SCRIPT=es_lowrank.py LABEL=lowrank FLAGS="--pop 16 --alpha 1e-2" OUT=runs/lowrank-seeds bash bench/quickstart_seeds.sh
#   SEEDS=0 FLAGS="--pop 32" ... one seed of another setting (FLAGS come last: they override the Quickstart's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/quickstart-seeds}
SCRIPT=${SCRIPT:-es.py}
LABEL=${LABEL:-es}
SEEDS=${SEEDS:-0 1 2}
QUICKSTART="--task arith --chat-template --pop 8 --prompts-per-iter 8 --max-new-tokens 24 --sigma 5e-3 --alpha 5e-3
  --iterations 6 --eval-every 3 --eval-prompts 64"
MODELS="base=smollm2-135m"
for SEED in $SEEDS; do
  RUN=$OUT/seed$SEED
  [ -d "$RUN/checkpoints/step_000006" ] || $PY "$SCRIPT" $QUICKSTART ${FLAGS:-} --seed "$SEED" --out-dir "$RUN"
  MODELS="$MODELS $LABEL@$SEED=$RUN/checkpoints/step_000006"
done
[ -f "$OUT/eval/samples.jsonl" ] || $PY eval_passk.py --task arith --chat-template --models $MODELS --num-problems 200 \
  --n 1 --max-new-tokens 24 --out-dir "$OUT/eval"
$PY bench/paired_greedy.py --run "$OUT/eval" --base base
