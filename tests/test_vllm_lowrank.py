"""es_lowrank.py on vLLM (vllm-cpu, the embedded SmolLM2-135M, fp32): every member a LoRA adapter in one batch must
generate what the HF backend's forward hooks generate, and a run must end with the HF backend's weights. One
LoRA-enabled engine for the module (start-up is 40-150 s on a 2-core CPU). Run: `pytest -m vllm`."""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # use every core (the default keeps one back)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
pytest.importorskip("vllm")

import common  # noqa: E402
import es  # noqa: E402
import es_lowrank as lr  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL, POP, RANK = common.EMBEDDED_MODEL, 4, 2


@pytest.fixture(scope="module")
def policy() -> common.VLLMPolicy:
    return common.VLLMPolicy(MODEL, batch_size=64, lora=(POP, RANK))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    tokenizer = common.load_tokenizer(common.resolve_model(MODEL))
    problems = common.load_task("arith", "train")[:3]
    return [common.render_prompt("arith", p, tokenizer, chat_template=True) for p in problems]


def test_lora_members_generate_the_hook_members_tokens(policy: common.VLLMPolicy, prompts: list[str]) -> None:
    """A center θ ≠ θ₀ (one update applied) synced into the engine, then 4 members (antithetic, rank 2) × 3 prompts:
    the LoRA batch's greedy tokens equal the HF hook batch's, row by row, and the members differ from the center."""
    hf = common.HFPolicy(MODEL)
    master = common.Master(hf.params)
    seeds, signs = es.member_seeds(0, 0, POP, antithetic=True)
    lr.es_update(master, seeds, signs, np.array([1.0, 0.0, 0.3, 0.6]), alpha=2e-3, r=RANK)
    common.sync_weights(policy, master.params)
    center = [s.token_ids for s in policy.generate(prompts, max_new_tokens=16)]
    assert center == [s.token_ids for s in hf.generate(prompts, max_new_tokens=16)]  # the updated θ is the engine's
    seeds, signs = es.member_seeds(0, 1, POP, antithetic=True)
    coefs = [s * 2e-2 / math.sqrt(RANK) for s in signs]
    rows = prompts * POP
    with lr.member_hooks(hf.model, hf.params, list(seeds), coefs, RANK):
        hooked = [s.token_ids for s in hf.generate(rows, max_new_tokens=16)]
    with tempfile.TemporaryDirectory() as tmp:
        folders = [lr.write_adapter(Path(tmp) / str(n), hf.params, seeds[n], coefs[n], RANK) for n in range(POP)]
        adapted = [s.token_ids for s in policy.generate(rows, max_new_tokens=16,
                                                        loras=[folders[b // len(prompts)] for b in range(len(rows))])]
    print("members × prompts differing from the center:", sum(a != c for a, c in zip(adapted, center * POP)))
    assert adapted == hooked
    assert any(a != c for a, c in zip(adapted, center * POP))  # the adapters change what is generated


def test_a_run_on_vllm_ends_with_the_hf_runs_weights(policy: common.VLLMPolicy, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """es_lowrank.main, 2 iterations per backend (hashed reward, so members differ and every update runs; the center
    evaluated through the engine after the updates): same member rewards, update norms, eval rewards and checkpoint.
    es.main builds the vLLM engine with lora = (N, r)."""
    common.sync_weights(policy, common.load_weights(common.resolve_model(MODEL)))  # θ₀ after the test above
    monkeypatch.setattr(es, "score", lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False))
    built = []
    monkeypatch.setattr(es, "VLLMPolicy", lambda *args, **kwargs: built.append(kwargs["lora"]) or policy)
    monkeypatch.setattr(policy, "close", lambda: None)  # the module's engine outlives the run
    runs = {}
    for backend in ("hf", "vllm"):
        args = lr.Args(backend=backend, task="arith", chat_template=True, pop=POP, noise_rank=RANK, sigma=2e-2,
                       alpha=5e-3, prompts_per_iter=3, max_new_tokens=16, iterations=2, eval_every=2, eval_prompts=2,
                       batch_size=64, out_dir=str(tmp_path / backend))
        runs[backend] = lr.main(args)
    assert built == [(POP, RANK)]
    rows = {b: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for b, run in runs.items()}
    keys = ("train/reward_mean", "train/reward_std", "es/update_norm", "es/d_rel", "eval/reward")
    assert [{k: r.get(k) for k in keys} for r in rows["vllm"]] == [{k: r.get(k) for k in keys} for r in rows["hf"]]
    assert all(r["es/skipped"] == 0 for r in rows["hf"] if "es/skipped" in r)
    from safetensors.torch import load_file

    a, b = (load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors")) for run in runs.values())
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_signal_inside_the_lora_rollout_then_resume_ends_with_the_hf_runs_weights(tmp_path: Path) -> None:
    """es_lowrank.py --backend vllm, SIGTERM inside iteration 2's batched LoRA rollout: the checkpoint holds θ_1 (the
    members live in adapters, never in θ), and the resumed run ends with an uninterrupted HF run's weights."""
    from test_runs import last_line, ok, run, weights

    flags = ["--task", "arith", "--chat-template", "--pop", str(POP), "--noise-rank", str(RANK), "--prompts-per-iter",
             "3", "--max-new-tokens", "12", "--sigma", "1e-2", "--alpha", "5e-3", "--iterations", "2", "--eval-every",
             "0", "--batch-size", "16", "--save-every", "0"]
    ok(run(tmp_path, *flags, "--out-dir", str(tmp_path / "hf"), script="es_lowrank"))
    out = tmp_path / "vllm"
    # generate calls, --eval-every 0: one batched call per iteration, 2 = iteration 2's
    stopped = ok(run(tmp_path, *flags, "--backend", "vllm", "--vllm-memory", "0.2", "--out-dir", str(out),
                     at_generate=2, sig="TERM", script="es_lowrank"), 143)
    assert last_line(stopped).startswith("interrupted after update 1; checkpoint ")
    ok(run(tmp_path, "--resume", str(out), script="es_lowrank"))
    a, b = weights(tmp_path / "hf", 2), weights(out, 2)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
