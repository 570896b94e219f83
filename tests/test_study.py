"""bench/study.py and bench/stats.py: the statistics against hand-computed values on small cases (the two-level
interval, same-seed pairing, Holm, the minimum detectable effect, variance components, probability of improvement,
rank correlation), the claim table's rules, the export → report round trip, the study's steps and plan, and the
committed report rebuilt from the committed data (the study takes hours; here it runs on files written by hand)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import stats  # noqa: E402
import study  # noqa: E402
from eval_passk import k_grid, pass_at_k, seed_interval  # noqa: E402

T975_1, T975_2, T95_2, T8_2 = 12.706205, 4.302653, 2.919986, 1.060660  # Student's t tables: t_{q, df}


def write_eval(folder: Path, label: str, counts: list[int], greedy: list[int], n: int = 4, **extra: object) -> None:
    """A passk.json and args.json as eval_passk.py writes them (JSON keys as strings), for one model on 'arith'."""
    ks = k_grid(n)
    result = {"pass@k": {str(k): float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in ks},
              "maj@k": {str(k): 0.0 for k in ks}, "reward": 0.0, "response_tokens": 5.0, "num_problems": len(counts),
              "correct_counts": counts, "greedy_correct": greedy, "greedy": float(np.mean(greedy))}
    (folder / label).mkdir(parents=True)
    (folder / label / "passk.json").write_text(json.dumps(
        {"task": "arith", "split": "test", "n": n, "ks": ks, "models": {label: "/machine/specific/path"}, "base": None,
         "results": {label: {"arith": result}}, "sparsity": {}, "uncertainty": {}} | extra))
    (folder / label / "args.json").write_text(json.dumps({"args": {
        "models": [f"{label}=runs/{label}"], "data": "data/sums50", "num_problems": len(counts), "temperature": 0.6,
        "top_p": 1.0, "max_new_tokens": 24, "chat_template": True, "seed": 0, "backend": "hf"}}))


def write_curves(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **row}) + "\n" for i, row in enumerate(rows)))


def fake_study(out: Path) -> None:
    """A finished study's run directory in the real formats, small: ES, GRPO and GRPO→ES at seeds 0–2 on 20 problems
    (n = 4), the held-out task, the sweep, the population study, each run's training curves, the costs."""
    rng = np.random.default_rng(0)
    rate = rng.random(20) * 0.6  # each problem's base solve rate
    lift = {"base": 0.0, "es": 0.1, "grpo": 0.2, "grpo_es": 0.12, "es4": 0.05, "es8": 0.1}
    for kind, labels in (("eval", [f"{m}@{s}" for m in ("es", "grpo", "grpo_es") for s in range(3)]),
                         ("heldout", [f"{m}@{s}" for m in ("es", "grpo") for s in range(3)]),
                         ("pop", ["es4@0", "es8@0", "es8@1", "es8@2"])):
        for label in ["base", *labels]:
            p = np.clip(rate + lift[label.partition("@")[0]] + rng.normal(0, 0.05, 20), 0, 1)
            write_eval(out / kind, label, rng.binomial(4, p).tolist(), (rng.random(20) < p).astype(int).tolist())
    counts = rng.binomial(4, np.clip(rate + 0.1, 0, 1))
    taus = [{"tau": tau, "s_tau": s_tau, "reset": 1, "changed": 2, "d_rel": 0.02, "pass@1": 0.1,
             "correct_counts": np.clip(counts - (rng.random(20) < drop), 0, 4).tolist()}
            for tau, s_tau, drop in ((1e-3, 0.16, 0.0), (1e-2, 0.95, 0.3))]
    write_eval(out / "sweep", "es@0", counts.tolist(), [0] * 20, base="smollm2-135m",
               sparsity={"es@0": {"d_rel": 0.03, "pass@1": 0.2, "taus": taus}})
    for run in [f"{m}-s{s}" for m in ("es", "grpo", "grpo_es") for s in range(3)] + ["es4-s0"]:
        write_curves(out / "runs" / run, [{"train/reward_mean": float(rng.random()), **(
            {"es/js_succ_bits": float(rng.random())} if run.startswith("es") else {"grpo/entropy": 1.3 / step})}
            for step in range(1, 9)])
    (out / "costs.json").write_text(json.dumps({"data-sums50": 4.4, "eval-base": 708.0, "es-s0": 250.0}))


def claim_rows(tmp_path: Path) -> dict[str, dict]:
    """Export tmp_path/run into a fresh tmp_path/data, and the claims judged from that data alone, by claim."""
    shutil.rmtree(tmp_path / "data", ignore_errors=True)  # export adds to what --data holds
    study.export(tmp_path / "run", tmp_path / "data")
    return {row["name"]: row for row in study.claims(study.load_data(tmp_path / "data"))}


# ---------------------------------------------------------------------------------------------------- statistics
def test_two_level_interval_by_hand() -> None:
    """S = 2 seeds, P = 3 problems, d = [[1, 3, 5], [7, 9, 11]], three resamples forced by hand: (seed 0, problems
    0 0 0; seed 0, 0 0 0) → 1; (seed 1, 2 2 2; seed 1, 0 1 2) → (33 + 27)/6 = 10; (seed 0, 0 1 2; seed 1, 1 1 1)
    → (9 + 27)/6 = 6. Percentiles of (1, 6, 10) by linear interpolation: 2.5 % at rank 0.05 → 1.25, 97.5 % at rank
    1.95 → 9.8; the point estimate is the plain mean 6. A second column ×10 scales it all."""
    d = np.array([[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]])[:, :, None] * [1, 10]  # (S, P, M)
    picks = np.array([[0, 0], [1, 1], [0, 1]])  # (B, S): the seeds drawn
    counts = np.array([[[3, 0, 0], [3, 0, 0]], [[0, 0, 3], [1, 1, 1]], [[1, 1, 1], [0, 3, 0]]])  # (B, S, P)
    assert stats.two_level(d, picks, counts) == pytest.approx(np.array([[6, 60], [1.25, 12.5], [9.8, 98]]))
    picks, counts = stats.seed_draws(3, 5, 400, seed=7)
    assert picks.shape == (400, 3) and set(np.unique(picks)) == {0, 1, 2} and (counts.sum(2) == 5).all()
    assert not (counts[:, 0] == counts[:, 1]).all(1).all()  # each drawn seed gets its own problems
    assert np.array_equal(stats.seed_draws(3, 5, 400, seed=7)[1], counts)


def test_same_seed_pairing_pairs_each_seed_with_its_own() -> None:
    """ES@s solves one sample more than GRPO@s on every problem (n = 4), while the seeds differ widely: paired seed
    by seed, d_s(x) = 1/4 everywhere (a point interval, p = 0); against GRPO's pooled mean 5/12 the ES seeds would
    differ by (−1/6, 1/3, 7/12). The results are listed out of seed order. P(ES > GRPO) over the 9 seed pairs of
    means (1/4, 3/4, 1) vs (0, 1/2, 3/4): 1 + 2.5 + 3 = 6.5 of 9."""
    grpo, es = {0: [0] * 8, 1: [2] * 8, 2: [3] * 8}, {0: [1] * 8, 1: [3] * 8, 2: [4] * 8}
    results = {}
    for label, c in (("grpo@2", grpo[2]), ("es@1", es[1]), ("grpo@0", grpo[0]), ("base", [1] * 8), ("es@0", es[0]),
                     ("grpo@1", grpo[1]), ("es@2", es[2])):
        results[label] = {"arith": {"correct_counts": c, "greedy_correct": [0] * 8}}
    report = {"task": "arith", "n": 4, "ks": [1, 2, 4], "results": results}
    found = stats.seeded(report, "es", "grpo", "pass@1")
    assert found["seeds"] == [0, 1, 2] and found["d"] == pytest.approx(np.full((3, 8), 0.25))
    row = stats.seeded_row("x", report, "es", "grpo", "pass@1", None)
    assert row["ci"] == pytest.approx([0.25, 0.25]) and row["boot"] == pytest.approx([0.25, 0.25])
    assert (row["p"], row["p_opp"]) == pytest.approx((0, 1), abs=1e-9)
    assert row["improvement"] == (pytest.approx(6.5 / 9), 9)
    vs_base = stats.seeded(report, "es", "base", "pass@1")  # a fixed model: the same base for every seed
    assert vs_base["d"][:, 0] == pytest.approx([0, 0.5, 0.75]) and vs_base["b"] == pytest.approx([0.25])


def test_holm_steps_down_by_hand() -> None:
    """p = (0.01, 0.04, 0.03) at α = 0.05: sorted 0.01 ≤ 0.05/3 is rejected, then 0.03 > 0.05/2 stops the steps: only
    the first. Adjusted: 3·0.01 = 0.03, max(0.03, 2·0.03) = 0.06, max(0.06, 1·0.04) = 0.06. (0.03, 0.04, 0.045)
    rejects none (0.03 > 0.05/3), where a step-up rule (Hochberg) would reject all three (0.045 ≤ 0.05)."""
    adjusted, levels = stats.holm([0.01, 0.04, 0.03], 0.05)
    assert adjusted == pytest.approx([0.03, 0.06, 0.06]) and levels == pytest.approx([0.05 / 3, 0.05, 0.025])
    assert (adjusted <= 0.05).tolist() == [True, False, False]
    assert (stats.holm([0.03, 0.04, 0.045])[0] <= 0.05).tolist() == [False, False, False]
    assert stats.holm([0.001, 0.02, 0.04])[0] == pytest.approx([0.003, 0.04, 0.04])  # every step passes
    assert stats.holm([0.5, 0.5])[0] == pytest.approx([1.0, 1.0])  # capped at 1


def test_t_tests_and_the_minimum_detectable_effect_by_hand() -> None:
    """The issue's case: GRPO→ES − base at pass@16 per seed +2.0, +21.0, −1.5 points. Mean 7.17, sd 12.107 (ddof 1),
    t interval 7.17 ± 4.302653·12.107/√3 = [−22.9, +37.2]; MDE at α' = 0.05 (80 % power) = (t_{.95,2} + t_{.8,2})·sd/√3
    = 27.8 points. ν = 2 has a closed-form CDF, F(t) = ½ + t/(2√(2 + t²)): (1, 2, 3) against 0 gives t = 2√3."""
    effects = np.array([2.0, 21.0, -1.5])
    sd = math.sqrt(((2 - 43 / 6) ** 2 + (21 - 43 / 6) ** 2 + (-1.5 - 43 / 6) ** 2) / 2)
    assert sd == pytest.approx(12.107, abs=1e-3)
    mean, lo, hi = seed_interval(effects[:, None, None])[:, 0]
    assert (mean, lo, hi) == pytest.approx((43 / 6, 43 / 6 - T975_2 * sd / math.sqrt(3), 43 / 6 + T975_2 * sd / 3**0.5))
    assert (round(lo, 1), round(hi, 1)) == (-22.9, 37.2)
    assert stats.mde(sd, 3, 0.05) == pytest.approx((T95_2 + T8_2) * sd / math.sqrt(3), rel=1e-6)
    assert stats.mde(sd, 3, 0.05) == pytest.approx(27.82, abs=0.01)
    needed = stats.units_needed(sd, 43 / 6, 0.05)  # the fewest seeds whose MDE reaches the observed effect
    assert stats.mde(sd, needed, 0.05) <= 43 / 6 < stats.mde(sd, needed - 1, 0.05)
    assert stats.units_needed(sd, -1.0, 0.05) is None and stats.units_needed(sd, 1e-6, 0.05) is None
    for x in (-3.0, 0.0, 0.7, 5.0):
        assert stats.t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-9)
        assert stats.t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-9)
    p, p_opp = stats.t_test(np.array([1.0, 2.0, 3.0]))
    assert p == pytest.approx(0.5 - 2 * 3**0.5 / (2 * math.sqrt(14)), abs=1e-9) and p + p_opp == pytest.approx(1)
    assert stats.t_test(np.array([1.0, 2.0, 3.0]), null=2.0) == pytest.approx((0.5, 0.5))  # a margin moves the null
    assert stats.t_test(np.array([0.3, 0.3])) == (0.0, 1.0) and stats.t_test(np.zeros(3)) == (0.5, 0.5)


def test_variance_components_and_the_sampling_variance_by_hand() -> None:
    """d_s(x) = a_s + b_x exactly (no interaction): σ²_seed = var(a), σ²_problem = var(b), σ²_seed×problem = 0. A ±e
    checkerboard has zero seed and problem means: everything is interaction, MS_res = 4e²/((2−1)(2−1)). Both, S = 2
    and P = 4: MS_res = 8e²/(1·3), σ²_seed = var(a) − MS_res/4, σ²_problem = var(b) − MS_res/2. c(n − c)/(n²(n − 1))
    averages to p(1 − p)/n over Binomial(n, p) (exactly, by enumeration)."""
    a, b = np.array([0.0, 0.1, 0.2]), np.array([0.0, 0.2, 0.4, 0.6])
    c = stats.components(a[:, None] + b[None, :], np.zeros((3, 4)))
    assert (c["seed"], c["problem"], c["seed×problem"], c["sampling"]) == pytest.approx(
        (np.var(a, ddof=1), np.var(b, ddof=1), 0.0, 0.0))
    e = 0.3
    c = stats.components(np.array([[e, -e], [-e, e]]), np.full((2, 2), 0.01))
    assert (c["seed"], c["problem"], c["seed×problem"], c["sampling"]) == pytest.approx((0, 0, 4 * e * e - 0.01, 0.01))
    assert stats.components(np.array([[e, -e], [-e, e]]), None)["seed×problem"] == pytest.approx(4 * e * e)
    a, e = np.array([0.0, 0.4]), 0.1
    c = stats.components(a[:, None] + b[None, :] + e * np.array([[1, -1, 1, -1], [-1, 1, -1, 1]]), None)
    ms_res = 8 * e * e / 3
    assert (c["seed"], c["problem"], c["seed×problem"], c["var(m_s)"]) == pytest.approx(
        (0.08 - ms_res / 4, np.var(b, ddof=1) - ms_res / 2, ms_res, 0.08))
    n, p = 5, 0.3
    pmf = np.array([math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)])
    assert pmf @ stats.sampling_variance(list(range(n + 1)), n) == pytest.approx(p * (1 - p) / n)
    assert stats.sampling_variance([2], 4)[0] == pytest.approx(2 * 2 / (16 * 3))


def test_probability_of_improvement_over_seed_pairs() -> None:
    """a = (1, 2, 3), b = (2, 2, 0): a_1 beats one b, a_2 ties two and beats one (½ + ½ + 1), a_3 beats all three:
    6 of 9 pairs."""
    assert stats.improvement(np.array([1.0, 2, 3]), np.array([2.0, 2, 0])) == (pytest.approx(6 / 9), 9)
    assert stats.improvement(np.array([0.5, 0.6]), np.array([0.55])) == (0.5, 2)


def test_spearman_exact_permutation_p_and_the_smallest_attainable() -> None:
    rho, p, least = stats.spearman(np.array([1.0, 2, 3, 4]), np.array([1.0, 3, 2, 4]))
    assert rho == pytest.approx(1 - 6 * 2 / (4 * 15))  # 1 − 6Σd²/(n(n²−1)), Σd² = 2
    assert p == pytest.approx(4 / 24) and least == pytest.approx(1 / 24)  # 4 of the 24 orderings have Σd² ≤ 2
    rho_ties, _, least_ties = stats.spearman(np.array([1.0, 1, 2, 3]), np.array([5.0, 6, 7, 8]))  # x: 0.5 0.5 2 3
    assert rho_ties == pytest.approx(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])
    assert least_ties == pytest.approx(2 / 24)  # a tie: two orderings reach the top ρ, so p ≥ 1/12 > 0.05
    assert stats.spearman(np.arange(3.0), np.arange(3.0))[2] == pytest.approx(1 / 6)  # 3 runs: never below 0.05


def test_spearman_mde_by_hand_and_the_power_of_the_permutation_test_there() -> None:
    """n = 12, α = 0.05: z_0.95 + z_0.8 = 1.6449 + 0.8416 = 2.4865; ρ = 0.7321 gives atanh(ρ) = ½·ln(1.7321/0.2679) =
    0.9333, and 0.9333·√9/√(1 + 0.7321²/2) = 2.7998/1.1261 = 2.4864. Then the test it stands for, simulated: 1000
    draws of 12 bivariate normal pairs whose Spearman ρ is that MDE (Pearson r = 2·sin(π·ρ/6)), each judged by
    stats.spearman's one-sided permutation p ≤ 0.05: power 0.8 or a little more (the formula errs high)."""
    assert stats.spearman_mde(12, 0.05) == pytest.approx(0.7321, abs=1e-4)
    assert stats.spearman_mde(3, 0.05) is None  # n − 3 = 0: no variance to speak of
    assert stats.spearman_mde(20, 0.05) < stats.spearman_mde(12, 0.05) < stats.spearman_mde(12, 0.01)
    r = 2 * math.sin(math.pi * stats.spearman_mde(12, 0.05) / 6)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 12))
    y = r * x + math.sqrt(1 - r**2) * rng.standard_normal((1000, 12))
    power = np.mean([stats.spearman(a, b, permutations=2000, seed=i)[1] <= 0.05 for i, (a, b) in enumerate(zip(x, y))])
    assert 0.78 <= power <= 0.93


def test_judge_holds_opposite_and_undecided_with_its_power() -> None:
    """K = 3. Claimed direction: p = 0.004 (×3 = 0.012: holds), 0.03 (×2 = 0.06: not), 0.9999. The other direction:
    0.0001 (×3: opposite). The undecided row at its Holm step level α' = 0.05/2, 3 seeds, sd 0.05 (of points/100):
    MDE = (t_{0.975,2} + t_{0.8,2})·0.05/√3 = 15.5 points."""
    def row(p: float, sd: float = 0.01) -> dict:
        return {"p": p, "p_opp": 1 - p, "sd": sd, "units": 3, "mean": 0.02, "null": 0.0, "scale": 100, "unit": "pt",
                "fmt": "+.1f"}

    rows = [row(0.004), row(0.9999), row(0.03, sd=0.05), {"name": "(f)", "verdict": "not testable here"}]
    stats.judge(rows)
    assert [r["verdict"] for r in rows] == ["holds", "opposite", "undecided (MDE 15.5 pt at 80 % power)",
                                            "not testable here"]
    assert rows[2]["level"] == pytest.approx(0.025) and rows[2]["holm"] == pytest.approx(0.06)
    assert rows[2]["mde"] == pytest.approx((T975_2 + T8_2) * 0.05 / math.sqrt(3), rel=1e-6)


# ---------------------------------------------------------------------------------------------------- claims
def test_effects_are_the_paired_means_of_the_seeds(tmp_path: Path) -> None:
    """pass@1(x) = c/4: seed 0's d = (1, 0, 1, 0)/4, m_0 = 1/8; seed 1's (2, 1, 0, 0)/4, m_1 = 3/16; pooled 5/32 with
    the t interval at df = 1; the seed-mean d(x) = (1.5, 0.5, 0.5, 0)/4 wins 3 problems; each seed's mean pass@1
    (9/16, 10/16) beats the base's 7/16."""
    base, es0, es1 = [0, 1, 2, 4], [1, 1, 3, 4], [2, 2, 2, 4]  # c(x) of 4 samples on 4 problems
    for label, counts in (("base", base), ("es@0", es0), ("es@1", es1)):
        write_eval(tmp_path / "run" / "eval", label, counts, [int(c >= 2) for c in counts])
    study.export(tmp_path / "run", tmp_path / "data")
    report = study.load_data(tmp_path / "data")["eval"]
    r = stats.seeded_row("x", report, "es", "base", "pass@1", None)
    half = T975_1 * np.std([1 / 8, 3 / 16], ddof=1) / math.sqrt(2)
    assert r["effects"] == pytest.approx([1 / 8, 3 / 16]) and r["mean"] == pytest.approx(np.mean([1.5, .5, .5, 0]) / 4)
    assert r["ci"] == pytest.approx([5 / 32 - half, 5 / 32 + half], rel=1e-6)
    assert (r["won"], r["lost"], r["improvement"]) == (3, 0, (1.0, 2))
    assert [c[0] for c in r["per_seed"]] == pytest.approx([1 / 8, 3 / 16])
    assert [c[3:] for c in r["per_seed"]] == [(2, 0), (2, 0)] and r["per_seed"][0][1] >= 0  # d ≥ 0: so is the interval
    k4 = stats.seeded_row("x", report, "es", "base", "pass@4", None)  # pass@4(x) = 1[c ≥ 1]: seed 0 wins problem 0
    assert k4["per_seed"][0][0] == pytest.approx(0.25) and k4["per_seed"][0][3:] == (1, 0)
    g = stats.seeded_row("x", report, "es", "base", "greedy", None)  # greedy 1[c ≥ 2]: es@1 wins problems 0 and 1
    assert g["per_seed"][1][0] == pytest.approx(0.5) and g["per_seed"][1][3:] == (2, 0)
    same = stats.seeded_row("x", report, "es", "es", "pass@2", None)  # each seed against itself: exactly 0
    assert same["mean"] == 0 and list(same["ci"]) == [0, 0] and all(list(c) == [0] * 5 for c in same["per_seed"])


def test_the_claim_table_of_a_study_still_running(tmp_path: Path) -> None:
    """Only the rows whose methods are evaluated. ES at seeds 0, 1 against base on 30 problems: m_s = 1/3, 1/6, so
    t = (1/4)/(sd/√2) = 3 at df = 1: p = ½ − atan(3)/π, undecided. GRPO at seed 0 only: ES vs GRPO pairs one seed,
    and GRPO's entropy has one seed: not testable (the sign test's chance shown beside)."""
    base = [0] * 30
    for label, counts in (("base", base), ("es@0", [2] * 20 + [0] * 10), ("es@1", [1] * 20 + [0] * 10),
                          ("grpo@0", base)):
        write_eval(tmp_path / "run" / "eval", label, counts, [0] * 30)
    write_curves(tmp_path / "run" / "runs" / "grpo-s0", [{"grpo/entropy": 0.9}, {"grpo/entropy": 0.5}])
    rows = claim_rows(tmp_path)
    assert list(rows) == ["(a) ES raises pass@1", "(a) ES reaches a higher pass@4 than GRPO",
                          "(a) GRPO's token entropy falls (first → last update)"]
    es = rows["(a) ES raises pass@1"]
    assert es["mean"] == pytest.approx(0.25) and es["p"] == pytest.approx(0.5 - math.atan(3) / math.pi, abs=1e-9)
    assert es["holm"] == pytest.approx(es["p"]) and es["verdict"].startswith("undecided (MDE ")  # K = 1
    assert rows["(a) ES reaches a higher pass@4 than GRPO"]["verdict"] == "not testable at 1 seed"
    entropy = rows["(a) GRPO's token entropy falls (first → last update)"]
    assert entropy["per_seed_text"] == "0.900 → 0.500" and entropy["verdict"] == "not testable at 1 seed"
    assert entropy["improvement_text"] == "1/1 seeds down; sign test p = 0.500 (at best 1/2^1)"
    shutil.rmtree(tmp_path / "run" / "eval" / "grpo@0")  # GRPO not evaluated yet: no row compares with it
    assert list(claim_rows(tmp_path)) == ["(a) ES raises pass@1"]


def test_the_entropy_rule_is_a_t_test_with_the_sign_test_beside_it(tmp_path: Path) -> None:
    """Three GRPO seeds, entropy first → last 1.25 → 0.09, 1.32 → 0.11, 1.21 → 0.15: drops (1.16, 1.21, 1.06), t at
    df = 2 by the closed form; the sign test's 3/3 down has chance 1/8, above 0.05 whatever the data."""
    for s, (first, last) in enumerate(((1.25, 0.09), (1.32, 0.11), (1.21, 0.15))):
        write_eval(tmp_path / "run" / "eval", f"grpo@{s}", [1] * 5, [0] * 5)
        write_curves(tmp_path / "run" / "runs" / f"grpo-s{s}", [{"grpo/entropy": first}, {"grpo/entropy": last}])
    write_eval(tmp_path / "run" / "eval", "base", [0] * 5, [0] * 5)
    entropy = claim_rows(tmp_path)["(a) GRPO's token entropy falls (first → last update)"]
    drops = np.array([1.16, 1.21, 1.06])
    t = drops.mean() / (drops.std(ddof=1) / math.sqrt(3))
    assert entropy["p"] == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), abs=1e-9)
    assert entropy["improvement_text"] == "3/3 seeds down; sign test p = 0.125 (at best 1/2^3)"
    assert entropy["verdict"] == "holds"  # K = 1: no other claim can be tested on these files


def test_export_then_report_rebuilds_byte_for_byte_without_the_run_directory(tmp_path: Path) -> None:
    fake_study(tmp_path / "run")
    study.main(study.Args(out=str(tmp_path / "run"), export=True, data=str(tmp_path / "data"),
                          docs=str(tmp_path / "docs")))
    assert sorted(f.name for f in (tmp_path / "data").iterdir()) == [
        "costs.json", "curves.json", "eval.json", "heldout.json", "pop.json", "sweep.json"]
    assert sum(f.stat().st_size for f in (tmp_path / "data").iterdir()) < 30_000  # kilobytes: no checkpoints
    eval_data = json.loads((tmp_path / "data" / "eval.json").read_text())
    assert eval_data["models"]["es@1"] == "runs/es@1" and eval_data["seeds"]["grpo_es@2"] == 2  # as the study named
    assert eval_data["protocol"]["temperature"] == 0.6 and "uncertainty" not in eval_data  # them; recomputed later
    shutil.rmtree(tmp_path / "run")  # the report reads the exported data alone
    study.main(study.Args(report=True, data=str(tmp_path / "data"), docs=str(tmp_path / "again")))
    report = (tmp_path / "docs" / "results.md").read_text()
    assert (tmp_path / "again" / "results.md").read_text() == report
    for png in ("delta-k.png", "curves.png"):
        assert (tmp_path / "again" / png).read_bytes() == (tmp_path / "docs" / png).read_bytes()
    for claim in ("(a) ES raises pass@1 |", "(b) ES runs with more JS diversity", "(c) GRPO→ES not below ES at pass@4",
                  "(d) resetting ES's small changes (τ = 0.01, s_τ = 95 %)", "(e) nor does GRPO",
                  "| not testable here (one model size) |", "## Held-out task (products) (n = 4)", "| es@* | arith |"):
        assert claim in report, claim
    assert "| seed 0 | seed 1 | seed 2 |" in report and "| total | 962 | 16.0 |" in report


def test_the_committed_report_is_rebuilt_from_the_committed_data(tmp_path: Path) -> None:
    """docs/study/results.md is what `python bench/study.py --report` writes from docs/study/data/ on a fresh clone."""
    data = ROOT / "docs" / "study" / "data"
    if not (data / "eval.json").exists():
        pytest.skip("docs/study/data/ is not committed yet")
    study.write_report(data, tmp_path)
    assert (tmp_path / "results.md").read_text() == (ROOT / "docs" / "study" / "results.md").read_text()


# ---------------------------------------------------------------------------------------------------- the study
def test_steps_skip_when_done_and_a_failed_step_stops_the_study(tmp_path: Path) -> None:
    args = study.Args(out=str(tmp_path / "study"), data=str(tmp_path / "data"))
    done = tmp_path / "study" / "x" / "done.txt"
    write = ["-c", f"import pathlib; p = pathlib.Path({str(done)!r}); p.parent.mkdir(parents=True); p.write_text('1')"]
    study.run_step(args, "write", done, write, partial=done.parent)
    study.run_step(args, "write", done, ["-c", "raise SystemExit(3)"])  # done: not run again
    costs = json.loads((tmp_path / "study" / "costs.json").read_text())
    assert list(costs) == ["write"] and costs["write"] > 0
    assert (tmp_path / "study" / "logs" / "write.log").read_text().startswith("$ ")
    other = tmp_path / "study" / "y" / "done.txt"
    other.parent.mkdir()
    (other.parent / "half.txt").write_text("a killed attempt")
    with pytest.raises(SystemExit, match="step fails failed"):
        study.run_step(args, "fails", other, ["-c", "raise SystemExit(3)"], partial=other.parent)
    assert not other.parent.exists()  # the partial folder was removed before the retry, and nothing marks it done


def test_the_plan_matches_budgets_and_the_population_study_keeps_64_completions(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    """Every step of a study with the default flags (run_step recorded, nothing run): each method at each seed, ES at
    N members × 64/N prompts, GRPO at 8 × 8; bad population flags stop it before anything runs."""
    steps: dict[str, list[str]] = {}
    monkeypatch.setattr(study, "run_step", lambda args, name, done, argv, partial=None: steps.setdefault(name, argv))
    args = study.Args(out=str(tmp_path), data=str(tmp_path / "data"))
    study.run_all(args)
    flag = lambda name, f: steps[name][steps[name].index(f) + 1]  # noqa: E731
    trained = sorted(name for name in steps if not name.startswith(("data-", "eval-", "heldout-", "sweep-", "pop-")))
    assert trained == sorted([f"{m}-s{s}" for m in ("es", "grpo", "grpo_es") for s in (0, 1, 2)] + ["es4-s0"])
    for name, pop in (("es-s1", 8), ("es4-s0", 4)):
        assert int(flag(name, "--pop")) == pop and int(flag(name, "--prompts-per-iter")) == 64 // pop
        assert flag(name, "--iterations") == "8"
    assert study.es_flags(16)[:4] == ["--pop", "16", "--prompts-per-iter", "4"]
    assert int(flag("grpo-s2", "--prompts-per-step")) * int(flag("grpo-s2", "--group-size")) == 64
    assert flag("grpo_es-s0", "--total-updates") == "8" and flag("grpo_es-s0", "--order") == "grpo-es"
    assert {f"eval-{m}@{s}" for m in ("base", "es", "grpo", "grpo_es") for s in (0, 1, 2)} - steps.keys() == {
        "eval-base@0", "eval-base@1", "eval-base@2"} and "eval-base" in steps
    assert {name for name in steps if name.startswith("heldout-")} == {
        "heldout-base", *[f"heldout-{m}@{s}" for m in ("es", "grpo") for s in (0, 1, 2)]}
    assert {name for name in steps if name.startswith(("pop-", "sweep-"))} == {
        "pop-es4@0", "pop-es8@0", "pop-es8@1", "pop-es8@2", "pop-base", "sweep-es@0"}
    assert flag("eval-es@0", "--n") == "16" and flag("pop-es4@0", "--n") == flag("heldout-grpo@1", "--n") == "4"
    for bad, message in (({"pops": (5,)}, "must divide 64"), ({"pop_seeds": (3,)}, "among --seeds")):
        with pytest.raises(SystemExit, match=message):
            study.main(study.Args(out=str(tmp_path / "bad"), **bad))
    assert not (tmp_path / "bad").exists()


def test_lanes_committed_in_data_are_skipped_and_a_model_is_trained_only_when_needed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The study carried out in parts: an evaluation that --data holds is not run again, and a training run whose
    evaluations are all there is not run at all; the first one still missing trains its model once."""
    calls: list[str] = []
    monkeypatch.setattr(study, "run_step", lambda args, name, *rest, **kw: calls.append(name))
    data = tmp_path / "data"
    data.mkdir()
    done = {"eval": ["base", "es@0"], "heldout": ["base", "es@0"], "sweep": ["es@0"], "pop": ["base", "es4@0", "es8@0"]}
    for kind, labels in done.items():
        (data / f"{kind}.json").write_text(json.dumps(
            {"results": {label: {"arith": {"pass@k": {}, "maj@k": {}}} for label in labels}}))
    args = study.Args(out=str(tmp_path / "run"), data=str(data), seeds=(0,), methods=("es",))
    study.run_all(args)
    assert calls == ["data-sums50", "data-products"]
    pop = json.loads((data / "pop.json").read_text())
    del pop["results"]["es8@0"]
    (data / "pop.json").write_text(json.dumps(pop))
    calls.clear()
    study.run_all(args)
    assert calls == ["data-sums50", "data-products", "es-s0", "pop-es8@0"]


def test_export_adds_to_the_data_of_earlier_runs(tmp_path: Path) -> None:
    """Two run directories (two sessions, say), exported one after the other: --data holds both lanes' results, and a
    run evaluated with other settings is refused."""
    write_eval(tmp_path / "a" / "eval", "base", [0, 1, 2, 4], [0, 0, 1, 1])
    write_eval(tmp_path / "a" / "eval", "es@0", [1, 1, 3, 4], [0, 0, 1, 1])
    write_eval(tmp_path / "b" / "eval", "es@1", [2, 2, 2, 4], [1, 1, 1, 1])
    for run in ("a", "b"):
        study.export(tmp_path / run, tmp_path / "data")
    merged = study.load(tmp_path / "data" / "eval.json")
    assert sorted(merged["results"]) == ["base", "es@0", "es@1"]
    assert merged["results"]["es@0"]["arith"]["correct_counts"] == [1, 1, 3, 4]
    assert merged["seeds"] == {"base": None, "es@0": 0, "es@1": 1}
    write_eval(tmp_path / "c" / "eval", "es@2", [0] * 4, [0] * 4, n=8)
    with pytest.raises(SystemExit, match="evaluated with other settings"):
        study.export(tmp_path / "c", tmp_path / "data")
