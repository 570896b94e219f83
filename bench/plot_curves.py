"""Training curves of es.py / grpo.py / grpo_es.py runs side by side, from their metrics.jsonl.

One PNG (harness.plot_curves: the same panels every training run writes to its curves.png) with a colour per run:
train reward (ES: mean over the population's members; GRPO: mean over sampled completions), greedy held-out reward
and accuracy (the runs' --eval-every rows), and ES's JS_succ diversity ([ES-LLM] §3.1, bits). Prints a markdown
table of the first → last value of each.

    python bench/plot_curves.py --runs es=runs/es grpo=runs/grpo --out runs/curves.png
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import require  # noqa: E402
from harness import CURVES, cli, plot_curves  # noqa: E402
from es import ES_CURVES  # noqa: E402
from grpo import GRPO_CURVES  # noqa: E402

PANELS = CURVES + ES_CURVES + GRPO_CURVES


@dataclass
class Args:
    runs: tuple[str, ...]
    """runs as label=RUN_DIR (each holding metrics.jsonl)"""
    out: str = "curves.png"
    """output PNG; the markdown table is printed"""


def table(found: dict[str, dict[str, list[tuple[int, float]]]]) -> list[str]:
    """A markdown table of each metric's first → last value per run, from {run: {metric: [(step, value)]}}."""
    lines = ["| run | " + " | ".join(f"{name} (first → last)" for _, name in PANELS) + " |",
             "|---" * (len(PANELS) + 1) + "|"]
    for label, run_curves in found.items():
        cells = [f"{p[0][1]:.3f} → {p[-1][1]:.3f}" if (p := run_curves.get(key)) else "–" for key, _ in PANELS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def curves(runs: dict[str, Path], out: Path) -> list[str]:
    """Plot the runs' curves to `out`; a markdown table of each metric's first → last value per run."""
    return table(plot_curves(runs, out, PANELS))


def main(args: Args) -> None:
    runs = {}
    for spec in args.runs:
        label, _, path = spec.partition("=")
        runs[label] = Path(path or label)
        require((runs[label] / "metrics.jsonl").is_file(), f"no metrics.jsonl in '{runs[label]}'")
    print("\n".join(curves(runs, Path(args.out))))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(cli(Args))
