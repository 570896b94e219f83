"""bench/stats.py — the findings study's statistics (bench/study.py): seed-level tests, Holm, power, rank correlation,
and a row of the claim table for each kind of claim (seeded_row, entropy_row, sparsity_row, population_rows, judge).

A claim compares A with B on the same P problems x. With training seeds s = 1..S and v(x) = 1[greedy correct] or the
unbiased pass@k(x) (eval_passk.py):

    d_s(x) = v_{A@s}(x) − v_B(x)        B one fixed model (the base): the same v_B(x) for every seed
    d_s(x) = v_{A@s}(x) − v_{B@s}(x)    same-seed pairing: A and B trained from seed s saw the same prompts in the same
                                        order, so s is paired with s (never with B's pooled mean)
    m_s = mean_x d_s(x)                 the seed's effect; the seeds are the units of replication

  seed-level t   m̄ ± t_{0.975,S−1}·sd(m_s)/√S, and the one-sided test of H0: Δ ≤ δ0 by t = (m̄ − δ0)/(sd(m_s)/√S),
                 df = S − 1 [Student 1908]; δ0 = 0 for an effect claimed > 0, −margin for "no loss beyond the margin".
                 The verdicts use it. It holds the problems fixed (the claim is about these P problems' distribution
                 as sampled), and counts what moves a seed's mean: the seed itself, seed × problem and sampling noise.
  two-level      shown beside it: resample S seeds with replacement, then P problems with replacement anew within each
                 drawn seed [Davison & Hinkley 1997 §3.8]; it adds the problems' own spread, but with S = 3 it
                 resamples three numbers (10 distinct multisets) and cannot widen for a df of 2: too narrow to judge by.
  P(A > B)       mean over seed pairs (i, j) of 1[a_i > b_j] + ½·1[a_i = b_j], a_i and b_j the seeds' means of v
                 (all S_A·S_B pairs; S_A against a fixed B) [Agarwal et al. 2021, "Deep RL at the edge of the
                 statistical precipice": the probability of improvement].
  Holm           K pre-stated claims, p_(1) ≤ … ≤ p_(K): reject H_(i) while p_(i) ≤ α/(K − i + 1), stop at the first
                 that is not [Holm 1979]; family-wise error ≤ α. Adjusted p̃_(i) = max_{j≤i} min(1, (K − j + 1)·p_(j)).
  MDE            (t_{1−α',S−1} + t_{0.8,S−1})·sd/√S: the true effect (from δ0) a one-sided t test at level α' detects
                 with 80 % power, sd the observed sd of the units (seeds) [Cohen 1988 ch. 2; the noncentral t replaced
                 by a shifted central t: exact as S → ∞, optimistic at few seeds and small α' — at df = 2 and α' =
                 0.005 the power at this MDE is ≈ 0.70, not 0.80 — so read it as a lower bound]. α' is the level
                 Holm's step-down gives the row at its rank r by p: α/(K − r + 1).
  MDE of ρ       the Spearman ρ that a one-sided test over n points detects at level α with 80 % power: ρ solving
                 atanh(ρ)·√(n − 3)/√(1 + ρ²/2) = z_{1−α} + z_0.8, Fisher's z of ρ with Bonett and Wright's variance
                 (1 + ρ²/2)/(n − 3) [Bonett & Wright 2000]. Against the permutation test on bivariate normal data
                 it errs high (power 0.84–0.88 there at n = 5–20): an upper bound.
  components     crossed random effects d_s(x) = μ + a_s + b_x + (ab)_sx + ε_sx, method of moments (ANOVA, each floored
                 at 0): MS_res = Σ (d − m_s − m_x + m̄)²/((S−1)(P−1)) estimates σ²_sp + σ²_ε; var(m_s) = σ²_seed +
                 MS_res/P; var(m_x) = σ²_problem + MS_res/S. σ²_ε, the sampling variance of one cell, is known for
                 pass@1: c(n−c)/(n²(n−1)) is unbiased for p(1−p)/n, the variance of c/n; summed over the models whose
                 samples vary with the seed (A@s, and B@s when paired; the base's noise is shared by every seed, so it
                 sits in b_x). Every model draws a problem's samples from the same sampler seeds (common random
                 numbers), so their noise is correlated and the part that varies with the training seed is smaller:
                 the sum is an upper bound. Greedy: σ²_ε = 0. pass@k, k > 1: folded into σ²_sp. A seed's mean has
                 var(m_s) = σ²_seed + (σ²_sp + σ²_ε)/P, the sum the shares in the report divide; σ²_problem/P is
                 what the t interval leaves out (the problems are shared by every seed, so b_x cancels in m_s − m̄).
                 Crossed, not one-way within seeds: a one-way split would count b_x (the problems' shared effect,
                 the base's own values among it) as noise within each seed, and subtract too much from σ²_seed.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import derive_seed  # noqa: E402
from eval_passk import bootstrap_draws, interval, per_problem, seed_interval, t_quantile, t_table  # noqa: E402

RESAMPLES, SEED, ALPHA = 2000, 0, 0.05  # eval_passk's defaults (the resamples of its passk.md); Holm's family-wise α


def seed_draws(seeds: int, num_problems: int, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two-level resamples: (B, S) seed indices drawn with replacement, and (B, S, P) counts of the P problems drawn
    with replacement anew for each drawn seed (Multinomial(P, 1/P each))."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, seeds, (resamples, seeds)),
            rng.multinomial(num_problems, np.full(num_problems, 1 / num_problems), (resamples, seeds)))


def two_level(values: np.ndarray, picks: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(3, M): the mean of `values` (S, P, M) over seeds and problems, and its 95% percentile interval over two-level
    resamples: resample b's mean is (1/(S·P)) Σ_j Σ_x counts[b, j, x] · values[picks[b, j], x]."""
    per_seed = np.einsum("bjp,spm->bjsm", counts, values) / values.shape[1]  # (B, S, S, M): draw j's problems, seed s
    means = np.take_along_axis(per_seed, picks[:, :, None, None], 2)[:, :, 0].mean(1)  # (B, M): seed s = picks[b, j]
    return np.vstack([values.mean((0, 1)), np.percentile(means, [2.5, 97.5], axis=0)])


def t_cdf(x: float, df: int) -> float:
    """Student's t CDF F_ν(x), from eval_passk.t_table at φ = arctan(|x|/√ν); F(−x) = 1 − F(x)."""
    phi, cdf = t_table(df)
    f = min(1.0, float(np.interp(math.atan(abs(x) / math.sqrt(df)), phi, cdf)))  # the grid's F(π/2) is 1 ± 1e-12
    return f if x >= 0 else 1 - f


def t_test(effects: np.ndarray, null: float = 0.0) -> tuple[float, float]:
    """One-sided p-values of the mean of `effects` (n ≥ 2 units, df = n − 1) against `null`: (H1: Δ > null,
    H1: Δ < null). Units that all agree (sd = 0) give p = 0 on the side the mean lies, ½ each when it is the null."""
    se = effects.std(ddof=1) / math.sqrt(len(effects))
    gap = effects.mean() - null
    t = gap / se if se > 0 else math.copysign(math.inf, gap) if gap != 0 else 0.0
    return 1 - t_cdf(t, len(effects) - 1), t_cdf(t, len(effects) - 1)


def holm(p: Sequence[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down (module docstring): each hypothesis' adjusted p̃ (rejected ⇔ p̃ ≤ α) and its step level
    α/(K − r + 1), r its rank by p (ties in input order)."""
    p = np.asarray(p, float)
    order = np.argsort(p, kind="stable")
    steps = len(p) - np.arange(len(p))  # K, K − 1, …, 1 hypotheses left at each step
    adjusted, levels = np.empty(len(p)), np.empty(len(p))
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps * p[order]))  # a later step never undoes an earlier
    levels[order] = alpha / steps
    return adjusted, levels


def mde(sd: float, units: int, alpha: float, power: float = 0.8) -> float:
    """Minimum detectable effect of a one-sided t test over `units` (df = units − 1) at level α with this power."""
    return (t_quantile(1 - alpha, units - 1) + t_quantile(power, units - 1)) * sd / math.sqrt(units)


def spearman_mde(n: int, alpha: float, power: float = 0.8) -> Optional[float]:
    """The MDE of Spearman's ρ over n ≥ 4 points (the docstring's formula; bisection, its left side grows with ρ)."""
    if n < 4:
        return None
    target = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(power)
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.atanh(mid) * math.sqrt(n - 3) / math.sqrt(1 + mid**2 / 2) < target else (lo, mid)
    return hi


def units_needed(sd: float, effect: float, alpha: float, power: float = 0.8, most: int = 100_000) -> Optional[int]:
    """The fewest units (≥ 2) whose MDE is ≤ `effect` (MDE falls as units grow: bisection); None if the effect is ≤ 0
    or needs more than `most`."""
    if effect <= 0 or mde(sd, most, alpha, power) > effect:
        return None
    lo, hi = 1, most  # mde(lo) > effect ≥ mde(hi); units = 1 has no df: never enough
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mde(sd, mid, alpha, power) <= effect else (mid, hi)
    return hi


def sampling_variance(counts: Sequence[int], n: int) -> np.ndarray:
    """(P,): c(n − c)/(n²(n − 1)) per problem, unbiased for p(1 − p)/n, the variance of pass@1(x) = c/n (n ≥ 2)."""
    c = np.asarray(counts, float)
    return c * (n - c) / (n**2 * (n - 1))


def components(d: np.ndarray, sampling: Optional[np.ndarray]) -> dict[str, float]:
    """Variance components of d_s(x), (S ≥ 2, P ≥ 2) (module docstring), and var(m_s) as observed; `sampling` (S, P)
    each cell's sampling variance, or None (folded into seed × problem)."""
    num_seeds, num_problems = d.shape
    m_s, m_x, m = d.mean(1), d.mean(0), d.mean()
    ms_res = ((d - m_s[:, None] - m_x[None, :] + m) ** 2).sum() / ((num_seeds - 1) * (num_problems - 1))
    eps = 0.0 if sampling is None else float(sampling.mean())
    return {"seed": max(0.0, m_s.var(ddof=1) - ms_res / num_problems), "seed×problem": max(0.0, ms_res - eps),
            "sampling": eps, "problem": max(0.0, m_x.var(ddof=1) - ms_res / num_seeds), "var(m_s)": m_s.var(ddof=1)}


def improvement(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """P(A > B) over all pairs (i, j) of A's and B's seed values: mean 1[a_i > b_j] + ½·1[a_i = b_j]; and #pairs."""
    a, b = np.asarray(a, float)[:, None], np.asarray(b, float)[None, :]
    return float(((a > b) + 0.5 * (a == b)).mean()), a.size * b.size


def ranks(v: np.ndarray) -> np.ndarray:
    """Ranks 0 … n − 1; tied values share their mean rank."""
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v))
    return np.array([r[v == value].mean() for value in v])


def spearman(x: np.ndarray, y: np.ndarray, permutations: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Spearman's ρ (the correlation of the ranks), its one-sided permutation p of ρ ≥ observed, and the smallest p any
    data with these ties could reach. Exact over all n! orderings for n ≤ 8; else `permutations` random ones (+1)."""
    rx, ry = ranks(np.asarray(x, float)), ranks(np.asarray(y, float))
    cx, cy = rx - rx.mean(), ry - ry.mean()
    if not cx.any() or not cy.any():  # one variable constant: no order to correlate
        return math.nan, 1.0, 1.0
    exact = len(rx) <= 8
    shuffled = (np.array(list(itertools.permutations(cy))) if exact else  # (n!, n): every ordering of y; or (B, n)
                np.random.default_rng(seed).permuted(np.tile(cy, (permutations, 1)), axis=1))
    null = shuffled @ cx / math.sqrt((cx @ cx) * (cy @ cy))  # the ranks' sums of squares do not change when shuffled
    rho = float(cx @ cy / math.sqrt((cx @ cx) * (cy @ cy)))

    def p_of(r: float) -> float:
        hits = int((null >= r - 1e-12).sum())
        return hits / len(null) if exact else (1 + hits) / (1 + len(null))

    return rho, p_of(rho), p_of(float(null.max()))


# ---------------------------------------------------------------------------------------------------- claims
def seeds_of(report: dict, method: str) -> dict[int, str]:
    """seed → label of a method's evaluations in `report` ('es' → {0: 'es@0', 1: 'es@1'}), by seed."""
    return dict(sorted((int(label.rpartition("@")[2]), label) for label in report["results"]
                       if label.rpartition("@")[0] == method))


def seeded(report: dict, a: str, b: str, metric: str) -> dict:
    """d_s(x) = v_{a@s}(x) − v_b(x) (b a fixed model) or v_{a@s}(x) − v_{b@s}(x) (same seed s) on `metric`, for every
    seed both have (module docstring): {"seeds", "d" (S, P), "a", "b": each seed's mean v (b fixed: its one value),
    "sampling": (S, P) each d_s(x)'s sampling variance (pass@1; greedy: 0) or None (pass@k, k > 1)}."""
    results, task, n, ks = report["results"], report["task"], report["n"], report["ks"]
    col = ["greedy", *[f"pass@{k}" for k in ks]].index(metric)
    fixed = b in results
    labels_a, labels_b = seeds_of(report, a), ({} if fixed else seeds_of(report, b))
    seeds = [s for s in labels_a if fixed or s in labels_b]
    pairs = [(labels_a[s], b if fixed else labels_b[s]) for s in seeds]  # (A@s, B or B@s)
    va, vb = (np.array([per_problem(results[p[i]][task], n, ks)[:, col] for p in pairs]).reshape(len(pairs), -1)
              for i in (0, 1))  # (S, P) each
    sampling = None  # pass@k, k > 1: folded into seed × problem
    if metric == "greedy":
        sampling = np.zeros_like(va)  # one deterministic completion: no sampling noise
    elif metric == "pass@1":  # A@s's, and B@s's when paired: the base's noise is the same for every seed (in b_x)
        sampling = sum(np.array([sampling_variance(results[p[i]][task]["correct_counts"], n) for p in pairs])
                       for i in ((0,) if fixed else (0, 1)))
    return {"seeds": seeds, "d": va - vb, "a": va.mean(1), "b": vb[:1].mean(1) if fixed else vb.mean(1),
            "sampling": sampling}


def seeded_row(name: str, report: Optional[dict], a: str, b: str, metric: str,
               margin: Optional[float]) -> Optional[dict]:
    """A claim about trained models (module docstring): seed-level t interval and test, the two-level bootstrap, each
    seed's own problem-level interval, P(A > B), the variance components; None while a or b is not evaluated yet."""
    if report is None or not seeds_of(report, a) or not (b in report["results"] or seeds_of(report, b)):
        return None
    found = seeded(report, a, b, metric)
    d, seeds, null = found["d"], found["seeds"], -(margin or 0.0) / 100
    draws = bootstrap_draws(d.shape[1], RESAMPLES, derive_seed(SEED, "bootstrap", report["task"]))  # eval_passk's
    m, pooled = d.mean(1), d.mean(0)  # (S,) each seed's effect; (P,) each problem's mean over the seeds
    row = {"name": name, "scale": 100, "unit": "pt", "fmt": "+.1f", "null": null, "units": len(seeds),
           "unit_name": "seeds", "mean": float(d.mean()), "seeds": seeds, "effects": m, "problems": d.shape[1],
           "folded": found["sampling"] is None, "improvement": improvement(found["a"], found["b"]),
           "won": int((pooled > 0).sum()), "lost": int((pooled < 0).sum()),  # of the seeds' mean d(x)
           "per_seed": [(*interval(x[:, None], draws)[:, 0], int((x > 0).sum()), int((x < 0).sum())) for x in d]}
    if len(seeds) < 2:
        return row | {"verdict": f"not testable at {len(seeds)} seed{'s' * (len(seeds) != 1)}"}
    picks, counts = seed_draws(len(seeds), d.shape[1], RESAMPLES, derive_seed(SEED, "two-level", report["task"],
                                                                               len(seeds)))
    p, p_opp = t_test(m, null)
    return row | {"ci": seed_interval(d[:, :, None])[1:, 0], "boot": two_level(d[:, :, None], picks, counts)[1:, 0],
                  "p": p, "p_opp": p_opp, "sd": float(m.std(ddof=1)), "components": components(d, found["sampling"])}


def entropy_row(main: dict, curves: dict) -> Optional[dict]:
    """(a)'s entropy collapse: the one-sided t test of each GRPO seed's first − last logged token entropy > 0, and the
    sign test beside it (all S seeds down: p = 1/2^S, the best it can reach)."""
    runs = {s: curves[f"grpo@{s}"]["grpo/entropy"] for s in seeds_of(main, "grpo")
            if curves.get(f"grpo@{s}", {}).get("grpo/entropy")}
    if not runs:
        return None
    first, last = np.array([c[0][1] for c in runs.values()]), np.array([c[-1][1] for c in runs.values()])
    drops, down = first - last, int((last < first).sum())
    sign_p = sum(math.comb(len(runs), i) for i in range(down, len(runs) + 1)) / 2 ** len(runs)
    row = {"name": "(a) GRPO's token entropy falls (first → last update)", "scale": 1, "unit": "nats", "fmt": "+.2f",
           "null": 0.0, "units": len(runs), "unit_name": "seeds", "mean": float(drops.mean()), "seeds": list(runs),
           "per_seed_text": ", ".join(f"{a:.3f} → {b:.3f}" for a, b in zip(first, last)),
           "improvement_text": f"{down}/{len(runs)} seeds down; sign test p = {sign_p:.3f} (at best 1/2^{len(runs)})"}
    if len(runs) < 2:
        return row | {"verdict": "not testable at 1 seed"}
    p, p_opp = t_test(drops)
    return row | {"ci": seed_interval(drops[:, None, None])[1:, 0], "p": p, "p_opp": p_opp,
                  "sd": float(drops.std(ddof=1))}


def sparsity_row(sweep: dict) -> dict:
    """(d): θ_τ against its full θ at the τ whose s_τ is nearest the paper's 78 %: one model, so the problems are the
    units (its problem-level paired bootstrap interval, eval_passk's, and the t test over problems, margin 2 points)."""
    label, sp = next(iter(sweep["sparsity"].items()))
    i = int(np.argmin([abs(row["s_tau"] - 0.78) for row in sp["taus"]]))
    full = sweep["results"][label][sweep["task"]]["correct_counts"]
    d = (np.array(sp["taus"][i]["correct_counts"]) - full) / sweep["n"]  # (P,): pass@1_τ(x) − pass@1_θ(x)
    c, null = sweep["uncertainty"]["sparsity"][label][i], -0.02
    p, p_opp = t_test(d, null)
    return {"name": f"(d) resetting ES's small changes (τ = {sp['taus'][i]['tau']:g}, s_τ = "
                    f"{100 * sp['taus'][i]['s_tau']:.0f} %) keeps pass@1 (margin 2 pt)", "scale": 100, "unit": "pt",
            "fmt": "+.1f", "null": null, "units": len(d), "unit_name": "problems", "mean": float(d.mean()),
            "ci": c["diff_ci"], "p": p, "p_opp": p_opp, "sd": float(d.std(ddof=1)),
            "per_seed_text": f"{label} only: one model, the problems resampled; {c['won']}/{c['lost']} problems"}


def population_rows(pop: dict, curves: dict) -> list[dict]:
    """(f) the population ES needs (not testable with one model size: its numbers only), and (b) JS diversity against
    pass@k over the ES runs of the population protocol (Spearman, exact permutation p)."""
    k, rows = f"pass@{pop['ks'][-1]}", []
    sizes = sorted({int(label.partition("@")[0][2:]) for label in pop["results"] if label.startswith("es")})
    cells = []
    for size in sizes:
        r = seeded_row("", pop, f"es{size}", "base", "pass@1", None)
        lo, hi = r["ci"] if "ci" in r else r["per_seed"][0][1:3]  # one seed: its own interval over problems
        cells.append(f"N = {size}: {100 * r['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] ({len(r['seeds'])} seed"
                     + ("s, t)" if "ci" in r else ", problems)"))
    rows.append({"name": "(f) the population ES needs (pass@1 vs base)", "effect_text": "; ".join(cells),
                 "verdict": "not testable here (one model size)"})
    x, y = [], []
    for label in pop["results"]:
        if label.startswith("es"):
            size, seed = label[2:].split("@")
            js = curves.get(f"es@{seed}" if size == "8" else f"es{size}@{seed}", {}).get("es/js_succ_bits", [])
            x.append(np.mean([v for _, v in js]) if js else 0.0)
            y.append(per_problem(pop["results"][label][pop["task"]], pop["n"], pop["ks"])[:, -1].mean())
    if len(x) >= 3:
        rho, p, least = spearman(np.array(x), np.array(y))
        row = {"name": f"(b) ES runs with more JS diversity reach a higher {k}",
               "effect_text": f"Spearman ρ = {rho:+.2f} over {len(x)} runs, permutation p = {p:.3f} (exact); the "
                              f"smallest p these runs' ties allow: {least:.3f}"}
        rows.append(row | ({"p": p, "p_opp": spearman(np.array(x), -np.array(y))[1], "sd": None} if least < ALPHA else
                           {"verdict": f"not testable at {len(x)} runs (p ≥ {least:.3f} whatever they show)"}))
    return rows


def judge(rows: list[dict]) -> None:
    """Holm's step-down over the rows with a p-value, in each direction: verdicts, and each row's MDE at its level."""
    family = [r for r in rows if "p" in r]
    adjusted, levels = holm([r["p"] for r in family], ALPHA)
    opposite, _ = holm([r["p_opp"] for r in family], ALPHA)
    for r, p_holm, level, p_opp in zip(family, adjusted, levels, opposite):
        r |= {"holm": float(p_holm), "level": float(level)}
        if r["sd"] is not None:
            r |= {"mde": mde(r["sd"], r["units"], level), "needed": units_needed(r["sd"], r["mean"] - r["null"], level)}
        r["verdict"] = ("holds" if p_holm <= ALPHA else "opposite" if p_opp <= ALPHA else "undecided" + (
            f" (MDE {r['scale'] * r['mde']:{r['fmt'].lstrip('+')}} {r['unit']} at 80 % power)" if "mde" in r else ""))
