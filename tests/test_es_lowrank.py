"""es_lowrank.py: batched members against materialised models, the update against the brute-force sum, learning on a
toy reward, and the script end to end. (HF against vLLM: tests/test_vllm_lowrank.py; Ctrl-C/resume: test_runs.py.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import harness  # noqa: E402
import es
import es_lowrank as lr
from common import HFPolicy, Master

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ab", "hello there, tiny model", "12+3=", "xyz!"]  # different lengths: left padding in every batch


@torch.no_grad()
def materialise(master: Master, seed: int, coef: float, r: int) -> None:
    """The model's params = θ + coef·A·Bᵀ on every target (member `seed` written out as a full weight change)."""
    for name in lr.targets(master.params):
        a, b = lr.factors(seed, name, master.params[name], r)
        master.params[name].copy_(master.theta[name] + coef * (a @ b.T))


def test_targets_are_the_block_matrices_of_the_tiny_llama(tiny_model: str) -> None:
    params = HFPolicy(tiny_model, "float32", "cpu").params
    names = lr.targets(params)
    assert len(names) == 2 * 7 and all(params[k].ndim == 2 and ".layers." in k for k in names)
    assert "model.embed_tokens.weight" not in names and not any("norm" in k for k in names)
    a, b = lr.factors(3, names[0], params[names[0]], 2)
    assert a.shape == (params[names[0]].shape[0], 2) and b.shape == (params[names[0]].shape[1], 2)
    q0, q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"  # equal shapes
    assert a.dtype == torch.float32 and not torch.equal(lr.factors(3, q0, params[q0], 2)[0],
                                                        lr.factors(3, q1, params[q1], 2)[0])  # i.i.d. across tensors


@pytest.mark.parametrize("r", [1, 3])
def test_batched_members_have_the_logits_of_their_materialised_models(tiny_model: str, r: int) -> None:
    """Four members (antithetic signs) in one left-padded batch of 4 × 4 rows: row b's logits equal those of the
    model θ + sign·σ/√r·A_n·B_nᵀ, n = b // 4, at every real (non-pad) position."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    seeds, signs = es.member_seeds(0, 0, 4, antithetic=True)
    coefs = [s * 0.05 / math.sqrt(r) for s in signs]
    batch = policy.tokenizer([p for _ in seeds for p in PROMPTS], return_tensors="pt", padding=True,
                             add_special_tokens=False)
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # left padding is exercised
    with lr.member_hooks(policy.model, policy.params, seeds, coefs, r):
        batched = policy.model(**batch).logits  # (16, T, V)
    center = policy.model(**batch).logits  # hooks removed: θ again
    for n, (seed, coef) in enumerate(zip(seeds, coefs)):
        materialise(master, seed, coef, r)
        alone = policy.model(**batch).logits
        rows = slice(4 * n, 4 * n + 4)
        torch.testing.assert_close(batched[rows][mask[rows]], alone[rows][mask[rows]], rtol=0, atol=2e-5)
        assert (center[rows][mask[rows]] - alone[rows][mask[rows]]).abs().max() > 1e-2  # the member is not θ
    master.restore()
    assert torch.equal(center, policy.model(**batch).logits)


def test_population_rows_go_to_their_members_however_they_are_batched(tiny_model: str) -> None:
    """evaluate_population: row n of the rewards holds member n's greedy completions, the same texts as member n's
    materialised model θ + sign_n·σ/√r·A_n·B_nᵀ generates alone (6 antithetic members, rank 2), whether the members
    share one batch, go 2 per batch, or 1 per batch cut into chunks of 3 prompts (HFPolicy.generate's own chunking);
    θ is untouched."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    before = {k: p.clone() for k, p in policy.params.items()}
    seeds, signs = es.member_seeds(1, 0, 6, antithetic=True)
    expected = []
    for seed, sign in zip(seeds, signs):
        materialise(master, seed, sign * 0.05 / math.sqrt(2), 2)
        expected.append([x.text for x in policy.generate(PROMPTS, max_new_tokens=6)])
        master.restore()
    assert len({tuple(t) for t in expected}) == 6  # every member generates its own texts
    by_hand = [[sum(map(ord, t)) + i for i, t in enumerate(row)] for row in expected]
    for batch_size in (64, 8, 3):
        policy.batch_size = batch_size

        def reward(i: int, text: str) -> tuple[float, bool]:
            return float(sum(map(ord, text)) + i), i % 2 == 1

        rewards, correct, perf = lr.evaluate_population(policy, master, PROMPTS, reward, seeds, signs, 0.05, 6, 0.0,
                                                        [0] * 6, r=2)
        assert rewards.tolist() == by_hand, batch_size
        assert correct.tolist() == [[0, 1, 0, 1]] * 6 and perf["tokens"] > 0
    assert all(torch.equal(before[k], p) for k, p in policy.params.items())


def brute_force(theta: dict[str, torch.Tensor], params: dict, seeds: list[int], coefs: np.ndarray, alpha: float,
                r: int) -> dict[str, torch.Tensor]:
    """θ + α/N·Σ_n coefs[n]·A_n·B_nᵀ/√r on every target, each member's matrix written out and summed one by one."""
    out = {k: v.clone() for k, v in theta.items()}
    for name in lr.targets(params):
        for seed, c in zip(seeds, coefs):
            a, b = lr.factors(seed, name, params[name], r)
            out[name] += alpha / len(seeds) * float(c) * (a @ b.T) / math.sqrt(r)
    return out


@pytest.mark.parametrize("antithetic,r", [(False, 1), (True, 2)])
def test_update_equals_the_brute_force_sum(tiny_model: str, antithetic: bool, r: int) -> None:
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    theta0 = {k: m.clone() for k, m in master.theta.items()}
    seeds, signs = es.member_seeds(0, 2, 6, antithetic)
    rewards = np.array([0.3, 0.9, 0.1, 0.5, 0.5, 0.0])
    stats = lr.es_update(master, seeds, signs, rewards, alpha=0.1, r=r)
    expected = brute_force(theta0, policy.params, seeds, es.zscore(rewards) * signs, 0.1, r)
    untouched = [k for k in theta0 if k not in lr.targets(policy.params)]
    assert "model.embed_tokens.weight" in untouched and any("norm" in k for k in untouched)
    for k, m in master.theta.items():
        torch.testing.assert_close(m, expected[k], rtol=0, atol=1e-6)
        assert torch.equal(policy.params[k], m)  # cast once into the model (fp32: the master itself)
    assert all(torch.equal(master.theta[k], theta0[k]) for k in untouched)
    norm = math.sqrt(sum(float((master.theta[k] - theta0[k]).norm()) ** 2 for k in theta0))
    assert stats == {"es/update_norm": pytest.approx(norm, rel=1e-4), "es/skipped": 0}


def test_update_with_anchored_weight_decay_skips_and_nan(tiny_model: str) -> None:
    """AWD shrinks towards θ₀ after the step (es.py's master.shrink_to_base); equal rewards: no update; a NaN
    reward stops before the master is touched."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    theta0 = {k: m.clone() for k, m in master.theta.items()}
    seeds, signs = es.member_seeds(0, 0, 4, False)
    rewards = np.array([1.0, 0.0, 0.5, 0.25])
    lr.es_update(master, seeds, signs, rewards, alpha=0.1, awd_lambda=2.0)
    stepped = brute_force(theta0, policy.params, seeds, es.zscore(rewards), 0.1, 1)
    for k, m in master.theta.items():
        torch.testing.assert_close(m, theta0[k] + (1 - 0.1 * 2.0) * (stepped[k] - theta0[k]), rtol=0, atol=1e-6)
    now = {k: m.clone() for k, m in master.theta.items()}
    assert lr.es_update(master, seeds, signs, np.full(4, 0.5), alpha=0.1) == {"es/update_norm": 0.0, "es/skipped": 1}
    with pytest.raises(SystemExit, match="reward is not finite"):
        lr.es_update(master, seeds, signs, np.array([1.0, float("nan"), 0, 0]), alpha=0.1)
    assert all(torch.equal(now[k], m) for k, m in master.theta.items())


def test_lowrank_es_learns_a_toy_reward(tiny_model: str) -> None:
    """The tiny random model must learn to emit digits: center reward clearly up after 30 iterations of 16 members
    (as es.py's test, which uses 8 full-rank members)."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)

    def digits(i: int, text: str) -> tuple[float, bool]:
        r = sum(c.isdigit() for c in text) / max(len(text), 1)
        return r, r > 0.5

    def center_reward() -> float:
        return float(np.mean([digits(0, x.text)[0] for x in policy.generate(PROMPTS, max_new_tokens=8)]))

    start = center_reward()
    for t in range(30):
        seeds, signs = es.member_seeds(0, t, 16, False)
        rewards, _, _ = lr.evaluate_population(policy, master, PROMPTS, digits, seeds, signs, 0.02, 8, 0.0, [0] * 16)
        lr.es_update(master, seeds, signs, rewards.mean(1), alpha=0.05)
    assert center_reward() >= start + 0.25, (start, center_reward())


# ---------------------------------------------------------------------------------------------------- the script
def test_es_lowrank_script_smoke(tiny_model: str, tmp_path: Path) -> None:
    """3 iterations, rank 2, antithetic: metrics.jsonl, a checkpoint that loads with from_pretrained, in which the
    targets moved and the embedding and norms did not. The reward is a hash of the text (the tiny model earns no
    task reward: every update would be skipped), patched in by a runner that then runs the script's own main."""
    run, runner = tmp_path / "run", tmp_path / "hashed_reward_es_lowrank.py"
    runner.write_text(f"import sys, zlib\nsys.path.insert(0, {str(ROOT)!r})\nimport common, es, es_lowrank, harness\n"
                      "es.score = lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False)\n"
                      "if __name__ == \"__main__\":  # the spawned math-verify worker imports this file\n"
                      "    es_lowrank.main(harness.cli(es_lowrank.Args))\n")
    result = subprocess.run([sys.executable, str(runner), "--model", tiny_model, "--pop", "4", "--antithetic",
                             "--noise-rank", "2", "--prompts-per-iter", "3", "--max-new-tokens", "8", "--eval-prompts",
                             "3", "--sigma", "0.05", "--alpha", "0.05", "--iterations", "3", "--eval-every", "2",
                             "--batch-size", "6", "--out-dir", str(run)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in rows if "eval/reward" in r] == [0, 2, 3]
    for key in ("es/js_succ_bits", "es/d_rel", "es/update_norm", "perf/rollout_s", "perf/tokens_per_s"):
        assert all(math.isfinite(r[key]) for r in train), key
    info = json.loads((run / "args.json").read_text())["args"]
    assert info["noise_rank"] == 2 and info["pop"] == 4
    final = run / "checkpoints" / "step_000003"
    AutoModelForCausalLM.from_pretrained(final)
    start, end = load_file(str(Path(tiny_model) / "model.safetensors")), load_file(str(final / "model.safetensors"))
    moved = {k for k in end if not torch.equal(start[k], end[k])}
    assert moved == set(lr.targets(end)), sorted(moved)


@pytest.mark.parametrize("flags,message", [(["--noise-rank", "0"], "--noise-rank must be ≥ 1, got 0"),
                                           (["--noise-table", "1000"], "--noise-table is es.py's"),
                                           (["--pop", "1"], "--pop must be ≥ 2")])
def test_bad_flags_stop_before_anything_is_loaded(flags: list[str], message: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(es, "HFPolicy", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "argv", ["es_lowrank.py", *flags, "--out-dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as stop:
        lr.main(harness.cli(lr.Args))
    assert str(stop.value.code).startswith(f"error: {message}") and not (tmp_path / "run").exists()


def test_args_extend_es_args_and_main_passes_the_engine_its_adapters(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """es_lowrank.Args is es.Args + --noise-rank (every es.py flag works); main hands es.main the batched stages and,
    for a vLLM engine, (N, r) adapters."""
    assert {f for f in es.Args.__dataclass_fields__} < {f for f in lr.Args.__dataclass_fields__}
    called = {}
    monkeypatch.setattr(lr.es, "main", lambda args, population, update, lora: called.update(
        population=population, update=update, lora=lora))
    lr.main(lr.Args(pop=12, noise_rank=4, out_dir=str(tmp_path / "run")))
    assert called["lora"] == (12, 4) and called["population"].func is lr.evaluate_population
    assert called["update"].func is lr.es_update and called["update"].keywords == {"r": 4}
