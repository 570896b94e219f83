"""bench/study.py: its steps resume and its report's effects, verdicts and rank correlation match hand-computed values
(the study itself takes hours; here its report runs on evaluation files written by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import study  # noqa: E402
from eval_passk import k_grid, pass_at_k  # noqa: E402


def write_eval(folder: Path, label: str, counts: list[int], greedy: list[int], n: int = 4) -> None:
    """A passk.json as eval_passk.py writes it (JSON keys as strings), for one model on 'arith'."""
    ks = k_grid(n)
    result = {"pass@k": {str(k): float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in ks},
              "maj@k": {str(k): 0.0 for k in ks}, "reward": 0.0, "response_tokens": 5.0, "num_problems": len(counts),
              "correct_counts": counts, "greedy_correct": greedy, "greedy": float(np.mean(greedy))}
    (folder / label).mkdir(parents=True)
    (folder / label / "passk.json").write_text(json.dumps(
        {"task": "arith", "split": "test", "n": n, "ks": ks, "models": {label: "x"}, "base": None,
         "results": {label: {"arith": result}}, "sparsity": {}}))


def test_effects_are_the_paired_means_with_seeds_pooled(tmp_path: Path) -> None:
    base, es0, es1 = [0, 1, 2, 4], [1, 1, 3, 4], [2, 2, 2, 4]  # c(x) of 4 samples on 4 problems
    for label, counts in (("base", base), ("es@0", es0), ("es@1", es1)):
        write_eval(tmp_path / "eval", label, counts, [int(c >= 2) for c in counts])
    report = study.merged(tmp_path, "eval")
    e = study.effect(report, "es@*", "base", "pass@1")
    # pass@1(x) = c/4; es@* = the mean of the two seeds per problem: (1.5, 1.5, 2.5, 4)/4 vs (0, 1, 2, 4)/4
    assert e["mean"] == pytest.approx(100 * np.mean([1.5, 0.5, 0.5, 0]) / 4)
    assert (e["won"], e["lost"], e["seeds_up"], e["seeds"]) == (3, 0, 2, 2)
    assert e["ci"][0] >= 0 and e["ci"][1] <= 100 * 1.5 / 4  # a resampled mean of d(x) ≥ 0 lies in [min d, max d]
    k4 = study.effect(report, "es@0", "base", "pass@4")  # pass@4(x) = 1[c ≥ 1]: only problem 0 changes, 0 → 1
    assert k4["mean"] == pytest.approx(25.0) and (k4["won"], k4["lost"], k4["seeds"]) == (1, 0, 0)
    g = study.effect(report, "es@1", "base", "greedy")  # greedy 1[c ≥ 2]: es@1 wins problems 0 and 1
    assert g["mean"] == pytest.approx(50.0) and (g["won"], g["lost"]) == (2, 0)
    same = study.effect(report, "es@0", "es@0", "pass@2")  # d(x) = 0 everywhere: a zero-width interval
    assert same["mean"] == 0 and same["ci"] == [0, 0] and (same["won"], same["lost"]) == (0, 0)


def test_verdicts_follow_the_stated_rule() -> None:
    def e(lo: float, hi: float) -> dict:
        return {"ci": [lo, hi]}

    assert [study.verdict(e(lo, hi)) for lo, hi in ((0.1, 3), (-3, -0.1), (-1, 1), (0, 2))] == [
        "reproduced", "opposite", "undecided at this power", "undecided at this power"]
    assert [study.verdict(e(lo, hi), 2.0) for lo, hi in ((-1.9, 5), (-9, -2.1), (-2.5, 1), (-2, 0))] == [
        "reproduced", "opposite", "undecided at this power", "undecided at this power"]


def test_spearman_matches_the_closed_form_and_the_exact_permutation_p() -> None:
    rho, p = study.spearman(np.array([1.0, 2, 3, 4]), np.array([1.0, 3, 2, 4]))
    assert rho == pytest.approx(1 - 6 * 2 / (4 * 15))  # 1 − 6Σd²/(n(n²−1)), Σd² = 2
    assert p == pytest.approx(4 / 24, abs=0.015)  # 4 of the 24 orderings have Σd² ≤ 2
    rho_ties, _ = study.spearman(np.array([1.0, 1, 2, 3]), np.array([5.0, 6, 7, 8]))  # x ranks 0.5 0.5 2 3
    assert rho_ties == pytest.approx(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])


def test_steps_skip_when_done_and_a_failed_step_stops_the_study(tmp_path: Path) -> None:
    args = study.Args(out=str(tmp_path / "study"))
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


def test_the_claim_table_of_a_study_still_running(tmp_path: Path) -> None:
    """Only the rows whose methods are evaluated; verdicts by the rule: ES ahead of base on 20 of 30 problems and
    never behind is reproduced, GRPO behind ES at pass@4 everywhere makes ES-vs-GRPO reproduced."""
    base = [0] * 30
    for label, counts in (("base", base), ("es@0", [2] * 20 + [0] * 10), ("es@1", [1] * 20 + [0] * 10),
                          ("grpo@0", base)):
        write_eval(tmp_path / "eval", label, counts, [0] * 30)
    main = study.merged(tmp_path, "eval")
    (tmp_path / "runs" / "grpo-s0").mkdir(parents=True)
    (tmp_path / "runs" / "grpo-s0" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "grpo/entropy": e}) + "\n" for s, e in ((1, 0.9), (2, 0.5))))
    lines = study.claims(tmp_path, main, None, None, None)
    table = {line.split(" | ")[0][2:]: line for line in lines[2:]}
    assert set(table) == {"(a) ES raises pass@1", "(a) ES reaches a higher pass@4 than GRPO",
                          "(a) GRPO's token entropy falls (first → last update, nats)"}
    assert table["(a) ES raises pass@1"].endswith("2/2 seeds up | reproduced |")
    assert "+25.0 [" in table["(a) ES raises pass@1"]  # mean over problems of (2/4 + 1/4)/2 on 20 of 30: 25 points
    assert table["(a) ES reaches a higher pass@4 than GRPO"].endswith("| reproduced |")
    entropy = table["(a) GRPO's token entropy falls (first → last update, nats)"]
    assert "0.900 → 0.500; 1/1 seeds down | reproduced |" in entropy
    (tmp_path / "eval" / "grpo@0" / "passk.json").unlink()  # GRPO not evaluated yet: no row compares with it
    lines = study.claims(tmp_path, study.merged(tmp_path, "eval"), None, None, None)
    assert [line.split(" | ")[0][2:] for line in lines[2:]] == ["(a) ES raises pass@1"]


def test_the_plan_matches_budgets_and_the_population_study_keeps_64_completions(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    """Every step of a study with the default flags (run_step recorded, nothing run): each method at each seed, ES at
    N members × 64/N prompts, GRPO at 8 × 8; bad population flags stop it before anything runs."""
    steps: dict[str, list[str]] = {}
    monkeypatch.setattr(study, "run_step", lambda args, name, done, argv, partial=None: steps.setdefault(name, argv))
    args = study.Args(out=str(tmp_path))
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
