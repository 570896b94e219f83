"""Did a model's greedy answers get better than the base's on the same problems? The paired greedy reward and
accuracy from the samples.jsonl of one eval_passk.py run, with eval_passk's paired bootstrap.

eval_passk.py's passk.md already gives the paired greedy accuracy and pass@k against --reference; this adds the greedy
reward r (1 right, 0.1 boxed but wrong, 0 unboxed), which passk.json does not keep per problem. For each model m ≠ base
and problem set, over its P problems x: d(x) = r_m(x) − r_base(x) (and likewise for correctness), its mean with a 95%
paired-bootstrap interval (eval_passk.paired: both models on the same resampled problems), and how many problems m
solves that the base does not ("won") and the reverse ("lost").

    python eval_passk.py --task arith --chat-template --models base=smollm2-135m \
        es=runs/quickstart/checkpoints/step_000006 --num-problems 200 --n 1 --max-new-tokens 24 --out-dir runs/qs-eval
    python bench/paired_greedy.py --run runs/qs-eval --base base
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import derive_seed, require  # noqa: E402
from harness import cli  # noqa: E402
from eval_passk import Args as EvalArgs, bootstrap_draws, paired  # noqa: E402


@dataclass
class Args:
    run: str
    """an eval_passk.py run directory (its samples.jsonl)"""
    base: str = "base"
    """the label of the model to compare against"""


def compare(rows: list[dict], base: str, resamples: int = EvalArgs.resamples, seed: int = EvalArgs.seed) -> list[dict]:
    """A result per (model ≠ base, problem set) from samples.jsonl rows that hold a greedy completion; eval_passk's
    resamples of the problems (its default --resamples and --seed), so the accuracy intervals are passk.md's."""
    greedy = defaultdict(dict)  # (model, set) -> problem -> greedy row
    for row in rows:
        if "greedy" in row:
            greedy[row["model"], row["set"]][row["problem"]] = row["greedy"]
    out = []
    for (model, name), by_problem in greedy.items():
        if model == base:
            continue
        require((base, name) in greedy, f"no greedy rows of '{base}' on '{name}'")
        problems = sorted(set(by_problem) & set(greedy[base, name]))
        a, b = (np.array([[float(g[x]["reward"]), float(g[x]["correct"])] for x in problems])  # (P, 2)
                for g in (greedy[base, name], by_problem))
        draws = bootstrap_draws(len(problems), resamples, derive_seed(seed, "bootstrap", name))
        (diff, lo, hi), won, lost = paired(b, a, draws)
        out.append({"model": model, "set": name, "problems": len(problems), "won": int(won[1]), "lost": int(lost[1]),
                    **{key: (a[:, i].mean(), b[:, i].mean(), diff[i], lo[i], hi[i])
                       for i, key in enumerate(("reward", "correct"))}})
    return out


def main(args: Args) -> None:
    file = Path(args.run) / "samples.jsonl"
    require(file.is_file(), f"no samples.jsonl in '{args.run}'")
    results = compare([json.loads(line) for line in file.read_text().splitlines()], args.base)
    print(f"| model | set | P | greedy reward: {args.base} → model | Δ [95% interval] | greedy accuracy: {args.base} → "
          "model | Δ [95% interval] | won / lost |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        (ra, rb, rd, rlo, rhi), (ca, cb, cd, clo, chi) = r["reward"], r["correct"]
        print(f"| {r['model']} | {r['set']} | {r['problems']} | {ra:.3f} → {rb:.3f} | {rd:+.3f} [{rlo:+.3f}, "
              f"{rhi:+.3f}] | {ca:.3f} → {cb:.3f} | {cd:+.3f} [{clo:+.3f}, {chi:+.3f}] | {r['won']} / {r['lost']} |")


if __name__ == "__main__":
    main(cli(Args))
