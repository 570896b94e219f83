"""bench/regime.py: the rules written before the study's numbers (the search's choice, the pilot's horizon T, the four
endpoints with Holm, the coverage table) against hand-computed values, and the report rebuilt from lane files written
by hand (the study's lanes take hours; here they are files)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import regime  # noqa: E402
import stats  # noqa: E402
from eval_passk import k_grid  # noqa: E402


def evaluation(counts: list[int], n: int, greedy: list[int] | None = None) -> dict:
    return {"label": "x", "n": n, "ks": k_grid(n), "greedy_correct": greedy or [0] * len(counts),
            "correct_counts": counts, "response_tokens": 20.0}


def curve(values: dict[int, float]) -> list[list[float]]:
    return [[u, v] for u, v in sorted(values.items())]


def pilot(reward: dict[int, float], entropy: dict[int, float]) -> dict:
    return {"pilot-grpo": {"curves": {"train/reward_mean": curve(reward), "grpo/entropy": curve(entropy)}}}


def test_the_horizon_is_the_first_plateau_with_a_collapsed_entropy() -> None:
    """reward min(u, 20)/20: at T = 32 the 8 updates 25..32 average 1.0 and 17..24 average 154/160 = 0.9625, within
    0.05; at T = 16 they average 100/160 and 36/160, not. Entropy 1 until update 24, then 0.2 < 1/2 over 25..32."""
    reward = {u: min(u, 20) / 20 for u in range(1, 65)}
    assert regime.horizon(pilot(reward, {u: 1.0 if u <= 24 else 0.2 for u in range(1, 65)})) == 32
    assert regime.horizon(pilot(reward, {u: 1.0 if u <= 40 else 0.2 for u in range(1, 65)})) == 48
    assert regime.horizon(pilot(reward, {u: 1.0 if u <= 8 else 0.2 for u in range(1, 65)})) == 32  # reward: not at 16
    assert regime.horizon(pilot(reward, {u: 0.6 for u in range(1, 65)})) == 64  # never below half: the cap
    flat = {u: 0.5 + 0.06 * (u > 8) for u in range(1, 65)}  # 0.06 apart at T = 16: no plateau there
    assert regime.horizon(pilot(flat, {u: 1.0 if u <= 8 else 0.1 for u in range(1, 65)})) == 32
    with pytest.raises(SystemExit, match="pilot"):
        regime.horizon({})


def test_the_search_takes_the_best_validation_accuracy_and_the_first_of_ties() -> None:
    def lanes(es: list[float], grpo: list[float]) -> dict:
        return {f"hp-{m}-{i}": {"curves": {"eval/accuracy": [[0, 0.1], [16, v]]}}
                for m, values in (("es", es), ("grpo", grpo)) for i, v in enumerate(values)}

    assert regime.chosen(lanes([0.2, 0.4, 0.3], [0.5, 0.5, 0.1])) == (regime.ES_GRID[1], (regime.GRPO_LRS[0],))
    assert regime.chosen(lanes([0.2, 0.1, 0.3], [0.1, 0.5, 0.6])) == (regime.ES_GRID[2], (regime.GRPO_LRS[2],))
    incomplete = lanes([0.2, 0.4, 0.3], [0.5, 0.5, 0.1])
    del incomplete["hp-grpo-2"]
    with pytest.raises(SystemExit, match="search is not complete"):
        regime.chosen(incomplete)


def final_report(es_solved: list[int], grpo_solved: list[int], base_solved: int, problems: int = 40) -> dict:
    """Seed s of ES solves (c > 0 of n = 128) the first es_solved[s] problems, GRPO the first grpo_solved[s], the base
    the first base_solved; pass@1 = c/128 with c = 64 on a solved problem."""
    def ev(solved: int) -> dict:
        return {"arith": evaluation([64 if x < solved else 0 for x in range(problems)], 128)}

    results = {"base": ev(base_solved)} | {f"es@{s}": ev(v) for s, v in enumerate(es_solved)} | {
        f"grpo@{s}": ev(v) for s, v in enumerate(grpo_solved)}
    return {"task": "arith", "n": 128, "ks": k_grid(128), "results": results}


def test_endpoints_are_two_sided_seed_level_t_tests_under_holm() -> None:
    es, grpo = [30, 31, 29, 30, 32], [20, 22, 19, 21, 20]
    rows = regime.endpoints(final_report(es, grpo, 25))
    assert [r["name"][:2] for r in rows] == ["E1", "E2", "E3", "E4"]
    effects = {"E1": np.array(grpo) / 40 - 25 / 40, "E2": np.array(es) / 40 - 25 / 40,
               "E3": (np.array(es) - grpo) / 40, "E4": (np.array(es) - grpo) / 80}  # pass@1: half of each solved
    p = {}
    for name, d in effects.items():
        t = d.mean() / (d.std(ddof=1) / math.sqrt(5))
        p[name] = 2 * (1 - stats.t_cdf(abs(t), 4))  # two-sided, by hand
    order = sorted(p, key=p.get)
    holm = {name: min(1.0, max((4 - j) * p[order[j]] for j in range(i + 1))) for i, name in enumerate(order)}
    for r in rows:
        name = r["name"][:2]
        assert r["mean"] == pytest.approx(effects[name].mean())
        assert r["p2"] == pytest.approx(p[name], rel=1e-6, abs=1e-9)
        assert r["holm"] == pytest.approx(holm[name], rel=1e-6, abs=1e-9)
        assert r["verdict"] == ("below" if name == "E1" else "above")
    noisy = regime.endpoints(final_report([26, 24, 27, 23, 25], grpo, 25))  # ES − base: mean 0, sd 1.58 problems
    e2 = next(r for r in noisy if r["name"].startswith("E2"))
    level = dict(zip([r["name"] for r in noisy], stats.holm([r["p2"] for r in noisy])[1]))[e2["name"]]
    assert e2["verdict"].startswith("undecided (MDE") and e2["mde"] == pytest.approx(
        stats.mde(e2["sd"], 5, level / 2))
    assert e2["needed"] is None and e2["verdict"].endswith("would need over 100 000 seeds)")  # mean 0: no number
    small = regime.endpoints(final_report([24, 26, 22, 27, 24], grpo, 25))  # ES − base: mean −0.4 problems, sd 1.95
    e2 = next(r for r in small if r["name"].startswith("E2"))
    level = dict(zip([r["name"] for r in small], stats.holm([r["p2"] for r in small])[1]))[e2["name"]]
    needed = next(u for u in range(2, 10_000) if stats.mde(e2["sd"], u, level / 2) <= 0.4 / 40)  # brute force, |mean|
    assert e2["needed"] == needed and e2["verdict"].endswith(f"the mean seen would need {needed} seeds)")


def test_coverage_counts_each_seeds_problems_by_brute_force() -> None:
    report = final_report([30, 10], [20, 35], 25)
    lines = regime.coverage(report)
    # seed 0: ES solves 0..29, GRPO 0..19, base 0..24 → both 20, ES only 10, GRPO only 0, neither 10;
    # ES gains 25..29 (5), loses none; GRPO gains none, loses 20..24 (5). Seed 1: ES 0..9, GRPO 0..34.
    assert lines[2] == "| 0 | 20 | 10 | 0 | 10 | 5 / 0 | 0 / 5 |"
    assert lines[3] == "| 1 | 10 | 0 | 25 | 5 | 0 / 15 | 10 / 0 |"
    assert lines[-1].startswith("| base | 25 solved of 40")


def lane_files(folder: Path) -> None:
    """Every kind of lane, written by hand: a screen, the base, the search, the pilot, two seeds of each method."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write = lambda lane, d: (folder / f"{lane}.json").write_text(json.dumps({"lane": lane, "seconds": 600} | d))  # noqa

    def ev(n: int, p: float) -> dict:
        return evaluation([int(c) for c in rng.binomial(n, p, 30)], n, [int(g) for g in rng.random(30) < p])

    write(f"screen-{regime.TASK}", {"evals": {"base": ev(32, 0.05)}})
    write("base", {"evals": {"base": ev(128, 0.05)}, "entropy": {"base": 1.2}})
    for m, grid in (("es", regime.ES_GRID), ("grpo", regime.GRPO_LRS)):
        for i, setting in enumerate(grid):
            write(f"hp-{m}-{i}", {"setting": setting, "curves": {"eval/accuracy": [[0, 0.05], [16, 0.1 + i / 20]]}})
    reward = curve({u: min(u, 20) / 20 for u in range(1, 65)})
    write("pilot-es", {"setting": [5e-3, 5e-3], "curves": {"train/reward_mean": reward},
                       "entropy": {str(t): 1.1 for t in (16, 32, 48, 64)}})
    write("pilot-grpo", {"setting": [5e-5], "curves": {"train/reward_mean": reward, "grpo/entropy": curve(
        {u: 1.0 if u <= 24 else 0.2 for u in range(1, 65)})}, "entropy": {str(t): 0.5 for t in (16, 32, 48, 64)}})
    for seed in (0, 1):
        for m, p in (("es", 0.08), ("grpo", 0.3)):
            perf = {"perf/rollout_s": [[1, 2.0], [2, 4.0]], "perf/tokens_per_s": [[1, 100.0], [2, 50.0 * (1 + seed)]],
                    "perf/iteration_s" if m == "es" else "perf/step_s": [[1, 10.0], [2, 20.0 + seed]]}
            write(f"{m}-s{seed}", {"updates": 32, "setting": [1], "curves": {"train/reward_mean": reward[:32]} | perf,
                                   "evals": {"16": ev(32, p), "32": ev(128, p)}, "entropy": {"16": 1.0, "32": 0.9 if m == "es" else 0.1}})


def test_the_report_is_rebuilt_from_the_lane_files_alone(tmp_path: Path) -> None:
    lane_files(tmp_path / "data")
    for lane, setting, rollout in (("diversity-0", [1.25e-3, 5e-3, 4], 1.0), ("diversity-6", [5e-3, 5e-3, 8], 100.0)):
        (tmp_path / "data" / f"{lane}.json").write_text(json.dumps({"lane": lane, "seconds": 0, "setting": setting,
            "curves": {"es/js_succ_bits": [[1, 0.5]], "perf/rollout_s": [[1, rollout]], "perf/tokens_per_s": [
                [1, 100.0]], "perf/iteration_s": [[1, 5 * rollout]]}, "evals": {"16": evaluation([1, 0], 32)}}))
    (tmp_path / "data" / "parity.json").write_text(json.dumps({"lane": "parity", "seconds": 0, "curves": {
        "es": {"perf/rollout_s": [[1, 3.0]], "perf/tokens_per_s": [[1, 100.0]], "perf/iteration_s": [[1, 30.0]]},
        "grpo": {"perf/rollout_s": [[1, 2.0]], "perf/tokens_per_s": [[1, 50.0]], "perf/step_s": [[1, 40.0]]}}}))
    args = regime.Args(report=True, data=str(tmp_path / "data"), docs=str(tmp_path / "docs"))
    regime.main(args)
    text = (tmp_path / "docs" / "results.md").read_text()
    for part in ("## Task screen", "## Hyperparameter search", "T (the pilot's rule): 32 updates.", "## Endpoints",
                 "E3 ES − GRPO at pass@128", "## Coverage at k = 128", "## pass@k at T/2 (n = 32)",
                 "## Token entropy", "| total | 140 |",
                 # seed 1 and diversity-0 (seed 0's run and diversity-6's, the chosen σ at N = 8, are the pilot's):
                 # ES tokens 2·100, 4·100, 1·100 → 233.3, seconds 10, 21, 5 → 12.0; GRPO 300 and 15.5
                 "| ES | 3 | 64 | 233 | N members", "| 12.0 |", "| GRPO | 2 | 64 | 300 | 64 samples", "| 15.5 |",
                 "## Diversity: ES runs with σ and N varied", "## Budget per update measured alone (lane parity: 8",
                 "| ES | 1 | 64 | 300 | N members × 64/N prompts, generation only; no backward | 30.0 |",
                 "| GRPO | 1 | 64 | 100 | 64 samples generated; 1 forward + backward over them (4 micro-batches of 16) | "
                 "40.0 |",
                 "Lanes still to run: screen-chains20, es-s2, grpo-s2, heldout-s2, sparsity-s2, es-s3, grpo-s3, "
                 "heldout-s3, sparsity-s3, es-s4, grpo-s4, heldout-s4, sparsity-s4, weights, heldout-base, "
                 "diversity-1, diversity-2, diversity-3, diversity-4, diversity-5, diversity-7, diversity-8, "
                 "diversity-9, diversity-10, diversity-11."):
        assert part in text, part
    assert (tmp_path / "docs" / "passk.png").stat().st_size > 10_000
    first = {f.name: f.read_bytes() for f in (tmp_path / "docs").iterdir()}
    regime.main(args)
    assert {f.name: f.read_bytes() for f in (tmp_path / "docs").iterdir()} == first  # a rebuild: the same bytes


def test_an_unknown_lane_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown \\['es-s9'\\]"):
        regime.main(regime.Args(out=str(tmp_path / "run"), lanes=("base", "es-s9"), data=str(tmp_path / "d")))
    assert not (tmp_path / "run").exists()


def test_token_entropy_equals_each_samples_own_forward(tmp_path: Path, tiny_model: str) -> None:
    """The batched, left-padded measure against one unpadded forward per sample: H = −Σ p log p at every completion
    position, averaged over all completion tokens."""
    import torch

    from common import HFPolicy, load_task, render_prompt

    (tmp_path / "run" / "data" / "val").mkdir(parents=True)
    (tmp_path / "run" / "data" / "val" / "test.jsonl").write_text("".join(
        json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in ("What is 1 + 2 - 3?", "What is 12 - 3 + 4?",
                                                                       "What is 7 + 1 + 20?")))
    got = regime.token_entropy(regime.Args(out=str(tmp_path / "run")), "tiny", tiny_model, prompts_used=3)
    policy = HFPolicy(tiny_model, batch_size=128)
    prompts = [render_prompt("arith", p, policy.tokenizer, True)
               for p in load_task("arith", "test", str(tmp_path / "run" / "data" / "val"))]
    samples = policy.generate(prompts, n=4, max_new_tokens=regime.TOKENS, temperature=1.0, seed=0)
    total, count = 0.0, 0
    for x in samples:
        prompt = policy.encode([prompts[x.prompt_index]])[0]
        with torch.no_grad():
            logits = policy.model(torch.tensor([prompt + x.token_ids])).logits[0, len(prompt) - 1:-1].double()
        p = logits.softmax(-1)
        total += float(-(p * p.log()).sum())
        count += len(x.token_ids)
    assert count > 12 and got == pytest.approx(total / count, rel=1e-4)


def test_every_lane_command_parses_and_matches_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lanes' subprocess commands, parsed by their scripts' own parsers and range checks (a lane that fails on a
    flag fails an hour into a run otherwise); every update 64 completions (ES 8 × 8, GRPO 8 × 8), n = 128 at the end."""
    import importlib.util

    import harness
    import tyro

    captured: dict[str, list[str]] = {}
    monkeypatch.setattr(regime, "run_step", lambda args, name, done, argv, partial=None: captured.update({name: argv}))
    args = regime.Args(out=str(tmp_path / "run"))
    regime.train(args, "es", "hp-es-0", 16, tmp_path / "val", regime.ES_GRID[0])
    regime.train(args, "grpo", "grpo-s3", 32, tmp_path / "val", (regime.GRPO_LRS[0],), seed=3)
    regime.train(args, "es", "diversity-8", 32, tmp_path / "val", regime.DIVERSITY[8][:1] + (2.5e-3,), pop=16)
    regime.evaluate(args, "base", args.model, tmp_path / "data", 128)
    regime.make_data(args, "chains20")
    parsed = {}
    for name, argv in captured.items():
        script = argv[0]
        spec = importlib.util.spec_from_file_location(Path(script).stem + "_lane", ROOT / script)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setattr(sys, "argv", argv)
        parsed[name] = harness.cli(module.Args) if script != "bench/task_data.py" else tyro.cli(module.Args,
                                                                                                args=argv[1:])
        if hasattr(module, "check_args"):
            module.check_args(parsed[name])
    es, grpo, base = parsed["hp-es-0"], parsed["grpo-s3"], parsed["eval-base"]
    wide = parsed["diversity-8"]
    assert es.pop * es.prompts_per_iter == grpo.prompts_per_step * grpo.group_size == 64
    assert (wide.pop, wide.prompts_per_iter, wide.sigma) == (16, 4, regime.DIVERSITY[8][0])
    assert (es.iterations, es.seed, grpo.steps, grpo.seed, grpo.lr) == (16, 0, 32, 3, regime.GRPO_LRS[0])
    assert (base.n, base.num_problems, base.batch_size, base.max_new_tokens) == (128, 100, 256, regime.TOKENS)
    assert (parsed["data-chains20"].kind, parsed["data-chains20"].max_number) == ("chains", 20)


def test_the_validation_split_comes_from_the_training_problems_with_twins_together(tmp_path: Path) -> None:
    import task_data

    args = regime.Args(out=str(tmp_path / "run"))
    folder = regime.make_data(args, regime.TASK)  # runs bench/task_data.py
    read = lambda f: [json.loads(line)["question"] for line in f.read_text().splitlines()]  # noqa: E731
    train, val, test = read(folder.parent / "val" / "train.jsonl"), read(folder.parent / "val" / "test.jsonl"), read(
        folder / "test.jsonl")
    assert (len(train), len(val), len(test)) == (900, regime.VALIDATION, 300)
    assert sorted(train + val) == sorted(read(folder / "train.jsonl")) and not set(val) & set(test)
    twins = task_data.split_twins  # a validation problem's reordered twin is never trained on: hold both out again
    held = {p.question for p in twins([regime.Problem(q, "0") for q in train + val], regime.VALIDATION)[1]}
    assert held == set(val)
    assert regime.make_data(args, regime.TASK) == folder and read(folder.parent / "val" / "test.jsonl") == val


def test_the_committed_report_rebuilds_from_the_committed_lanes(tmp_path: Path) -> None:
    """docs/regime/results.md (and its plot, once there are trained models) is what --report makes of
    docs/regime/data/ alone: a fresh clone rebuilds it, byte for byte."""
    regime.main(regime.Args(report=True, data=str(ROOT / "docs" / "regime" / "data"), docs=str(tmp_path)))
    for made in tmp_path.iterdir():
        assert made.read_bytes() == (ROOT / "docs" / "regime" / made.name).read_bytes(), made.name


def searched_and_piloted(folder: Path) -> dict:
    """The search (ES: ES_GRID[2], α = 2.5e-3) and the pilot (T = 32) as lane files, loaded as the lanes see them."""
    lane_files(folder)
    return regime.loaded(regime.Args(data=str(folder)))


def test_the_weight_space_lane_asks_for_the_members_of_seed_0s_first_update(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Its wiring (the batched members' logits are es_lowrank's, tested there): es.py's member seeds of update 0,
    σ, greedy, ≤ TOKENS tokens, the first PROBLEMS test problems with the chat template; a string per member."""
    import common
    import es
    import es_lowrank

    seen, calls = {}, []
    verdicts = dict(zip(es.member_seeds(0, 0, 4, False)[0], ([1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0])))

    def population(engine, master, prompts, reward_fn, seeds, signs, sigma, max_new_tokens, temperature, sample_seeds):
        calls.append((list(seeds), signs.tolist(), list(sample_seeds)))
        seen.update(prompts=prompts, sigma=sigma, tokens=max_new_tokens, temperature=temperature,
                    verdict=reward_fn(1, "so \\boxed{2}"))
        return None, np.array([verdicts[s] for s in seeds]), {}

    class Policy:
        def __init__(self, model: str, batch_size: int) -> None:
            self.tokenizer, self.params, self.batch_size = None, {}, batch_size

    monkeypatch.setattr(es_lowrank, "evaluate_population", population)
    monkeypatch.setattr(regime, "HFPolicy", Policy)
    monkeypatch.setattr(regime, "render_prompt", lambda task, p, tokenizer, chat: f"{chat}: {p.question}")
    monkeypatch.setattr(common, "Master", lambda params: None)
    monkeypatch.setattr(regime, "MEMBERS", 4)
    monkeypatch.setattr(regime, "PROBLEMS", 3)
    monkeypatch.setattr(regime, "BATCH", 7)  # two members (six rows) a call, as evaluate_population would group them
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": f"#### {a + 1}"})
                                                 + "\n" for a in range(5)))
    got = regime.weight_space(regime.Args(model="m"), tmp_path, 5e-3)
    assert got == ["101", "001", "111", "000"]
    member_seeds = es.member_seeds(0, 0, 4, False)[0]
    assert calls == [(member_seeds[:2], [1.0] * 2, [0] * 2), (member_seeds[2:], [1.0] * 2, [0] * 2)]
    assert (seen["sigma"], seen["tokens"], seen["temperature"]) == (5e-3, regime.TOKENS, 0.0)
    assert seen["prompts"] == [f"True: What is {a} + 1?" for a in range(3)] and seen["verdict"] == (1.0, True)


def test_the_reset_models_reset_the_small_changes_and_as_many_at_random(tmp_path: Path, tiny_model: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """τ* = z·α·√(T'/N) with P(|Z| ≤ z) = 0.78 (z by bisection on erf), T' = 32 − 1 skipped; θ_T = θ₀ + N(0, s²)
    noise, so about 78 % of the coordinates are reset; the control resets exactly as many, elsewhere. θ_T is lane
    es-s0's final model, asked of train() (which retrains it only where this machine lacks it)."""
    import torch

    from common import HFPolicy, load_weights

    data = searched_and_piloted(tmp_path / "data")
    (_, alpha), T = regime.chosen(data)[0], regime.horizon(data)
    run = tmp_path / "run" / "runs" / "es-s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": u, "es/skipped": int(u in (5, T + 3))}) + "\n"
                                               for u in range(1, 2 * T + 1)))  # seed 0's run goes on past T
    s = alpha * math.sqrt((T - 1) / 8)
    lo, hi = 0.0, 5.0
    for _ in range(100):
        lo, hi = ((lo + hi) / 2, hi) if math.erf((lo + hi) / 2 / math.sqrt(2)) < 0.78 else (lo, (lo + hi) / 2)
    policy = HFPolicy(tiny_model, device="cpu")
    generator = torch.Generator().manual_seed(0)
    for p in policy.params.values():
        p.add_(torch.randn(p.shape, generator=generator) * s)
    policy.save(run / "checkpoints" / f"step_{T:06d}")
    asked = []
    monkeypatch.setattr(regime, "train", lambda args, method, label, updates, folder, setting, seed=0, pop=8: (
        asked.append((method, label, updates, setting, seed, pop)) or run))
    info, folders = regime.reset_models(regime.Args(out=str(tmp_path / "run"), model=tiny_model), data, 0)
    assert asked == [("es", "es-s0", T, regime.chosen(data)[0], 0, 8)]
    assert info["tau"] == pytest.approx(lo * s, rel=1e-6) and info["skipped"] == 1
    theta0, theta = load_weights(tiny_model), load_weights(run / "checkpoints" / f"step_{T:06d}")
    small = {k: (t - theta0[k]).abs() <= lo * s for k, t in theta.items()}
    total = sum(m.numel() for m in small.values())
    count = sum(int(m.sum()) for m in small.values())
    assert info["reset_share"] == count / total and abs(count / total - 0.78) < 0.02
    tau, random = load_weights(folders["tau"]), load_weights(folders["random"])
    assert all(torch.equal(tau[k], torch.where(small[k], theta0[k], theta[k])) for k in theta)
    reset = {k: (random[k] == theta0[k]) & (theta[k] != theta0[k]) for k in theta}  # reset, and it was moved
    kept = {k: random[k] == theta[k] for k in theta}
    assert all(bool((reset[k] | kept[k]).all()) for k in theta)
    assert sum(int(m.sum()) for m in reset.values()) == count - sum(int((theta[k] == theta0[k]).sum()) for k in theta)
    overlap = sum(int((reset[k] & small[k]).sum()) for k in theta) / count
    assert abs(overlap - 0.78) < 0.03  # drawn at random: as often on a small change as the small changes are common


def test_boxed_scores_count_boxed_samples_and_the_correct_ones_among_them(tmp_path: Path) -> None:
    rows = [{"samples": [{"reward": 1.0, "correct": True}, {"reward": 0.1, "correct": False},
                         {"reward": 0.0, "correct": True}]},  # right but not boxed: not counted
            {"samples": [{"reward": 0.0, "correct": False}] * 3}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert regime.boxed_scores(tmp_path) == {"boxed": [2, 0], "correct": [1, 0]}


def test_the_sub_study_sections_by_hand() -> None:
    """Weight space: problem 0 solved by 64 of 128 members, 1 by none, 2 by one, 3 by all, 4 by none; the base's
    samples solve 5 of 128 on problem 1 and all on 3. Held out: ES − GRPO among boxed answers 25, 0, 12.5 points over 3 seeds:
    mean 12.5, sd 12.5, t = √3 (df 2: F(t) = ½ + t/(2√(2 + t²)), two-sided p 0.225), t_0.975 = 4.303, MDE at 80 %
    power (4.303 + 1.061)·12.5/√3 = 38.7."""
    members = [f"{int(n < 64)}0{int(n == 0)}10" for n in range(128)]
    data = {"base": {"evals": {"base": evaluation([0, 5, 0, 128, 0], 128)}},
            "weights": {"sigma": 5e-3, "correct": members}}
    lines = regime.weights_section(data)
    assert lines[4].startswith("| token space: 128 samples at temperature 0.6 | 20.8 |")  # (5 + 128)/640
    assert lines[5].startswith("| weight space: greedy θ₀ + σ·ε_n, 128 members, σ = 0.005 | 30.2 |")  # 193/640
    assert lines[4].endswith("| 40.0 |") and lines[5].endswith("| 60.0 |")
    assert lines[7] == ("At k = 128: reached by both 1, by weight space only 2, by token space only 1, by neither 1.")
    boxed = lambda b, c: {"boxed": b, "correct": c}  # noqa: E731
    data = {"heldout-base": {"evals": {"base": boxed([8, 0], [4, 0])}}}
    for seed, (es, grpo) in enumerate(((12, 8), (8, 8), (10, 8))):  # of 16 boxed: 75 / 50, 50 / 50, 62.5 / 50 %
        data[f"heldout-s{seed}"] = {"evals": {f"es@{seed}": boxed([8, 8], [es - 4, 4]),
                                              f"grpo@{seed}": boxed([8, 8], [grpo - 4, 4])}}
    lines = regime.heldout_section(data)
    assert "| base | 50.0 % | 50.0 % |" in lines and "| es@0 | 100.0 % | 75.0 % |" in lines
    assert lines[-2] == ("ES − GRPO (same seed), correct among boxed: +12.5 [-18.6, +43.6] pt, seed-level t over 3 "
                         "seeds, two-sided p 0.225: undecided (MDE 38.7 pt at 80 % power).")


def test_the_sparsity_section_by_hand() -> None:
    """n = 32 on 4 problems: θ_τ* solves 32, 16, 0, 8 of 32 (pass@1 43.75 %, pass@32 75 %); the control 16, 16, 0, 0
    at seed 0 (25 %, 50 %), as θ_τ* at seed 1, 8, 16, 0, 8 at seed 2 (25 %): differences 18.75, 0, 18.75 points,
    mean 12.5, sd 10.83, t_0.975,2 = 4.303: [−14.4, +39.4]."""
    tau = evaluation([32, 16, 0, 8], 32)
    controls = ([16, 16, 0, 0], [32, 16, 0, 8], [8, 16, 0, 8])
    lines = regime.sparsity_section({f"sparsity-s{s}": {"tau": 6e-3, "reset_share": 0.78, "skipped": s, "evals": {
        "tau": tau, "random": evaluation(c, 32)}} for s, c in enumerate(controls)})
    assert lines[4] == "| 0 | 0.006 | 78.0 % | 0 | 43.8 | 25.0 | 75.0 | 50.0 |"
    assert lines[-2].startswith("θ_τ* − θ_random at pass@1 (same seed): +12.5 [-14.4, +39.4] pt, seed-level t over 3 "
                                "seeds, two-sided p 0.18")
    assert lines[-2].endswith("undecided (MDE 33.5 pt at 80 % power).")


def evaluated_folder(out: Path, name: str, n: int) -> Path:
    """What evaluate() leaves: a passk.json of one model, two problems (one correct sample, none)."""
    out.mkdir(parents=True)
    (out / "passk.json").write_text(json.dumps({"n": n, "ks": k_grid(n), "results": {name: {"arith": evaluation(
        [1, 0], n) | {"label": name}}}}))
    return out


def test_a_diversity_lane_trains_its_sigma_and_n_and_reuses_es_s0_for_the_chosen_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the search's ES choice (σ, α) = (2.5e-3, 2.5e-3) and T = 32: diversity-0 is σ = 1.25e-3, N = 4 (16 prompts),
    trained T/2 = 16 updates and evaluated at n = 32, written to --data with its curves up to update 16; diversity-5,
    the chosen σ at N = 8, is lane es-s0's run: its curves up to update 16 and its T/2 evaluation, nothing run."""
    lane_files(tmp_path / "data")
    trained, evaluated = [], []

    def train(args, method, label, updates, folder, setting, seed=0, pop=8):
        trained.append((label, updates, setting, pop))
        run = tmp_path / "runs" / label
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": u, "es/js_succ_bits": u / 10}) + "\n"
                                                   for u in (1, 2, 17)))
        return run

    def evaluate(args, name, model, folder, n):
        evaluated.append((name, model, n))
        return evaluated_folder(tmp_path / "eval" / name, name, n)

    monkeypatch.setattr(regime, "train", train)
    monkeypatch.setattr(regime, "evaluate", evaluate)
    monkeypatch.setattr(regime, "make_data", lambda args, name: tmp_path / "task")
    args = regime.Args(out=str(tmp_path / "run"), data=str(tmp_path / "data"))
    for lane in ("diversity-0", "diversity-5"):
        regime.run_lane(args, lane)
    assert trained == [("diversity-0", 16, (1.25e-3, 2.5e-3), 4)]
    assert [(name, n) for name, _, n in evaluated] == [("diversity-0-t16", 32)]
    assert evaluated[0][1].endswith("diversity-0/checkpoints/step_000016")
    saved = json.loads((tmp_path / "data" / "diversity-0.json").read_text())
    assert saved["setting"] == [1.25e-3, 2.5e-3, 4] and saved["curves"]["es/js_succ_bits"] == [[1, 0.1], [2, 0.2]]
    reused, es_s0 = (json.loads((tmp_path / "data" / f"{x}.json").read_text()) for x in ("diversity-5", "es-s0"))
    assert reused["setting"] == [2.5e-3, 2.5e-3, 8] and reused["evals"] == {"16": es_s0["evals"]["16"]}
    assert reused["curves"]["train/reward_mean"] == es_s0["curves"]["train/reward_mean"][:16]


def test_the_parity_lane_trains_each_method_from_the_base_at_its_chosen_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained = []

    def train(args, method, label, updates, folder, setting, seed=0, pop=8):
        trained.append((method, label, updates, setting, seed, pop))
        run = tmp_path / "runs" / label
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": u, "perf/rollout_s": u}) + "\n"
                                                   for u in range(1, 10)))
        return run

    lane_files(tmp_path / "data")
    settings = regime.chosen(regime.loaded(regime.Args(data=str(tmp_path / "data"))))
    monkeypatch.setattr(regime, "train", train)
    monkeypatch.setattr(regime, "make_data", lambda args, name: tmp_path / "task")
    regime.run_lane(regime.Args(out=str(tmp_path / "run"), data=str(tmp_path / "data")), "parity")
    assert trained == [("es", "parity-es", 8, settings[0], 0, 8), ("grpo", "parity-grpo", 8, settings[1], 0, 8)]
    saved = json.loads((tmp_path / "data" / "parity.json").read_text())["curves"]
    assert saved["es"]["perf/rollout_s"] == saved["grpo"]["perf/rollout_s"] == [[u, u] for u in range(1, 9)]


def test_a_seed_lane_trains_t_updates_and_evaluates_t_half_at_32_and_t_at_128(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lane grpo-s1 with T = 32: GRPO at the chosen learning rate, seed 1, 32 updates; θ_16 at n = 32 and θ_32 at
    n = 128, each with its token entropy; the curves saved up to update 32 although the run logged 40 (seed 0's run
    is the pilot's, 64 updates)."""
    lane_files(tmp_path / "data")
    (tmp_path / "data" / "grpo-s1.json").unlink()
    calls = []

    def train(args, method, label, updates, folder, setting, seed=0, pop=8):
        calls.append(("train", method, label, updates, setting, seed))
        run = tmp_path / "runs" / label
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": u, "train/reward_mean": u / 100}) + "\n"
                                                   for u in range(1, 41)))
        return run

    def evaluate(args, name, model, folder, n):
        calls.append(("eval", name, Path(model).name, n))
        return evaluated_folder(tmp_path / "eval" / name, name, n)

    monkeypatch.setattr(regime, "train", train)
    monkeypatch.setattr(regime, "evaluate", evaluate)
    monkeypatch.setattr(regime, "token_entropy", lambda args, label, model: calls.append(
        ("entropy", label, Path(model).name)) or len(calls) / 10)
    monkeypatch.setattr(regime, "make_data", lambda args, name: tmp_path / "task")
    regime.run_lane(regime.Args(out=str(tmp_path / "run"), data=str(tmp_path / "data")), "grpo-s1")
    (lr,) = regime.chosen(regime.loaded(regime.Args(data=str(tmp_path / "data"))))[1]
    assert calls == [("train", "grpo", "grpo-s1", 32, (lr,), 1), ("eval", "grpo@1-t16", "step_000016", 32),
                     ("entropy", "grpo@1@16", "step_000016"), ("eval", "grpo@1-t32", "step_000032", 128),
                     ("entropy", "grpo@1@32", "step_000032")]
    saved = json.loads((tmp_path / "data" / "grpo-s1.json").read_text())
    assert saved["updates"] == 32 and saved["entropy"] == {"16": 0.3, "32": 0.5}
    assert [u for u, _ in saved["curves"]["train/reward_mean"]] == list(range(1, 33))
    assert (saved["evals"]["16"]["n"], saved["evals"]["32"]["n"]) == (32, 128)


def test_the_diversity_section_by_hand() -> None:
    """Four runs: pass@32 0, 25, 50, 75 % (one correct sample of 32 on 0–3 of the 4 problems: pass@1 a 32nd of
    that), mean JS diversity ranked 0, 1, 3, 2: ρ = 1 − 6·2/(4·15) = 0.8, reached or
    passed by 4 of the 4! orderings (ρ = 1 once, 0.8 three times): exact one-sided p = 4/24 = 0.167, the smallest
    possible 1/24 = 0.042; undecided, and over four runs only ρ ≈ 1 is detectable (stats.spearman_mde(4, 0.05) =
    0.995)."""
    order = [0, 1, 3, 2]
    data = {f"diversity-{i}": {"setting": [1e-3 * (i + 1), 2.5e-3, 8], "curves": {"es/js_succ_bits": [
        [1, 0.1 * order[i]], [2, 0.1 * order[i] + 0.2]]}, "evals": {"32": evaluation([1] * i + [0] * (4 - i), 32)}}
        for i in range(4)}
    lines = regime.diversity_section(data)
    assert lines[5] == "| diversity-1 | 0.002 | 8 | 0.200 | 0.8 | 25.0 |"
    assert lines[-2] == ("Spearman ρ (mean JS diversity, pass@32) over 4 runs: +0.80, one-sided permutation p 0.167 (the "
                         "smallest these ties allow: 0.042): undecided (MDE ρ = 1.00 at 80 % power over 4 "
                         "runs).")


def test_the_sub_study_lanes_of_a_seed_read_its_final_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """heldout-s1: ES's and GRPO's θ_T of seed 1 (asked of train(), which retrains only a missing run), each on the
    products at n = HELDOUT_N, scored among boxed answers; heldout-base: the base alike; sparsity-s1: the two reset
    models of ES seed 1 at n = 32, with τ*'s facts. A seed whose lanes are not in --data is refused."""
    lane_files(tmp_path / "data")
    data = regime.loaded(regime.Args(data=str(tmp_path / "data")))
    settings, calls = dict(zip(("es", "grpo"), regime.chosen(data))), []

    def train(args, method, label, updates, folder, setting, seed=0, pop=8):
        calls.append(("train", label, updates, setting, seed, folder.name))
        return tmp_path / "run" / "runs" / label

    def evaluate(args, name, model, folder, n):
        calls.append(("eval", name, str(model), folder.name, n))
        return evaluated_folder(tmp_path / "eval" / name, name, n)

    def reset_models(args, data, seed):
        calls.append(("reset", seed))
        return {"tau": 1e-3, "reset_share": 0.78, "skipped": 2}, {x: tmp_path / x for x in ("tau", "random")}

    monkeypatch.setattr(regime, "train", train)
    monkeypatch.setattr(regime, "evaluate", evaluate)
    monkeypatch.setattr(regime, "reset_models", reset_models)
    scores = {"heldout-es@1": 5, "heldout-grpo@1": 3, "heldout-base": 1}  # correct of 8 boxed, by evaluation
    monkeypatch.setattr(regime, "boxed_scores", lambda folder: {"boxed": [8], "correct": [scores[folder.name]]})
    monkeypatch.setattr(regime, "products", lambda args: tmp_path / "products")
    monkeypatch.setattr(regime, "make_data", lambda args, name: tmp_path / "task")
    args = regime.Args(out=str(tmp_path / "run"), data=str(tmp_path / "data"), model="base-model")
    for lane in ("heldout-s1", "heldout-base", "sparsity-s1"):
        regime.run_lane(args, lane)
    final = lambda label: str(tmp_path / "run" / "runs" / label / "checkpoints" / "step_000032")  # noqa: E731
    assert calls == [("train", "es-s1", 32, settings["es"], 1, "val"),
                     ("train", "grpo-s1", 32, settings["grpo"], 1, "val"),
                     ("eval", "heldout-es@1", final("es-s1"), "products", regime.HELDOUT_N),
                     ("eval", "heldout-grpo@1", final("grpo-s1"), "products", regime.HELDOUT_N),
                     ("eval", "heldout-base", "base-model", "products", regime.HELDOUT_N), ("reset", 1),
                     ("eval", "sparsity-es1-tau", str(tmp_path / "tau"), "task", 32),
                     ("eval", "sparsity-es1-random", str(tmp_path / "random"), "task", 32)]
    saved = regime.loaded(regime.Args(data=str(tmp_path / "data")))
    assert saved["heldout-s1"]["evals"] == {"es@1": {"boxed": [8], "correct": [5]},
                                            "grpo@1": {"boxed": [8], "correct": [3]}}
    assert saved["heldout-base"]["evals"] == {"base": {"boxed": [8], "correct": [1]}}
    sparsity = saved["sparsity-s1"]
    assert (sparsity["tau"], sparsity["reset_share"], sparsity["skipped"]) == (1e-3, 0.78, 2)
    assert sparsity["evals"]["tau"]["n"] == sparsity["evals"]["random"]["n"] == 32
    assert "## Sparsity" in "\n".join(regime.sparsity_section(saved))  # the section reads the lane as written
    assert {"| base | 100.0 % | 12.5 % |", "| es@1 | 100.0 % | 62.5 % |", "| grpo@1 | 100.0 % | 37.5 % |"} <= set(
        regime.heldout_section(saved))
    (tmp_path / "data" / "grpo-s1.json").unlink()
    with pytest.raises(SystemExit, match="run lane grpo-s1 first"):
        regime.run_lane(args, "heldout-s1")


def test_the_claims_table_states_each_endpoint_and_sub_study_by_brute_force(tmp_path: Path) -> None:
    """The README's table from lane files: E1 per seed is GRPO's share of problems with any correct sample minus the
    base's (pass@128 from n = 128: 1[any correct]), counted here by hand; the held-out row is the section's test
    (by hand above: +12.5 [-18.6, +43.6], p 0.225; with one seed, its effect alone); rows whose lanes have not run say
    so."""
    lane_files(tmp_path / "data")
    data = regime.loaded(regime.Args(data=str(tmp_path / "data")))
    solved = lambda lane, key: np.mean(np.array(data[lane]["evals"][key]["correct_counts"]) > 0)  # noqa: E731
    e1 = [100 * (solved(f"grpo-s{s}", "32") - solved("base", "base")) for s in (0, 1)]
    lines = regime.claims(data, regime.endpoints(regime.report_of(data)))
    assert lines[2].startswith("| Does GRPO's coverage at large k fall below the base's? (E1: GRPO − base at "
                               f"pass@128) | {e1[0]:+.1f} / {e1[1]:+.1f} | {np.mean(e1):+.1f} [")
    assert all(line.endswith("| not run yet | | | |") for line in lines[6:8])
    assert lines[8].endswith("| 0 of 12 runs | | | |") and lines[10].endswith("| not run yet | | | |")
    assert lines[9] == ("| Token entropy at update T (nats; descriptive) | GRPO 0.10 / 0.10; ES 0.90 / 0.90 | base 1.20 "
                        "| | |")
    boxed = lambda b, c: {"boxed": b, "correct": c}  # noqa: E731
    one = data | {"heldout-s0": {"evals": {"es@0": boxed([8, 8], [8, 4]), "grpo@0": boxed([8, 8], [4, 4])}}}
    assert regime.claims(one, [])[6].endswith("| +25.0 | 1 of 3 seeds | | |")  # one seed: its effect, no test yet
    data |= {"heldout-base": {"evals": {"base": boxed([8, 0], [4, 0])}}} | {
        f"heldout-s{seed}": {"evals": {f"es@{seed}": boxed([8, 8], [es - 4, 4]), f"grpo@{seed}": boxed([8, 8], [4, 4])}}
        for seed, es in enumerate((12, 8, 10))}
    assert regime.claims(data, [])[6].endswith(
        "| +25.0 / +0.0 / +12.5 | +12.5 [-18.6, +43.6] | 0.225 | undecided (MDE 38.7 pt at 80 % power) |")


def test_the_readme_states_the_committed_claims() -> None:
    """README's regime table is the committed report's claims table, line for line (rebuild, then copy it)."""
    report = (ROOT / "docs" / "regime" / "results.md").read_text().splitlines()
    table = report[report.index("## Claims (the README's table)") + 2:]
    table = table[:table.index("")]
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index(table[0]) if table[0] in readme else -1
    assert start >= 0 and readme[start:start + len(table)] == table, "README's regime table differs from the report"
