#!/usr/bin/env bash
# bench/gpu.sh — issue-6 benchmarks 1 (ES iteration split) and 3 (grpo.py vs TRL step) at GPU scale, on one lent
# H200, in under 8 minutes; tables and logs go to $OUT (bench-gpu.md, *.log).
#
# The H200 has torch + transformers but no tyro/trl/datasets, no vllm and no internet; the models are random-init
# Qwen2.5-1.5B built there from its config (bench/util.py), so nothing big travels (64 MiB carry limit).
#   1. here, once:            bash bench/prepare_gpu.sh /work/main/.venv/bin/python    (fills .whl/, git-ignored)
#   2. device tool:           run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=570)
# Without .whl/tokenizer the random models get a character-level tokenizer (prompts ~3× longer in tokens); without
# the trl wheels item 3 times grpo.py alone.
# CPU dry run of the Python parts with tiny sizes:  DRY=1 OUT=/tmp/gpu-dry PYTHON=/work/venv-trl/bin/python bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if ! "$PY" -c "import tyro, trl" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (py3.12)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed" | tee "$OUT/bench-gpu.md"; exit 1; }
fi
"$PY" -c "import tyro" 2>/dev/null || { echo "tyro missing: run bench/prepare_gpu.sh here and carry .whl" | tee "$OUT/bench-gpu.md"; exit 1; }
SIDES="ours trl"
"$PY" -c "import trl" 2>/dev/null || SIDES="ours"
TOK=.whl/tokenizer
[ -d "$TOK" ] || TOK=char

if [ "${DRY:-0}" = 1 ]; then  # CPU dry run: the same commands at toy sizes
  MODEL=smollm2-135m; ES="--pop 2 --prompts 2 --max-new-tokens 4 --dtype float32 --threads 2"
  GR="--prompts 1 --group-size 2 --max-new-tokens 4 --steps 2 --dtype float32 --threads 2"; T0=600; T1=600; T3=600
else
  MODEL=random:qwen2.5-1.5b; ES="--pop 8 --prompts 64 --max-new-tokens 256 --dtype bfloat16"
  GR="--prompts 8 --group-size 8 --max-new-tokens 256 --steps 3 --dtype bfloat16"; T0=90; T1=180; T3=200  # worst case 470 s
fi

{
  echo "# bench/gpu.sh — $(date -u +%F' '%H:%M' UTC')"; echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU (dry run)"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '· transformers', transformers.__version__)"
  "$PY" -c "import trl; print('trl', trl.__version__)" 2>/dev/null || echo "trl: not available, item 3 times grpo.py alone"
  echo "tokenizer for random models: $TOK"; echo
} > "$OUT/bench-gpu.md"

# build the random-init model once (on the GPU), shared by both benches
timeout $T0 "$PY" -c "import sys; sys.path.insert(0, 'bench'); from util import resolve_bench_model; from pathlib import Path; \
print(resolve_bench_model('$MODEL', Path('runs/bench-models'), None, '$TOK'))" > "$OUT/build.log" 2>&1

# 1. ES iteration split (HF backend: no vllm on the device)
timeout $T1 "$PY" bench/es_iteration.py --models "$MODEL" --tokenizer "$TOK" $ES --out "$OUT/es_iteration.md" \
  > "$OUT/es_iteration.log" 2>&1 || echo "es_iteration.py failed or timed out (rc $?): see es_iteration.log" >> "$OUT/bench-gpu.md"
[ -f "$OUT/es_iteration.md" ] && cat "$OUT/es_iteration.md" >> "$OUT/bench-gpu.md"; echo >> "$OUT/bench-gpu.md"

# 3. one GRPO step, grpo.py vs TRL GRPOTrainer (each side in its own subprocess)
timeout $T3 "$PY" bench/grpo_vs_trl.py --model "$MODEL" --tokenizer "$TOK" $GR --sides $SIDES --out "$OUT/grpo_vs_trl.md" \
  > "$OUT/grpo_vs_trl.log" 2>&1 || echo "grpo_vs_trl.py failed or timed out (rc $?): see grpo_vs_trl.log" >> "$OUT/bench-gpu.md"
[ -f "$OUT/grpo_vs_trl.md" ] && cat "$OUT/grpo_vs_trl.md" >> "$OUT/bench-gpu.md"

echo; echo "total $(( $(date +%s) - start )) s" >> "$OUT/bench-gpu.md"
cat "$OUT/bench-gpu.md"
