"""bench/shared_prefill.py — n samples per prompt: one shared prefill (HFPolicy.generate) vs n prefills.

eval_passk.py samples n = 32 completions of every problem and grpo.py G = 8 of every prompt. HFPolicy.generate
prefills each prompt once and copies its KV cache to the prompt's n rows; the reference is HF `generate` on the n
copies of each prompt (how HFPolicy sampled before), in the same chunks of --batch-size rows with the same seeds.
On a CPU a forward costs about the same per token in prefill and decode, so with arith's 76-token chat prompt and
~22 new tokens, the n prefills are most of the work. The two alternate A B A B …; the table gives seconds per call
and new tokens per second, and the tokens of the two are compared (they must be equal).

    python bench/shared_prefill.py --problems 8 --n 32 --repeats 2
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from util import machine_line, setup_threads, table

import common  # noqa: E402  (util puts the repo root on sys.path)
import harness  # noqa: E402


@dataclass
class Args:
    model: str = common.EMBEDDED_MODEL
    """model (a name common.resolve_model takes)"""
    problems: int = 8
    """arith test problems (chat template), each sampled n times"""
    n: int = 32
    """samples per problem"""
    max_new_tokens: int = 24
    """generation budget per completion (the Quickstart's)"""
    batch_size: int = 256
    """rows per generate call"""
    repeats: int = 2
    """pairs of calls (one of each per pair)"""
    threads: int = 2
    """torch threads"""


def n_prefills(policy: common.HFPolicy, prompts: list[str], n: int, max_new_tokens: int, seed: int) -> list[list[int]]:
    """The reference: HF generate on n copies of every prompt (full rows, no EOS trimming)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=0.6, top_p=1.0, top_k=0,
                              pad_token_id=policy.tokenizer.pad_token_id, eos_token_id=sorted(policy.eos_ids))
    rows, out = [p for p in prompts for _ in range(n)], []
    for start in range(0, len(rows), policy.batch_size):
        batch = policy.tokenizer(rows[start:start + policy.batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False)
        torch.manual_seed(common.derive_seed(seed, start))
        out += policy.model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:].tolist()
    return out


def main(args: Args) -> None:
    setup_threads(args.threads)
    policy = common.HFPolicy(args.model, "float32", "cpu", batch_size=args.batch_size)
    problems = common.load_task("arith", "test")[:args.problems]
    prompts = [common.render_prompt("arith", p, policy.tokenizer, True) for p in problems]
    calls = {"shared prefill (HFPolicy.generate)": lambda s: [x.token_ids for x in policy.generate(
                 prompts, args.n, args.max_new_tokens, temperature=0.6, seed=s)],
             "n prefills (HF generate on copies)": lambda s: n_prefills(policy, prompts, args.n, args.max_new_tokens, s)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    tokens, equal = 0, True
    for r in range(args.repeats):
        got = {}
        for name, call in calls.items():
            start = time.perf_counter()
            got[name] = call(r)
            seconds[name].append(time.perf_counter() - start)
        shared, full = got.values()
        equal &= all(s == f[:len(s)] for s, f in zip(shared, full))  # the reference keeps padding after EOS
        tokens = sum(map(len, shared))
    (a, sa), (b, sb) = seconds.items()
    print(f"machine: {machine_line('cpu')}")
    print(f"{args.problems} problems × n = {args.n}, prompt {len(policy.encode(prompts[:1])[0])} tokens, {tokens} new "
          f"tokens a call, batches of {args.batch_size} rows, {args.repeats} pairs; same tokens: {equal}\n")
    print(table(["generation", "median s", "new tokens/s"],
                [[name, statistics.median(s), tokens / statistics.median(s)] for name, s in seconds.items()]))
    print(f"\nspeed-up ({b} / {a}): median {statistics.median(y / x for x, y in zip(sa, sb)):.2f}")


if __name__ == "__main__":
    main(harness.cli(Args))
