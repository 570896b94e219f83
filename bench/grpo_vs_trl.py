"""bench/grpo_vs_trl.py — one GRPO optimizer step of grpo.py vs TRL's GRPOTrainer: seconds per step and peak RSS.

Same model, the same P prompts per step, G completions each, exactly T new tokens (EOS disabled on our side,
`min_new_tokens = T` on TRL's, so both generate and train on the same number of tokens), HF `generate` on both
(no vLLM), the same dtype (fp32 on CPU; fp32 weights + bf16 autocast with --dtype bfloat16), lr 1e-6 constant,
β = 0 (no reference model), μ = 1, the same `grpo` loss aggregation, no gradient checkpointing, grad clip 1.0,
one optimizer step per generation batch. The reward is the same cheap function on both sides (distinct
characters / 100: a spread of rewards, so advantages are non-zero); scoring time is negligible either way.

Each side runs in its own subprocess (`--side ours|trl`), so peak RSS (ru_maxrss: model load included) is its own.
A step = rollout + reward + advantages + forward/backward + AdamW; step 1 includes one-time warm-up costs, so the
table shows every step and the ratio uses the mean of steps 2.. (step 1 when --steps 1). Besides wall time it
reports the process's CPU seconds per step: on a shared CPU the wall time of two sides run one after the other
sees different loads; CPU seconds are less sensitive to that (on a GPU they mean little: read the wall time).

Needs `trl`, in its own environment (requirements-trl.txt). Run it (CPU, ~3 min on 2 cores):
  .venv-trl/bin/python bench/grpo_vs_trl.py --prompts 2 --group-size 4 --max-new-tokens 32 --steps 3
GPU:
  python bench/grpo_vs_trl.py --model random:qwen2.5-1.5b --dtype bfloat16 --prompts 8 --group-size 8 \
      --max-new-tokens 256 --steps 3
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

from util import emit, fixed_length, machine_line, resolve_bench_model, setup_threads, sync, table

import common  # noqa: E402  (util puts the repo root on sys.path)


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
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype: float32, or bf16 autocast over fp32 weights (both sides)"""
    device: Optional[str] = None
    """cpu or cuda; default: cuda if available"""
    prompts: int = 2
    """prompts per step P"""
    group_size: int = 4
    """completions per prompt G"""
    max_new_tokens: int = 32
    """tokens per completion T (fixed on both sides)"""
    steps: int = 3
    """optimizer steps timed per side"""
    lr: float = 1e-6
    """AdamW learning rate (constant)"""
    threads: Optional[int] = 2
    """torch CPU threads (this CPU is shared: 2 cores)"""
    sides: tuple[Literal["ours", "trl"], ...] = ("ours", "trl")
    """which implementations to run"""
    side: Optional[Literal["ours", "trl"]] = None
    """internal: run one side in this process and print its JSON"""
    out: Optional[str] = None
    """also write the table to this file"""


def bench_reward(text: str) -> float:
    """Cheap, deterministic, and spread out over a group of sampled completions."""
    return len(set(text)) / 100


def step_prompts(args: Args, tokenizer: object) -> list[str]:
    """P·steps Countdown prompts (raw [Qiu] form); step k uses prompts[kP:(k+1)P] on both sides."""
    problems = common.load_task("countdown", "train")[: args.prompts * args.steps]
    return [common.render_prompt("countdown", p) for p in problems]


def run_ours(args: Args, path: str, device: str) -> list[tuple[float, float]]:
    """grpo.py's stages 2–4 (rollout, rewards, update) as its main loop runs them, timed per step."""
    import torch

    import grpo

    gargs = replace(grpo.Args(), model=path, group_size=args.group_size, prompts_per_step=args.prompts,
                    max_new_tokens=args.max_new_tokens, lr=args.lr, beta=0.0, loss_type="grpo", num_iterations=1,
                    temperature=1.0, top_p=1.0, dtype=args.dtype, batch_size=args.prompts * args.group_size,
                    micro_batch_size=args.prompts * args.group_size, gradient_checkpointing=False)  # as TRL's below
    policy = common.HFPolicy(path, "float32", device, batch_size=gargs.batch_size)  # fp32 weights, as grpo.main
    fixed_length(policy)
    policy.model.requires_grad_(True)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=gargs.lr, weight_decay=gargs.weight_decay)
    prompts = step_prompts(args, policy.tokenizer)
    prompt_ids = policy.encode(prompts)
    times = []
    for step in range(args.steps):
        batch = list(range(step * args.prompts, (step + 1) * args.prompts))
        sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        samples = grpo.rollout(policy, [prompts[i] for i in batch], gargs, step)  # 2. rollouts
        rewards = np.array([bench_reward(x.text) for x in samples]).reshape(args.prompts, args.group_size)  # 3.
        grpo.update(policy, optimizer, None, [prompt_ids[i] for i in batch], samples, rewards, gargs)  # 4.
        sync(device)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
        assert all(len(x.token_ids) == args.max_new_tokens for x in samples)
    return times


def run_trl(args: Args, path: str, device: str) -> list[tuple[float, float]]:
    """TRL GRPOTrainer with the same settings; a callback times each optimizer step (generation included)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": step_prompts(args, tokenizer)})
    times: list[tuple[float, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            sync(device)
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: object, **k: object) -> None:
            sync(device)
            times.append((time.perf_counter() - self.start, time.process_time() - self.cpu))

    def reward(prompts: list[str], completions: list[str], **kwargs: object) -> list[tuple[float, float]]:
        return [bench_reward(c) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group_size,
        gradient_accumulation_steps=1, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, num_iterations=1, loss_type="grpo", scale_rewards="group", gradient_checkpointing=False,
        bf16=args.dtype == "bfloat16", use_cpu=device == "cpu", shuffle_dataset=False, seed=0,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    return times


def run_side(args: Args) -> None:
    """Child process: one side, then one JSON line with its step times and peak memory."""
    import torch

    setup_threads(args.threads)
    device = args.device or common.default_device()
    path = resolve_bench_model(args.model, Path(args.model_dir), args.random_layers, args.tokenizer)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = (run_ours if args.side == "ours" else run_trl)(args, path, device)
    version = "grpo.py" if args.side == "ours" else f"trl {__import__('trl').__version__}"
    print(json.dumps({"side": args.side, "version": version, "times": times,
                      "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
                      "gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0}))


def main(args: Args) -> str:
    if args.side:
        run_side(args)
        return ""
    setup_threads(args.threads)
    device = args.device or common.default_device()
    # build a random-init model once, here, so neither child pays for it
    resolve_bench_model(args.model, Path(args.model_dir), args.random_layers, args.tokenizer)
    lines = ["# GRPO step: grpo.py vs TRL GRPOTrainer (bench/grpo_vs_trl.py)", "",
             f"machine: {machine_line(device)}", ""]
    flags = ["--model", args.model, "--dtype", args.dtype, "--prompts", str(args.prompts), "--group-size",
             str(args.group_size), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps),
             "--lr", str(args.lr), "--model-dir", args.model_dir, "--tokenizer", args.tokenizer]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--random-layers", str(args.random_layers)] if args.random_layers else []
    flags += ["--device", args.device] if args.device else []
    results = {}
    for side in args.sides:
        proc = subprocess.run([sys.executable, __file__, *flags, "--side", side], capture_output=True, text=True)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not last.startswith("{"):
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            results[side] = None
            continue
        results[side] = json.loads(last)

    def mean_step(r: dict, k: int = 0) -> float:  # k = 0: wall seconds, 1: CPU seconds of the process
        t = r["times"][1:] or r["times"]
        return float(np.mean([x[k] for x in t]))

    trl = results.get("trl")
    header = ["side", "version", "wall s per step", "mean wall s/step (2..)", "× TRL wall", "mean CPU s/step (2..)",
              "× TRL CPU", "peak RSS GB", "peak GPU GB"]
    rows = []
    for side in args.sides:
        r = results[side]
        if r is None:
            rows.append([side, "failed (see stderr)"] + [""] * 7)
            continue
        ratio = f"{mean_step(r) / mean_step(trl):.2f}" if trl else "n/a"
        ratio_cpu = f"{mean_step(r, 1) / mean_step(trl, 1):.2f}" if trl else "n/a"
        rows.append([side, r["version"], " / ".join(f"{t[0]:.1f}" for t in r["times"]), mean_step(r), ratio,
                     mean_step(r, 1), ratio_cpu, r["rss_gb"], r["gpu_gb"]])
    lines += [f"model {args.model}" + (f" ({args.random_layers} layers)" if args.random_layers else "") +
              f", {args.dtype}, P={args.prompts} prompts × G={args.group_size}, T={args.max_new_tokens} tokens "
              f"(fixed), {device}", "", table(header, rows), "", f"after: {machine_line(device)}",
              "command: python bench/grpo_vs_trl.py " + " ".join(flags)]
    return emit(lines, args.out)


if __name__ == "__main__":
    main(tyro.cli(Args))
