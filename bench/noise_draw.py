"""bench/noise_draw.py — one ES noise draw over every parameter of a model: common.noise vs a single generator.

ES draws fresh fp32 Gaussian noise for all parameters twice per member (the perturbation, and its share of the
update, which regenerates every member's noise), so on a CPU the draw is a large part of the non-rollout time.
common.noise splits each tensor into chunks of NOISE_CHUNK elements, each with its own generator seeded from
(seed, tensor name, chunk), and fills them in parallel threads. The reference here is the previous implementation:
one generator per tensor seeded from (seed, tensor name), one serial `torch.randn`. Both are i.i.d. N(0, 1) per
tensor; they are different random streams. The two alternate A B A B … in one process; the table gives the
median seconds per full draw and the per-pair ratio.

    python bench/noise_draw.py --model smollm2-135m --repeats 5
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from util import machine_line, resolve_bench_model, setup_threads, table

import common  # noqa: E402  (util puts the repo root on sys.path)
import harness  # noqa: E402


@dataclass
class Args:
    model: str = common.EMBEDDED_MODEL
    """model whose parameter shapes are drawn (a name common.resolve_model takes, or random:qwen2.5-0.5b)"""
    repeats: int = 5
    """pairs of draws (one of each implementation per pair)"""
    threads: int = 2
    """torch threads (common.noise uses this many fill threads on CPU)"""


def single_generator(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """The previous common.noise: one generator per tensor, one serial randn."""
    generator = torch.Generator().manual_seed(common.derive_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def main(args: Args) -> None:
    setup_threads(args.threads)
    path = resolve_bench_model(args.model, common.CACHE_DIR / "bench-models", None, common.EMBEDDED_MODEL)
    shapes = {k: p.shape for k, p in common.meta_params(path).items()}
    draws = {"common.noise (chunks, threads)": lambda s, k, shape: common.noise(s, k, shape, "cpu"),
             "one generator per tensor": single_generator}
    seconds: dict[str, list[float]] = {name: [] for name in draws}
    for r in range(args.repeats + 1):  # pair 0 warms up (thread pool, allocator) and is not counted
        for name, draw in draws.items():
            start = time.perf_counter()
            for k, shape in shapes.items():
                draw(r, k, shape)
            if r:
                seconds[name].append(time.perf_counter() - start)
    (a, sa), (b, sb) = seconds.items()
    ratios = [x / y for x, y in zip(sa, sb)]
    print(f"machine: {machine_line('cpu')}")
    print(f"{sum(s.numel() for s in shapes.values()) / 1e6:.1f}M parameters, {len(shapes)} tensors, "
          f"NOISE_CHUNK = {common.NOISE_CHUNK}, {args.repeats} pairs\n")
    print(table(["draw", "median s", "min s", "max s"],
                [[name, statistics.median(s), min(s), max(s)] for name, s in seconds.items()]))
    print(f"\nratio {a} / {b}: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main(harness.cli(Args))
