"""bench/es_iteration.py — where one ES iteration's time goes: rollout / perturb / restore / update.

Runs es.py's own `evaluate_population` and `es_update` once per model and backend, with the methods wrapped by
timers: `generate` (rollout), `Master.perturb` (θ = cast(master + σ·ε_n), + the engine load on vLLM),
`Master.restore` (θ = cast(master)) and `Master.add_noise`
(the update θ ← θ + α/N·Σ Z_n ε_n, regenerating N noises; its internal restore is counted as update). Rollouts are
greedy and fixed-length (EOS disabled), so every member generates exactly P × max_new_tokens tokens. The rewards
are synthetic (member n gets reward n) so that the update always runs: this measures time, not learning.

The overhead per member is ~2 passes of fp32 noise over all parameters (perturb + its share of the update),
independent of the prompt batch; the rollout grows with P × tokens. So the table also prints the tokens per member
at which (perturb + restore + update) / rollout would fall to 10% (extrapolated at the measured tokens/s).

Models: the embedded SmolLM2-135M-Instruct and random-init models of a real architecture built from its config
(`random:qwen2.5-0.5b`, `random:qwen2.5-1.5b`; no download, SmolLM2's tokenizer, whose ids fit Qwen's vocabulary).
Backends: `hf` (common.HFPolicy) and `vllm` (common.VLLMPolicy, needs vllm).

Run it (CPU, ~4 min on 2 cores):
  python bench/es_iteration.py --models smollm2-135m random:qwen2.5-0.5b --pop 4 --prompts 32 --max-new-tokens 32
GPU (see bench/gpu.sh):
  python bench/es_iteration.py --models random:qwen2.5-1.5b --dtype bfloat16 --pop 16 --prompts 64 --max-new-tokens 256
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import tyro

from util import (emit, fixed_length, machine_line, param_count, resolve_bench_model, setup_threads, sync,
                  table)

import common  # noqa: E402  (util puts the repo root on sys.path)
import es  # noqa: E402


@dataclass
class Args:
    models: tuple[str, ...] = ("smollm2-135m", "random:qwen2.5-0.5b")
    """models: names common.resolve_model takes, or random:qwen2.5-0.5b / random:qwen2.5-1.5b (random-init)"""
    backends: tuple[Literal["hf", "vllm"], ...] = ("hf",)
    """rollout backends; vllm needs common.VLLMPolicy"""
    random_layers: Optional[int] = None
    """override num_hidden_layers of the random-init architectures (default: the real count)"""
    tokenizer: str = common.EMBEDDED_MODEL
    """tokenizer for random-init models: a model name or a tokenizer folder"""
    model_dir: str = "runs/bench-models"
    """where random-init models are saved (reused when present)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype; auto = bf16 on GPU, fp32 on CPU (the master is fp32)"""
    device: Optional[str] = None
    """cpu or cuda; default: cuda if available"""
    pop: int = 4
    """population size N"""
    prompts: int = 32
    """prompts per iteration P (one batched generate per member)"""
    max_new_tokens: int = 32
    """tokens per completion T (fixed: EOS disabled)"""
    sigma: float = 1.5e-3
    """noise scale σ"""
    alpha: float = 2.5e-4
    """step size α"""
    threads: Optional[int] = 2
    """torch CPU threads (this CPU is shared: 2 cores)"""
    ratio: float = 0.10
    """the last column: tokens per member at which (perturb + restore + update) / rollout falls to this ratio"""
    out: Optional[str] = None
    """also write the table to this file"""


def timed(fn: Callable, key: str, seconds: dict[str, float], device: str,
          skip: Callable[[], bool] = lambda: False) -> Callable:
    """fn, with its wall time (GPU synchronised) added to seconds[key] unless skip() at call time."""
    def inner(*a: Any, **k: Any) -> Any:
        if skip():
            return fn(*a, **k)
        sync(device)
        start = time.perf_counter()
        out = fn(*a, **k)
        sync(device)
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
        return out
    return inner


def bench_one(engine: Any, master: common.Master, prompts: list[str], args: Args, device: str) -> dict[str, float]:
    """One iteration as es.py runs it (evaluate_population, then es_update) with per-primitive timers. Returns
    seconds per phase (a vLLM engine's weight load counts as perturb) and the token count."""
    seconds: dict[str, float] = {}
    in_update = {"on": False}
    add_noise = master.add_noise

    def update(*a: Any, **k: Any) -> float:
        in_update["on"] = True
        try:
            return add_noise(*a, **k)
        finally:
            in_update["on"] = False

    engine.generate = timed(engine.generate, "rollout", seconds, device)
    master.perturb = timed(master.perturb, "perturb", seconds, device)
    master.restore = timed(master.restore, "restore", seconds, device, skip=lambda: in_update["on"])
    master.add_noise = timed(update, "update", seconds, device)
    sync_weights = es.sync_weights
    es.sync_weights = timed(sync_weights, "perturb", seconds, device)  # the engine load of each member

    calls = [0]

    def reward_fn(i: int, text: str) -> tuple[float, bool]:  # member n → reward n: std > 0, the update always runs
        calls[0] += 1
        return float((calls[0] - 1) // len(prompts)), False

    try:
        seeds, signs = es.member_seeds(0, 0, args.pop, False)
        rewards, _, perf = es.evaluate_population(engine, master, prompts, reward_fn, seeds, signs, args.sigma,
                                                  args.max_new_tokens, 0.0, [0] * args.pop)
        row = es.es_update(master, seeds, signs, rewards.mean(1), args.alpha)
    finally:
        es.sync_weights = sync_weights
    assert row["es/skipped"] == 0
    return {**seconds, "tokens": perf["tokens"]}


def main(args: Args) -> str:
    threads = setup_threads(args.threads)
    device = args.device or common.default_device()
    lines = ["# ES iteration split (bench/es_iteration.py)", "", f"machine: {machine_line(device)}", ""]
    header = ["model", "params", "backend", "dtype", "N", "P×T", "rollout s", "perturb s", "restore s", "update s",
              "overhead/rollout", "tok/s", f"tokens/member for {args.ratio:.0%}"]
    rows = []
    for name in args.models:
        path = resolve_bench_model(name, Path(args.model_dir), args.random_layers, args.tokenizer)
        for backend in args.backends:
            policy = common.HFPolicy(path, args.dtype, device, batch_size=args.prompts)
            master = common.Master(policy.params)
            engine = policy if backend == "hf" else common.VLLMPolicy(path, args.dtype, device,
                                                                      batch_size=args.prompts)
            fixed_length(engine)
            problems = common.load_task("countdown", "train")[: args.prompts]
            prompts = [common.render_prompt("countdown", p) for p in problems]
            engine.generate(prompts[:2], max_new_tokens=2)  # warm-up: first-call allocations, kernels
            s = bench_one(engine, master, prompts, args, device)
            overhead = s["perturb"] + s["restore"] + s["update"]
            per_token = s["rollout"] / max(s["tokens"], 1)
            need = overhead / args.pop / (args.ratio * per_token)  # tokens per member: overhead = ratio·rollout
            dtype = str(getattr(getattr(policy, "model", None), "dtype", args.dtype)).removeprefix("torch.")
            rows.append([name + (f" ({args.random_layers} layers)" if args.random_layers and
                                 name.startswith("random:") else ""),
                         f"{param_count(policy) / 1e6:.0f}M", backend, dtype, args.pop,
                         f"{args.prompts}×{s['tokens'] // (args.pop * args.prompts)}", s["rollout"], s["perturb"],
                         s["restore"], s["update"], f"{overhead / s['rollout']:.1%}", s["tokens"] / s["rollout"],
                         f"{need:.0f}"])
            del policy, master, engine
    lines += [table(header, rows), "", f"after: {machine_line(device)}",
              f"command: python bench/es_iteration.py --models {' '.join(args.models)} --pop {args.pop} "
              f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --dtype {args.dtype} "
              f"--threads {threads}" + (f" --random-layers {args.random_layers}" if args.random_layers else "")]
    return emit(lines, args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
