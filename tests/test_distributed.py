"""Distributed ES under torchrun (gloo, 2 CPU processes): identical to the single-process run; failures don't hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--pop", "4", "--prompts-per-iter", "3", "--max-new-tokens", "8", "--eval-every", "2", "--eval-prompts", "3",
         "--sigma", "0.01", "--alpha", "0.01", "--save-every", "3"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]


def rows_without_perf(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_two_processes_end_with_the_single_process_weights(tiny_model: str, tmp_path: Path) -> None:
    one, two = tmp_path / "w1", tmp_path / "w2"
    subprocess.run([sys.executable, "es.py", "--model", tiny_model, *FLAGS, "--iterations", "3", "--out-dir", str(one)],
                   cwd=ROOT, check=True, capture_output=True)
    result = subprocess.run([*TORCHRUN, "es.py", "--model", tiny_model, *FLAGS, "--iterations", "3", "--out-dir",
                             str(two)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    a = AutoModelForCausalLM.from_pretrained(one / "checkpoints" / "step_000003").state_dict()
    b = AutoModelForCausalLM.from_pretrained(two / "checkpoints" / "step_000003").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows_without_perf(one) == rows_without_perf(two)  # one log (rank 0), the same numbers


def test_a_rank_dying_mid_run_stops_every_rank(tiny_model: str, tmp_path: Path) -> None:
    run = tmp_path / "dies"
    proc = subprocess.Popen([*TORCHRUN, "es.py", "--model", tiny_model, *FLAGS, "--iterations", "1000", "--out-dir",
                             str(run)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.5)
        # kill the rank-1 worker the hard way (no Python cleanup), as an OOM kill or a node loss would
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        rank1 = [p for p in workers if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes()]
        assert len(rank1) == 1, workers
        os.kill(int(rank1[0]), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=180)  # no hang: rank 0 is torn down too
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "es.py FAILED" in stderr or "Signal 9" in stderr or "SIGKILL" in stderr, stderr[-2000:]
