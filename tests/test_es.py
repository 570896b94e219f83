"""es.py: the math against hand-computed values, learning on a toy reward, and the script end to end."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import harness  # noqa: E402
import es
from common import HFPolicy, Master, noise

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


def es_master(tiny_model: str, **kwargs) -> Master:
    return Master(HFPolicy(tiny_model, "float32", "cpu").params, **kwargs)


def test_equal_rewards_give_no_update_and_no_nan(tiny_model: str) -> None:
    master = es_master(tiny_model)
    before = {k: m.clone() for k, m in master.theta.items()}
    seeds, signs = es.member_seeds(0, 0, 4, False)
    metrics = es.es_update(master, seeds, signs, np.full(4, 0.5), alpha=0.01)
    assert metrics == {"es/update_norm": 0.0, "es/skipped": 1}
    assert all(torch.equal(before[k], m) for k, m in master.theta.items())


def test_es_update_moves_along_the_rewarded_noise(tiny_model: str) -> None:
    """Two members, rewards (1, 0): z = (+1, −1), so θ moves by α/2·(ε₁ − ε₂) exactly."""
    master = es_master(tiny_model)
    before = {k: m.clone() for k, m in master.theta.items()}
    (s1, s2), signs = es.member_seeds(0, 0, 2, False)
    es.es_update(master, [s1, s2], signs, np.array([1.0, 0.0]), alpha=0.1)
    z = (1 - 0.5) / (0.5 + 1e-8)
    for name, m in before.items():
        eps1, eps2 = (noise(s, name, m.shape, "cpu") for s in (s1, s2))
        assert torch.allclose(master.theta[name], m + 0.1 / 2 * (z * eps1 - z * eps2), rtol=0, atol=1e-8)


def hand_update(master0: dict, seeds: list[int], coefs: list[float], scale: float) -> dict:
    """master0 + scale·Σ_n coefs[n]·ε(seeds[n]), with the noise drawn here and every sum written out."""
    return {k: m + scale * sum(c * noise(s, k, m.shape, "cpu") for s, c in zip(seeds, coefs))
            for k, m in master0.items()}


def member_scorer(rewards: list[float], prompts: int):
    """A reward function that gives member n (its `prompts` calls in order) the reward rewards[n]."""
    calls = []

    def reward(i: int, text: str) -> tuple[float, bool]:
        calls.append(i)
        return rewards[(len(calls) - 1) // prompts], False

    return reward


def test_population_rewards_are_per_member_and_theta_is_restored(tiny_model: str) -> None:
    """evaluate_population: row n holds member n's rewards over the prompts, each member is θ + sign·σ·ε_n while it
    generates (its completion differs from θ's), and θ is back bit-exactly afterwards."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    before = {k: p.clone() for k, p in policy.params.items()}
    seen = []

    def reward(i: int, text: str) -> tuple[float, bool]:
        seen.append(text)
        return float(len(seen)), len(seen) % 2 == 0

    seeds, signs = es.member_seeds(0, 0, 3, False)
    rewards, correct, perf = es.evaluate_population(policy, master, ["ab", "cd"], reward, seeds, signs, 0.5, 6, 0.0,
                                                    [0, 0, 0])
    assert rewards.tolist() == [[1, 2], [3, 4], [5, 6]] and correct.tolist() == [[0, 1], [0, 1], [0, 1]]
    assert perf["tokens"] > 0 and all(torch.equal(before[k], p) for k, p in policy.params.items())
    center = [x.text for x in policy.generate(["ab", "cd"], max_new_tokens=6)]
    assert seen[:2] != center or seen[2:4] != center  # σ = 0.5 moves the members' greedy text


def test_es_update_with_antithetic_pairs_by_hand(tiny_model: str) -> None:
    """N = 4 antithetic: members (+ε_a, −ε_a, +ε_b, −ε_b) with rewards (1, 0, 0.5, 0.5). By hand: mean 0.5,
    std = √((0.25 + 0.25 + 0 + 0)/4) = 1/(2√2), z = (√2, −√2, 0, 0); the update is α/4·(√2·ε_a − (−√2)·ε_a)
    = α/4·2√2·ε_a: the pair's two members push along the same +ε_a."""
    master = es_master(tiny_model)
    master0 = {k: m.clone() for k, m in master.theta.items()}
    seeds, signs = es.member_seeds(0, 0, 4, True)
    es.es_update(master, seeds, signs, np.array([1.0, 0.0, 0.5, 0.5]), alpha=0.1)
    a, a2, b, _ = seeds
    assert a == a2 != b
    z = 0.5 / (math.sqrt(0.125) + 1e-8)
    expected = hand_update(master0, [a], [2 * z], 0.1 / 4)
    for k, m in master.theta.items():
        torch.testing.assert_close(m, expected[k], rtol=0, atol=2e-7)


def test_es_update_with_anchored_weight_decay_by_hand(tiny_model: str) -> None:
    """AWD after the update: master = θ₀ + (1 − αλ)(θ' − θ₀), θ' = θ + α/N·Σ z_n ε_n. Here θ starts away from θ₀
    (a first step), so the shrink is visible on both the old drift and the new update."""
    master = es_master(tiny_model)
    theta0 = {k: m.clone() for k, m in master.theta.items()}
    master.add_noise([99], [1.0], 0.02)  # θ = θ₀ + 0.02·ε_99
    theta = {k: m.clone() for k, m in master.theta.items()}
    (s1, s2), signs = es.member_seeds(0, 3, 2, False)
    es.es_update(master, [s1, s2], signs, np.array([1.0, 0.0]), alpha=0.1, awd_lambda=2.0)
    z = 0.5 / (0.5 + 1e-8)
    stepped = hand_update(theta, [s1, s2], [z, -z], 0.1 / 2)
    for k, m in master.theta.items():
        expected = theta0[k] + (1 - 0.1 * 2.0) * (stepped[k] - theta0[k])
        torch.testing.assert_close(m, expected, rtol=0, atol=2e-7)


def test_a_nan_reward_never_reaches_the_master(tiny_model: str) -> None:
    master = es_master(tiny_model)
    before = {k: m.clone() for k, m in master.theta.items()}
    seeds, signs = es.member_seeds(0, 0, 2, False)
    with pytest.raises(SystemExit, match="reward is not finite"):
        es.es_update(master, seeds, signs, np.array([1.0, float("nan")]), alpha=0.1)
    assert all(torch.equal(before[k], m) for k, m in master.theta.items())


def test_master_on_cpu_gives_the_same_weights(tiny_model: str) -> None:
    """--master-device: noise is drawn on the model's device either way, so the placement of the master changes no
    number (on a GPU machine: master on the CPU vs on the GPU; here both are the CPU)."""
    a, b = es_master(tiny_model), es_master(tiny_model, device="cpu")
    for master in (a, b):
        master.perturb(5, 0.01)
        master.add_noise([1, 2], [0.3, -0.7], 0.1)
    assert all(torch.equal(a.theta[k], b.theta[k]) for k in a.theta)


def test_es_learns_a_toy_reward(tiny_model: str) -> None:
    """The tiny random model must learn to emit digits: center reward clearly up after 30 iterations."""
    policy = HFPolicy(tiny_model, "float32", "cpu")
    master = Master(policy.params)
    prompts = ["abc", "hello", "12+3", "xyz!"]

    def digits(i: int, text: str) -> tuple[float, bool]:
        r = sum(c.isdigit() for c in text) / max(len(text), 1)
        return r, r > 0.5

    def center_reward() -> float:
        return float(np.mean([digits(0, x.text)[0] for x in policy.generate(prompts, max_new_tokens=8)]))

    start = center_reward()
    for t in range(30):
        seeds, signs = es.member_seeds(0, t, 8, False)
        rewards, _, _ = es.evaluate_population(policy, master, prompts, digits, seeds, signs, 0.01, 8, 0.0, [0] * 8)
        es.es_update(master, seeds, signs, rewards.mean(1), alpha=0.03)
    assert center_reward() >= start + 0.25, (start, center_reward())


# ---------------------------------------------------------------------------------------------------- the script
TINY_FLAGS = ["--pop", "4", "--prompts-per-iter", "3", "--max-new-tokens", "8", "--eval-prompts", "3",
              "--sigma", "0.01", "--alpha", "0.01", "--batch-size", "16"]


def test_es_script_smoke(tiny_model: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_script("es.py", "--model", tiny_model, *TINY_FLAGS, "--iterations", "3", "--eval-every", "2",
                        "--save-every", "2", "--out-dir", str(run))
    rows = read_metrics(run)
    train, evals = [r for r in rows if "train/reward_mean" in r], [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [0, 2, 3]
    for key in ["train/reward_mean", "es/js_succ_bits", "es/coverage", "es/d_rel", "perf/rollout_s"]:
        assert all(math.isfinite(r[key]) for r in train), key
    info = json.loads((run / "args.json").read_text())
    assert info["args"]["pop"] == 4 and "torch" in info["packages"] and "git_sha" in info
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000003")
    assert sum(p.numel() for p in model.parameters()) > 0
    # the estimate before the first iteration, the projection after it, and the picture at the end
    out = result.stdout
    assert "3 iterations of 4 members × 3 prompts × ≤ 8 new tokens (≤ 96 generated tokens per iteration)" in out
    assert "iteration 1: " in out and "s each so far; the remaining 2 take about" in out and f"curves: {run / 'curves.png'}" in out
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second run into the same directory is refused instead of mixing two runs' logs
    again = run_script("es.py", "--model", tiny_model, "--out-dir", str(run), check=False)
    assert again.returncode != 0 and "already holds a run" in again.stderr


def test_resume_takes_every_flag_passed_even_when_it_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    ) -> None:
    """Saved with --eval-every 0 --pop 8; resumed with --eval-every 25 --pop 32 (both es.py's defaults): the flags
    passed win; the flags not passed come from args.json."""
    run = tmp_path / "run"
    run.mkdir()
    saved = es.Args(eval_every=0, pop=8, sigma=0.02, out_dir=str(run))
    (run / "args.json").write_text(json.dumps({"args": {**saved.__dict__, "dropped_field": 1}}))
    monkeypatch.setattr(sys, "argv", ["es.py", "--resume", str(run), "--eval-every", "25", "--pop", "32"])
    args = harness.cli(es.Args)
    assert (args.eval_every, args.pop, args.sigma, args.resume, args.out_dir) == (25, 32, 0.02, str(run), str(run))
    monkeypatch.setattr(sys, "argv", ["es.py", "--resume", str(run)])
    assert harness.cli(es.Args) == replace(saved, resume=str(run))


BAD_FLAGS = [(["--pop", "0"], "--pop must be ≥ 2"), (["--pop", "-3"], "--pop must be ≥ 2"),
             (["--sigma", "-1"], "--sigma must be a finite number > 0"), (["--alpha", "0"], "--alpha must be"),
             (["--iterations", "-1"], "--iterations must be ≥ 1"), (["--prompts-per-iter", "0"], "--prompts-per-iter"),
             (["--eval-prompts", "0"], "--eval-prompts must be ≥ 1"), (["--max-new-tokens", "0"], "--max-new-tokens"),
             (["--temperature", "-0.5"], "--temperature must be ≥ 0"), (["--vllm-memory", "1.5"], "--vllm-memory"),
             (["--pop", "5", "--antithetic"], "--antithetic needs an even --pop"),
             (["--awd-lambda", "1e9"], "--awd-lambda must be in"), (["--epochs", "0"], "--epochs must be ≥ 1"),
             (["--keep-last", "0"], "--keep-last must be ≥ 1"), (["--schedule-start", "-1"], "--schedule-start")]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_stop_before_anything_is_loaded_or_written(flags: list[str], message: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(es, "HFPolicy", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(es, "load_task", lambda *a, **k: pytest.fail("data was read"))
    monkeypatch.setattr(sys, "argv", ["es.py", *flags, "--out-dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as stop:
        es.main(harness.cli(es.Args))
    assert str(stop.value.code).startswith(f"error: {message}") and "\n" not in str(stop.value.code)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["es.py", "es_lowrank.py"])
def test_help_exits_zero_with_warnings_as_errors(script: str) -> None:
    result = run_script("-W", "error", script, "--help")
    assert "--pop" in result.stdout or "--help" in result.stdout


def test_bad_input_is_one_line_error_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "never"
    for argv, message in [(["--model", str(tmp_path / "missing")], "error: model"),
                          (["--task", "gsm8k", "--data", str(tmp_path)], "error: no train.jsonl"),
                          (["--pop", "0"], "error: --pop must be ≥ 2"),
                          (["--task", "gsm8k", "--data", str(tmp_path / "empty")], "error: task gsm8k"),
                          (["--out-dir", str(tmp_path / "a-file")], "error: --out-dir")]:
        (tmp_path / "empty").mkdir(exist_ok=True)
        (tmp_path / "empty" / "train.jsonl").write_text("")  # an empty split: refused, never NaN weights
        (tmp_path / "a-file").write_text("")
        result = run_script("es.py", "--out-dir", str(out), *argv, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and lines[-1].startswith(message) and "Traceback" not in result.stderr, argv
        assert not out.exists()


def test_ctrl_c_saves_the_last_iteration_and_resumes(tiny_model: str, tmp_path: Path) -> None:
    """SIGINT mid-run: one line naming the iteration, the checkpoint and the --resume command; exit 130; the
    checkpoint of the last finished iteration loads; --resume continues from it."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "es.py", "--model", tiny_model, *TINY_FLAGS, "--iterations", "500",
                             "--eval-every", "0", "--save-every", "1000", "--out-dir", str(run)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            # a shell's background job (`… &`) ignores SIGINT and its children inherit that; Python
                            # then keeps ignoring it, as a user who started a run that way wants
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    done = max(r["step"] for r in read_metrics(run))
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert last == (f"interrupted after update {done}; checkpoint {run / 'checkpoints' / f'step_{done:06d}'}; "
                    f"continue with --resume {run}")
    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / f"step_{done:06d}")
    assert not list((run / "checkpoints").glob(".tmp*")) and (run / "curves.png").is_file()
    run_script("es.py", "--resume", str(run), "--iterations", str(done + 1))
    assert max(r["step"] for r in read_metrics(run)) == done + 1


def test_es_on_the_embedded_smollm2(tmp_path: Path) -> None:
    """The real default model: 1 iteration, N=2, 2 prompts, 16 tokens; converts the GGUF on first use."""
    run = tmp_path / "smol"
    run_script("es.py", "--pop", "2", "--prompts-per-iter", "2", "--max-new-tokens", "16", "--iterations", "1",
               "--eval-every", "0", "--out-dir", str(run), threads=os.cpu_count() or 1)
    row = read_metrics(run)[-1]
    assert row["step"] == 1 and 0 <= row["train/reward_mean"] <= 1.1 and row["perf/tokens_per_s"] > 0
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000001")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_a_bad_master_device_is_refused_before_loading(tmp_path: Path) -> None:
    """--master-device was handed to torch only once the model was loaded; now the CLI refuses it."""
    result = run_script("es.py", "--master-device", "gpu0", "--out-dir", str(tmp_path / "run"), check=False)
    assert result.returncode != 0 and "--master-device" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["es", "grpo"])
def test_the_prompt_schedule_starts_at_schedule_start(script: str, tiny_model: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """grpo_es.py's second stage sets --schedule-start to continue the first stage's prompt order: the script must
    ask the schedule for updates schedule_start, schedule_start + 1, …"""
    import grpo

    module = {"es": es, "grpo": grpo}[script]
    asked, plan = [], module.plan

    def plan_asked(*args: object) -> tuple:
        total, per_epoch, batch = plan(*args)
        return total, per_epoch, lambda t: asked.append(t) or batch(t)

    monkeypatch.setattr(module, "plan", plan_asked)
    flags = dict(pop=2, prompts_per_iter=2) if script == "es" else dict(group_size=2, prompts_per_step=2)
    length = {"iterations": 2} if script == "es" else {"steps": 2}
    module.main(module.Args(model=tiny_model, max_new_tokens=2, eval_every=0, schedule_start=5,
                            out_dir=str(tmp_path / "run"), **flags, **length))
    assert asked == [5, 6]


def test_a_fork_that_changes_one_stage_runs_the_whole_loop(tiny_model: str, tmp_path: Path) -> None:
    """README "How to fork": a copy of es.py whose stage 3 uses centered ranks instead of z-scores trains, saves and
    evaluates with no change outside its file; the same first iteration as es.py (same θ₀, seeds and prompts), a
    different update. Both score by a hash of the completion (members differ, so every iteration updates θ)."""
    source = (ROOT / "es.py").read_text()
    assert source.count("z = zscore(member_rewards)") == 1
    ranks = "z = member_rewards.argsort().argsort() / (len(member_rewards) - 1) - 0.5  # centered ranks in [-½, ½]"
    (tmp_path / "es_ranks.py").write_text(source.replace("z = zscore(member_rewards)", ranks))
    runner = ("import sys, zlib; sys.path[:0] = [{tmp!r}, {root!r}]; import {m}; import common, harness\n"
              "{m}.score = lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False)\n"
              "if __name__ == '__main__':\n    {m}.main(harness.cli({m}.Args))\n")
    for module in ("es_ranks", "es"):
        (tmp_path / f"run_{module}.py").write_text(runner.format(tmp=str(tmp_path), root=str(ROOT), m=module))
        run_script(str(tmp_path / f"run_{module}.py"), "--model", tiny_model, *TINY_FLAGS, "--iterations", "2",
                   "--sigma", "0.1", "--eval-every", "2", "--out-dir", str(tmp_path / module))
    first = [next(r for r in read_metrics(tmp_path / run) if r["step"] == 1) for run in ("es_ranks", "es")]
    assert first[0]["train/reward_mean"] == first[1]["train/reward_mean"]
    assert first[0]["es/update_norm"] > 0 and first[0]["es/update_norm"] != first[1]["es/update_norm"]
    assert (tmp_path / "es_ranks" / "checkpoints" / "step_000002" / "state.json").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "es_ranks") if "eval/reward" in r] == [0, 2]
