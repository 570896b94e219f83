"""es.py: the math against hand-computed values, learning on a toy reward, and the script end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import es
from common import HFPolicy, noise

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str, check: bool = True, threads: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------- math
def test_zscore_has_mean_zero_std_one_and_no_nan_when_constant() -> None:
    z = es.zscore(np.array([0.1, 0.5, 0.2, 0.9]))
    assert z.mean() == pytest.approx(0) and z.std() == pytest.approx(1, abs=1e-6)
    assert np.array_equal(es.zscore(np.full(5, 0.3)), np.zeros(5))


def test_js_diversity_and_coverage_by_hand() -> None:
    # prompt 1: 3 of 4 members correct; prompt 2: 1 of 4. Greedy: p_i ∈ {0,1}, so JS_succ(x) = h(p̄(x)).
    correct = np.array([[1, 0], [1, 1], [0, 0], [1, 0]], dtype=float)
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))  # 0.8113 bits, same for p̄ = 0.25
    js, coverage = es.js_diversity(correct)
    assert js == pytest.approx(h) and coverage == pytest.approx(1.0)
    js, coverage = es.js_diversity(np.array([[0.5], [0.5]]))  # identical members: no diversity
    assert js == pytest.approx(0) and coverage == pytest.approx(0.75)
    assert es.js_diversity(np.zeros((3, 2))) == (pytest.approx(0), pytest.approx(0))


def test_member_seeds_are_derived_and_antithetic_pairs_share_them() -> None:
    seeds, signs = es.member_seeds(0, 3, 4, antithetic=False)
    assert len(set(seeds)) == 4 and list(signs) == [1, 1, 1, 1] and seeds == es.member_seeds(0, 3, 4, False)[0]
    assert seeds != es.member_seeds(0, 4, 4, False)[0] != es.member_seeds(1, 3, 4, False)[0]
    seeds, signs = es.member_seeds(0, 3, 4, antithetic=True)
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3] and list(signs) == [1, -1, 1, -1]


def test_equal_rewards_give_no_update_and_no_nan(tiny_model: str) -> None:
    policy = HFPolicy(tiny_model, "float32", "cpu", es=True)
    before = {k: m.clone() for k, m in policy.master.items()}
    args = es.Args(model=tiny_model, pop=4, sigma=0.01, alpha=0.01, max_new_tokens=4)
    metrics = es.es_step(policy, ["ab", "cd"], lambda i, text: (0.5, False), args, t=0)
    assert metrics["es/skipped"] == 1 and metrics["es/update_norm"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert all(torch.equal(before[k], m) for k, m in policy.master.items())


def test_es_update_moves_along_the_rewarded_noise(tiny_model: str) -> None:
    """Two members, rewards (1, 0): z = (+1, −1), so θ moves by α/2·(ε₁ − ε₂) exactly."""
    policy = HFPolicy(tiny_model, "float32", "cpu", es=True)
    before = {k: m.clone() for k, m in policy.master.items()}
    args = es.Args(model=tiny_model, pop=2, sigma=0.01, alpha=0.1, max_new_tokens=2)
    seen = []

    def reward(i: int, text: str) -> tuple[float, bool]:  # member 0 (first 2 calls) scores 1, member 1 scores 0
        seen.append(text)
        return (1.0 if len(seen) <= 2 else 0.0), False

    es.es_step(policy, ["ab", "cd"], reward, args, t=0)
    (s1, s2), _ = es.member_seeds(args.seed, 0, 2, False)
    z = (1 - 0.5) / (0.5 + 1e-8)
    for name, m in before.items():
        eps1, eps2 = (noise(s, name, m.shape, "cpu") for s in (s1, s2))
        assert torch.allclose(policy.master[name], m + 0.1 / 2 * (z * eps1 - z * eps2), rtol=0, atol=1e-8)


def test_es_learns_a_toy_reward(tiny_model: str) -> None:
    """The tiny random model must learn to emit digits: center reward clearly up after 30 iterations."""
    policy = HFPolicy(tiny_model, "float32", "cpu", es=True)
    prompts = ["abc", "hello", "12+3", "xyz!"]

    def digits(i: int, text: str) -> tuple[float, bool]:
        r = sum(c.isdigit() for c in text) / max(len(text), 1)
        return r, r > 0.5

    def center_reward() -> float:
        return float(np.mean([digits(0, x.text)[0] for x in policy.generate(prompts, max_new_tokens=8)]))

    args = es.Args(model=tiny_model, pop=8, sigma=0.01, alpha=0.03, max_new_tokens=8, seed=0)
    start = center_reward()
    for t in range(30):
        es.es_step(policy, prompts, digits, args, t)
    assert center_reward() >= start + 0.25, (start, center_reward())


# ---------------------------------------------------------------------------------------------------- the script
TINY_FLAGS = ["--pop", "4", "--prompts-per-iter", "3", "--max-new-tokens", "8", "--eval-prompts", "3",
              "--sigma", "0.01", "--alpha", "0.01", "--batch-size", "16"]


def test_es_script_smoke(tiny_model: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_script("es.py", "--model", tiny_model, *TINY_FLAGS, "--iterations", "3", "--eval-every", "2",
               "--save-every", "2", "--out-dir", str(run))
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    for key in ["train/reward_mean", "es/js_succ_bits", "es/coverage", "es/d_rel", "perf/rollout_s"]:
        assert all(math.isfinite(r[key]) for r in rows[1:]), key
    info = json.loads((run / "args.json").read_text())
    assert info["args"]["pop"] == 4 and "torch" in info["packages"] and "git_sha" in info
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000003")
    assert sum(p.numel() for p in model.parameters()) > 0
    # a second run into the same directory is refused instead of mixing two runs' logs
    again = run_script("es.py", "--model", tiny_model, "--out-dir", str(run), check=False)
    assert again.returncode != 0 and "already holds a run" in again.stderr


def test_resume_ends_with_exactly_the_uninterrupted_weights(tiny_model: str, tmp_path: Path) -> None:
    flags = ["--model", tiny_model, *TINY_FLAGS, "--eval-every", "2", "--save-every", "2"]
    run_script("es.py", *flags, "--iterations", "4", "--out-dir", str(tmp_path / "full"))
    # "crash" after iteration 3 was logged but before its checkpoint: keep only step 2
    run_script("es.py", *flags, "--iterations", "3", "--out-dir", str(tmp_path / "cut"))
    import shutil
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000003")
    run_script("es.py", "--resume", str(tmp_path / "cut"), "--iterations", "4")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoints" / "step_000004").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "checkpoints" / "step_000004").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "full")) == strip(read_metrics(tmp_path / "cut"))


@pytest.mark.parametrize("script", ["es.py"])
def test_help_exits_zero_with_warnings_as_errors(script: str) -> None:
    result = run_script("-W", "error", script, "--help")
    assert "--pop" in result.stdout or "--help" in result.stdout


def test_bad_input_is_one_line_error_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = run_script("es.py", "--model", str(tmp_path / "missing"), "--out-dir", str(out), check=False)
    assert result.returncode == 1 and not out.exists()
    assert result.stderr.strip().splitlines()[-1].startswith("error: model")
    result = run_script("es.py", "--task", "gsm8k", "--data", str(tmp_path), "--out-dir", str(out), check=False)
    assert result.returncode == 1 and "no train.jsonl" in result.stderr and not out.exists()


def test_es_on_the_embedded_smollm2(tmp_path: Path) -> None:
    """The real default model: 1 iteration, N=2, 2 prompts, 16 tokens; converts the GGUF on first use."""
    run = tmp_path / "smol"
    run_script("es.py", "--pop", "2", "--prompts-per-iter", "2", "--max-new-tokens", "16", "--iterations", "1",
               "--eval-every", "0", "--out-dir", str(run), threads=os.cpu_count() or 1)
    row = read_metrics(run)[-1]
    assert row["iteration"] == 1 and 0 <= row["train/reward_mean"] <= 1.1 and row["perf/tokens_per_s"] > 0
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000001")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
