"""vLLM backend (docs/vllm.md) on vllm-cpu with the embedded SmolLM2-135M: weights written with `sync_weights` are the
engine's weights bit for bit, so ES and GRPO on vLLM equal the HF backend. One engine for the whole module (start-up
is 40-150 s on a 2-core CPU). Run: `pytest -m vllm`."""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
import torch

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # use every core (the default keeps one back)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
pytest.importorskip("vllm")

import common  # noqa: E402
import harness  # noqa: E402
import es  # noqa: E402
import eval_passk  # noqa: E402
import grpo  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = common.EMBEDDED_MODEL


@pytest.fixture(scope="module")
def policy() -> Iterator[common.VLLMPolicy]:
    engine = common.VLLMPolicy(MODEL)
    yield engine
    engine.close()  # free its KV cache before the next module's engine


@pytest.fixture(scope="module")
def hf() -> common.HFPolicy:
    return common.HFPolicy(MODEL)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["The capital of France is"] + [common.render_prompt("countdown", p)
                                           for p in common.load_task("countdown", "train")[:3]]


@torch.no_grad()
def engine_weights(worker, hf: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Run in the vLLM worker: the weights the engine computes with, in the HF names and shapes `hf` (an HF model's
    `state_dict`, so a tied lm_head appears under both names). Linear layers and the lm_head are read through their
    kernels as (I·Wᵀ)ᵀ — exact: each output is one product by 1.0 plus zeros — since vllm-cpu keeps them only
    prepacked."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model()
    found = {k: p.detach() for k, p in model.named_parameters()}
    for name, mod in model.named_modules():
        if isinstance(mod, (LinearBase, ParallelLMHead)):
            eye = torch.eye(mod.weight.shape[1] if mod.weight.numel() else mod.input_size,
                            dtype=worker.model_config.dtype, device=worker.device)
            found[f"{name}.weight"] = mod.quant_method.apply(mod, eye).T
    fusions = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name, w in found.items():  # unfuse: qkv_proj → q/k/v_proj, gate_up_proj → gate/up_proj (split rows)
        fused = next((k for k in fusions if f".{k}." in name), None)
        parts = [name.replace(f".{fused}.", f".{p}.") for p in fusions[fused]] if fused else [name]
        if all(p in hf for p in parts):
            out.update(zip(parts, torch.split(w, [hf[p][0] for p in parts])))
    return {k: v.contiguous().clone() for k, v in out.items()}


def arithmetic_data(folder: Path) -> str:
    """Easy GSM8K-format sums (last number = answer): SmolLM2 gets some right in a few dozen tokens."""
    folder.mkdir()
    for split in ("train", "test"):
        items = [{"question": f"What is {a} + {b}? Answer with the number.", "answer": f"#### {a + b}"}
                 for a, b in [(2, 3), (7, 5), (12, 9), (4, 4)]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    return str(folder)


def use_module_engine(script, policy: common.VLLMPolicy, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`script.VLLMPolicy(path, ...)` returns the module's engine loaded with the weights at `path`, and its `close`
    only counts. Returns the paths opened, then "close" for each close."""
    opened: list[str] = []

    def make(path: str, *args, **kwargs) -> common.VLLMPolicy:
        opened.append(path)
        common.sync_weights(policy, common.load_weights(common.resolve_model(path)))
        return policy

    monkeypatch.setattr(script, "VLLMPolicy", make)
    monkeypatch.setattr(policy, "close", lambda: opened.append("close"))
    return opened


def read_engine(policy: common.VLLMPolicy, hf: common.HFPolicy) -> dict[str, torch.Tensor]:
    shapes = {k: v.shape for k, v in hf.model.state_dict().items()}
    return policy.llm.collective_rpc(engine_weights, args=(shapes,))[0]


def assert_same_weights(engine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(engine) == set(expected)
    assert [k for k, v in expected.items() if not torch.equal(engine[k], v)] == []


def test_perturb_then_restore_is_exact(policy: common.VLLMPolicy, hf: common.HFPolicy, prompts: list[str]) -> None:
    """ES on vLLM: the master perturbs the HF model, `sync_weights` writes it into the engine; after the restore the
    engine computes with exactly θ₀ again (and generates the base tokens)."""
    master = common.Master(hf.params)
    base = [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)]
    theta0 = read_engine(policy, hf)
    master.perturb(seed=7, scale=0.01)
    common.sync_weights(policy, hf.params)
    assert [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)] != base  # the noise reached the kernels
    master.restore()
    common.sync_weights(policy, hf.params)
    assert [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)] == base
    assert_same_weights(read_engine(policy, hf), theta0)


def test_seeded_sampling_survives_a_batch_larger_than_one_prefill(policy: common.VLLMPolicy,
                                                                   prompts: list[str]) -> None:
    """~9k prompt tokens in one call: with chunked prefill on, vllm-cpu 0.32 rewinds the generator of a partly
    prefilled seeded request and raises ("CPU Generator does not use offset"). Seeds are per (prompt, sample), so
    a prompt's samples do not depend on what else is in the batch."""
    big = prompts[1:] * 20  # 60 Countdown prompts of ~150 tokens
    out = policy.generate(big, n=2, max_new_tokens=4, temperature=1.0, seed=7)
    alone = policy.generate(big[:1], n=2, max_new_tokens=4, temperature=1.0, seed=7)
    assert len(out) == 120 and [s.token_ids for s in out[:2]] == [s.token_ids for s in alone]


def test_same_seed_same_weights_as_hf_backend(policy: common.VLLMPolicy, hf: common.HFPolicy,
                                             prompts: list[str]) -> None:
    """θ₀ and a perturbed member: the engine's weights (tied lm_head included) equal the HF model's bit for bit, and
    greedy completions are token-identical."""
    assert_same_weights(read_engine(policy, hf), hf.model.state_dict())  # θ₀
    master = common.Master(hf.params)
    master.perturb(seed=11, scale=1.5e-3)
    common.sync_weights(policy, hf.params)
    assert_same_weights(read_engine(policy, hf), hf.model.state_dict())
    vllm_out, hf_out = policy.generate(prompts, max_new_tokens=24), hf.generate(prompts, max_new_tokens=24)
    assert [(s.text, s.token_ids) for s in vllm_out] == [(s.text, s.token_ids) for s in hf_out]
    master.restore()
    common.sync_weights(policy, hf.params)  # the engine holds θ₀ again


def test_es_iteration_matches_hf_backend(policy: common.VLLMPolicy, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One es.py iteration per backend on the same prompts: same member rewards, same update, same checkpoint.

    The reward is a hash of the completion, so that members whose texts differ get different rewards and the
    update is applied (SmolLM2 earns no task reward in 16 tokens on most batches: the update would be skipped)."""
    common.sync_weights(policy, common.load_weights(common.resolve_model(MODEL)))  # θ₀ after the tests above
    monkeypatch.setattr(es, "score", lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False))
    monkeypatch.setattr(es, "VLLMPolicy", lambda *args, **kwargs: policy)  # reuse the module's engine
    closed = []
    monkeypatch.setattr(policy, "close", lambda: closed.append(True))  # es.main shuts its engine down at the end
    rewards = {}

    def spy(engine, *args, **kwargs):
        out = es.evaluate_population(engine, *args, **kwargs)
        rewards[type(engine).__name__] = out[0].mean(1).tolist()
        return out

    runs = {}
    for backend in ("hf", "vllm"):
        args = es.Args(backend=backend, task="arith", chat_template=True, pop=4, sigma=1e-2, alpha=5e-3,
                       prompts_per_iter=4, max_new_tokens=16, iterations=1, eval_every=0, batch_size=16,
                       out_dir=str(tmp_path / backend))
        runs[backend] = es.main(args, population=spy)
    print("member rewards:", rewards)
    assert rewards["VLLMPolicy"] == rewards["HFPolicy"]
    assert len(set(rewards["HFPolicy"])) > 1  # members differ, so an update is applied and compared below
    rows = {b: json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for b, run in runs.items()}
    for key in ("train/reward_mean", "train/reward_std", "es/update_norm", "es/d_rel"):
        assert rows["vllm"][key] == rows["hf"][key], key
    from safetensors.torch import load_file

    ckpt = {b: load_file(str(run / "checkpoints" / "step_000001" / "model.safetensors")) for b, run in runs.items()}
    assert_same_weights(ckpt["vllm"], ckpt["hf"])
    assert closed == [True]


def test_grpo_steps_keep_the_engine_synced(policy: common.VLLMPolicy, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """grpo.py --backend vllm: after every update the engine computes with exactly the trained HF weights (cast to
    the engine dtype: fp32 here), the checkpoint loads, and --resume starts the engine from the checkpoint.

    A toy reward (a hash of the text) makes the two completions of a group differ, so every step changes θ."""
    opened = use_module_engine(grpo, policy, monkeypatch)
    monkeypatch.setattr(grpo, "score", lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False))
    synced = []

    hf = common.HFPolicy(MODEL)  # names and shapes for reading the engine back

    def spy(engine, weights: dict[str, torch.Tensor]) -> None:
        common.sync_weights(engine, weights)
        model_weights = {k: v.detach().clone() for k, v in weights.items()}
        synced.append(({**model_weights, "lm_head.weight": model_weights["model.embed_tokens.weight"]},
                       read_engine(engine, hf)))

    monkeypatch.setattr(grpo, "sync_weights", spy)
    common.sync_weights(policy, common.load_weights(common.resolve_model(MODEL)))
    theta0 = read_engine(policy, hf)
    args = grpo.Args(backend="vllm", task="gsm8k", data=arithmetic_data(tmp_path / "data"), group_size=2,
                     prompts_per_step=2, max_new_tokens=12, steps=2, lr=1e-4, eval_every=2, eval_prompts=2,
                     batch_size=8, out_dir=str(tmp_path / "run"))
    run = grpo.main(args)
    assert opened == [common.resolve_model(MODEL), "close"] and len(synced) == 2
    for trained, engine in synced:
        dtype = next(iter(engine.values())).dtype
        assert_same_weights(engine, {k: v.to(dtype) for k, v in trained.items()})
    assert [k for k in theta0 if not torch.equal(theta0[k], synced[0][1][k])] != []  # the update reached the engine
    assert [k for k in theta0 if not torch.equal(synced[0][1][k], synced[1][1][k])] != []
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval/accuracy" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True)]
    assert rows[2]["perf/sync_s"] > 0 and rows[2]["grpo/zero_std_frac"] < 1
    from transformers import AutoModelForCausalLM

    ckpt = run / "checkpoints" / "step_000002"
    assert_same_weights(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict(), synced[1][0])
    # as `grpo.py --resume RUN --steps 3`: the saved flags, one changed; the engine starts from the checkpoint
    grpo.main(replace(harness.saved_args(grpo.Args, str(run)), steps=3))
    assert opened[-2:] == [str(ckpt), "close"] and len(synced) == 3
    assert_same_weights(synced[2][1], synced[2][0])


def test_eval_passk_sparsity_through_the_engine(policy: common.VLLMPolicy, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """eval_passk.py --backend vllm with a base and a perturbed "es" model: θ_τ is written into the engine, so
    τ = ∞ (θ_τ = θ₀) samples exactly the base model's tokens and τ = 0 (θ_τ = θ) the es model's (same seeds)."""
    hf = common.HFPolicy(MODEL)
    common.Master(hf.params).add_noise([3], [1.0], scale=0.02)
    hf.save(tmp_path / "es")
    opened = use_module_engine(eval_passk, policy, monkeypatch)
    tokens, generate = {}, eval_passk.generate

    def spy(policy_, prompts, args, task, desc):
        out = generate(policy_, prompts, args, task, desc)
        tokens[desc] = [[s.token_ids for s in group] for group in out]
        return out

    monkeypatch.setattr(eval_passk, "generate", spy)
    args = eval_passk.Args(models=(f"base={MODEL}", f"es={tmp_path / 'es'}"), base="base", backend="vllm",
                           task="gsm8k", data=arithmetic_data(tmp_path / "data"), num_problems=2, n=2,
                           max_new_tokens=8, reset_tau=(0.0, math.inf), out_dir=str(tmp_path / "passk"))
    run = eval_passk.main(args)
    assert opened == [common.resolve_model(MODEL), "close"]  # one engine for both models, closed at the end
    assert tokens["es/τ=inf"] == tokens["base/gsm8k"] != tokens["es/gsm8k"] == tokens["es/τ=0"]
    report = json.loads((run / "passk.json").read_text())
    taus = report["sparsity"]["es"]["taus"]
    assert [t["s_tau"] for t in taus] == [0.0, 1.0]
    assert taus[1]["correct_counts"] == report["results"]["base"]["gsm8k"]["correct_counts"]
    assert (run / "passk.md").is_file() and (run / "passk.png").is_file()


def test_a_bf16_es_checkpoint_is_read_once_by_vllms_loader(tmp_path: Path) -> None:
    """es.py's fp32 master lives in a subfolder: vLLM's default loader reads every top-level *.safetensors of a
    folder (no index file), so a master beside model.safetensors would be loaded as a second copy of the weights."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    hf = common.HFPolicy(MODEL, "bfloat16")
    master = common.Master(hf.params)
    master.add_noise([3], [1.0], scale=1e-3)  # below bf16's resolution for many weights: the master is what keeps them
    hf.save(tmp_path / "ckpt")
    master.save(tmp_path / "ckpt")
    _, files, use_safetensors, _ = DefaultModelLoader(LoadConfig())._prepare_weights(
        str(tmp_path / "ckpt"), None, None, True, None)
    assert use_safetensors and files == [str(tmp_path / "ckpt" / "model.safetensors")]
    saved = common.load_weights(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], m) for k, m in master.theta.items())


def test_torchrun_two_ranks_with_vllm_engines_match_one_hf_process(tmp_path: Path) -> None:
    """es.py --backend vllm under torchrun: each rank builds its own engine ("external_launcher"), evaluates its half
    of the population, and the end weights equal a single-process HF run's (greedy vllm-cpu = HF, tested above).
    The engines' shutdown destroys the process group; es.py must not destroy it again. The reward is a hash of the
    text (as above), so that the members differ and the update is really compared."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    runner = tmp_path / "hashed_reward_es.py"
    runner.write_text(f"import sys, zlib\nsys.path.insert(0, {str(root)!r})\nimport common, es, harness\n"
                      "es.score = lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False)\n"
                      "if __name__ == \"__main__\":  # the spawned math-verify worker imports this file\n"
                      "    es.main(harness.cli(es.Args))\n")
    flags = ["--task", "arith", "--chat-template", "--pop", "4", "--prompts-per-iter", "4", "--max-new-tokens", "16",
             "--sigma", "1e-2", "--alpha", "5e-3", "--iterations", "1", "--eval-every", "0", "--batch-size", "16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([sys.executable, str(runner), *flags, "--out-dir", str(tmp_path / "hf")], cwd=root, check=True,
                   env=env, capture_output=True)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             "29533", str(runner), *flags, "--backend", "vllm", "--vllm-memory", "0.2", "--out-dir",
                             str(tmp_path / "vllm")], cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / run / "checkpoints" / "step_000001" / "model.safetensors"))
            for run in ("hf", "vllm"))
    assert_same_weights(a, b)
    rows = [json.loads(line) for line in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["es/skipped"] == 0 and rows[-1]["es/update_norm"] > 0  # the update is compared, not a no-op


def test_grpo_then_es_on_vllm_one_engine_per_stage_process(tmp_path: Path) -> None:
    """grpo_es.py --backend vllm: each stage builds its engine in a process of its own (a CUDA engine does not give
    its memory back when closed), and the run ends with the second stage's weights."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "grpo_es.py", "--backend", "vllm", "--task", "arith", "--chat-template",
                             "--total-updates", "2", "--max-new-tokens", "8", "--eval-every", "0", "--batch-size", "8",
                             "--grpo.group-size", "2", "--grpo.prompts-per-step", "2", "--es.pop", "2",
                             "--es.prompts-per-iter", "2", "--out-dir", str(tmp_path / "run")], cwd=root,
                            capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    pids = [json.loads((run / d / "args.json").read_text())["pid"] for d in ("stage1-grpo", "stage2-es")]
    assert len(set(pids)) == 2
    from safetensors.torch import load_file

    final, stage2 = (load_file(str(d / "model.safetensors"))
                     for d in (run / "final", run / "stage2-es" / "checkpoints" / "step_000001"))
    assert_same_weights(final, stage2)


def test_a_signal_inside_a_member_rollout_on_vllm_saves_theta(tmp_path: Path) -> None:
    """es.py --backend vllm, SIGTERM inside a member's rollout of iteration 2 (the engine and the HF model hold
    θ + σ·ε_n): the checkpoint holds θ_1, and the resumed run ends with the weights of an uninterrupted HF run (greedy
    vllm-cpu = HF, tested above)."""
    from test_runs import last_line, ok, run, weights

    flags = ["--task", "arith", "--chat-template", "--pop", "4", "--prompts-per-iter", "4", "--max-new-tokens", "16",
             "--sigma", "1e-2", "--alpha", "5e-3", "--iterations", "2", "--eval-every", "0", "--batch-size", "16",
             "--save-every", "0"]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    ok(run(tmp_path, *flags, "--out-dir", str(tmp_path / "hf")))
    out = tmp_path / "vllm"
    # generate calls, --eval-every 0: 1–4 = iteration 1's members, 5–8 = iteration 2's
    stopped = ok(run(tmp_path, *flags, "--backend", "vllm", "--vllm-memory", "0.2", "--out-dir", str(out),
                     at_generate=6, sig="TERM"), 143)
    assert last_line(stopped).startswith("interrupted after update 1; checkpoint ")
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_weights(weights(tmp_path / "hf", 2), weights(out, 2))
