"""grpo_es.py: CLI and a smoke run of both orders on the tiny model (stage dirs, merged metrics, final weights)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def test_help_runs_without_warnings() -> None:
    out = subprocess.run([sys.executable, "-W", "error", "grpo_es.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "--grpo.lr" in out.stdout and "--es.pop" in out.stdout and "--total-updates" in out.stdout


def test_stage_fields_set_here_are_refused(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "grpo_es.py", "--grpo.seed", "3", "--out-dir", str(tmp_path / "r")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "--grpo.seed is set by grpo_es.py" in out.stderr


@pytest.mark.parametrize("flags,message", [(["--es.pop", "1"], "--pop must be ≥ 2"),
                                           (["--grpo.group-size", "1"], "--group-size must be ≥ 2"),
                                           (["--total-updates", "1"], "--total-updates must be ≥ 2")])
def test_both_stages_are_checked_before_anything_runs(flags: list[str], message: str, tmp_path: Path) -> None:
    """A bad second-stage flag must not surface after the first stage has trained for hours."""
    out = subprocess.run([sys.executable, "grpo_es.py", *flags, "--out-dir", str(tmp_path / "r")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("order", ["grpo-es", "es-grpo"])
def test_smoke_both_orders(tiny_model: str, tmp_path: Path, order: str) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-W", "error", "grpo_es.py", "--model", tiny_model, "--out-dir", str(run), "--order", order,
           "--total-updates", "3", "--max-new-tokens", "8", "--eval-every", "1", "--eval-prompts", "2",
           "--grpo.group-size", "2", "--grpo.prompts-per-step", "2", "--grpo.lr", "1e-3",
           "--es.pop", "2", "--es.prompts-per-iter", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = order.split("-")
    assert (run / f"stage1-{first}" / "metrics.jsonl").is_file()

    # budget 3 → 1 + 2 updates; stage 2 starts from stage 1's final checkpoint
    stage2_args = json.loads((run / f"stage2-{second}" / "args.json").read_text())["args"]
    assert stage2_args["model"] == str(run / f"stage1-{first}" / "checkpoints" / "step_000001")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["stage"], r["algo"], r["step"], "eval" if "eval/accuracy" in r else "train") for r in rows]
    assert kinds == [(1, first, 0, "eval"), (1, first, 1, "train"), (1, first, 1, "eval"), (2, second, 1, "eval"),
                     (2, second, 2, "train"), (2, second, 2, "eval"), (2, second, 3, "train"), (2, second, 3, "eval")]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, (int, float)))
    AutoModelForCausalLM.from_pretrained(run / "final")
    last = run / f"stage2-{second}" / "checkpoints" / "step_000002" / "model.safetensors"
    assert (run / "final" / "model.safetensors").read_bytes() == last.read_bytes()



def test_each_stage_runs_in_its_own_process_and_the_second_continues_the_prompt_order(tiny_model: str,
                                                                                      tmp_path: Path) -> None:
    """A CUDA vLLM engine does not give its memory back when closed, so stage 2 must not run in stage 1's process
    (each run dir's args.json names the process that wrote it). Stage 2's prompt schedule starts at update ⌊T/2⌋,
    where stage 1's ended, instead of replaying stage 1's batches."""
    import os

    import common
    import es
    import grpo
    import grpo_es
    import harness

    run = grpo_es.main(grpo_es.Args(model=tiny_model, out_dir=str(tmp_path / "run"), order="grpo-es", total_updates=4,
                                    max_new_tokens=4, eval_every=0, eval_prompts=2, task="arith",
                                    grpo=grpo.Args(group_size=2, prompts_per_step=3),
                                    es=es.Args(pop=2, prompts_per_iter=3)))
    info = {k: json.loads((run / f"stage{k}-{a}" / "args.json").read_text()) for k, a in ((1, "grpo"), (2, "es"))}
    assert len({info[1]["pid"], info[2]["pid"], os.getpid()}) == 3
    assert (info[1]["args"]["schedule_start"], info[2]["args"]["schedule_start"]) == (0, 2)
    n = len(common.load_task("arith", "train"))
    seen = [harness.plan(0, n, 3, None, 1, "epoch")[2](t).tolist() for t in range(2)]  # stage 1's two batches
    after = [harness.plan(0, n, 3, None, 1, "epoch")[2](2 + t).tolist() for t in range(2)]  # stage 2's
    assert not set(sum(seen, [])) & set(sum(after, []))  # one epoch's shuffle: no prompt seen twice
