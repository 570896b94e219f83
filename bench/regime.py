"""bench/regime.py — [ES-LLM]'s title claim where it can show: a multi-step task, long training, pass@k up to k = 128.

    python bench/regime.py --out runs/regime                 # every lane not in --data yet, each exported as it ends
    python bench/regime.py --out runs/regime --lanes base    # only these lanes (in this order)
    python bench/regime.py --report                          # docs/regime/results.md from --data alone

The claim: after long training GRPO's pass@k at large k falls (its token entropy collapses) where ES's does not, so ES
keeps the broader coverage. The findings study (bench/study.py) could not test it: 8 updates, k ≤ 16 at n = 16,
one-step sums. This study is built where the claim is expected to show, and is run in lanes of about an hour each; a
lane writes one compact JSON file into --data as it ends (commit it), and a lane whose file exists is skipped, so the
study goes on over several runs on different machines. --report rebuilds every table and plot from --data alone.

Design (written and committed before any trained model was evaluated):
  task        "What is a + b - c?": 3 numbers ≤ 10, + and −, value ≥ 0 (`task_data.py --kind chains`, seed 1, 1000
              train / 300 test, twins kept on one side), scored by the `arith` rules, chat template, ≤ 32 new tokens.
              Chosen from the screened candidates (lanes screen-*: the base at n = 32 on 100 test problems, the table
              in the report) as the one with base pass@1 in 5–30 % and pass@32 ≥ 60 % (pass@128 ≥ pass@32): numbers
              ≤ 10 (pass@1 7.1 %, pass@32 60 %); numbers ≤ 20 had pass@1 3.8 %, pass@32 45 %.
  splits      the 1000 training problems: 900 train every run, 100 (twins kept together) are the validation split of
              the hyperparameter search. Evaluations: the first 100 test problems.
  budget      every update is 64 sampled completions, as in the findings study: ES N = 8 members × 8 prompts (greedy),
              GRPO 8 prompts × G = 8 samples (β = 0, ε = 0.2).
  search      ≤ 3 settings each, HP_UPDATES updates of seed 0 on the 900, scored by the greedy accuracy on the 100
              validation problems after the last update (ties: the earlier setting in the grid): ES (σ, α) in ES_GRID,
              GRPO's learning rate in GRPO_LRS. Never the test problems.
  pilot       seed 0 of each method for PILOT_UPDATES updates at the chosen settings, a checkpoint every 16. T, the
              updates of every seed, is the first of 16, 32, 48, 64 where GRPO's mean training reward over the 8
              updates before T is within 0.05 of the 8 before those (a plateau) and its token entropy (mean of those
              8 updates) is below half its first update's (a collapse); none: 64.
  lanes       seed s (SEEDS, ≥ 5) of ES and of GRPO, the same prompts in the same order for both: train T updates
              (seed 0: the pilot's checkpoint at T), then evaluate θ_{T/2} at n = 32 and θ_T at n = 128 (eval_passk,
              temperature 0.6, seed 0 and batch 256 for every model: common random numbers). The base at n = 128
              (lane base; its n = 32 row is the chosen candidate's screen) and n = 32.
  entropy     the token entropy of ES's and GRPO's checkpoints and the base measured one way for all: the mean
              entropy of the next-token distribution along 4 samples (temperature 1) of 32 validation prompts.
  endpoints   four, two-sided, Holm over the four at family-wise α = 0.05, each the seed-level t test (df = S − 1) of
              the seeds' mean same-problem differences on the 100 test problems, ES and GRPO paired seed by seed:
                E1 GRPO − base at pass@128    E2 ES − base at pass@128
                E3 ES − GRPO at pass@128      E4 ES − GRPO at pass@1
              A rejected endpoint reads "above" or "below" by its sign; the others "undecided" with their minimum
              detectable effect at 80 % power at their Holm level. pass@128 from n = 128 samples is 1[any correct]:
              the estimator's 0/1 case; the report says for which k it has n ≥ 4k (k ≤ 32).
  seeds       SEEDS stays at five (decided on 7 December 2026, after the five pairs were in and evaluated;
              the design said "≥ 5, more if the first pairs show the effect within reach", with no number): each
              undecided endpoint's verdict says how many seeds its MDE would need to reach the mean seen; at five
              pairs E1–E3 need 10–11, five or six more pairs at 2.2–2.6 hours each, past the study's budget.
  coverage    at k = 128, seed by seed: test problems solved by both / ES only / GRPO only / neither, and what each
              method gained and lost against the base's solved set.
  parity      per method and update: completions, generated tokens, passes, wall seconds (from the scripts' perf/ log),
              over every training lane (the load beside them varied), and from lane parity: PARITY_UPDATES updates of
              each method from θ₀ at the chosen settings, run with nothing else on the machine.

Sub-studies, their rules fixed here before any of their numbers. Lanes heldout-sS and sparsity-sS read seed S's final
models, so each runs right after that seed's lanes, on the machine that holds them (about 6 and 20 minutes); where
they are gone it retrains them from the seed (a deterministic run, at the seed lanes' cost). SUB_SEEDS are 2–4: the
checkpoints of seeds 0–1 went with an earlier machine, and retraining them would cost about two hours (changed on
6 December 2026, before any held-out or sparsity number existed; the rules were seeds 0–2 and every seed). Then
weights (planned at about 35 minutes, measured 72), heldout-base (3) and diversity-0 … diversity-11 (planned at about
20 minutes each, measured 23–30 at N ≤ 8 and 32–38 at N = 16; diversity-6 is lane es-s0's run and costs nothing):
  sparsity    ES's update is α/N·Σ z_n ε_n with population z-scores (Σ z_n² = N), so after T updates (skipped ones
              not counted) a coordinate's change is N(0, s²), s = α·√(T/N), and |Δ| ≤ τ* = √2·erfinv(0.78)·s ≈ 1.227·s
              holds for 78 % of them (the paper's share). ES θ_T of SUB_SEEDS: reset |Δ| ≤ τ* to θ₀, beside a control
              that resets as many coordinates drawn uniformly (seeded); pass@1 and pass@32 at n = 32. Row: θ_τ* −
              θ_random at pass@1, seed-level t, two-sided (the paper: the small changes carry little).
  held out    ES and GRPO θ_T of SUB_SEEDS, and the base, on "What is a * b?", a, b ≤ 15 (PRODUCTS, the findings
              study's; n = 8, the first 100 test problems), scored as correct among the samples with a \boxed{}
              answer, so that learning the format cannot pass for no forgetting. Row: ES − GRPO, same seed.
  diversity   12 ES runs of seed 0 with (σ, N) varied on purpose (σ ∈ {1.25e-3, 2.5e-3, 5e-3, 1e-2} × N ∈ {4, 8, 16},
              64 completions an update: 64/N prompts; α the chosen one; the chosen σ at N = 8 is lane es-s0's run and
              its T/2 evaluation), T/2 updates each (T would cost 12 × 35 minutes, past the study's budget; set before
              any diversity number): Spearman ρ between the mean JS diversity over those updates and pass@32 of
              θ_{T/2} (n = 32), one-sided permutation p at α = 0.05 ([ES-LLM]'s claim: more diversity, higher pass@k).
  weight vs   the base's pass@k from n = 128 samples at temperature 0.6, against the greedy answers of k perturbed
  token space models θ₀ + σ·ε_n (n = 1 … 128, low-rank members as es_lowrank.py draws them, σ = the chosen ES σ) on the
              same 100 problems: does exploring in weight space reach problems that token sampling misses? Rows: the
              two coverages at k = 128 and the problems each reaches alone.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import HFPolicy, Problem, load_task, render_prompt, require, write_atomic  # noqa: E402
from harness import cli, load_curves  # noqa: E402
from eval_passk import per_problem, seed_interval, t_quantile  # noqa: E402

from stats import ALPHA, holm, mde, seeded_row, seeds_of, spearman, spearman_mde, t_test, units_needed  # noqa: E402
from study import COLORS, p_text, run_step, write_json  # noqa: E402
from task_data import split_twins  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = {  # task_data.py flags of the screened tasks (all --kind chains --seed 1 --train 1000 --test 300)
    "chains20": ["--max-number", "20", "--ops", "+-"],
    "chains10": ["--max-number", "10", "--ops", "+-"],
}
TASK = "chains10"
SEEDS = (0, 1, 2, 3, 4)
ES_GRID = ((5e-3, 5e-3), (5e-3, 2.5e-3), (2.5e-3, 2.5e-3))  # (σ, α): the findings study's first
ES_POP = 8
GRPO_LRS = (2e-5, 1e-5, 5e-5)  # the findings study's first
HP_UPDATES, PILOT_UPDATES, PARITY_UPDATES, PROBLEMS, VALIDATION = 16, 64, 8, 100, 100
TOKENS, BATCH = 32, 256
RESET_SHARE, SUB_SEEDS, MEMBERS, HELDOUT_N = 0.78, (2, 3, 4), 128, 8  # sub-studies (module docstring)
DIVERSITY = tuple((sigma, pop) for pop in (4, 8, 16) for sigma in (1.25e-3, 2.5e-3, 5e-3, 1e-2))
PRODUCTS = ["--kind", "sums", "--seed", "1", "--ops", "*", "--max-number", "15", "--train", "25", "--test", "200"]
CURVE_KEYS = ("train/reward_mean", "eval/reward", "eval/accuracy", "grpo/entropy", "es/js_succ_bits",
              "perf/tokens_per_s", "perf/rollout_s", "perf/iteration_s", "perf/step_s")  # perf/: the budget table


@dataclass
class Args:
    out: str = "runs/regime"
    """run directory (data/, runs/, eval/, logs/, costs.json)"""
    report: bool = False
    """only rebuild the report (--docs) from --data: nothing is run"""
    lanes: tuple[str, ...] = ()
    """run only these lanes, in this order (default: every lane not in --data, in the design's order)"""
    data: str = "docs/regime/data"
    """one JSON file per finished lane (committed): all that the report reads"""
    docs: str = "docs/regime"
    """where the report goes: results.md, passk.png"""
    model: str = "smollm2-135m"
    """base model (a folder, or 'smollm2-135m')"""
    python: str = sys.executable
    """the Python that runs the scripts"""


# ---------------------------------------------------------------------------------------------------- steps
def flags(folder: Path) -> list[str]:
    """The task as every script takes it."""
    return ["--task", "arith", "--data", str(folder), "--chat-template", "--max-new-tokens", str(TOKENS)]


def make_data(args: Args, name: str) -> Path:
    """data/NAME (a candidate's 1000 / 300 problems); for the chosen task also data/val: the 900 training problems
    every run trains on, and the 100 validation problems as its test split (the runs' own greedy evaluation)."""
    out = Path(args.out) / "data"
    run_step(args, f"data-{name}", out / name / "test.jsonl", ["bench/task_data.py", "--kind", "chains", "--seed", "1",
             "--train", "1000", "--test", "300", "--out", str(out / name), *CANDIDATES[name]])
    if name == TASK and not (out / "val" / "test.jsonl").exists():
        rows = [json.loads(line) for line in (out / name / "train.jsonl").read_text().splitlines()]
        problems = [Problem(r["question"], r["answer"].removeprefix("#### ")) for r in rows]
        train, val = split_twins(problems, VALIDATION)
        lines = lambda ps: "".join(json.dumps({"question": p.question, "answer": f"#### {p.answer}"}) + "\n"  # noqa
                                   for p in ps)

        def fill(tmp: Path) -> None:
            tmp.mkdir()
            (tmp / "train.jsonl").write_text(lines(train))
            (tmp / "test.jsonl").write_text(lines(val))

        write_atomic(out / "val", fill)  # a kill leaves no half folder that the check above would take as done
    return out / name


def evaluate(args: Args, name: str, model: str, folder: Path, n: int) -> Path:
    """eval_passk.py on one model: the first PROBLEMS test problems of `folder`, n samples each."""
    out = Path(args.out) / "eval" / name
    run_step(args, f"eval-{name}", out / "passk.json",
             ["eval_passk.py", *flags(folder), "--models", f"{name}={model}", "--num-problems", str(PROBLEMS),
              "--n", str(n), "--seed", "0", "--batch-size", str(BATCH), "--out-dir", str(out)], partial=out)
    return out


def checkpoint(args: Args, label: str, step: int) -> Path:
    """The checkpoint of run `label` (runs/LABEL) after `step` updates."""
    return Path(args.out) / "runs" / label / "checkpoints" / f"step_{step:06d}"


def train(args: Args, method: str, label: str, updates: int, folder: Path, setting: tuple, seed: int = 0,
          pop: int = ES_POP) -> Path:
    """es.py or grpo.py (resuming a killed run) for `updates` updates on data/val: the 900 training problems, the
    greedy evaluation every 8 updates on the 100 validation problems; a checkpoint every 16, all kept."""
    run = Path(args.out) / "runs" / label
    common = ["--model", args.model, *flags(folder), "--seed", str(seed), "--out-dir", str(run), "--eval-every", "8",
              "--eval-prompts", str(VALIDATION), "--save-every", "16", "--keep-last", "8"]
    resume = ["--resume", str(run)] if (run / "args.json").exists() else []
    if method == "es":
        sigma, alpha = setting
        argv = ["es.py", *common, "--pop", str(pop), "--prompts-per-iter", str(64 // pop), "--sigma", str(sigma),
                "--alpha", str(alpha), "--iterations", str(updates)]
    else:
        argv = ["grpo.py", *common, "--prompts-per-step", "8", "--group-size", "8", "--micro-batch-size", "16",
                "--lr", str(setting[0]), "--steps", str(updates)]
    run_step(args, label, checkpoint(args, label, updates) / "state.json", [*argv, *resume])
    return run


def token_entropy(args: Args, label: str, model: str, prompts_used: int = 32) -> float:
    """Mean entropy (nats) of the next-token distribution along 4 samples (temperature 1) of the first 32 validation
    prompts, computed as grpo.py computes its own (`completion_logprobs`): one measure for the base, ES and GRPO
    checkpoints alike (GRPO's log sees only its own rollouts, ES logs none)."""
    import torch
    from grpo import completion_logprobs, pad_batch

    policy = HFPolicy(model, batch_size=128)
    problems = load_task("arith", "test", str(Path(args.out) / "data" / "val"))[:prompts_used]
    prompts = [render_prompt("arith", p, policy.tokenizer, True) for p in problems]
    samples = policy.generate(prompts, n=4, max_new_tokens=TOKENS, temperature=1.0, seed=0)
    encoded, total, count = policy.encode(prompts), 0.0, 0
    for start in range(0, len(samples), 32):  # 32 rows a forward: the (rows, C, V) logits stay small
        chunk = samples[start:start + 32]
        ids, mask, completion = pad_batch([encoded[x.prompt_index] for x in chunk], [x.token_ids for x in chunk],
                                          policy.tokenizer.pad_token_id)
        with torch.no_grad():
            _, entropy = completion_logprobs(policy.model, ids, mask, completion.shape[1], 1.0)
        total, count = total + float((entropy * completion).sum()), count + int(completion.sum())
    print(f"token entropy of {label}: {total / count:.3f} nats over {count} tokens", flush=True)
    return total / count


def weight_space(args: Args, folder: Path, sigma: float) -> list[str]:
    """Greedy verdicts of MEMBERS low-rank perturbed models θ₀ + σ·A_n·B_nᵀ (rank 1: es_lowrank.py's members of seed
    0's first update) on the first PROBLEMS test problems, one '0'/'1' string per member. The members are forward
    hooks on one model, two side by side in a batch (es_lowrank.evaluate_population): θ₀ is never written."""
    import es
    import es_lowrank
    from common import Master, score

    policy = HFPolicy(args.model, batch_size=BATCH)
    problems = load_task("arith", "test", str(folder))[:PROBLEMS]
    prompts = [render_prompt("arith", p, policy.tokenizer, True) for p in problems]
    seeds, signs = es.member_seeds(0, 0, MEMBERS, False)
    master = Master(policy.params)
    group = max(1, policy.batch_size // len(prompts))  # evaluate_population's members per generate: a bar step each

    def verdict(i: int, text: str) -> tuple[float, bool]:
        return score("arith", problems[i], text)

    correct = []
    for start in tqdm(range(0, MEMBERS, group), desc=f"weight space (σ = {sigma}, {group} members a call)"):
        part = slice(start, start + group)
        _, rows, _ = es_lowrank.evaluate_population(policy, master, prompts, verdict, seeds[part], signs[part], sigma,
                                                    TOKENS, 0.0, [0] * len(seeds[part]))
        correct.extend(rows)
    return ["".join(str(int(c)) for c in row) for row in correct]


def final_model(args: Args, data: dict, method: str, seed: int) -> Path:
    """θ_T of lane METHOD-sSEED: its checkpoint, retrained from the seed where this machine no longer holds it."""
    require(f"{method}-s{seed}" in data, f"run lane {method}-s{seed} first: this lane reads its final model")
    settings, updates = dict(zip(("es", "grpo"), chosen(data))), horizon(data)
    val_dir = Path(args.out) / "data" / "val"
    run = train(args, method, f"{method}-s{seed}", updates, val_dir, settings[method], seed=seed)
    return checkpoint(args, run.name, updates)


def products(args: Args) -> Path:
    """The held-out task's problems (data/products)."""
    folder = Path(args.out) / "data" / "products"
    run_step(args, "data-products", folder / "test.jsonl", ["bench/task_data.py", "--out", str(folder), *PRODUCTS])
    return folder


def reset_models(args: Args, data: dict, seed: int) -> tuple[dict, dict[str, Path]]:
    """ES θ_T of `seed` with every change |θ − θ₀| ≤ τ* reset to θ₀, and the control that resets as many coordinates
    drawn uniformly (seeded), as from_pretrained folders; τ* = z·α·√(T'/N), P(|Z| ≤ z) = RESET_SHARE, T' the updates
    that were not skipped (module docstring). Returns (τ*, the share it resets, T − T'), and the two folders."""
    import torch
    from statistics import NormalDist

    from common import derive_seed, load_weights, resolve_model

    (_, alpha), updates = chosen(data)[0], horizon(data)
    final = final_model(args, data, "es", seed)
    skipped = int(sum(v for u, v in load_curves(final.parents[1], ["es/skipped"])["es/skipped"] if u <= updates))
    tau = NormalDist().inv_cdf(0.5 + RESET_SHARE / 2) * alpha * math.sqrt((updates - skipped) / ES_POP)
    theta, theta0 = load_weights(final), load_weights(resolve_model(args.model))
    small = {k: (t - theta0[k]).abs() <= tau for k, t in theta.items()}
    sizes = [t.numel() for t in theta.values()]
    count, flat = sum(int(m.sum()) for m in small.values()), torch.zeros(sum(sizes), dtype=torch.bool)
    flat[torch.randperm(len(flat), generator=torch.Generator().manual_seed(derive_seed(seed, "random reset")))[
        :count]] = True
    masks = {"tau": small, "random": {k: m.view_as(t) for (k, t), m in zip(theta.items(), flat.split(sizes))}}
    folders = {name: Path(args.out) / "sparsity" / f"es-s{seed}-{name}" for name in masks}
    policy = None  # θ_T's model and tokenizer, loaded once for both folders (every weight is overwritten)
    for name, mask in masks.items():
        if not folders[name].exists():
            policy = policy or HFPolicy(str(final), device="cpu")
            for k, p in policy.params.items():
                p.copy_(torch.where(mask[k], theta0[k], theta[k]))
            folders[name].parent.mkdir(parents=True, exist_ok=True)
            write_atomic(folders[name], policy.save)
    return {"tau": tau, "reset_share": count / len(flat), "skipped": skipped}, folders


def boxed_scores(folder: Path) -> dict[str, list[int]]:
    """Per problem, from an evaluation's samples.jsonl: the samples with a \\boxed{} answer (arith's reward > 0) and
    those of them that are correct."""
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return {"boxed": [sum(x["reward"] > 0 for x in r["samples"]) for r in rows],
            "correct": [sum(x["reward"] > 0 and x["correct"] for x in r["samples"]) for r in rows]}


# ---------------------------------------------------------------------------------------------------- data
def lane_file(args: Args, lane: str) -> Path:
    return Path(args.data) / f"{lane}.json"


def evaluation(folder: Path) -> dict:
    """A passk.json as the report needs it: per problem the greedy verdict and correct counts, n and ks."""
    report = json.loads((folder / "passk.json").read_text())
    (label, tasks), = report["results"].items()
    r = tasks["arith"]
    return {"label": label, "n": report["n"], "ks": report["ks"], "greedy_correct": r["greedy_correct"],
            "correct_counts": r["correct_counts"], "response_tokens": r["response_tokens"]}


def save_lane(args: Args, lane: str, start: float, **parts: dict) -> None:
    Path(args.data).mkdir(parents=True, exist_ok=True)
    lane_data = {"lane": lane, "seconds": round(time.time() - start), **parts}
    write_atomic(lane_file(args, lane), lambda tmp: write_json(tmp, lane_data))  # a cut file would skip the lane
    print(f"lane {lane} done in {(time.time() - start) / 60:.0f} min: {lane_file(args, lane)} (commit it)", flush=True)


def curves(run: Path, last: int) -> dict:
    """The run's logged curves up to update `last` (seed 0's run, the pilot's, goes on past T)."""
    return {key: [x for x in c if x[0] <= last] for key, c in load_curves(run, CURVE_KEYS).items() if c}


def lanes(args: Args) -> list[str]:
    seeds = [f"{kind}-s{s}" for s in SEEDS for kind in ("es", "grpo", "heldout", "sparsity")
             if kind in ("es", "grpo") or s in SUB_SEEDS]  # a seed's sub-study lanes right after its models
    return ([f"screen-{c}" for c in CANDIDATES] + ["base"] + [f"hp-es-{i}" for i in range(len(ES_GRID))]
            + [f"hp-grpo-{i}" for i in range(len(GRPO_LRS))] + ["pilot-es", "pilot-grpo"] + seeds
            + ["parity", "weights", "heldout-base"] + [f"diversity-{i}" for i in range(len(DIVERSITY))])


def loaded(args: Args) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in sorted(Path(args.data).glob("*.json"))}


def chosen(data: dict) -> tuple[tuple, tuple]:
    """The search's settings: the highest validation accuracy after the last update (ties: the earlier one)."""
    def best(method: str, grid: tuple) -> tuple:
        scores = [data[f"hp-{method}-{i}"]["curves"]["eval/accuracy"][-1][1] for i in range(len(grid))]
        return grid[int(np.argmax(scores))]  # argmax: the first of the ties

    require(all(f"hp-{m}-{i}" in data for m, g in (("es", ES_GRID), ("grpo", GRPO_LRS)) for i in range(len(g))),
            "the hyperparameter search is not complete in --data: run its lanes first")
    return best("es", ES_GRID), (best("grpo", GRPO_LRS),)


def horizon(data: dict) -> int:
    """T from the pilot's GRPO curves (module docstring)."""
    require("pilot-grpo" in data, "the pilot is not in --data: run lane pilot-grpo first")
    run = data["pilot-grpo"]["curves"]
    reward, entropy = (dict(map(tuple, run[key])) for key in ("train/reward_mean", "grpo/entropy"))
    for t in (16, 32, 48, 64):
        late, early = ([reward[u] for u in range(a, b)] for a, b in ((t - 7, t + 1), (t - 15, t - 7)))
        if abs(np.mean(late) - np.mean(early)) <= 0.05 and np.mean([entropy[u] for u in range(t - 7, t + 1)]) < \
                entropy[1] / 2:
            return t
    return 64


def run_lane(args: Args, lane: str) -> None:
    start, data = time.time(), loaded(args)
    if lane.startswith("screen-"):
        name = lane.removeprefix("screen-")
        folder = make_data(args, name)
        save_lane(args, lane, start, evals={"base": evaluation(evaluate(args, f"screen-{name}", args.model, folder,
                                                                         32))})
        return
    folder, val_dir = make_data(args, TASK), Path(args.out) / "data" / "val"
    if lane == "base":
        save_lane(args, lane, start, evals={"base": evaluation(evaluate(args, "base", args.model, folder, 128))},
                  entropy={"base": token_entropy(args, "base", args.model)})
        return
    method = "grpo" if "grpo" in lane else "es"
    if lane.startswith("hp-"):
        i = int(lane.rpartition("-")[2])
        setting = ES_GRID[i] if method == "es" else (GRPO_LRS[i],)
        run = train(args, method, lane, HP_UPDATES, val_dir, setting)
        save_lane(args, lane, start, setting=setting, curves=curves(run, HP_UPDATES))
        return
    settings = dict(zip(("es", "grpo"), chosen(data)))
    if lane == "parity":  # run with nothing else on the machine: its wall times are the budget table's clean ones
        runs = {m: train(args, m, f"parity-{m}", PARITY_UPDATES, val_dir, settings[m]) for m in ("es", "grpo")}
        save_lane(args, lane, start, curves={m: curves(run, PARITY_UPDATES) for m, run in runs.items()})
        return
    if lane == "weights":
        save_lane(args, lane, start, sigma=settings["es"][0], correct=weight_space(args, folder, settings["es"][0]))
        return
    if lane.startswith("diversity-"):
        (sigma, pop), (chosen_sigma, alpha) = DIVERSITY[int(lane.rpartition("-")[2])], settings["es"]
        updates = horizon(data) // 2
        if (sigma, pop) == (chosen_sigma, ES_POP):  # seed 0 at the chosen setting: lane es-s0, its run and T/2 eval
            require("es-s0" in data, f"lane {lane} is lane es-s0's run up to T/2: run es-s0 first")
            d = data["es-s0"]
            save_lane(args, lane, start, setting=[sigma, alpha, pop], curves={
                key: [x for x in c if x[0] <= updates] for key, c in d["curves"].items()}, evals={
                str(updates): d["evals"][str(updates)]})
            return
        run = train(args, "es", lane, updates, val_dir, (sigma, alpha), pop=pop)
        final = evaluate(args, f"{lane}-t{updates}", str(checkpoint(args, run.name, updates)), folder, 32)
        save_lane(args, lane, start, setting=[sigma, alpha, pop], curves=curves(run, updates), evals={
            str(updates): evaluation(final)})
        return
    if lane == "heldout-base":
        save_lane(args, lane, start, evals={"base": boxed_scores(evaluate(args, "heldout-base", args.model,
                                                                           products(args), HELDOUT_N))})
        return
    if lane.startswith("heldout-s"):
        seed = int(lane.rpartition("-s")[2])
        models = {f"{m}@{seed}": final_model(args, data, m, seed) for m in ("es", "grpo")}
        problems = products(args)
        save_lane(args, lane, start, evals={label: boxed_scores(evaluate(args, f"heldout-{label}", str(model),
                                                                         problems, HELDOUT_N))
                                            for label, model in models.items()})
        return
    if lane.startswith("sparsity-s"):
        seed = int(lane.rpartition("-s")[2])
        info, models = reset_models(args, data, seed)
        save_lane(args, lane, start, **info, evals={
            name: evaluation(evaluate(args, f"sparsity-es{seed}-{name}", str(model), folder, 32))
            for name, model in models.items()})
        return
    if lane.startswith("pilot-"):
        run = train(args, method, f"{method}-s0", PILOT_UPDATES, val_dir, settings[method])
        entropy = {str(t): token_entropy(args, f"{lane}@{t}", str(checkpoint(args, run.name, t)))
                   for t in range(16, PILOT_UPDATES + 1, 16)}
        save_lane(args, lane, start, setting=settings[method], curves=curves(run, PILOT_UPDATES), entropy=entropy)
        return
    seed, updates = int(lane.rpartition("-s")[2]), horizon(data)
    run = train(args, method, f"{method}-s{seed}", updates, val_dir, settings[method], seed=seed)
    label, evals, entropy = f"{method}@{seed}", {}, {}
    for t, n in ((updates // 2, 32), (updates, 128)):
        model = str(checkpoint(args, run.name, t))
        evals[str(t)] = evaluation(evaluate(args, f"{label}-t{t}", model, folder, n))
        entropy[str(t)] = token_entropy(args, f"{label}@{t}", model)
    save_lane(args, lane, start, setting=settings[method], updates=updates, curves=curves(run, updates), evals=evals,
              entropy=entropy)


# ---------------------------------------------------------------------------------------------------- report
def report_of(data: dict, step: Optional[str] = None) -> Optional[dict]:
    """The final (step None: every seed at its T, n = 128, and the base) or the intermediate evaluations as one report
    for bench/stats.py: {"task", "n", "ks", "results": {label: {"arith": per-problem data}}}."""
    found = {"base": data["base"]["evals"]["base"] if step is None else data.get(f"screen-{TASK}", {}).get(
        "evals", {}).get("base")}
    for lane, d in data.items():
        if lane.startswith(("es-s", "grpo-s")):
            evals = d["evals"]
            key = str(d["updates"]) if step is None else str(d["updates"] // 2)
            found[lane.replace("-s", "@")] = evals[key]
    found = {label: r for label, r in found.items() if r is not None}
    if "base" not in found or len(found) < 2:
        return None
    n = found["base"]["n"]
    require(all(r["n"] == n for r in found.values()), "evaluations with different n in one report")
    return {"task": "arith", "n": n, "ks": found["base"]["ks"], "results": {k: {"arith": r} for k, r in found.items()}}


def endpoints(final: dict) -> list[dict]:
    """E1–E4 (module docstring): two-sided p = 2·min(one-sided p's), Holm over the four, verdict by the sign."""
    k = f"pass@{final['ks'][-1]}"
    rows = [seeded_row(f"E1 GRPO − base at {k}", final, "grpo", "base", k, None),
            seeded_row(f"E2 ES − base at {k}", final, "es", "base", k, None),
            seeded_row(f"E3 ES − GRPO at {k} (same seed)", final, "es", "grpo", k, None),
            seeded_row("E4 ES − GRPO at pass@1 (same seed)", final, "es", "grpo", "pass@1", None)]
    rows = [r for r in rows if r is not None]
    family = [r for r in rows if "p" in r]
    for r in family:
        r["p2"] = min(1.0, 2 * min(r["p"], r["p_opp"]))
    if family:
        adjusted, levels = holm([r["p2"] for r in family], ALPHA)
        for r, p_holm, level in zip(family, adjusted, levels):
            r |= {"holm": float(p_holm), "mde": mde(r["sd"], r["units"], level / 2),
                  "needed": units_needed(r["sd"], abs(r["mean"]), level / 2)}  # if the mean seen were the effect
            r["verdict"] = (("above" if r["mean"] > 0 else "below") if p_holm <= ALPHA else
                            f"undecided (MDE {100 * r['mde']:.1f} pt at 80 % power; the mean seen would need "
                            + (f"{r['needed']} seeds)" if r["needed"] else "over 100 000 seeds)"))
    return rows


def coverage(final: dict) -> list[str]:
    """At the largest k, seed by seed: which test problems each method solves at all (any of its n samples)."""
    solved = {label: np.array(r["arith"]["correct_counts"]) > 0 for label, r in final["results"].items()}
    base = solved["base"]
    lines = ["| seed | both | ES only | GRPO only | neither | ES: gained / lost vs base | "
             "GRPO: gained / lost vs base |", "|---|---|---|---|---|---|---|"]
    for seed in sorted(set(seeds_of(final, "es")) & set(seeds_of(final, "grpo"))):
        es, grpo = solved[f"es@{seed}"], solved[f"grpo@{seed}"]
        lines.append(f"| {seed} | {(es & grpo).sum()} | {(es & ~grpo).sum()} | {(~es & grpo).sum()} | "
                     f"{(~es & ~grpo).sum()} | {(es & ~base).sum()} / {(~es & base).sum()} | "
                     f"{(grpo & ~base).sum()} / {(~grpo & base).sum()} |")
    return lines + [f"| base | {base.sum()} solved of {len(base)} | | | | | |"]


def passk_table(report: dict) -> list[str]:
    """pass@k of the base and of each method (mean over seeds, 95 % seed-level t interval)."""
    ks = report["ks"]
    lines = ["| model | seeds | greedy | " + " | ".join(f"pass@{k}" for k in ks) + " |",
             "|---|---|---" + "|---" * len(ks) + "|"]
    base = per_problem(report["results"]["base"]["arith"], report["n"], ks).mean(0)
    lines.append("| base | — | " + " | ".join(f"{100 * v:.1f}" for v in base) + " |")
    for method in ("es", "grpo"):
        labels = list(seeds_of(report, method).values())
        if not labels:
            continue
        values = np.array([per_problem(report["results"][x]["arith"], report["n"], ks).mean(0) for x in labels])
        if len(labels) > 1:
            mean, lo, hi = 100 * seed_interval(values[:, None, :])
            cells = [f"{m:.1f} [{a:.1f}, {b:.1f}]" for m, a, b in zip(mean, lo, hi)]
        else:
            cells = [f"{100 * v:.1f}" for v in values[0]]
        lines.append(f"| {method.upper()} | {len(labels)} | " + " | ".join(cells) + " |")
    return lines


def plot_passk(reports: dict[str, dict], file: Path) -> None:
    """pass@k against k (log2) for the base, ES and GRPO (mean over seeds, thin lines each seed), one panel a report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4), squeeze=False, layout="constrained")
    for ax, (title, report) in zip(axes[0], reports.items()):
        ks = report["ks"]
        for (method, name), color in zip((("base", "base"), ("es", "ES"), ("grpo", "GRPO")), COLORS[2::-1]):
            labels = ["base"] if method == "base" else list(seeds_of(report, method).values())
            if not labels:
                continue
            values = 100 * np.array([per_problem(report["results"][x]["arith"], report["n"], ks)[:, 1:].mean(0)
                                     for x in labels])
            if len(labels) > 1:
                ax.plot(ks, values.T, color=color, lw=0.6, alpha=0.5)
            ax.plot(ks, values.mean(0), color=color, lw=2, marker="o", ms=3, label=f"{name} ({len(labels)})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(title=title, xlabel="k", ylabel="pass@k (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(file, dpi=120, metadata={"Software": None})
    plt.close(fig)


def verdict(mean: float, p2: float, sd: float, units: int) -> str:
    """One two-sided test at ALPHA (not in the endpoints' family): its direction, or undecided with its MDE."""
    return (("above" if mean > 0 else "below") if p2 <= ALPHA else
            f"undecided (MDE {100 * mde(sd, units, ALPHA / 2):.1f} pt at 80 % power)")


def weights_section(data: dict) -> list[str]:
    """Weight space (greedy answers of the perturbed members) against token space (the base's samples at temperature
    0.6) on the same problems: pass@k of each (the unbiased estimator from c of n = 128), and who reaches what."""
    w, base = data["weights"], data["base"]["evals"]["base"]
    counts = [sum(int(member[x]) for member in w["correct"]) for x in range(len(w["correct"][0]))]
    members = base | {"n": len(w["correct"]), "correct_counts": counts}
    ks = [k for k in base["ks"] if k <= members["n"]]
    lines = [f"## Weight space against token space (the base model, the {len(counts)} test problems)", "",
             "| exploration | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for name, r in ((f"token space: {base['n']} samples at temperature 0.6", base),
                    (f"weight space: greedy θ₀ + σ·ε_n, {members['n']} members, σ = {w['sigma']}", members)):
        v = per_problem(r, r["n"], ks)[:, 1:].mean(0)
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.1f}" for x in v) + " |")
    return lines + ["", f"At k = {max(ks)}: {reach(data)}.", ""]


def reach(data: dict) -> str:
    """Which test problems weight space (any member right) and token space (any of the base's samples) reach."""
    token = np.array(data["base"]["evals"]["base"]["correct_counts"]) > 0
    weight = np.array([any(member[x] == "1" for member in data["weights"]["correct"]) for x in range(len(token))])
    return (f"reached by both {(token & weight).sum()}, by weight space only {(weight & ~token).sum()}, by token "
            f"space only {(token & ~weight).sum()}, by neither {(~token & ~weight).sum()}")


def sparsity_section(data: dict) -> list[str]:
    """θ_τ* (ES's changes ≤ τ* reset) against θ_random (as many coordinates reset at random), SUB_SEEDS, n = 32."""
    found = {lane.removeprefix("sparsity-s"): d for lane, d in data.items() if lane.startswith("sparsity-s")}
    lines = ["## Sparsity: ES θ_T with its changes |Δ| ≤ τ* reset, against as many coordinates reset at random "
             "(n = 32)", "", "| seed | τ* | reset share | skipped updates | pass@1 θ_τ* | pass@1 θ_random | "
             "pass@32 θ_τ* | pass@32 θ_random |", "|---|---|---|---|---|---|---|---|"]
    for seed, x in found.items():
        (tau1, tau32), (rand1, rand32) = (per_problem(e, e["n"], e["ks"])[:, [1, -1]].mean(0) * 100
                                          for e in (x["evals"]["tau"], x["evals"]["random"]))
        lines.append(f"| {seed} | {x['tau']:.3g} | {100 * x['reset_share']:.1f} % | {x['skipped']} | {tau1:.1f} | "
                     f"{rand1:.1f} | {tau32:.1f} | {rand32:.1f} |")
    test = tested(sparsity_effects(data))
    if test is not None:
        lines += ["", f"θ_τ* − θ_random at pass@1 (same seed): {test['text']}, seed-level t over {test['units']} "
                  f"seeds, two-sided p {p_text(test['p2'])}: {test['verdict']}."]
    return lines + [""]


def sparsity_effects(data: dict) -> np.ndarray:
    """θ_τ* − θ_random at pass@1, seed by seed (each seed's mean over the problems)."""
    found = [d["evals"] for lane, d in data.items() if lane.startswith("sparsity-s")]
    return np.array([np.mean(per_problem(e["tau"], e["tau"]["n"], [1])[:, 1] - per_problem(
        e["random"], e["random"]["n"], [1])[:, 1]) for e in found])


def heldout_section(data: dict) -> list[str]:
    """Products a * b: each model's share of boxed samples and its accuracy among them; ES − GRPO, same seed."""
    evals, accuracy = heldout_evals(data), heldout_accuracy(data)
    lines = [f"## Held out: products a * b, a, b ≤ 15 (n = {HELDOUT_N}; correct among the samples with a boxed "
             "answer)", "", "| model | boxed | correct among boxed |", "|---|---|---|"]
    lines += [f"| {label} | {100 * sum(r['boxed']) / (HELDOUT_N * len(r['boxed'])):.1f} % | "
              f"{100 * accuracy[label]:.1f} % |" for label, r in evals.items()]
    test = tested(heldout_effects(data))
    if test is not None:
        lines += ["", f"ES − GRPO (same seed), correct among boxed: {test['text']}, seed-level t over {test['units']} "
                  f"seeds, two-sided p {p_text(test['p2'])}: {test['verdict']}."]
    return lines + [""]


def tested(effects: np.ndarray) -> Optional[dict]:
    """A sub-study's two-sided seed-level t test (df = S − 1) at ALPHA, not in the endpoints' family: the mean, its
    95 % interval as text, p and the verdict (with its MDE while undecided); None below two seeds."""
    if len(effects) < 2:
        return None
    sd, units = float(effects.std(ddof=1)), len(effects)
    half, p2 = t_quantile(0.975, units - 1) * sd / units ** .5, min(1.0, 2 * min(t_test(effects)))
    mean = float(effects.mean())
    return {"units": units, "mean": mean, "p2": p2, "verdict": verdict(mean, p2, sd, units),
            "text": f"{100 * mean:+.1f} [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}] pt"}


def heldout_evals(data: dict) -> dict[str, dict]:
    """Every held-out model's boxed scores (lanes heldout-base and heldout-sS), by label."""
    return {label: r for lane, d in data.items() if lane.startswith("heldout-") for label, r in d["evals"].items()}


def heldout_accuracy(data: dict) -> dict[str, float]:
    """Each held-out model's accuracy among its samples with a boxed answer."""
    return {label: sum(r["correct"]) / max(sum(r["boxed"]), 1) for label, r in heldout_evals(data).items()}


def heldout_effects(data: dict) -> np.ndarray:
    """ES − GRPO in accuracy among boxed answers, seed by seed (the seeds with both)."""
    accuracy = heldout_accuracy(data)
    return np.array([accuracy[f"es@{s}"] - accuracy[f"grpo@{s}"] for s in SEEDS
                     if f"es@{s}" in accuracy and f"grpo@{s}" in accuracy])


def diversity_points(data: dict) -> dict[str, tuple[float, float, float]]:
    """Per diversity lane: the mean JS diversity over its updates, pass@1 and pass@32 of its θ_{T/2}."""
    points = {}
    for lane, d in data.items():
        if lane.startswith("diversity-"):
            e = next(iter(d["evals"].values()))
            v = per_problem(e, e["n"], e["ks"]).mean(0)
            points[lane] = (float(np.mean([x for _, x in d["curves"]["es/js_succ_bits"]])), float(v[1]), float(v[-1]))
    return points


def diversity_test(data: dict) -> Optional[tuple[float, float, float, str]]:
    """Spearman ρ (mean JS diversity, pass@32) over the diversity runs (≥ 3), its one-sided permutation p, the
    smallest p these ties allow, and the verdict."""
    points = diversity_points(data)
    if len(points) < 3:
        return None
    js, _, top = np.array(list(points.values())).T
    rho, p, best = spearman(js, top)
    n = len(points)
    return rho, p, best, ("more diversity, higher pass@32" if p <= ALPHA else
                          f"undecided (MDE ρ = {spearman_mde(n, ALPHA):.2f} at 80 % power over {n} runs)")


def diversity_section(data: dict) -> list[str]:
    """The diversity runs: (σ, N), their mean JS diversity, pass@1 and pass@32 of θ_{T/2}; Spearman ρ."""
    points, test = diversity_points(data), diversity_test(data)
    lines = ["## Diversity: ES runs with σ and N varied (seed 0, n = 32 at θ_{T/2})", "",
             "| lane | σ | N | mean JS diversity (bits) | pass@1 | pass@32 |", "|---|---|---|---|---|---|"]
    for lane in sorted(points, key=lambda name: int(name.rpartition("-")[2])):  # diversity-2 before diversity-10
        (js, one, top), (sigma, _, pop) = points[lane], data[lane]["setting"]
        lines.append(f"| {lane} | {sigma:g} | {pop} | {js:.3f} | {100 * one:.1f} | {100 * top:.1f} |")
    if test is not None:
        rho, p, best, found = test
        lines += ["", f"Spearman ρ (mean JS diversity, pass@32) over {len(points)} runs: {rho:+.2f}, one-sided "
                  f"permutation p {p_text(p)} (the smallest these ties allow: {p_text(best)}): {found}."]
    return lines + [""]


def budget(data: dict) -> list[str]:
    """Budget parity, per method: per update the sampled completions, the generated tokens (tokens/s × rollout
    seconds, as the scripts log them), the passes, and the wall seconds; over every training lane, each run once, and
    from lane parity alone."""
    def table(title: str, runs: list[tuple[str, dict]]) -> list[str]:
        per: dict[str, list[tuple[float, float]]] = {}
        for method, c in runs:
            seconds = c.get("perf/iteration_s") or c.get("perf/step_s")
            per.setdefault(method, []).extend((r[1] * t[1], w[1]) for r, t, w in zip(
                c["perf/rollout_s"], c["perf/tokens_per_s"], seconds))
        lines = [title, "", "| method | updates | completions | generated tokens | passes | wall seconds |",
                 "|---|---|---|---|---|---|"]
        for method, rows in per.items():
            tokens, seconds = np.array(rows).T
            lines.append(f"| {method.upper()} | {len(rows)} | 64 | {tokens.mean():.0f} | {passes[method]} | "
                         f"{seconds.mean():.1f} |")
        return lines + [""] if per else []

    passes = {"es": "N members × 64/N prompts, generation only; no backward",
              "grpo": "64 samples generated; 1 forward + backward over them (4 micro-batches of 16)"}
    sigma = data.get("pilot-es", {}).get("setting", [None])[0]  # the chosen σ: its N = 8 diversity run is es-s0's
    again = {"es-s0", "grpo-s0"} | {lane for lane, d in data.items() if lane.startswith("diversity-") and (
        d["setting"][0], d["setting"][2]) == (sigma, ES_POP)}  # the pilots' runs, counted in the pilot lanes
    lines = table("## Budget per update (every training lane; wall time on the machine and load that ran it)",
                  [("grpo" if "grpo" in lane else "es", d["curves"]) for lane, d in data.items()
                   if "perf/rollout_s" in d.get("curves", {}) and lane not in again])
    alone = list(data.get("parity", {}).get("curves", {}).items())
    return lines + table(f"## Budget per update measured alone (lane parity: {PARITY_UPDATES} updates of each method "
                         "from θ₀, nothing else on the machine)", alone)


def claims(data: dict, endpoint_rows: list[dict]) -> list[str]:
    """The study's answers, one row a claim (the README's table): the four endpoints (endpoints()'s rows), the
    sub-studies' tests, and the two descriptive rows; a row whose lanes have not run says so."""
    rows = {r["name"][:2]: r for r in endpoint_rows}
    questions = {"E1": "Does GRPO's coverage at large k fall below the base's? (E1: GRPO − base at pass@128)",
                 "E2": "Does ES's? (E2: ES − base at pass@128)",
                 "E3": "How do ES and GRPO compare at large k? (E3: ES − GRPO at pass@128, same seed)",
                 "E4": "… and at pass@1? (E4: ES − GRPO at pass@1, same seed)"}
    lines = ["| claim | per seed (points) | mean [95 % seed-level t] | p two-sided (Holm) | verdict |",
             "|---|---|---|---|---|"]
    for key, question in questions.items():
        r = rows.get(key)
        lines.append(f"| {question} | not run yet | | | |" if r is None else
                     f"| {question} | " + " / ".join(f"{100 * m:+.1f}" for m in r["effects"]) + " | "
                     + (f"{100 * r['mean']:+.1f} [{100 * r['ci'][0]:+.1f}, {100 * r['ci'][1]:+.1f}] | "
                        f"{p_text(r['p2'])} ({p_text(r['holm'])}) | " if "ci" in r else f"{100 * r['mean']:+.1f} | | ")
                     + f"{r['verdict']} |")
    for question, effects in (("Held out, products: ES − GRPO in accuracy among boxed answers (same seed; its own "
                               "test, not in the four)", heldout_effects(data)),
                              ("Sparsity: ES θ_T with its changes ≤ τ* reset − as many reset at random, pass@1 (same "
                               "seed; its own test)", sparsity_effects(data))):
        test = tested(effects)
        lines.append(f"| {question} | not run yet | | | |" if not len(effects) else
                     f"| {question} | " + " / ".join(f"{100 * m:+.1f}" for m in effects) + " | " + (
                         f"{len(effects)} of {len(SUB_SEEDS)} seeds | | |" if test is None else
                         f"{test['text'].removesuffix(' pt')} | {p_text(test['p2'])} | {test['verdict']} |"))
    test = diversity_test(data)
    lines.append("| Diversity: more JS diversity, higher pass@32 (Spearman ρ over the ES runs with σ, N varied; "
                 f"one-sided permutation p) | {len(diversity_points(data))} of {len(DIVERSITY)} runs | "
                 + ("| | |" if test is None else f"ρ = {test[0]:+.2f} | {p_text(test[1])} | {test[3]} |"))
    at_t = {m: [d["entropy"][str(d["updates"])] for lane, d in data.items() if lane.startswith(f"{m}-s")]
            for m in ("es", "grpo")}
    lines.append("| Token entropy at update T (nats; descriptive) | GRPO " + " / ".join(
        f"{v:.2f}" for v in at_t["grpo"]) + "; ES " + " / ".join(f"{v:.2f}" for v in at_t["es"]) + " | base "
        + (f"{data['base']['entropy']['base']:.2f}" if "base" in data else "—") + " | | |")
    lines.append("| Weight space against token space from the base, k = 128 (descriptive) | "
                 + (f"{reach(data)} | | | |" if "weights" in data and "base" in data else "not run yet | | | |"))
    return lines


def write_report(args: Args) -> Path:
    data, docs = loaded(args), Path(args.docs)
    require(bool(data), f"{args.data} holds no lane yet: run the study first")
    docs.mkdir(parents=True, exist_ok=True)
    final = report_of(data) if "base" in data else None
    rows = endpoints(final) if final is not None else []  # the endpoints' tests, once: the claims and their table
    lines = ["# Regime study: ES and GRPO trained long on a multi-step task, pass@k to k = 128", "",
             "Written by `python bench/regime.py --report` from docs/regime/data/ alone; the design and the rules are "
             "bench/regime.py's docstring, committed before any trained model was evaluated.", "",
             "## Claims (the README's table)", "", *claims(data, rows), ""]
    screens = {lane.removeprefix("screen-"): d["evals"]["base"] for lane, d in data.items()
               if lane.startswith("screen-")}
    if screens:
        lines += ["## Task screen (the base model, 100 test problems, n = 32)", "",
                  "| candidate | task_data flags | greedy | pass@1 | pass@32 | mean tokens | chosen |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in screens.items():
            v = per_problem(r, r["n"], r["ks"]).mean(0)
            lines.append(f"| {name} | `{' '.join(CANDIDATES[name])}` | {100 * v[0]:.1f} | {100 * v[1]:.1f} | "
                         f"{100 * v[-1]:.1f} | {r['response_tokens']:.1f} | {'yes' if name == TASK else ''} |")
        lines.append("")
    searched = {lane: d for lane, d in data.items() if lane.startswith("hp-")}
    if searched:
        lines += [f"## Hyperparameter search (seed 0, {HP_UPDATES} updates; greedy accuracy on the 100 validation "
                  "problems)", "", "| lane | setting | accuracy by update |", "|---|---|---|"]
        for lane, d in searched.items():
            acc = ", ".join(f"{step}: {100 * v:.0f} %" for step, v in d["curves"].get("eval/accuracy", []))
            lines.append(f"| {lane} | {d['setting']} | {acc} |")
        lines.append("")
    for lane in ("pilot-es", "pilot-grpo"):
        if lane in data:
            d = data[lane]
            lines += [f"## {lane} (setting {d['setting']})", "",
                      "| update | train reward (8 updates to it) | validation accuracy | entropy |",
                      "|---|---|---|---|"]
            c = {key: dict(map(tuple, v)) for key, v in d["curves"].items()}
            for t in range(16, PILOT_UPDATES + 1, 16):
                reward = np.mean([c["train/reward_mean"].get(u, math.nan) for u in range(t - 7, t + 1)])
                lines.append(f"| {t} | {reward:.3f} | {100 * c.get('eval/accuracy', {}).get(t, math.nan):.0f} % | "
                             f"{d['entropy'][str(t)]:.3f} |")
            lines.append("")
    if "pilot-grpo" in data:
        lines += [f"T (the pilot's rule): {horizon(data)} updates.", ""]
    if final is not None:
        lines += ["## Endpoints", "", "| endpoint | mean [95 % seed-level t] | per seed | p (two-sided) | Holm p | "
                  "verdict |", "|---|---|---|---|---|---|"]
        for r in rows:
            interval = (f"{100 * r['mean']:+.1f} [{100 * r['ci'][0]:+.1f}, {100 * r['ci'][1]:+.1f}] pt" if "ci" in r
                        else f"{100 * r['mean']:+.1f} pt")
            lines.append(f"| {r['name']} | {interval} | " + ", ".join(f"{100 * m:+.1f}" for m in r["effects"])
                         + " | " + (f"{p_text(r['p2'])} | {p_text(r['holm'])}" if "p2" in r else "— | —")
                         + f" | {r['verdict']} |")
        lines += ["", f"## pass@k at the final checkpoints (n = {final['n']}; the estimator has n ≥ 4k for k ≤ "
                      f"{final['n'] // 4})", "", *passk_table(final), "", "## Coverage at k = "
                      f"{final['ks'][-1]} (problems with any correct sample)", "", *coverage(final), ""]
        middle = report_of(data, "middle")
        reports = {f"final checkpoints (n = {final['n']})": final} | (
            {f"θ at T/2 (n = {middle['n']})": middle} if middle else {})
        if middle:
            lines += [f"## pass@k at T/2 (n = {middle['n']})", "", *passk_table(middle), ""]
        plot_passk(reports, docs / "passk.png")
        lines += ["![pass@k against k](passk.png)", ""]
    entropy = {lane: d["entropy"] for lane, d in data.items() if "entropy" in d}
    if entropy:
        lines += ["## Token entropy (nats; one measure for every model: module docstring)", "",
                  "| lane | by update |", "|---|---|"]
        lines += [f"| {lane} | " + ", ".join(f"{t}: {v:.3f}" for t, v in e.items()) + " |"
                  for lane, e in entropy.items()]
        lines.append("")
    for lane, section in (("weights", weights_section), ("heldout", heldout_section), ("sparsity", sparsity_section),
                          ("diversity-", diversity_section)):
        lines += section(data) if any(name.startswith(lane) for name in data) else []
    lines += budget(data)
    lines += ["## Cost (wall minutes of each lane, on the machine that ran it)", "", "| lane | minutes |", "|---|---|",
              *[f"| {lane} | {d['seconds'] / 60:.0f} |" for lane, d in data.items()],
              f"| total | {sum(d['seconds'] for d in data.values()) / 60:.0f} |", "",
              "Lanes still to run: " + (", ".join(lane for lane in lanes(args) if lane not in data) or "none") + "."]
    (docs / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return docs / "results.md"


def main(args: Args) -> None:
    known = lanes(args)
    unknown = [lane for lane in args.lanes if lane not in known]
    require(not unknown, f"--lanes: unknown {unknown}; the lanes are {', '.join(known)}")
    if not args.report:
        for lane in args.lanes or known:
            if not lane_file(args, lane).exists():
                print(f"[{time.strftime('%H:%M:%S')}] lane {lane}", flush=True)
                run_lane(args, lane)
    write_report(args)


if __name__ == "__main__":
    main(cli(Args))
