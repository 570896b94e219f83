#!/usr/bin/env bash
# bench/prepare_gpu.sh — run HERE (with internet/pip) before bench/gpu.sh: fills .whl/ (git-ignored) with what the
# lent H200 lacks (it has torch + transformers + accelerate, but no tyro, trl or datasets, and no internet):
#   .whl/*.whl        tyro + its deps, trl + datasets + their missing deps (pure-Python wheels, ~5 MB together)
#   .whl/tokenizer/   the SmolLM2-135M-Instruct tokenizer (~3.5 MB) for the random-init models built there
# Usage, from the repo root:  bash bench/prepare_gpu.sh [PYTHON]   (PYTHON: one that imports common.py)
set -euo pipefail
PY=${1:-python3}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
"$PY" - <<'PYEOF'
import sys; sys.path.insert(0, ".")
from transformers import AutoTokenizer
from common import EMBEDDED_MODEL, resolve_model
AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL)).save_pretrained(".whl/tokenizer")
PYEOF
du -sh .whl && ls .whl
