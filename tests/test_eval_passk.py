"""eval_passk.py: pass@k / maj@k / sparsity math against brute force and hand-made cases, then end to end."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, make_tiny_model
from common import Problem, extract_answer, score
from eval_passk import (Args, bootstrap_draws, interval, k_grid, main, maj_at_k, markdown, paired, pass_at_k,
                        per_problem, plot, relative_drift, reset_small_changes, seed_interval, t_quantile, uncertainty)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_c_over_n_and_certain_when_n_minus_c_below_k():
    for n, c in [(32, 0), (32, 5), (32, 32), (7, 3)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert pass_at_k(32, 30, 4) == 1.0  # n − c = 2 < 4
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5)  # stable: C(1024, 512) would overflow floats


def test_pass_at_k_is_monotone_in_k():
    for n, c in [(32, 1), (32, 7), (16, 15), (10, 0)]:
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))


def test_k_grid():
    assert k_grid(32) == [1, 2, 4, 8, 16, 32]
    assert k_grid(1) == [1]
    assert k_grid(12) == [1, 2, 4, 8, 12]


def test_maj_at_k_majority_ties_and_none():
    answers = ["3", "5", "5", None, "3", "3"]
    correct = [True, False, False, False, True, True]
    assert maj_at_k(answers, correct, 1) is True  # only "3"
    assert maj_at_k(answers, correct, 3) is False  # "5" twice beats "3" once
    assert maj_at_k(answers, correct, 4) is False  # None abstains: still "5"
    assert maj_at_k(answers, correct, 5) is True  # tie 2–2: "3" was seen first
    assert maj_at_k(answers, correct, 6) is True
    assert maj_at_k(["7", "9"], [False, True], 2) is False  # tie: the earliest answer "7" wins
    assert maj_at_k([None, None, "4"], [False, False, True], 3) is True  # abstentions do not vote
    assert maj_at_k([None, None], [False, False], 2) is False  # nobody answered: wrong


def test_maj_at_k_votes_compare_exact_values():
    """1000000 and 1000001 are two answers, not one vote credited from its first sample."""
    texts = ["so \\boxed{1000000}", "so \\boxed{1000001}", "it is 1,000,001"]
    answers = [extract_answer("gsm8k", t) for t in texts]
    correct = [score("gsm8k", Problem("q", "1000000"), t)[1] for t in texts]
    assert correct == [True, False, False] and maj_at_k(answers, correct, 3) is False


def test_reset_small_changes_counts_and_limits():
    theta0 = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    theta = {"a": torch.tensor([[0.0, 1e-4, -3e-4], [1e-3, -2e-3, 0.0]]), "b": torch.tensor([1.0, 1.0005, 0.9, 1.0])}
    theta_tau, reset, changed = reset_small_changes(theta, theta0, 5e-4)
    # nonzero changes: a: 1e-4, 3e-4, 1e-3, 2e-3; b: ~5e-4 (fp32 rounding: 1.0005 − 1 is 4.999e-4), 0.1 → 6
    assert changed == 6 and reset == 3
    assert torch.equal(theta_tau["a"], torch.tensor([[0.0, 0.0, 0.0], [1e-3, -2e-3, 0.0]]))
    assert torch.equal(theta_tau["b"], torch.tensor([1.0, 1.0, 0.9, 1.0]))
    exact = {"a": torch.tensor([2.0**-11, 2.0**-11 + 2.0**-30]), "b": torch.zeros(0)}  # |Δ| = τ exactly, and just above
    out, n_reset, n_changed = reset_small_changes(exact, {"a": torch.zeros(2), "b": torch.zeros(0)}, 2.0**-11)
    assert (n_reset, n_changed) == (1, 2) and out["a"].tolist() == [0.0, 2.0**-11 + 2.0**-30]  # 0 < |Δ| ≤ τ: reset
    same, reset0, _ = reset_small_changes(theta, theta0, 0.0)
    assert reset0 == 0 and all(torch.equal(same[k], theta[k]) for k in theta)
    back, reset_inf, _ = reset_small_changes(theta, theta0, math.inf)
    assert reset_inf == changed and all(torch.equal(back[k], theta0[k]) for k in theta)
    assert relative_drift(back, theta0) == 0.0
    expected = math.sqrt(sum(float((theta[k].double() - theta0[k]).square().sum()) for k in theta) / 4.0)
    assert relative_drift(theta, theta0) == pytest.approx(expected)


def test_bootstrap_draws_match_the_exact_enumeration_of_resamples():
    """P = 3 problems: the 27 equally likely index triples give each of the 10 count vectors its exact probability."""
    exact = Counter(tuple(np.bincount(idx, minlength=3).tolist()) for idx in itertools.product(range(3), repeat=3))
    draws = bootstrap_draws(3, 200_000, seed=0)
    assert draws.shape == (200_000, 3) and (draws.sum(1) == 3).all()
    drawn = Counter(map(tuple, draws.tolist()))
    assert drawn.keys() == exact.keys()
    for w, count in exact.items():  # 5 standard errors of a frequency at B = 200,000
        assert drawn[w] / 200_000 == pytest.approx(count / 27, abs=5e-3), w
    assert np.array_equal(bootstrap_draws(5, 50, 7), bootstrap_draws(5, 50, 7))
    assert not np.array_equal(bootstrap_draws(5, 50, 7), bootstrap_draws(5, 50, 8))


def test_interval_against_exact_enumeration_and_the_closed_form():
    """The exact bootstrap distribution of a mean over P = 3 problems is the 27 resample means: its mean is the sample
    mean, its sd the closed form sd(v, ddof=0)/√P; its extremes (probability 1/27 > 2.5% each) are the interval."""
    values = np.array([[0.0, 1.0], [0.5, 0.0], [1.0, 0.0]])  # (P, M) = (3, 2)
    exact = np.array([values[list(idx)].mean(0) for idx in itertools.product(range(3), repeat=3)])  # (27, 2)
    assert exact.mean(0) == pytest.approx(values.mean(0)) and exact.std(0) == pytest.approx(values.std(0) / 3**0.5)
    draws = bootstrap_draws(3, 200_000, seed=1)
    means = draws @ values / 3  # the B resample means, as interval() takes them
    assert means.mean(0) == pytest.approx(exact.mean(0), abs=3e-3)
    assert means.std(0) == pytest.approx(exact.std(0), rel=1e-2)
    mean, lo, hi = interval(values, draws)
    assert mean.tolist() == values.mean(0).tolist() and lo.tolist() == exact.min(0).tolist()
    assert hi.tolist() == exact.max(0).tolist()


def test_interval_width_approaches_the_normal_closed_form():
    """P = 400: the resample mean is near normal with sd = sd(v, ddof=0)/√P, so the interval is ≈ mean ± 1.96 sd."""
    values = np.random.default_rng(0).random((400, 3)) ** [1, 2, 3]  # (P, M): three different spreads
    mean, lo, hi = interval(values, bootstrap_draws(400, 20_000, seed=2))
    se = values.std(0) / 20
    assert (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.05)
    assert (mean - lo) / se == pytest.approx(1.96, abs=0.15) and (hi - mean) / se == pytest.approx(1.96, abs=0.15)


def test_identical_problems_give_a_point_and_a_model_against_itself_gives_exactly_zero():
    draws = bootstrap_draws(7, 1000, seed=3)
    mean, lo, hi = interval(np.full((7, 2), 0.3), draws)
    assert mean == pytest.approx([0.3, 0.3])
    assert lo == pytest.approx(mean, abs=1e-15) and hi == pytest.approx(mean, abs=1e-15)
    values = np.random.default_rng(3).random((7, 2))
    (d, d_lo, d_hi), won, lost = paired(values, values.copy(), draws)
    assert (d == 0).all() and (d_lo == 0).all() and (d_hi == 0).all() and (won == 0).all() and (lost == 0).all()


def report_of(n: int, models: dict[str, tuple[list[int], list[int]]]) -> dict:
    """A passk.json-shaped report on one task: per label, c(x) and 1[greedy correct] for each problem x."""
    ks = k_grid(n)
    return {"n": n, "ks": ks, "results": {label: {"arith": {
        "correct_counts": c, "greedy_correct": g, "num_problems": len(c), "maj@k": {k: 0.25 for k in ks}, "reward": 0.5,
        "response_tokens": 9.0}} for label, (c, g) in models.items()}}


def test_paired_differences_and_won_lost_by_hand():
    """n = 4, ks 1, 2, 4. pass@1(x) = c/4: es (1, 0, .5, .25), base (.75, 0, .5, .75): d = (.25, 0, 0, −.5).
    pass@2(x) = 1 − C(4−c, 2)/6: c = 4, 3 → 1, c = 2 → 5/6, c = 1 → 1/2: d = (0, 0, 0, −.5). pass@4(x) = 1[c ≥ 1]:
    d = 0. Greedy d = (1, 0, 0, −1). The same es twice ("copy") differs from es by exactly 0 on every resample."""
    report = report_of(4, {"base": ([3, 0, 2, 3], [0, 0, 1, 1]), "es": ([4, 0, 2, 1], [1, 0, 1, 0]),
                           "copy": ([4, 0, 2, 1], [1, 0, 1, 0])})
    assert per_problem(report["results"]["es"]["arith"], 4, [1, 2, 4]) == pytest.approx(np.array(  # (P, greedy + K)
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0.5, 5 / 6, 1], [0, 0.25, 0.5, 1]]), abs=1e-15)
    u = uncertainty(report, "base", 500, seed=0)
    assert (u["reference"], u["methods"], list(u["rows"])) == ("base", {}, ["base", "es", "copy"])
    es, base = u["rows"]["es"]["arith"], u["rows"]["base"]["arith"]
    assert "diff" not in base["greedy"] and base["pass@1"]["mean"] == pytest.approx(0.5)
    expected = {"greedy": (0.0, 1, 1), "pass@1": (-0.0625, 1, 1), "pass@2": (-0.125, 0, 1), "pass@4": (0.0, 0, 0)}
    for metric, (diff, won, lost) in expected.items():
        assert (es[metric]["diff"], es[metric]["won"], es[metric]["lost"]) == (pytest.approx(diff), won, lost), metric
        assert es[metric]["diff_ci"][0] <= es[metric]["diff"] <= es[metric]["diff_ci"][1]
        assert es[metric]["mean"] - base[metric]["mean"] == pytest.approx(diff)
    assert es["pass@4"]["diff_ci"] == [0.0, 0.0] and es["pass@2"]["diff_ci"][1] == 0.0  # d ≤ 0 on every problem
    copy = report_of(4, {"es": ([4, 0, 2, 1], [1, 0, 1, 0]), "copy": ([4, 0, 2, 1], [1, 0, 1, 0])})
    for cell in uncertainty(copy, "es", 500, seed=0)["rows"]["copy"]["arith"].values():
        assert (cell["diff"], cell["diff_ci"], cell["won"], cell["lost"]) == (0.0, [0.0, 0.0], 0, 0)
    assert u["rows"]["copy"]["arith"] == es  # one set of resamples for every model
    again = uncertainty(report, "base", 500, seed=0)
    assert again == u and uncertainty(report, "base", 500, seed=1)["rows"]["es"] != u["rows"]["es"]


def test_t_quantile_against_the_closed_forms_and_the_tables():
    """ν = 1 (Cauchy): t_q = tan(π(q − ½)); ν = 2: t_q = (2q − 1)/√(2q(1 − q)); tables for ν = 4 and ν = 10⁴."""
    for q in (0.6, 0.8, 0.9, 0.975, 0.995, 0.9995):
        assert t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-8)
        assert t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-7)
        assert t_quantile(1 - q, 3) == -t_quantile(q, 3)
    assert (round(t_quantile(0.975, 2), 6), round(t_quantile(0.975, 4), 6), round(t_quantile(0.8, 2), 6)) == (
        4.302653, 2.776445, 1.060660)
    assert t_quantile(0.5, 7) == 0.0 and t_quantile(0.975, 10_000) == pytest.approx(1.960201, abs=1e-6)


def test_a_pooled_row_counts_the_seeds_not_only_the_problems():
    """Three seeds solve every problem at the rates 1/4, 2/4, 4/4 (n = 4): every problem sees the same seed mean 7/12,
    so resampling problems alone would give a point; the seeds' spread gives m̄ ± t_{0.975,2}·sd(m_s)/√3. Base
    pass@1 (0, 1, 0, 0): d_s = m_s − 1/4, the same sd; the seed-mean d(x) = 7/12 − base(x) wins 3 problems, loses 1."""
    report = report_of(4, {"base": ([0, 4, 0, 0], [0, 1, 0, 0]), "es@0": ([1] * 4, [0] * 4),
                           "es@1": ([2] * 4, [1] * 4), "es@2": ([4] * 4, [1] * 4)})
    sd = math.sqrt(((1 / 4 - 7 / 12) ** 2 + (2 / 4 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2) / 2)  # ddof = 1
    half = 4.302653 * sd / math.sqrt(3)
    cell = uncertainty(report, "base", 500, seed=0)["rows"]["es@*"]["arith"]["pass@1"]
    assert cell["mean"] == pytest.approx(7 / 12) and cell["ci"] == pytest.approx([7 / 12 - half, 7 / 12 + half])
    assert cell["diff"] == pytest.approx(1 / 3) and cell["diff_ci"] == pytest.approx([1 / 3 - half, 1 / 3 + half])
    assert (cell["won"], cell["lost"]) == (3, 1)
    values = np.array([[[0.25]], [[0.5]], [[1.0]]]) * np.ones((3, 4, 1))  # (S, P, M)
    assert seed_interval(values)[:, 0] == pytest.approx([7 / 12, 7 / 12 - half, 7 / 12 + half])


def test_seeds_pool_by_hand_on_the_same_resamples():
    """es@0 solves problems 0 and 2, es@1 problems 1 and 3 (n = 2, every sample alike): each seed's mean pass@1 =
    pass@2 = greedy = 1/2, so the seeds agree and the seed-level interval is a point (each seed's own, over problems,
    is not); base has c = 1 everywhere: pass@1 ties, pass@2 = 1 loses by 1/2 on all four problems."""
    report = report_of(2, {"base": ([1, 1, 1, 1], [1, 1, 0, 0]), "es@0": ([2, 0, 2, 0], [1, 0, 1, 0]),
                           "es@1": ([0, 2, 0, 2], [0, 1, 0, 1]), "grpo@0": ([1, 1, 1, 1], [1, 1, 1, 1])})
    u = uncertainty(report, "base", 2000, seed=0)
    assert u["methods"] == {"es@*": ["es@0", "es@1"]}  # a lone seed (grpo@0) is not pooled; base has no seed
    assert list(u["rows"]) == ["base", "es@0", "es@1", "grpo@0", "es@*"]
    pooled = u["rows"]["es@*"]["arith"]
    for metric in ("greedy", "pass@1", "pass@2"):
        assert (pooled[metric]["mean"], pooled[metric]["ci"]) == (0.5, [0.5, 0.5]), metric
        assert u["rows"]["es@0"]["arith"][metric]["ci"][1] - u["rows"]["es@0"]["arith"][metric]["ci"][0] > 0.4
    assert (pooled["pass@1"]["diff"], pooled["pass@1"]["diff_ci"], pooled["pass@1"]["won"]) == (0.0, [0.0, 0.0], 0)
    assert (pooled["pass@2"]["diff"], pooled["pass@2"]["diff_ci"], pooled["pass@2"]["lost"]) == (-0.5, [-0.5, -0.5], 4)
    assert (pooled["greedy"]["diff"], pooled["greedy"]["won"], pooled["greedy"]["lost"]) == (0.0, 2, 2)


def test_markdown_and_plot_show_the_intervals(tmp_path: Path):
    report = report_of(2, {"base": ([1, 1, 1, 1], [1, 1, 0, 0]), "es@0": ([2, 0, 2, 0], [1, 0, 1, 0]),
                           "es@1": ([0, 2, 0, 2], [0, 1, 0, 1])})
    report |= {"uncertainty": uncertainty(report, "base", 300, seed=0), "sparsity": {}}
    table = markdown(report)
    assert "| base | arith | 50.0 [" in table  # base greedy (1, 1, 0, 0): a real interval; then pass@1, pass@2, maj@2, …
    assert "| 50.0 [50.0, 50.0] | 100.0 [100.0, 100.0] | 25.0 | 0.500 | 9 |" in table
    assert "| es@* | arith | 50.0 [50.0, 50.0] | 50.0 [50.0, 50.0] | 50.0 [50.0, 50.0] | — | — | — |" in table
    assert "Paired difference from base" in table and table.count("| base | arith |") == 1  # no row against itself
    assert "| +0.0 [+0.0, +0.0] 0/0 | -50.0 [-50.0, -50.0] 0/4 |" in table  # es@*: pass@1, pass@2
    plot(report, tmp_path / "passk.png")
    assert (tmp_path / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sparsity_sweep_has_intervals_paired_with_the_full_model():
    """n = 4, es's full counts (4, 0, 2, 1). θ_τ1 solves the same: d = 0 exactly. θ_τ2 (1, 1, 2, 2): pass@1 = 6/16,
    d(x) = (−3, +1, 0, +1)/4: mean −1/16, two problems won and one lost; the interval spans 0 inside [−3/4, 1/4]."""
    report = report_of(4, {"base": ([3, 0, 2, 3], [0, 0, 1, 1]), "es": ([4, 0, 2, 1], [1, 0, 1, 0])})
    report |= {"task": "arith", "base": "base", "sparsity": {"es": {"d_rel": 0.1, "pass@1": 7 / 16, "taus": [
        {"tau": 1e-3, "s_tau": 0.5, "d_rel": 0.09, "pass@1": 7 / 16, "correct_counts": [4, 0, 2, 1]},
        {"tau": 2e-3, "s_tau": 0.8, "d_rel": 0.05, "pass@1": 6 / 16, "correct_counts": [1, 1, 2, 2]}]}}}
    u = uncertainty(report, "base", 2000, seed=0)
    same, fewer = u["sparsity"]["es"]
    assert (same["mean"], same["diff"], same["diff_ci"], same["won"], same["lost"]) == (0.4375, 0.0, [0.0, 0.0], 0, 0)
    assert same["ci"] == u["rows"]["es"]["arith"]["pass@1"]["ci"]  # the main task's resamples
    assert (fewer["mean"], fewer["diff"], fewer["won"], fewer["lost"]) == (0.375, -0.0625, 2, 1)
    assert -0.75 <= fewer["diff_ci"][0] < 0 < fewer["diff_ci"][1] <= 0.25
    report["uncertainty"] = u
    table = markdown(report)
    rng = np.random.default_rng(0)  # 60 problems: an interval that moves with the resamples it is computed on
    c = rng.integers(0, 5, 60).tolist()
    many = report_of(4, {"base": (rng.integers(0, 5, 60).tolist(), [0] * 60), "es": (c, [0] * 60)})
    many |= {"task": "arith", "sparsity": {"es": {"taus": [{"tau": 1.0, "correct_counts": c}]}}}
    u = uncertainty(many, "base", 1000, seed=0)
    assert u["sparsity"]["es"][0]["ci"] == u["rows"]["es"]["arith"]["pass@1"]["ci"]  # the same resamples
    assert "| es | full | 0.0% | 1.00e-01 | 43.8 [" in table
    assert "| es | 0.002 | 80.0% | 5.00e-02 | 37.5 [" in table and "| -6.2 [" in table and "] 2/1 |" in table


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error", str(ROOT / "eval_passk.py"), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_help_exits_zero():
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    assert "--reset-tau" in result.stdout and "--heldout" in result.stdout and "--reference" in result.stdout


def test_end_to_end_two_models_heldout_and_sparsity(tiny_model: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # an "ES" model: the tiny model with N(0, 1e-3²) added to every weight
    es_dir = tmp_path / "es"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    model.save_pretrained(es_dir)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(es_dir)
    gsm = tmp_path / "gsm8k"
    gsm.mkdir()
    (gsm / "test.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                                            + "\n" for i in range(2)))
    out = tmp_path / "run"
    result = run_script("--models", f"base={tiny_model}", f"es={es_dir}", "--num-problems", "3", "--n", "4",
                        "--max-new-tokens", "6", "--heldout", f"gsm8k={gsm}", f"again:gsm8k={gsm}", "--base", "base",
                        "--reset-tau", "5e-4", "1", "--resamples", "500", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads((out / "passk.json").read_text())
    assert report["ks"] == [1, 2, 4] and list(report["results"]) == ["base", "es"]
    for label in ("base", "es"):
        assert list(report["results"][label]) == ["countdown", "gsm8k", "again"]  # a named second gsm8k set
        r = report["results"][label]["countdown"]
        assert r["num_problems"] == 3 and len(r["correct_counts"]) == 3
        assert r["pass@k"]["1"] == pytest.approx(sum(r["correct_counts"]) / 12)
        assert 0 < r["response_tokens"] <= 6 and set(r["maj@k"]) == {"1", "2", "4"}
    assert len(report["results"]["base"]["gsm8k"]["correct_counts"]) == 2
    assert report["results"]["base"]["again"]["num_problems"] == 2
    sparsity = report["sparsity"]
    assert list(sparsity) == ["es"]  # the base is not compared with itself
    rows = sparsity["es"]["taus"]
    assert [row["tau"] for row in rows] == [5e-4, 1.0]  # τ = 1 > every |Δ|: θ_τ = θ₀
    assert 0.3 < rows[0]["s_tau"] < 0.5  # P(|N(0, 1e-3²)| ≤ 5e-4) ≈ 0.38
    assert rows[1]["s_tau"] == 1.0 and rows[1]["d_rel"] == 0.0 and rows[1]["reset"] == rows[1]["changed"]
    # θ_1 = θ₀ and sampling seeds are shared across models: it must reproduce the base's counts exactly
    assert rows[1]["correct_counts"] == report["results"]["base"]["countdown"]["correct_counts"]
    assert 0 < sparsity["es"]["d_rel"] < 0.1  # ‖Δ‖ ≈ 1e-3·√d against weights of std ≈ 0.02
    # θ_1 = θ₀, so its paired difference from the full es is base − es: the es row's difference negated, on the
    # same resamples
    tau_1, es_row = report["uncertainty"]["sparsity"]["es"][1], report["uncertainty"]["rows"]["es"]["countdown"]
    assert tau_1["mean"] == pytest.approx(report["results"]["base"]["countdown"]["pass@k"]["1"])
    assert tau_1["diff"] == pytest.approx(-es_row["pass@1"]["diff"])
    assert tau_1["diff_ci"] == pytest.approx([-es_row["pass@1"]["diff_ci"][1], -es_row["pass@1"]["diff_ci"][0]])
    assert (tau_1["won"], tau_1["lost"]) == (es_row["pass@1"]["lost"], es_row["pass@1"]["won"])

    # every completion is kept: a row per model × problem set × problem, the greedy one and the n samples
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (3 + 2 + 2) and {r["model"] for r in rows} == {"base", "es"}
    row = next(r for r in rows if r["model"] == "es" and r["set"] == "gsm8k" and r["problem"] == 1)
    assert row["gold"] == "2" and len(row["samples"]) == 4
    assert set(row["greedy"]) == {"response", "correct", "reward", "answer"}
    counted = [sum(s["correct"] for s in r["samples"]) for r in rows if r["model"] == "es" and r["set"] == "countdown"]
    assert counted == report["results"]["es"]["countdown"]["correct_counts"]
    for r in rows:  # each stored verdict is the scorer's verdict on the stored text
        task = "countdown" if r["set"] == "countdown" else "gsm8k"
        problem = (Problem(numbers=tuple(r["gold"][0]), target=r["gold"][1]) if task == "countdown"
                   else Problem("", r["gold"]))
        assert all(score(task, problem, s["response"])[1] == s["correct"] for s in r["samples"])
        assert score(task, problem, r["greedy"]["response"]) == (r["greedy"]["reward"], r["greedy"]["correct"])
    greedy = [r["greedy"]["correct"] for r in rows if r["model"] == "base" and r["set"] == "gsm8k"]
    assert report["results"]["base"]["gsm8k"]["greedy"] == pytest.approx(sum(greedy) / 2)
    assert report["results"]["base"]["gsm8k"]["greedy_correct"] == [int(g) for g in greedy]

    # intervals: against the first model by default, and recomputed exactly from passk.json's per-problem data alone
    u = report["uncertainty"]
    assert (u["reference"], u["resamples"], u["seed"], list(u["rows"])) == ("base", 500, 0, ["base", "es"])
    assert uncertainty(report, "base", 500, 0) == u
    cell = u["rows"]["es"]["countdown"]["pass@1"]
    assert cell["mean"] == pytest.approx(report["results"]["es"]["countdown"]["pass@k"]["1"])
    assert cell["ci"][0] <= cell["mean"] <= cell["ci"][1] and cell["diff_ci"][0] <= cell["diff"] <= cell["diff_ci"][1]
    assert cell["won"] + cell["lost"] <= 3 and set(u["rows"]["es"]) == {"countdown", "gsm8k", "again"}

    table = (out / "passk.md").read_text()
    assert "| base | countdown |" in table and "| es | gsm8k |" in table and "| es | again |" in table
    assert f"| es | countdown | {100 * u['rows']['es']['countdown']['greedy']['mean']:.1f} [" in table
    assert "Paired difference from base" in table and table.count("| es | countdown |") == 2
    assert "s_τ" in table
    assert "| es | full |" in table and table in result.stdout
    png = (out / "passk.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image = plt.imread(out / "passk.png")
    assert image.ndim == 3 and image.shape[1] > 2 * image.shape[0] > 200  # three panels side by side
    assert (out / "args.json").is_file()
    with pytest.raises(SystemExit, match="already holds passk.json"):  # refuses to overwrite the report
        main(Args(models=(tiny_model,), out_dir=str(out)))


def test_clear_errors(tiny_model: str, tiny_qwen: str, tmp_path: Path):
    def error(**kwargs: object) -> str:
        with pytest.raises(SystemExit) as stop:  # die(): one line, exit status 1
            main(Args(num_problems=1, n=1, max_new_tokens=1, out_dir=str(tmp_path / "run"), **kwargs))
        return str(stop.value.code)

    assert error(models=(f"a={tmp_path / 'nope'}",)).startswith("error: model")
    # transformers loads the tiny Qwen2's tokenizer with one extra token (<|endoftext|>): a real vocab mismatch
    assert "different tokenizers" in error(models=(f"a={tiny_model}", f"b={tiny_qwen}"))
    deeper = str(make_tiny_model(tmp_path / "three-layers", layers=3))  # same tokenizer, one more layer
    assert "different parameter names" in error(models=(f"a={tiny_model}", f"b={deeper}"), base="a")
    assert "used twice" in error(models=(f"a={tiny_model}", f"a={deeper}"))
    assert "task must be one of" in error(models=(tiny_model,), heldout=("aime",))
    assert "the name 'countdown' is taken" in error(models=(tiny_model,), heldout=("countdown",))  # the main task
    assert "the name 'x' is taken" in error(models=(tiny_model,), heldout=("x:gsm8k", "x:math500"))
    assert "--reference 'b' is not a label" in error(models=(f"a={tiny_model}",), reference="b")
    assert "--resamples must be ≥ 1" in error(models=(tiny_model,), resamples=0)


def test_a_bad_heldout_spec_stops_before_any_model_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """--heldout was parsed after every model had been resolved and loaded (minutes for a large one)."""
    import eval_passk

    monkeypatch.setattr(eval_passk, "resolve_model", lambda path: pytest.fail("a model was resolved first"))
    with pytest.raises(SystemExit, match="task must be one of"):
        main(Args(models=("some/model",), heldout=("aime",), out_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["eval_passk.py", "grpo.py"])
def test_one_process_scripts_refuse_torchrun(script: str, tmp_path: Path) -> None:
    """Under torchrun every rank of these one-process scripts would take GPU 0 and write the same run directory."""
    out = subprocess.run([sys.executable, script, "--out-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "WORLD_SIZE": "2"}, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        f"error: {script} runs in one process (WORLD_SIZE is 2): start it with python, not torchrun")
    assert not (tmp_path / "run").exists()
