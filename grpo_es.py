"""grpo_es.py — sequential GRPO→ES (or ES→GRPO): one budget of updates split equally between two stages.

[ES-LLM] trains with one total update budget T, spent as T/2 updates of the first algorithm and T/2 of the second,
the second starting from the first's final weights (either order). A GRPO update is one step (one generation batch;
μ > 1 makes it μ optimizer steps); an ES update is one iteration. This file only composes `grpo.main` and `es.main`:
the algorithms live in grpo.py and es.py, unchanged.

    stage 1: θ_1 = algo_1(θ_0, ⌊T/2⌋ updates)      run_dir/stage1-<algo_1>/   (its own args.json, metrics, checkpoints)
    stage 2: θ_2 = algo_2(θ_1, T − ⌊T/2⌋ updates)   run_dir/stage2-<algo_2>/   (model = stage 1's final checkpoint)
    run_dir/metrics.jsonl                           both stages' rows on one "step" axis, tagged "stage"/"algo"
    run_dir/final/                                  θ_2, loadable with from_pretrained

Notes:
  1. The shared fields (model, task, data, seed, dtype, eval and length settings) are set once here and override the
     stages' own copies; everything else reaches a stage as --grpo.<flag> or --es.<flag>.
  2. Stage 2 treats its starting weights as θ₀: ES's D_rel = ‖θ−θ₀‖/‖θ₀‖ and anchored weight decay measure and
     anchor to the stage start (θ_1), not to the base model.
  3. The hand-over goes through a saved checkpoint in the model dtype: with --dtype bfloat16, GRPO's fp32 weights
     are rounded to bf16 when ES loads them (and ES's fp32 master is not carried into GRPO). fp32 (CPU) is exact.
  4. Both stages use the same --seed. The second stage's prompt schedule starts where the first one's ended
     (--schedule-start = ⌊T/2⌋), so with equal prompt batches (the paper's 64) GRPO→ES sees epoch 1 then epoch 2,
     not epoch 1 twice; its member and sampling seeds are its own.
  5. Each stage runs in its own process: a CUDA vLLM engine does not reliably give its memory back when closed, and
     the second stage needs the memory the first one's engine held.

Run it:
  CPU, the embedded SmolLM2-135M-Instruct at the Quickstart's size (3 GRPO steps, then 3 ES iterations):
    python grpo_es.py --task arith --chat-template --order grpo-es --total-updates 6 --max-new-tokens 24 \
        --eval-every 3 --eval-prompts 64 --grpo.prompts-per-step 4 --grpo.lr 2e-5 \
        --es.pop 8 --es.prompts-per-iter 8 --es.sigma 5e-3 --es.alpha 5e-3
  GPU, the [ES-LLM] GSM8K protocol, both orders on one budget of 234 updates:
    python grpo_es.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --chat-template --backend vllm \
        --order grpo-es --total-updates 234 --max-new-tokens 2048 --grpo.prompts-per-step 64
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import es
import grpo
from common import EMBEDDED_MODEL, Task, die, require, write_atomic
from harness import check_run_dir, cli, write_args


@dataclass
class Args:
    model: str = EMBEDDED_MODEL
    """starting model θ_0: a Hugging Face folder, a hub id, or 'smollm2-135m' (embedded, offline)"""
    task: Task = "countdown"
    """task both stages train on (README: Tasks)"""
    data: Optional[str] = None
    """folder with train.jsonl/test.jsonl (or a hub dataset id); default: generated or the task's hub dataset"""
    chat_template: bool = False
    """render prompts with the tokenizer's chat template instead of raw text"""
    seed: int = 0
    """run seed, passed to both stages"""
    out_dir: str = "runs/grpo_es"
    """run directory: stage1-*/, stage2-*/, merged metrics.jsonl, final/"""
    backend: Literal["hf", "vllm"] = "hf"
    """rollout backend of both stages (vllm: each stage starts its own engine and shuts it down when done)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """ES: model dtype; GRPO: autocast dtype (its weights stay fp32); auto = bf16 on GPU, fp32 on CPU"""
    eval_every: int = 25
    """evaluate greedily on held-out problems every this many updates of each stage, at its start and end (≥ 0)"""
    eval_prompts: int = 200
    """number of held-out test problems per evaluation (≥ 1)"""
    max_new_tokens: int = 1024
    """generation budget per completion (≥ 1)"""
    batch_size: int = 64
    """sequences per generate call (≥ 1)"""
    order: Literal["grpo-es", "es-grpo"] = "grpo-es"
    """which algorithm runs first"""
    total_updates: int = 234
    """total budget T (≥ 2): ⌊T/2⌋ updates of the first stage, the rest for the second"""
    grpo: grpo.Args = field(default_factory=grpo.Args)
    """GRPO settings (its steps, model, out_dir and the shared fields above are set by this script)"""
    es: es.Args = field(default_factory=es.Args)
    """ES settings (its iterations, model, out_dir and the shared fields above are set by this script)"""


SHARED = ("task", "data", "chat_template", "seed", "backend", "dtype", "eval_every", "eval_prompts",
          "max_new_tokens", "batch_size")
STAGES = {"grpo": (grpo.main, "steps"), "es": (es.main, "iterations")}
"""algo → (entry point, its Args field for the number of updates)"""


def run_stage(entry: Callable[[Any], Path], stage: Any) -> None:
    """`entry(stage)` in a fresh process (spawned: torch and vLLM threads do not survive a fork). Ctrl-C reaches both
    processes; this one waits for the stage to save and stop, then stops with its exit status."""
    process = multiprocessing.get_context("spawn").Process(target=entry, args=(stage,))
    process.start()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # after start: the child must not inherit the ignore
    try:
        process.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    if process.exitcode:
        raise SystemExit(process.exitcode)  # the stage has said why


def main(args: Args) -> Path:
    require(args.total_updates >= 2, f"--total-updates must be ≥ 2 (one update per stage), got {args.total_updates}")
    for algo, (_, length_field) in STAGES.items():  # these stage fields would be silently overridden below
        stage, default = getattr(args, algo), type(getattr(args, algo))()
        for f in (*SHARED, "model", "out_dir", "resume", "schedule_start", length_field):
            if getattr(stage, f) != getattr(default, f):
                die(f"--{algo}.{f.replace('_', '-')} is set by grpo_es.py; use the top-level flag or --total-updates")
    run, budgets = Path(args.out_dir), [args.total_updates // 2, args.total_updates - args.total_updates // 2]
    check_run_dir(args.out_dir, None, resumable=False)
    # 1. configure both stages: their own flags, the shared ones and their share of the budget; check them all now
    stages = [(algo, replace(getattr(args, algo), **{f: getattr(args, f) for f in SHARED}, model=args.model,
                             out_dir=str(run / f"stage{k}-{algo}"), resume=None, **{STAGES[algo][1]: updates},
                             schedule_start=budgets[0] if k == 2 else 0))  # stage 2 continues the prompt order
              for k, (algo, updates) in enumerate(zip(args.order.split("-"), budgets), start=1)]
    for algo, stage in stages:
        (es.check_args if algo == "es" else grpo.check_args)(stage)
    write_args(run, args)
    model, offset, rows = args.model, 0, []
    for k, (algo, stage) in enumerate(stages, start=1):
        # 2. run it, in a process of its own, from the previous stage's final checkpoint
        run_stage(STAGES[algo][0], replace(stage, model=model))
        model = str(Path(stage.out_dir) / "checkpoints" / f"step_{budgets[k - 1]:06d}")

        # 3. merge its metrics, stage-tagged, on one step axis
        for line in (Path(stage.out_dir) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.append({**row, "step": offset + row["step"], "stage": k, "algo": algo, "stage_step": row["step"]})
        offset += budgets[k - 1]
        write_atomic(run / "metrics.jsonl", lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))

    # 4. the final weights as a plain from_pretrained folder
    shutil.copytree(model, run / "final", ignore=shutil.ignore_patterns("optimizer.pt", "state.json"))
    return run

if __name__ == "__main__":
    main(cli(Args))
