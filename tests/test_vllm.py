"""vLLM backend (SPEC §2) on vllm-cpu with the embedded SmolLM2-135M: ES inside the worker is bit-identical to the HF
backend. One engine for the whole module (start-up is 40-150 s on a 2-core CPU). Run: `pytest -m vllm`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # use every core (the default keeps one back)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
pytest.importorskip("vllm")

import common  # noqa: E402
import es  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = common.EMBEDDED_MODEL


@pytest.fixture(scope="module")
def policy() -> common.VLLMPolicy:
    return common.VLLMPolicy(MODEL, es=True)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return ["The capital of France is"] + [common.render_prompt("countdown", p)
                                           for p in common.load_task("countdown", "train")[:3]]


@torch.no_grad()
def engine_weights(worker) -> dict[str, torch.Tensor]:
    """Run in the vLLM worker: the weights the engine computes with, in HF names (`state_dict` of the worker's HF
    model, so a tied lm_head appears under both names). Linear layers and the lm_head are read through their kernels
    as (I·Wᵀ)ᵀ — exact: each output is one product by 1.0 plus zeros — since vllm-cpu keeps them only prepacked."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model, hf = worker.model_runner.get_model(), worker.es_policy.model.state_dict()
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
            out.update(zip(parts, torch.split(w, [hf[p].shape[0] for p in parts])))
    return {k: v.contiguous().clone() for k, v in out.items()}


def read_engine(policy: common.VLLMPolicy) -> dict[str, torch.Tensor]:
    policy._sync()  # apply a pending (lazy) restore first
    return policy.llm.collective_rpc(engine_weights)[0]


def assert_same_weights(engine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(engine) == set(expected)
    assert [k for k, v in expected.items() if not torch.equal(engine[k], v)] == []


def test_perturb_then_restore_is_exact(policy: common.VLLMPolicy, prompts: list[str]) -> None:
    base = [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)]
    master = {k: v.clone() for k, v in read_engine(policy).items()}
    policy.perturb(seed=7, scale=0.01)
    assert [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)] != base  # the noise reached the kernels
    policy.restore()
    assert [s.token_ids for s in policy.generate(prompts, max_new_tokens=24)] == base
    assert_same_weights(read_engine(policy), master)


def test_same_seed_same_weights_as_hf_backend(policy: common.VLLMPolicy, prompts: list[str]) -> None:
    hf = common.HFPolicy(MODEL, es=True)
    assert_same_weights(read_engine(policy), hf.model.state_dict())  # θ₀, incl. the tied lm_head
    hf.perturb(seed=11, scale=1.5e-3)
    policy.perturb(seed=11, scale=1.5e-3)
    assert_same_weights(read_engine(policy), hf.model.state_dict())
    vllm_out, hf_out = policy.generate(prompts, max_new_tokens=24), hf.generate(prompts, max_new_tokens=24)
    assert [(s.text, s.token_ids) for s in vllm_out] == [(s.text, s.token_ids) for s in hf_out]
    # GRPO path: sync_weights pushes a trained HF model's parameters into the engine
    policy.restore()
    policy._sync()  # the engine holds θ₀ again
    hf.perturb(seed=12, scale=1.5e-3)  # stands in for an optimizer step
    common.sync_weights(policy.llm, hf.model)
    assert_same_weights(policy.llm.collective_rpc(engine_weights)[0], hf.model.state_dict())
    policy.stale = True  # the next generate rewrites the engine from the worker's master

def test_es_iteration_matches_hf_backend(policy: common.VLLMPolicy, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One es.py iteration per backend on the same prompts: same member rewards, same update, same checkpoint.

    Easy GSM8K-format arithmetic (last number = answer) so that 32 greedy tokens give rewards that differ between
    members; on Countdown SmolLM2 scores 0 for every member at this length and the update would be skipped."""
    policy.load_master(Path(common.resolve_model(MODEL)))  # back to θ₀ after the tests above
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        items = [{"question": f"What is {a} + {b}? Answer with the number.", "answer": f"#### {a + b}"}
                 for a, b in [(2, 3), (7, 5), (12, 9), (4, 4)]]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    monkeypatch.setattr(es, "VLLMPolicy", lambda *args, **kwargs: policy)  # reuse the module's engine
    rewards = {}
    evaluate_population = es.evaluate_population

    def spy(policy_, *args, **kwargs):
        out = evaluate_population(policy_, *args, **kwargs)
        rewards[type(policy_).__name__] = out[0].mean(1).tolist()
        return out

    monkeypatch.setattr(es, "evaluate_population", spy)
    runs = {}
    for backend in ("hf", "vllm"):
        args = es.Args(backend=backend, task="gsm8k", data=str(data), pop=4, sigma=5e-3, alpha=1e-3,
                       prompts_per_iter=4, max_new_tokens=32, iterations=1, eval_every=0, batch_size=16,
                       out_dir=str(tmp_path / backend))
        runs[backend] = es.main(args)
    print("member rewards:", rewards)
    assert rewards["VLLMPolicy"] == rewards["HFPolicy"]
    assert len(set(rewards["HFPolicy"])) > 1  # members differ, so an update is applied and compared below
    rows = {b: json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for b, run in runs.items()}
    for key in ("train/reward_mean", "train/reward_std", "es/update_norm", "es/d_rel"):
        assert rows["vllm"][key] == rows["hf"][key], key
    from safetensors.torch import load_file

    ckpt = {b: load_file(str(run / "checkpoints" / "step_000001" / "model.safetensors")) for b, run in runs.items()}
    assert_same_weights(ckpt["vllm"], ckpt["hf"])
