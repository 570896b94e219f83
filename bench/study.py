"""bench/study.py — [ES-LLM]'s claims at CPU scale on SmolLM2-135M, from one resumable command, with intervals.

    python bench/study.py --out runs/study             # every step not yet done, then the report; rerun to resume
    python bench/study.py --out runs/study --report    # the report only, from what the run directory holds

The claims ([ES-LLM] abstract, §3–5) and what measures each, all against the base model on the same problems:
  (a) ES raises pass@1, and reaches a higher pass@k than GRPO, whose token entropy collapses    eval/, GRPO's metrics
  (b) the verifier-projected JS diversity of the ES population goes with higher pass@k          ES runs' es/js_succ_bits
  (c) GRPO→ES keeps GRPO's pass@1 and ES's pass@k                                                eval/
  (d) ES's gain survives resetting its many small changes (functional sparsity)                  sweep/
  (e) no catastrophic forgetting on a held-out task                                              heldout/
  (f) the population size ES needs (one model size here: the size trend cannot be tested)       pop/

Design (fixed before the run; the defaults are the size one 2-core CPU runs in about two hours):
  task       `arith` on sums and differences of numbers ≤ 50 ("What is 37 - 12?"; train 800 / test 300, disjoint),
             chat template, ≤ 24 new tokens. The base model solves it sometimes: headroom at both ends (README).
  held out   products "What is a * b?" with a, b ≤ 15: another skill with the same answer format.
  budget     matched in sampled completions: every update of every method is 64 completions (ES: N members × 64/N
             prompts, greedy; GRPO: 8 prompts × G = 8 samples) and every run gets --updates of them (GRPO→ES and
             ES→GRPO: half each). Seeds --seeds for each of --methods.
  ES         N = 8, σ = α = 5e-3 (the Quickstart's, which learns on `arith` in 6 iterations); GRPO lr 2e-5, β = 0,
             ε = 0.2.
  evaluation eval_passk.py, one run per model (resumable model by model), the same --seed, batch size and problems
             for all: common random numbers. Main task: --problems test problems, n = --n at temperature 0.6 (pass@k,
             k = 1 … n). Held out (ES and GRPO, the methods (e) asks about): --heldout-problems, n = --heldout-n.
             Sweep: ES seed 0 at --taus, n = --heldout-n.
  population ES with N in --pops at the same 64 completions an update (N × 64/N prompts), seeds --pop-seeds, and the
             main runs' N = 8 at every seed, evaluated on the main task's problems at n = --heldout-n.
  verdicts   an effect claimed > 0 ((a) ES vs base at pass@1, ES vs GRPO at pass@n; (c) GRPO→ES vs base at pass@1
             and pass@n) is "reproduced" when the 95 % paired-bootstrap interval of its effect (seeds pooled:
             METHOD@*) lies above 0, "opposite" when it lies below 0, else "undecided at this power". A claim of no
             loss ((c) GRPO→ES vs GRPO at pass@1 and vs ES at pass@n, margin 2 points; (d) θ_τ vs θ at the τ with s_τ
             nearest the paper's 78 %, margin 2 points, the paper's ±0.5 widened to our power; (e) held-out pass@1 vs
             base, margin 5 points) is reproduced when the interval's lower end is above −margin, opposite when its
             upper end is below −margin, else undecided. GRPO's entropy: reproduced when every seed ends below its
             first update, opposite when every seed ends above. (b): Spearman's ρ between an ES run's mean JS
             diversity and its pass@k (population protocol, every ES run), reproduced when ρ > 0 at a permutation
             p < 0.05, else undecided. (f): the smallest N whose pooled pass@1 gain over base lies above 0.

Every step is a subprocess of the project's scripts (the command is at the top of its log in logs/); a step is done when
its output exists, so a killed study resumes at the step it was in (es.py and grpo.py from their last checkpoint). The
wall time of every step goes to costs.json; report/results.md gives the claim table, every eval table and the costs.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import derive_seed, die, require  # noqa: E402
from harness import cli, load_curves  # noqa: E402
from eval_passk import bootstrap_draws, markdown, paired, per_problem, plot, uncertainty  # noqa: E402

import plot_curves  # noqa: E402  (bench/, beside this file)

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("es", "grpo", "grpo_es", "es_grpo")


@dataclass
class Args:
    out: str = "runs/study"
    """run directory (data/, runs/, eval/, heldout/, sweep/, pop/, logs/, costs.json, report/)"""
    report: bool = False
    """only write the report from what --out holds (nothing is run)"""
    model: str = "smollm2-135m"
    """base model (a folder, or 'smollm2-135m')"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """training seeds of every method"""
    methods: tuple[Literal["es", "grpo", "grpo_es", "es_grpo"], ...] = ("es", "grpo", "grpo_es")
    """trained methods (ES→GRPO, in no claim, is optional); ES runs whatever this says: the sweep and N = 8 use it"""
    updates: int = 8
    """updates per training run (64 completions each)"""
    problems: int = 200
    """main-task test problems evaluated"""
    n: int = 16
    """samples per problem on the main task (pass@k up to k = n)"""
    heldout_problems: int = 100
    """held-out test problems evaluated"""
    heldout_n: int = 4
    """samples per problem on the held-out task, the sweep's θ_τ and the population runs"""
    taus: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    """sparsity thresholds τ for ES seed 0 (reset every change with |Δ| ≤ τ)"""
    pops: tuple[int, ...] = (4,)
    """population sizes N of the population study, besides the main runs' 8 (N divides 64: N × 64/N prompts)"""
    pop_seeds: tuple[int, ...] = (0,)
    """seeds of the population study's runs (among --seeds; N = 8 is the main ES runs, every seed)"""
    chat_template: bool = True
    """render prompts with the model's chat template"""
    max_new_tokens: int = 24
    """generation budget of every rollout and evaluation"""
    eval_backend: Literal["hf", "vllm"] = "hf"
    """eval_passk's backend (training rollouts stay on HF generate)"""
    batch_size: int = 256
    """eval_passk's sequences per generate call (8 problems × 32 samples)"""
    python: str = sys.executable
    """the Python that runs the scripts"""


# ---------------------------------------------------------------------------------------------------- steps
def run_step(args: Args, name: str, done: Path, argv: list[str], partial: Optional[Path] = None) -> None:
    """Run `python argv` unless `done` exists; log to logs/NAME.log, its wall time to costs.json. `partial`: a
    folder a killed attempt leaves behind that the script cannot resume (removed first)."""
    out = Path(args.out)
    if done.exists():
        return
    if partial is not None and partial.exists():
        shutil.rmtree(partial)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = out / "logs" / f"{name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join([args.python, *argv]) + "\n")
        f.flush()
        result = subprocess.run([args.python, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0 or not done.exists():
        die(f"step {name} failed (exit {result.returncode}): see {log}")
    costs = json.loads((out / "costs.json").read_text()) if (out / "costs.json").exists() else {}
    costs[name] = time.time() - start  # the attempt that completed it: a killed attempt's time is not counted
    (out / "costs.json").write_text(json.dumps(costs, indent=1))
    print(f"[{time.strftime('%H:%M:%S')}] {name} done in {time.time() - start:.0f} s", flush=True)


def shared(args: Args) -> list[str]:
    return ["--model", args.model, "--task", "arith", "--data", f"{args.out}/data/sums50", "--max-new-tokens",
            str(args.max_new_tokens)] + (["--chat-template"] if args.chat_template else ["--no-chat-template"])


COMPLETIONS = 64  # per update, every method: ES N members × 64/N prompts (greedy), GRPO 8 prompts × G = 8 samples


def es_flags(pop: int = 8) -> list[str]:
    return ["--pop", str(pop), "--prompts-per-iter", str(COMPLETIONS // pop), "--sigma", "5e-3", "--alpha", "5e-3"]


GRPO = ["--prompts-per-step", "8", "--group-size", "8", "--lr", "2e-5", "--micro-batch-size", "16"]


def train(args: Args, method: str, seed: int, pop: int = 8) -> Path:
    """Train one run (resuming a killed one) and return its final checkpoint."""
    label = f"{method}{'' if pop == 8 else pop}-s{seed}"
    run = Path(args.out) / "runs" / label
    shared_flags = shared(args) + ["--seed", str(seed), "--out-dir", str(run), "--eval-every", "4", "--eval-prompts",
                                   "64"]
    resume = ["--resume", str(run)] if (run / "args.json").exists() else []
    if method in ("es", "grpo"):
        final = run / "checkpoints" / f"step_{args.updates:06d}"
        flags = es_flags(pop) + ["--iterations"] if method == "es" else GRPO + ["--steps"]
        run_step(args, label, final / "state.json", [f"{method}.py", *shared_flags, *flags, str(args.updates),
                                                     "--save-every", "2", "--keep-last", "1", *resume])
        return final
    order = "grpo-es" if method == "grpo_es" else "es-grpo"  # grpo_es.py does not resume: a killed run starts over
    stages = [f"--es.{f[2:]}" if f.startswith("--") else f for f in es_flags()] + [
        f"--grpo.{f[2:]}" if f.startswith("--") else f for f in GRPO]
    run_step(args, label, run / "final" / "config.json",
             ["grpo_es.py", *shared_flags, "--order", order, "--total-updates", str(args.updates), *stages],
             partial=run)
    return run / "final"


def evaluate(args: Args, kind: str, label: str, model: str, extra: list[str]) -> None:
    """eval_passk.py on one model into KIND/LABEL/ (a killed evaluation starts over)."""
    out = Path(args.out) / kind / label
    data, n, problems = ("sums50", args.n, args.problems) if kind == "eval" else (
        "products" if kind == "heldout" else "sums50", args.heldout_n,
        args.heldout_problems if kind == "heldout" else args.problems)
    argv = ["eval_passk.py", "--models", f"{label}={model}", "--task", "arith", "--data", f"{args.out}/data/{data}",
            "--num-problems", str(problems), "--n", str(n), "--max-new-tokens", str(args.max_new_tokens), "--seed", "0",
            "--backend", args.eval_backend, "--batch-size", str(args.batch_size), "--out-dir", str(out), *extra,
            *(["--chat-template"] if args.chat_template else [])]
    run_step(args, f"{kind}-{label}", out / "passk.json", argv, partial=out)


def run_all(args: Args) -> None:
    out = Path(args.out)
    for name, flags in (("sums50", ["--max-number", "50", "--train", "800", "--test", "300"]),
                        ("products", ["--ops", "*", "--max-number", "15", "--train", "25", "--test", "200"])):
        run_step(args, f"data-{name}", out / "data" / name / "test.jsonl",
                 ["bench/task_data.py", "--kind", "sums", "--seed", "1", "--out", f"{out}/data/{name}", *flags])
    for kind in ("heldout", "eval"):  # the held-out base first: the quickest check that the task is not at the floor
        evaluate(args, kind, "base", args.model, [])
    es_final = {}  # seed → the main ES run's final checkpoint (also the sweep's θ and the population study's N = 8)
    for seed in args.seeds:  # seed by seed: a study stopped early still has every method at its first seeds
        for method in ("es", *[m for m in args.methods if m != "es"]):  # ES always: the sweep and N = 8 use it
            final = train(args, method, seed)
            if method == "es":
                es_final[seed] = final
            for kind in ("eval", "heldout") if method in ("es", "grpo") else ("eval",):  # (e) asks of ES and GRPO
                evaluate(args, kind, f"{method}@{seed}", str(final), [])
        if seed == args.seeds[0]:
            evaluate(args, "sweep", f"es@{seed}", str(es_final[seed]),
                     ["--base", args.model, "--reset-tau", *map(str, args.taus)])
    for pop in args.pops:
        for seed in args.pop_seeds:
            evaluate(args, "pop", f"es{pop}@{seed}", str(train(args, "es", seed, pop)), [])
    for seed in args.seeds:  # N = 8 on the population study's protocol: the main runs, every seed (for (b)'s ρ)
        evaluate(args, "pop", f"es8@{seed}", str(es_final[seed]), [])
    evaluate(args, "pop", "base", args.model, [])


# ---------------------------------------------------------------------------------------------------- report
RESAMPLES, SEED = 2000, 0  # eval_passk's defaults: the same resamples as each evaluation's own passk.md


def load(file: Path) -> dict:
    """An eval_passk passk.json, with its k keys as ints again (JSON made them strings)."""
    report = json.loads(file.read_text())
    for tasks in report["results"].values():
        for r in tasks.values():
            r["pass@k"], r["maj@k"] = ({int(k): v for k, v in r[key].items()} for key in ("pass@k", "maj@k"))
    return report


def merged(out: Path, kind: str) -> Optional[dict]:
    """One eval_passk report of every model evaluated under KIND/ (the same problems and sampler seeds for all), with
    intervals and paired differences from the base; None when nothing is there yet."""
    runs = [load(f) for f in sorted((out / kind).glob("*/passk.json"))]
    if not runs or not any("base" in r["results"] for r in runs):
        return None
    first = runs[0]
    report = {"task": first["task"], "split": first["split"], "n": first["n"], "ks": first["ks"], "base": None,
              "models": {}, "results": {}, "sparsity": {}}
    for r in runs:
        require(r["n"] == first["n"], f"{kind}/: evaluations with different n ({r['n']}, {first['n']})")
        report["models"] |= r["models"]
        report["results"] |= r["results"]
    report["uncertainty"] = uncertainty(report, "base", RESAMPLES, SEED)
    return report


def values(report: dict, row: str, metric: str) -> np.ndarray:
    """(P,): v(x) of a label, or of METHOD@* (the mean over its seeds), for 'greedy' or 'pass@k'."""
    col = ["greedy", *[f"pass@{k}" for k in report["ks"]]].index(metric)
    labels = [label for label in report["results"] if label.rpartition("@")[0] + "@*" == row] or [row]
    return np.mean([per_problem(report["results"][label][report["task"]], report["n"], report["ks"])[:, col]
                    for label in labels], 0)


def effect(report: dict, a: str, b: str, metric: str) -> dict:
    """v_a − v_b on the same problems: mean and 95% paired interval (in points), problems won/lost, and the sign of
    each seed's own difference when a is METHOD@*."""
    va, vb = values(report, a, metric), values(report, b, metric)
    draws = bootstrap_draws(len(va), RESAMPLES, derive_seed(SEED, "bootstrap", report["task"]))
    diff, won, lost = paired(va[:, None], vb[:, None], draws)  # one column: (3, 1), (1,), (1,)
    mean, lo, hi = diff[:, 0]
    seeds = [values(report, label, metric).mean() - vb.mean() for label in report["results"]
             if a.endswith("@*") and label.rpartition("@")[0] == a[:-2]]
    return {"mean": 100 * mean, "ci": [100 * lo, 100 * hi], "won": int(won[0]), "lost": int(lost[0]),
            "seeds_up": sum(s > 0 for s in seeds), "seeds": len(seeds)}


def verdict(e: dict, margin: Optional[float] = None) -> str:
    """Pre-stated rule (module docstring): an effect claimed > 0, or with `margin` an absence claimed (lo > −margin)."""
    lo, hi = e["ci"]
    if margin is None:
        return "reproduced" if lo > 0 else "opposite" if hi < 0 else "undecided at this power"
    return "reproduced" if lo > -margin else "opposite" if hi < -margin else "undecided at this power"


def fmt(e: dict) -> str:
    seeds = f"; {e['seeds_up']}/{e['seeds']} seeds up" if e["seeds"] else ""
    return f"{e['mean']:+.1f} [{e['ci'][0]:+.1f}, {e['ci'][1]:+.1f}] pt, {e['won']}/{e['lost']} problems{seeds}"


def spearman(x: np.ndarray, y: np.ndarray, permutations: int = 10_000) -> tuple[float, float]:
    """Spearman's ρ (ranks; ties get their mean rank) and the one-sided permutation p-value of ρ ≥ observed."""
    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        return np.array([r[v == value].mean() for value in v])

    rx, ry = ranks(x), ranks(y)
    rho = float(np.corrcoef(rx, ry)[0, 1])
    rng = np.random.default_rng(derive_seed(SEED, "spearman"))
    null = np.array([np.corrcoef(rx, rng.permutation(ry))[0, 1] for _ in range(permutations)])
    return rho, float((1 + (null >= rho - 1e-12).sum()) / (1 + permutations))


def claims(out: Path, main: dict, heldout: Optional[dict], sweep: Optional[dict], pop: Optional[dict]) -> list[str]:
    """The claim table: the measured effect, its 95% interval, how many seeds agree, and the verdict."""
    k = f"pass@{main['ks'][-1]}"
    planned = [("(a) ES raises pass@1", main, "es", "base", "pass@1", None),
               (f"(a) ES reaches a higher {k} than GRPO", main, "es", "grpo", k, None),
               ("(c) GRPO→ES above base at pass@1", main, "grpo_es", "base", "pass@1", None),
               (f"(c) GRPO→ES above base at {k}", main, "grpo_es", "base", k, None),
               ("(c) GRPO→ES not below GRPO at pass@1 (margin 2 pt)", main, "grpo_es", "grpo", "pass@1", 2.0),
               (f"(c) GRPO→ES not below ES at {k} (margin 2 pt)", main, "grpo_es", "es", k, 2.0),
               ("(e) ES does not forget the held-out products (pass@1, margin 5 pt)", heldout, "es", "base", "pass@1",
                5.0),
               ("(e) nor does GRPO (the same rule)", heldout, "grpo", "base", "pass@1", 5.0)]
    lines = ["| claim | effect (pooled seeds) [95 % paired interval] | verdict |", "|---|---|---|"]
    for name, report, a, b, metric, margin in planned:
        found = {label.rpartition("@")[0] or label for label in (report or {}).get("results", {})}
        if a in found and b in found:  # a study still running has some methods and seeds only
            e = effect(report, f"{a}@*", b if b == "base" else f"{b}@*", metric)
            lines.append(f"| {name} | {fmt(e)} | {verdict(e, margin)} |")
    entropy = {seed: load_curves(out / "runs" / f"grpo-s{seed}", ["grpo/entropy"])["grpo/entropy"]
               for seed in sorted({label.rpartition("@")[2] for label in main["results"] if label.startswith("grpo@")})}
    drops = [(c[0][1], c[-1][1]) for c in entropy.values() if c]
    if drops:
        v = ("reproduced" if all(b < a for a, b in drops) else "opposite" if all(b > a for a, b in drops) else
             "undecided at this power")
        down = sum(b < a for a, b in drops)
        lines.append("| (a) GRPO's token entropy falls (first → last update, nats) | " + ", ".join(
            f"{a:.3f} → {b:.3f}" for a, b in drops) + f"; {down}/{len(drops)} seeds down | {v} |")
    if sweep:
        sp = next(iter(sweep["sparsity"].values()))
        i = int(np.argmin([abs(row["s_tau"] - 0.78) for row in sp["taus"]]))
        c = next(iter(sweep["uncertainty"]["sparsity"].values()))[i]
        e = {"mean": 100 * c["diff"], "ci": [100 * x for x in c["diff_ci"]], "won": c["won"], "lost": c["lost"],
             "seeds_up": 0, "seeds": 0}
        tau, s_tau = sp["taus"][i]["tau"], 100 * sp["taus"][i]["s_tau"]
        lines.append(f"| (d) resetting ES's small changes (τ = {tau:g}, s_τ = {s_tau:.0f} %) keeps pass@1 (margin 2 "
                     f"pt) | {fmt(e)} | {verdict(e, 2.0)} |")
    if pop:
        lines += population(out, pop)
    return lines


def population(out: Path, pop: dict) -> list[str]:
    """(b) and (f) from the population study's evaluations."""
    k, lines = f"pass@{pop['ks'][-1]}", []
    sizes = sorted({int(label.partition("@")[0][2:]) for label in pop["results"] if label.startswith("es")})
    gains = {size: effect(pop, f"es{size}@*", "base", "pass@1") for size in sizes}
    enough = [size for size in sizes if gains[size]["ci"][0] > 0]
    lines.append("| (f) the population ES needs (pass@1 vs base; one model size: the size trend is not testable) | " +
                 "; ".join(f"N = {size}: {gains[size]['mean']:+.1f} [{gains[size]['ci'][0]:+.1f}, "
                           f"{gains[size]['ci'][1]:+.1f}] ({gains[size]['seeds']} seed{'s' * (gains[size]['seeds'] != 1)})"
                           for size in sizes) +
                 f" | smallest N above base: {enough[0] if enough else 'none at this budget'} |")
    x, y = [], []
    for label in pop["results"]:
        if label.startswith("es"):
            size, seed = label[2:].split("@")
            run = out / "runs" / (f"es-s{seed}" if size == "8" else f"es{size}-s{seed}")
            js = [v for _, v in load_curves(run, ["es/js_succ_bits"])["es/js_succ_bits"]]
            x.append(np.mean(js) if js else 0.0)
            y.append(values(pop, label, k).mean())
    if len(x) >= 3:
        rho, p = spearman(np.array(x), np.array(y))
        lines.append(f"| (b) ES runs with more JS diversity reach a higher {k} | Spearman ρ = {rho:+.2f} over {len(x)} "
                     f"runs, permutation p = {p:.3f} | "
                     f"{'reproduced' if rho > 0 and p < 0.05 else 'undecided at this power'} |")
    return lines


def write_report(args: Args) -> Path:
    out = Path(args.out)
    main = merged(out, "eval")
    if main is None:
        die(f"{out}/eval/ holds no base evaluation yet: run the study first")
    heldout, sweep, pop = merged(out, "heldout"), None, merged(out, "pop")
    if (out / "sweep").is_dir():
        sweep = next((load(f) for f in sorted((out / "sweep").glob("*/passk.json"))), None)
    report = out / "report"
    report.mkdir(exist_ok=True)
    plot(main, report / "passk.png")
    trained = {f"{run.name.rpartition('-s')[0]}@{run.name.rpartition('-s')[2]}": run
               for run in sorted((out / "runs").glob("*-s*"))
               if run.name.rpartition("-s")[0] in METHODS and (run / "metrics.jsonl").is_file()}
    curves = plot_curves.curves(trained, report / "curves.png") if trained else []
    costs = json.loads((out / "costs.json").read_text()) if (out / "costs.json").exists() else {}
    lanes: dict[str, float] = {}
    for step, seconds in costs.items():
        lane = (step.split("@")[0] if step.startswith(("eval-", "heldout-", "pop-", "sweep-")) else
                step if step.startswith("data-") else step.split("-s")[0])
        lanes[lane] = lanes.get(lane, 0.0) + seconds
    lines = [f"# Study: [ES-LLM]'s claims on {args.model}", "",
             f"Written by `python bench/study.py --out {args.out} --report` from the run directory.", "", "## Claims",
             "", *claims(out, main, heldout, sweep, pop), "", f"## Main task (sums ≤ 50, n = {main['n']})", "",
             markdown(main)]
    for title, r in (("Held-out task (products)", heldout), ("Functional sparsity", sweep), ("Population", pop)):
        if r is not None:
            lines += [f"## {title} (n = {r['n']})", "", markdown(r)]
    lines += ["## Training curves (report/curves.png; GRPO→ES and ES→GRPO on one step axis)", "", *curves, ""]
    lines += ["## Cost (wall seconds of each lane; a lane's steps summed)", "", "| lane | seconds | minutes |",
              "|---|---|---|", *[f"| {lane} | {s:.0f} | {s / 60:.1f} |" for lane, s in lanes.items()],
              f"| total | {sum(lanes.values()):.0f} | {sum(lanes.values()) / 60:.1f} |"]
    (report / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report / "results.md"


def main(args: Args) -> None:
    require(args.updates >= 2 and args.n >= 1 and args.heldout_n >= 1 and args.problems >= 1,
            "--updates must be ≥ 2, --n, --heldout-n and --problems ≥ 1")
    require(all(COMPLETIONS % pop == 0 for pop in args.pops), f"every --pops N must divide {COMPLETIONS}")
    require(set(args.pop_seeds) <= set(args.seeds), "--pop-seeds must be among --seeds")
    if not args.report:
        run_all(args)
    write_report(args)


if __name__ == "__main__":
    main(cli(Args))
