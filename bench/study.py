"""bench/study.py — [ES-LLM]'s claims at CPU scale on SmolLM2-135M, from one resumable command, with intervals.

    python bench/study.py --out runs/study             # every step not yet done, then --export; rerun to resume
    python bench/study.py --out runs/study --export    # its results into docs/study/data/, then --report
    python bench/study.py --report                     # docs/study/results.md and plots, from docs/study/data/ alone

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
  verdicts   each claim is one pre-stated one-sided test, and Holm's step-down runs over all of them at family-wise
             α = 0.05 (bench/stats.py has the math). A claim about trained models is tested on its training seeds:
             the seed-level t test of the seeds' mean differences (df = seeds − 1), with ES, GRPO and GRPO→ES paired
             seed by seed where they saw the same seed's prompts. An effect claimed > 0 ((a) ES vs base at pass@1,
             ES vs GRPO at pass@n; (c) GRPO→ES vs base at pass@1 and at pass@n) tests H0: Δ ≤ 0; a claim of no loss
             ((c) GRPO→ES vs GRPO at pass@1 and vs ES at pass@n, margin 2 points; (d) θ_τ vs θ at the τ whose s_τ is
             nearest the paper's 78 %, margin 2 points, one model: the t test over problems; (e) held-out pass@1 vs
             base, margin 5 points) tests H0: Δ ≤ −margin. It "holds" when Holm rejects H0, is "opposite" when Holm
             rejects the one-sided test the other way (that direction's family, also at 0.05), else "undecided",
             with the minimum detectable effect at 80 % power. GRPO's entropy falls: the one-sided t test of each
             seed's first − last update > 0 (beside it the sign test, whose best p with S seeds is 1/2^S: 1/8 at 3,
             never below 0.05). (b): Spearman's ρ between an ES run's mean JS diversity and its pass@k (population
             protocol, every ES run), exact permutation p; "not testable" (and out of Holm's family) when no ordering
             of this many runs with their ties reaches p < 0.05 (4 runs: 1/24 at best, 2/24 with one tie). (f): one
             model size cannot test a size trend: "not testable here", with each N's gain shown.

Every step is a subprocess of the project's scripts (the command is at the top of its log in logs/); a step is done when
its output exists, so a killed study resumes at the step it was in (es.py and grpo.py from their last checkpoint). An
evaluation already in --data (committed by an earlier run, on any machine) is skipped, and a model is trained only when
an evaluation still needs it, so the study can be carried out in parts: run it, --export what finished, commit, and
the next run (a fresh run directory) starts at the first lane not committed; --export adds to --data. The
wall time of every step goes to costs.json. A finished run ends as --export does: every evaluation's per-problem data,
the training curves and the costs go to --data as compact JSON (docs/study/data/: kilobytes, committed), and the report
(results.md: the claim table, seeds, power, every eval table, curves, costs; delta-k.png, curves.png) is rebuilt from
those files alone, into --docs: a fresh clone rebuilds it with --report, byte for byte (tests/test_study.py checks).
"""

from __future__ import annotations

import functools
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import die, require  # noqa: E402
from harness import cli, load_curves  # noqa: E402
from eval_passk import markdown, parse_models, seed_interval, uncertainty  # noqa: E402

import plot_curves  # noqa: E402  (bench/, beside this file)
from stats import (ALPHA, RESAMPLES, SEED, entropy_row, judge, population_rows, seeded, seeded_row,  # noqa: E402
                   seeds_of, sparsity_row)

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("es", "grpo", "grpo_es", "es_grpo")


@dataclass
class Args:
    out: str = "runs/study"
    """run directory (data/, runs/, eval/, heldout/, sweep/, pop/, logs/, costs.json)"""
    report: bool = False
    """only rebuild the report (--docs) from --data: nothing is run, no run directory is needed"""
    export: bool = False
    """only export --out's results into --data, then rebuild the report (nothing is run)"""
    data: str = "docs/study/data"
    """the exported results, compact JSON (committed): all that the report reads"""
    docs: str = "docs/study"
    """where the report goes: results.md, delta-k.png, curves.png"""
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


def committed(args: Args, kind: str, label: str) -> bool:
    """Is LABEL's evaluation of KIND in --data already (exported by an earlier run, perhaps on another machine)?"""
    return label in (load(Path(args.data) / f"{kind}.json") or {"results": {}})["results"]


def evaluate(args: Args, kind: str, label: str, model: Callable[[], str], extra: list[str]) -> None:
    """eval_passk.py on one model into KIND/LABEL/ (a killed evaluation starts over), unless --data has it: `model()`
    gives the model's folder, training it on first need, so a lane whose results are committed costs nothing."""
    if committed(args, kind, label):
        return
    out = Path(args.out) / kind / label
    data, n, problems = ("sums50", args.n, args.problems) if kind == "eval" else (
        "products" if kind == "heldout" else "sums50", args.heldout_n,
        args.heldout_problems if kind == "heldout" else args.problems)
    argv = ["eval_passk.py", "--models", f"{label}={model()}", "--task", "arith", "--data", f"{args.out}/data/{data}",
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
    trained = functools.cache(lambda method, seed, pop: str(train(args, method, seed, pop)))  # each run once

    def final(method: str, seed: int, pop: int = 8) -> Callable[[], str]:  # its final checkpoint, trained on first call
        return lambda: trained(method, seed, pop)

    base = lambda: args.model  # noqa: E731
    for kind in ("heldout", "eval"):  # the held-out base first: the quickest check that the task is not at the floor
        evaluate(args, kind, "base", base, [])
    for seed in args.seeds:  # seed by seed: a study stopped early still has every method at its first seeds
        for method in ("es", *[m for m in args.methods if m != "es"]):  # ES always: the sweep and N = 8 use it
            for kind in ("eval", "heldout") if method in ("es", "grpo") else ("eval",):  # (e) asks of ES and GRPO
                evaluate(args, kind, f"{method}@{seed}", final(method, seed), [])
        if seed == args.seeds[0]:
            evaluate(args, "sweep", f"es@{seed}", final("es", seed),
                     ["--base", args.model, "--reset-tau", *map(str, args.taus)])
    for pop in args.pops:
        for seed in args.pop_seeds:
            evaluate(args, "pop", f"es{pop}@{seed}", final("es", seed, pop), [])
    for seed in args.seeds:  # N = 8 on the population study's protocol: the main runs, every seed (for (b)'s ρ)
        evaluate(args, "pop", f"es8@{seed}", final("es", seed), [])
    evaluate(args, "pop", "base", base, [])


# ---------------------------------------------------------------------------------------------------- data
KINDS = ("eval", "heldout", "sweep", "pop")  # a folder of eval_passk runs each in the run directory, a file in --data
CURVE_KEYS = [key for key, _ in plot_curves.PANELS]  # train reward, greedy eval reward and accuracy, JS, entropy
PROTOCOL = ("data", "num_problems", "temperature", "top_p", "max_new_tokens", "chat_template", "seed", "backend")


def write_json(file: Path, data: dict) -> None:
    """JSON with each entry of a top-level dict on a line of its own: kilobytes, and a diff names the model changed."""
    def line(key: str, value: object, indent: str) -> str:
        return f"{indent}{json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}"

    parts = [f" {json.dumps(k)}: {{\n" + ",\n".join(line(kk, vv, "  ") for kk, vv in v.items()) + "\n }"
             if isinstance(v, dict) and v else line(k, v, " ") for k, v in data.items()]
    file.write_text("{\n" + ",\n".join(parts) + "\n}\n" if parts else "{}\n")


def export(out: Path, data: Path) -> None:
    """The run directory's results into `data`: per kind, its evaluations merged into KIND.json (eval_passk's passk.json
    less its intervals, which the report recomputes: per model the per-problem greedy verdicts and correct counts, n,
    ks, the task; `seeds`: each label's training seed; `protocol`: the sampling flags), curves.json (each training
    run's logged curves), costs.json (each step's wall seconds)."""
    data.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        folders = sorted(f.parent for f in (out / kind).glob("*/passk.json"))
        if not folders:
            continue
        runs = [json.loads((f / "passk.json").read_text()) for f in folders]
        protocol = json.loads((folders[0] / "args.json").read_text())["args"]
        merged = {key: runs[0][key] for key in ("task", "split", "n", "ks", "base")} | {"protocol": {
            key: protocol[key] for key in PROTOCOL}, "models": {}, "seeds": {}, "results": {}, "sparsity": {}}
        if (data / f"{kind}.json").exists():  # lanes exported earlier (another run directory): kept, added to
            earlier = json.loads((data / f"{kind}.json").read_text())
            require(earlier["protocol"] == merged["protocol"] and earlier["n"] == merged["n"],
                    f"{data}/{kind}.json was evaluated with other settings than {out}/{kind}/")
            merged |= {key: earlier[key] for key in ("models", "results", "sparsity")}
        for folder, r in zip(folders, runs):
            require(r["n"] == runs[0]["n"], f"{kind}/: evaluations with different n ({r['n']}, {runs[0]['n']})")
            # the models as the study named them (passk.json holds the paths they resolved to on that machine)
            merged["models"] |= parse_models(json.loads((folder / "args.json").read_text())["args"]["models"])
            merged["results"] |= r["results"]
            merged["sparsity"] |= r["sparsity"]
        merged["seeds"] = {label: int(label.rpartition("@")[2]) if "@" in label else None
                           for label in merged["results"]}
        write_json(data / f"{kind}.json", merged)
    curves = json.loads((data / "curves.json").read_text()) if (data / "curves.json").exists() else {}
    for run in sorted((out / "runs").glob("*-s*")):  # es-s0, es4-s0, grpo_es-s2 → es@0, es4@0, grpo_es@2
        if (run / "metrics.jsonl").is_file():
            name, _, seed = run.name.rpartition("-s")
            curves[f"{name}@{seed}"] = {key: c for key, c in load_curves(run, CURVE_KEYS).items() if c}
    write_json(data / "curves.json", curves)
    costs = out / "costs.json"
    earlier = json.loads((data / "costs.json").read_text()) if (data / "costs.json").exists() else {}
    write_json(data / "costs.json", earlier | (json.loads(costs.read_text()) if costs.exists() else {}))
    print(f"exported {out} into {data} ({sum(f.stat().st_size for f in data.glob('*.json')) / 1024:.0f} KiB)")


def load(file: Path) -> Optional[dict]:
    """An exported KIND.json (None when absent), with its k keys as ints again (JSON made them strings)."""
    if not file.exists():
        return None
    report = json.loads(file.read_text())
    for tasks in report["results"].values():
        for r in tasks.values():
            r["pass@k"], r["maj@k"] = ({int(k): v for k, v in r[key].items()} for key in ("pass@k", "maj@k"))
    return report


def load_data(data: Path) -> dict:
    """Everything export wrote ({kind: report or None, "curves": …, "costs": …}), each report with eval_passk's
    intervals recomputed: against the base (the sweep: its full model), on the same resamples as its passk.md."""
    found: dict = {kind: load(data / f"{kind}.json") for kind in KINDS}
    for kind, report in found.items():
        if report is not None and (kind == "sweep" or "base" in report["results"]):
            report["uncertainty"] = uncertainty(report, "base" if kind != "sweep" else next(iter(report["results"])),
                                                RESAMPLES, SEED)
    return found | {name: json.loads((data / f"{name}.json").read_text()) if (data / f"{name}.json").exists() else {}
                    for name in ("curves", "costs")}


# ---------------------------------------------------------------------------------------------------- claims
def claims(data: dict) -> list[dict]:
    """Every pre-stated claim the data can speak to, in order, judged together (module docstring)."""
    main, heldout, sweep, pop = data["eval"], data["heldout"], data["sweep"], data["pop"]
    k = f"pass@{main['ks'][-1]}"
    rows = [seeded_row("(a) ES raises pass@1", main, "es", "base", "pass@1", None),
            seeded_row(f"(a) ES reaches a higher {k} than GRPO", main, "es", "grpo", k, None),
            entropy_row(main, data["curves"]),
            seeded_row("(c) GRPO→ES above base at pass@1", main, "grpo_es", "base", "pass@1", None),
            seeded_row(f"(c) GRPO→ES above base at {k}", main, "grpo_es", "base", k, None),
            seeded_row("(c) GRPO→ES not below GRPO at pass@1 (margin 2 pt)", main, "grpo_es", "grpo", "pass@1", 2.0),
            seeded_row(f"(c) GRPO→ES not below ES at {k} (margin 2 pt)", main, "grpo_es", "es", k, 2.0),
            sparsity_row(sweep) if sweep else None,
            seeded_row("(e) ES does not forget the held-out products (pass@1, margin 5 pt)", heldout, "es", "base",
                       "pass@1", 5.0),
            seeded_row("(e) nor does GRPO (the same rule)", heldout, "grpo", "base", "pass@1", 5.0),
            *(population_rows(pop, data["curves"]) if pop and "uncertainty" in pop else [])]
    rows = sorted((r for r in rows if r is not None), key=lambda r: r["name"][:3])  # a study still running has some
    judge(rows)  # methods and seeds only; (b) and (f) come from the population study
    return rows


# ---------------------------------------------------------------------------------------------------- report
def p_text(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def claim_tables(rows: list[dict]) -> list[str]:
    """The claim table, then each claimed comparison seed by seed, then the power of every test."""
    def ci(r: dict, lo: float, hi: float) -> str:
        f, x = r["fmt"], r["scale"]
        return f"{x * r['mean']:{f}} [{x * lo:{f}}, {x * hi:{f}}] {r['unit']}"

    def effect(r: dict) -> str:
        if "effect_text" in r:  # (b), (f): their own numbers
            return r["effect_text"]
        if "ci" not in r:  # one seed: no interval
            return f"{r['scale'] * r['mean']:{r['fmt']}} {r['unit']}"
        return ci(r, *r["ci"]) + (" (problems)" if r["unit_name"] == "problems" else "")

    family = [r for r in rows if "p" in r]
    lines = [f"Holm's step-down over the K = {len(family)} claims with a p-value, one-sided in the claimed direction, "
             f"family-wise α = {ALPHA} (and over the same tests the other way, for \"opposite\"). Effects of trained "
             "models: the mean over seeds of each seed's paired difference on the same problems (ES, GRPO and "
             "GRPO→ES paired seed by seed), its 95 % seed-level t interval (df = seeds − 1) and the one-sided t test "
             "of it; a margin claim tests H0: Δ ≤ −margin. (d) compares one model with another: its units are the "
             "problems. A row \"not testable\" is outside the family. P(A > B): probability of improvement over seed "
             "pairs (Agarwal et al. 2021). Method: bench/stats.py.", "",
             "| claim | effect [95 % interval] | per seed | P(A > B) | p | Holm p | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = r.get("per_seed_text") or (", ".join(f"{100 * m:+.1f}" for m in r["effects"])
                                              if "effects" in r else "—")
        better = r.get("improvement_text") or (f"{r['improvement'][0]:.2f} ({r['improvement'][1]} pairs)"
                                               if "improvement" in r else "—")
        lines.append(f"| {r['name']} | {effect(r)} | {per_seed} | {better} | "
                     + (f"{p_text(r['p'])} | {p_text(r['holm'])}" if "p" in r else "— | —") + f" | {r['verdict']} |")
    seeded = [r for r in rows if "per_seed" in r]
    seeds = sorted({s for r in seeded for s in r["seeds"]})
    lines += ["", "Each comparison seed by seed: the pooled mean with its two-level bootstrap interval (seeds, then "
                  "problems within each drawn seed; with 3 seeds too narrow to judge by), and each seed's own paired "
                  "difference with its problem-level 95 % bootstrap interval and the problems won/lost.", "",
              "| claim | pooled [two-level bootstrap], won/lost | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---|---|" + "---|" * len(seeds)]
    for r in seeded:
        cells = {s: f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] {won}/{lost}"
                 for s, (m, lo, hi, won, lost) in zip(r["seeds"], r["per_seed"])}
        pooled = ci(r, *r["boot"]) if "boot" in r else "—"
        lines.append(f"| {r['name']} | {pooled}, {r['won']}/{r['lost']} | "
                     + " | ".join(cells.get(s, "—") for s in seeds) + " |")
    lines += ["", "Power: what moves a seed's mean effect m_s — var(m_s) = σ²_seed + (σ²_seed×problem + σ²_sampling)/P,"
                  " each share of it (sampling: pass@1's binomial variance, an upper bound under common random "
                  "numbers; pass@k, k > 1: in seed × problem) — the problems' own spread beside it (σ_problem/√P: in "
                  "the two-level bootstrap, not in the t interval), and the minimum detectable effect at 80 % power at "
                  "the row's Holm step level α' (from the null: 0, or −margin), with the units that would detect the "
                  "observed effect at that level.", "",
              "| claim | sd of the units | seed / seed×problem / sampling | σ_problem/√P | α' | MDE | units to detect "
              "the observed effect |", "|---|---|---|---|---|---|---|"]
    for r in family:
        if r["sd"] is None:
            continue
        f, x, c = r["fmt"], r["scale"], r.get("components")
        shares = "—"
        if c is not None:
            parts = [c["seed"], c["seed×problem"] / r["problems"], c["sampling"] / r["problems"]]
            shares = " / ".join("—" if sum(parts) == 0 or (i == 2 and r["folded"]) else f"{v / sum(parts):.0%}"
                                for i, v in enumerate(parts))
        problem = f"{x * math.sqrt(c['problem'] / r['problems']):.1f} {r['unit']}" if c is not None else "—"
        needed = (f"{r['needed']:,} {r['unit_name']}" if r["needed"] else
                  "— (the observed effect is on the null side)" if r["mean"] <= r["null"] else "> 100,000")
        f = f.lstrip("+")  # sizes have no sign
        lines.append(f"| {r['name']} | {x * r['sd']:{f}} {r['unit']} ({r['units']} {r['unit_name']}) | {shares} "
                     f"| {problem} | {r['level']:.4f} | {x * r['mde']:{f}} {r['unit']} | {needed} |")
    return lines


COMPARISONS = (("es", "base", "ES − base"), ("grpo", "base", "GRPO − base"), ("grpo_es", "base", "GRPO→ES − base"),
               ("es", "grpo", "ES − GRPO (same seed)"), ("grpo_es", "grpo", "GRPO→ES − GRPO (same seed)"))
COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")  # Okabe & Ito: colour-blind safe


def plot_deltas(main: dict, file: Path) -> None:
    """Δ(k) = pass@k(A) − pass@k(B) vs k on a log2 axis, seed by seed (same seed where both are trained): the mean over
    seeds with its 95 % seed-level t band, each seed a thin line. Left against the base, right method against method."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ks = main["ks"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True, layout="constrained")
    for (a, b, name), color in zip(COMPARISONS, COLORS):
        if not seeds_of(main, a) or not (b in main["results"] or seeds_of(main, b)):
            continue
        effects = 100 * np.array([seeded(main, a, b, f"pass@{k}")["d"].mean(1) for k in ks]).T  # (S, K)
        ax = axes[0] if b == "base" else axes[1]
        ax.plot(ks, effects.T, color=color, lw=0.7, alpha=0.6)
        ax.plot(ks, effects.mean(0), color=color, lw=2, marker="o", label=f"{name} ({len(effects)} seeds)")
        if len(effects) > 1:
            _, lo, hi = seed_interval(effects[:, None, :])  # (3, K)
            ax.fill_between(ks, lo, hi, color=color, alpha=0.15, lw=0)
    for ax, title in zip(axes, ("against the base", "method against method, same seed")):
        ax.axhline(0, color="0.3", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(title=title, xlabel="k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Δ pass@k (points)")
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles, [h.get_label() for h in handles], loc="outside lower center", ncol=3, fontsize=8)
    fig.suptitle(f"pass@k differences on {main['task']} ({len(main['results']['base'][main['task']]['correct_counts'])}"
                 f" problems, n = {main['n']}): mean over seeds, 95 % seed-level t band; thin lines: each seed")
    fig.savefig(file, dpi=120, metadata={"Software": None})  # no version stamp: a rebuild gives the same bytes
    plt.close(fig)


def plot_training(curves: dict, file: Path) -> None:
    """Training curves from the exported data: a panel per logged metric, a colour per method, a line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, name) for key, name in plot_curves.PANELS if any(c.get(key) for c in curves.values())]
    methods = list(dict.fromkeys(label.rpartition("@")[0] for label in curves))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False, layout="constrained")
    for label, run in curves.items():
        method, _, seed = label.rpartition("@")
        style = dict(color=COLORS[methods.index(method) % len(COLORS)], ls=("-", "--", ":", "-.")[int(seed) % 4])
        for ax, (key, _) in zip(axes[0], panels):
            if run.get(key):
                ax.plot(*zip(*run[key]), marker="o", ms=2.5, lw=1.2, label=label, **style)
    for ax, (_, name) in zip(axes[0], panels):
        ax.set(title=name, xlabel="update")
        ax.grid(alpha=0.3)
    found = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(found.values(), found.keys(), loc="outside right upper", fontsize=8)
    fig.savefig(file, dpi=120, metadata={"Software": None})
    plt.close(fig)


def write_report(data_dir: Path, docs: Path) -> Path:
    """results.md, delta-k.png and curves.png in `docs`, from the exported data in `data_dir` alone."""
    data = load_data(data_dir)
    main = data["eval"]
    if main is None or "base" not in main["results"]:
        die(f"{data_dir} holds no evaluation of the base yet: run the study, then --export")
    docs.mkdir(parents=True, exist_ok=True)
    plot_deltas(main, docs / "delta-k.png")
    trained = {label: c for label, c in data["curves"].items() if label.rpartition("@")[0] in METHODS}
    if trained:
        plot_training(trained, docs / "curves.png")
    lanes: dict[str, float] = {}
    for step, seconds in data["costs"].items():
        lane = (step.split("@")[0] if step.startswith(("eval-", "heldout-", "pop-", "sweep-")) else
                step if step.startswith("data-") else step.split("-s")[0])
        lanes[lane] = lanes.get(lane, 0.0) + seconds
    lines = [f"# Study: [ES-LLM]'s claims on {main['models']['base']}", "",
             "Written by `python bench/study.py --report` from docs/study/data/ alone (exported from the run directory "
             "by `python bench/study.py --out runs/study --export`).", "", "## Claims", "", *claim_tables(claims(data)),
             "", "![Δ pass@k against k, seed-level bands](delta-k.png)", "",
             f"## Main task (sums ≤ 50, n = {main['n']})", "", markdown(main)]
    for title, kind in (("Held-out task (products)", "heldout"), ("Functional sparsity", "sweep"),
                        ("Population", "pop")):
        if data[kind] is not None and "uncertainty" in data[kind]:  # a kind whose base is not evaluated yet: later
            lines += [f"## {title} (n = {data[kind]['n']})", "", markdown(data[kind])]
    if trained:
        lines += ["## Training curves (curves.png; GRPO→ES and ES→GRPO on one step axis)", "",
                  *plot_curves.table(trained), "", "![training curves](curves.png)", ""]
    lines += ["## Cost (wall seconds of each lane; a lane's steps summed)", "", "| lane | seconds | minutes |",
              "|---|---|---|", *[f"| {lane} | {s:.0f} | {s / 60:.1f} |" for lane, s in lanes.items()],
              f"| total | {sum(lanes.values()):.0f} | {sum(lanes.values()) / 60:.1f} |"]
    (docs / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return docs / "results.md"


def main(args: Args) -> None:
    require(args.updates >= 2 and args.n >= 1 and args.heldout_n >= 1 and args.problems >= 1,
            "--updates must be ≥ 2, --n, --heldout-n and --problems ≥ 1")
    require(all(COMPLETIONS % pop == 0 for pop in args.pops), f"every --pops N must divide {COMPLETIONS}")
    require(set(args.pop_seeds) <= set(args.seeds), "--pop-seeds must be among --seeds")
    if not args.report:
        if not args.export:
            run_all(args)
        export(Path(args.out), Path(args.data))
    write_report(Path(args.data), Path(args.docs))


if __name__ == "__main__":
    main(cli(Args))
