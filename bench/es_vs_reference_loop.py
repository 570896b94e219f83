"""bench/es_vs_reference_loop.py — our ES member evaluation vs the reference implementation's loop structure.

Ours (`es.evaluate_population`, the real code): for each member, θ = cast(master + σ·ε_n) from the fp32 master with
i.i.d. per-tensor noise, ONE batched generate over all prompts, score, exact restore θ = cast(master).
Reference ([Qiu] original HF loop), re-expressed below in a few lines: for each member, add σ·ε in place to
every parameter in the model's dtype with ONE seed for every tensor, HF generate on all prompts at once (left
padding, greedy), decode, score, then regenerate the same noise and subtract it to restore.

Two measurements, side by side in one process on the same model:
  1. speed: N members × P prompts × T tokens each way (greedy, fixed length: EOS disabled), in --dtype (fp32 on
     CPU, where bf16 is ~3× slower; bf16 on GPU), wall and CPU seconds, after a short warm-up member each way; the
     weights' drift after those N members.
  2. bf16 restore drift after --drift-members (30) perturb/restore cycles, in bf16 on the same model: max |θ − θ₀|
     and the fraction of elements that differ from the start weights. Generation does not change weights, so the
     cycles here skip it: the drift comes from the perturb/restore arithmetic alone.

Run it (CPU, ~5 min on 2 cores):
  python bench/es_vs_reference_loop.py --pop 3 --prompts 16 --max-new-tokens 16 --drift-members 30
GPU:
  python bench/es_vs_reference_loop.py --model random:qwen2.5-1.5b --dtype bfloat16 --pop 8 --prompts 64 \
      --max-new-tokens 256
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import tyro
from transformers import GenerationConfig

from util import emit, fixed_length, machine_line, resolve_bench_model, setup_threads, sync, table

import common  # noqa: E402  (util puts the repo root on sys.path)
import es  # noqa: E402


@dataclass
class Args:
    model: str = common.EMBEDDED_MODEL
    """model: a name common.resolve_model takes, or random:qwen2.5-0.5b / random:qwen2.5-1.5b (random-init)"""
    random_layers: Optional[int] = None
    """override num_hidden_layers of a random-init architecture"""
    tokenizer: str = common.EMBEDDED_MODEL
    """tokenizer for random-init models: a model name or a tokenizer folder"""
    model_dir: str = "runs/bench-models"
    """where random-init models are saved (reused when present)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype of the speed comparison; auto = bf16 on GPU, fp32 on CPU (the drift is always measured in bf16)"""
    device: Optional[str] = None
    """cpu or cuda; default: cuda if available"""
    pop: int = 3
    """members N timed each way"""
    prompts: int = 16
    """prompts P per member (one batched generate)"""
    max_new_tokens: int = 16
    """tokens per completion T (fixed: EOS disabled)"""
    sigma: float = 1e-3
    """noise scale σ ([Qiu], the reference's)"""
    drift_members: int = 30
    """perturb/restore cycles for the bf16 drift measurement (0 = skip)"""
    seed: int = 0
    """seed of the member seeds"""
    threads: Optional[int] = 2
    """torch CPU threads (this CPU is shared: 2 cores)"""
    out: Optional[str] = None
    """also write the table to this file"""


# ------------------------------------------------------------------ the reference loop ([Qiu] HF code)
@torch.no_grad()
def reference_add_noise(model: torch.nn.Module, seed: int, scale: float) -> None:
    """θ += scale·ε in the model dtype; ONE seed for every tensor (equal-shaped tensors get equal noise)."""
    for p in model.parameters():
        generator = torch.Generator(device=p.device).manual_seed(seed)
        p.add_(scale * torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype))


@torch.no_grad()
def reference_member(policy: common.HFPolicy, prompts: list[str], seed: int, sigma: float,
                     max_new_tokens: int) -> list[str]:
    """Perturb in place, HF generate on all prompts at once (left padding, greedy), decode, subtract the noise."""
    reference_add_noise(policy.model, seed, sigma)
    batch = policy.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(policy.device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=policy.tokenizer.pad_token_id)
    out = policy.model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:]
    texts = policy.tokenizer.batch_decode(out, skip_special_tokens=True)
    reference_add_noise(policy.model, seed, -sigma)  # restore by subtraction: lossy in bf16 (and in fp32)
    return texts


# ------------------------------------------------------------------ measurements
def snapshot(policy: common.HFPolicy) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in policy.params.items()}


def drift(policy: common.HFPolicy, start: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |θ − θ₀|, fraction of elements with θ ≠ θ₀), compared in the model's dtype."""
    worst, differ, total = 0.0, 0, 0
    for k, p in policy.params.items():
        diff = p.detach() != start[k]
        differ, total = differ + int(diff.sum()), total + diff.numel()
        if diff.any():
            worst = max(worst, float((p.detach().float() - start[k].float()).abs().max()))
    return worst, differ / total


def timed(fn: callable, device: str) -> tuple[float, float]:
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(args: Args) -> str:
    threads = setup_threads(args.threads)
    device = args.device or common.default_device()
    path = resolve_bench_model(args.model, Path(args.model_dir), args.random_layers, args.tokenizer)
    problems = common.load_task("countdown", "train")[: args.prompts]
    prompts = [common.render_prompt("countdown", p) for p in problems]
    seeds, signs = es.member_seeds(args.seed, 0, args.pop, antithetic=False)
    lines = ["# ES member evaluation: ours vs the reference loop (bench/es_vs_reference_loop.py)", "",
             f"machine: {machine_line(device)}", ""]

    # 1. speed, in --dtype: the same N members, prompts and fixed-length greedy work each way
    policy = common.HFPolicy(path, args.dtype, device, batch_size=args.prompts)
    master = common.Master(policy.params)
    fixed_length(policy)
    reward_fn = lambda i, text: common.score("countdown", problems[i], text)  # noqa: E731

    def population(members: int, max_new_tokens: int) -> object:
        return es.evaluate_population(policy, master, prompts, reward_fn, seeds[:members], signs[:members],
                                      args.sigma, max_new_tokens, 0.0, [0] * members)

    # warm-up, one short member each way (first-call allocations), then back to exactly θ₀
    population(1, 2)
    reference_member(policy, prompts, 12345, args.sigma, 2)
    master.restore()
    start = snapshot(policy)
    ours = timed(lambda: population(args.pop, args.max_new_tokens), device)
    ours_drift = drift(policy, start)
    master.restore()
    ref = timed(lambda: [[common.score("countdown", problems[i], text) for i, text in
                          enumerate(reference_member(policy, prompts, s, args.sigma, args.max_new_tokens))]
                         for s in seeds], device)
    ref_drift = drift(policy, start)
    dtype = str(policy.model.dtype).removeprefix("torch.")
    header = ["loop", "dtype", "N×P×T", "wall s", "CPU s", "speed vs reference (wall)", "speed vs reference (CPU)",
              f"max abs Δθ after N={args.pop}", f"elements changed after N={args.pop}"]
    work = f"{args.pop}×{args.prompts}×{args.max_new_tokens}"
    rows = [["ours (fp32 master, exact restore)", dtype, work, ours[0], ours[1], f"{ref[0] / ours[0]:.2f}×",
             f"{ref[1] / ours[1]:.2f}×", ours_drift[0], f"{ours_drift[1]:.3%}"],
            ["reference (in-place add/subtract)", dtype, work, ref[0], ref[1], "1.00×", "1.00×", ref_drift[0],
             f"{ref_drift[1]:.3%}"]]
    lines += [table(header, rows), ""]
    del policy, master

    # 2. bf16 restore drift after `drift_members` members (perturb/restore only: generation changes no weight)
    if args.drift_members:
        policy = common.HFPolicy(path, "bfloat16", device, batch_size=args.prompts)
        master = common.Master(policy.params)
        start = snapshot(policy)
        drift_seeds, _ = es.member_seeds(args.seed, 1, args.drift_members, antithetic=False)
        t_ours = timed(lambda: [(master.perturb(s, args.sigma), master.restore()) for s in drift_seeds], device)
        ours_drift = drift(policy, start)
        t_ref = timed(lambda: [(reference_add_noise(policy.model, s, args.sigma),
                                reference_add_noise(policy.model, s, -args.sigma)) for s in drift_seeds], device)
        ref_drift = drift(policy, start)
        # the real ES update for scale: α/N·Σ Z_n ε_n has per-element std α·‖Z‖/N = α/√N
        header = ["loop (bf16)", "members", "max abs Δθ", "elements ≠ θ₀", "perturb+restore s"]
        rows = [["ours (fp32 master, exact restore)", args.drift_members, ours_drift[0], f"{ours_drift[1]:.3%}",
                 t_ours[0]],
                ["reference (in-place add/subtract)", args.drift_members, ref_drift[0], f"{ref_drift[1]:.3%}",
                 t_ref[0]]]
        lines += [f"bf16 restore drift after {args.drift_members} members, σ = {args.sigma:g} "
                  f"(for scale: one ES update at α = 5e-4, N = 30 moves an element by ~α/√N = "
                  f"{5e-4 / np.sqrt(30):.1e} in std)", "", table(header, rows), ""]
    lines += [f"after: {machine_line(device)}",
              f"command: python bench/es_vs_reference_loop.py --model {args.model} --dtype {args.dtype} "
              f"--pop {args.pop} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
              f"--sigma {args.sigma:g} --drift-members {args.drift_members} --threads {threads}"
              + (f" --random-layers {args.random_layers}" if args.random_layers else "")]
    return emit(lines, args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
