"""common.py: noise, exact perturb/restore/update, tasks, prompts and rewards."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

import common
from common import (HFPolicy, Master, Problem, derive_seed, extract_answer, load_task, make_countdown, noise,
                    render_prompt, score)
from harness import plan

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------------------------------------------- noise
def test_noise_is_a_function_of_seed_and_name() -> None:
    a = noise(7, "model.layers.0.self_attn.q_proj.weight", torch.Size([64, 64]), "cpu")
    b = noise(7, "model.layers.0.self_attn.q_proj.weight", torch.Size([64, 64]), "cpu")
    other_name = noise(7, "model.layers.1.self_attn.q_proj.weight", torch.Size([64, 64]), "cpu")
    other_seed = noise(8, "model.layers.0.self_attn.q_proj.weight", torch.Size([64, 64]), "cpu")
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, other_name) and not torch.equal(a, other_seed)
    # i.i.d. across equal-shaped tensors: uncorrelated, unlike the reference code's one-seed-for-all
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), other_name.flatten()]))[0, 1])) < 0.05
    big = noise(1, "x", torch.Size([200_000]), "cpu")
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1) < 0.01


def test_noise_chunks_are_independent_streams_whatever_the_thread_count() -> None:
    """A tensor spanning several NOISE_CHUNKs: the chunks are uncorrelated (one generator each, not one seed reused),
    and the values do not depend on how many threads fill them."""
    shape, c = torch.Size([3 * common.NOISE_CHUNK + 5]), common.NOISE_CHUNK
    a = noise(4, "w", shape, "cpu")
    chunks = a[: 3 * c].view(3, c)
    assert not torch.equal(chunks[0], chunks[1]) and abs(float(torch.corrcoef(chunks)[0, 1])) < 0.02
    threads = torch.get_num_threads()
    try:
        common._noise_threads.cache_clear()
        torch.set_num_threads(1)
        assert torch.equal(noise(4, "w", shape, "cpu"), a)
    finally:
        torch.set_num_threads(threads)
        common._noise_threads.cache_clear()


def test_derive_seed_is_stable_across_processes() -> None:
    code = "from common import derive_seed; print(derive_seed(3, 'member', 5, 1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={"PYTHONHASHSEED": "123"}).stdout
    assert int(out) == derive_seed(3, "member", 5, 1) != derive_seed(3, "member", 5, 2)


def test_keep_freed_memory_serves_large_blocks_from_the_heap_and_keeps_them() -> None:
    """In a fresh process (the setting is process-wide): a 64 MB block, the size of a batch's logits, is mmapped by
    default and handed back when freed; after keep_freed_memory it comes from the heap and stays there for reuse."""
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # glibc ≥ 2.33
    except (OSError, AttributeError):
        pytest.skip("not glibc ≥ 2.33")
    code = """if True:
        import ctypes, sys, common
        class Info(ctypes.Structure):
            _fields_ = [(f, ctypes.c_size_t) for f in "arena ordblks smblks hblks hblkhd usm fsm uord ford keep".split()]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
        if sys.argv[1] == "keep":
            common.keep_freed_memory()
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(64 << 20)
        mapped = libc.mallinfo2().hblkhd - before
        libc.free(block)
        print(mapped >> 20, libc.mallinfo2().ford >> 20)"""
    run = lambda mode: [int(v) for v in subprocess.run([sys.executable, "-c", code, mode], capture_output=True,
                                                       text=True, check=True, cwd=Path(__file__).parents[1]).stdout.split()]
    (mapped, _), (kept_mapped, kept_free) = run("default"), run("keep")
    assert mapped >= 64 and kept_mapped == 0 and kept_free >= 64  # MB: mmapped by default; heap, still held, after


# ---------------------------------------------------------------------------------------------------- ES primitives
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_restore_is_bit_exact_after_many_cycles(tiny_model: str, dtype: str) -> None:
    policy = HFPolicy(tiny_model, dtype, "cpu")
    master = Master(policy.params)
    before = {k: p.clone() for k, p in policy.params.items()}
    for cycle in range(25):
        master.perturb(seed=cycle, scale=1e-2)
        # the member is exactly cast(master + σ·ε), computed in fp32 (torch.add with alpha: one rounding)
        name, p = next(iter(policy.params.items()))
        expected = master.theta[name].add(noise(cycle, name, p.shape, "cpu"), alpha=1e-2).to(p.dtype)
        assert torch.equal(p, expected)
        master.restore()
    assert all(torch.equal(before[k], p) for k, p in policy.params.items())


def test_a_bf16_checkpoint_keeps_its_fp32_master_where_model_loaders_do_not_look(tiny_model: str,
                                                                               tmp_path: Path) -> None:
    """Loaders that read every top-level *.safetensors (vLLM's default loader does) must find only the model."""
    policy = HFPolicy(tiny_model, "bfloat16", "cpu")
    master = Master(policy.params)
    master.add_noise([3], [1.0], 1e-4)  # mostly below bf16's resolution: only the fp32 master keeps it
    policy.save(tmp_path / "ckpt")
    master.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == ["model.safetensors"]
    saved = common.load_weights(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], m) for k, m in master.theta.items())
    assert any(not torch.equal(saved[k], m.float()) for k, m in policy.params.items())
    again = Master(HFPolicy(tiny_model, "bfloat16", "cpu").params)
    again.load(tmp_path / "ckpt")  # resume: the exact fp32 θ, and the model = cast(θ)
    assert all(torch.equal(again.theta[k], m) for k, m in master.theta.items())
    assert all(torch.equal(again.params[k], p) for k, p in policy.params.items())
    f32 = Master(HFPolicy(tiny_model, "float32", "cpu").params)
    f32.save(tmp_path / "f32")
    assert not (tmp_path / "f32").exists()  # fp32 weights are the master: nothing to add


def test_add_then_subtract_restore_drifts_in_bf16(tiny_model: str) -> None:
    """Why the master copy exists: the reference's add-then-subtract restore is lossy in bf16."""
    policy = HFPolicy(tiny_model, "bfloat16", "cpu")
    name, p = next(iter(policy.params.items()))
    before = p.clone()
    with torch.no_grad():
        for cycle in range(5):
            eps = (1e-2 * noise(cycle, name, p.shape, "cpu")).to(p.dtype)
            p.add_(eps)
            p.sub_(eps)
    assert not torch.equal(before, p)


def test_update_from_regenerated_noise_equals_stored_noise(tiny_model: str) -> None:
    master = Master(HFPolicy(tiny_model, "float32", "cpu").params)
    master0 = {k: m.clone() for k, m in master.theta.items()}
    seeds, coefs, scale = [11, 12, 13], [0.5, -1.25, 0.75], 1e-3
    stored = [{k: noise(s, k, m.shape, "cpu") for k, m in master0.items()} for s in seeds]  # what we never keep
    norm = master.add_noise(seeds, coefs, scale)
    total_sq = 0.0
    for k, m in master0.items():
        delta = scale * sum(c * eps[k] for c, eps in zip(coefs, stored))
        assert torch.allclose(master.theta[k], m + delta, rtol=0, atol=1e-8)  # a few fp32 ulps
        total_sq += float(delta.double().square().sum())
    assert norm == pytest.approx(total_sq**0.5, rel=1e-5)
    assert all(torch.equal(master.params[k], master.theta[k]) for k in master.params)  # model = cast(master)


def test_sync_weights_into_an_hf_engine_copies_other_weights_and_skips_its_own(tiny_model: str) -> None:
    """sync_weights(engine, weights): an HFPolicy engine takes other HF-named weights (eval_passk's θ_τ, another
    model), cast to its dtype; its own parameters (ES and GRPO on the HF backend) are left alone, not copied."""
    engine = HFPolicy(tiny_model, "bfloat16", "cpu")
    other = {k: torch.full_like(p, 0.25, dtype=torch.float32) for k, p in engine.params.items()}
    common.sync_weights(engine, other)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p.float(), other[k]) for k, p in engine.params.items())
    pointers = {k: p.data_ptr() for k, p in engine.params.items()}
    common.sync_weights(engine, engine.params)
    assert {k: p.data_ptr() for k, p in engine.params.items()} == pointers


def test_a_noise_table_gives_slices_at_seeded_offsets(tiny_model: str) -> None:
    """[OpenAI-ES] §2.3: ε(seed, tensor) = table[o : o + n] with o = derive_seed(seed, name) mod (T − n + 1); the
    table is the same for the same seed (a resumed run regenerates it), and perturb / update use those slices."""
    table = common.noise_table(50_000, 3, "cpu")
    assert torch.equal(table, common.noise_table(50_000, 3, "cpu")) and not torch.equal(table, common.noise_table(
        50_000, 4, "cpu"))
    master = Master(HFPolicy(tiny_model, "float32", "cpu").params, table=table)
    theta0 = {k: m.clone() for k, m in master.theta.items()}

    def by_hand(seed: int, name: str) -> torch.Tensor:
        n = master.theta[name].numel()
        o = derive_seed(seed, name) % (50_000 - n + 1)
        return table[o:o + n].view(master.theta[name].shape)

    name = "model.embed_tokens.weight"
    assert torch.equal(master.eps(7, name), by_hand(7, name)) and not torch.equal(by_hand(7, name), by_hand(8, name))
    master.perturb(7, 0.1)
    assert all(torch.equal(master.params[k], theta0[k].add(by_hand(7, k), alpha=0.1)) for k in theta0)
    master.restore()
    master.add_noise([1, 2], [0.5, -1.0], 0.01)
    for k, m in master.theta.items():
        torch.testing.assert_close(m, theta0[k] + 0.01 * (0.5 * by_hand(1, k) - by_hand(2, k)), rtol=0, atol=1e-7)
    with pytest.raises(SystemExit, match="at least the largest tensor"):
        Master(master.params, table=common.noise_table(10, 3, "cpu"))


def test_shrink_to_base_and_drift(tiny_model: str) -> None:
    master = Master(HFPolicy(tiny_model, "float32", "cpu").params)
    assert master.drift() == 0.0
    master.add_noise([1], [1.0], 1e-3)
    d = master.drift()
    by_hand = sum(float((master.theta[k] - master.theta0[k]).double().square().sum()) for k in master.theta) / sum(
        float(b.double().square().sum()) for b in master.theta0.values())
    assert d == pytest.approx(by_hand**0.5, rel=1e-5)
    master.shrink_to_base(0.5)  # θ₀ + 0.5(θ − θ₀): the drift halves
    assert master.drift() == pytest.approx(d / 2, rel=1e-4)
    master.shrink_to_base(0.0)
    assert master.drift() == 0.0


def test_generate_greedy_is_deterministic_and_batched_like_single(tiny_model: str) -> None:
    policy = HFPolicy(tiny_model, "float32", "cpu", batch_size=8)
    prompts = ["short", "a much longer prompt here"]
    batched = policy.generate(prompts, max_new_tokens=12)
    single = [policy.generate([p], max_new_tokens=12)[0] for p in prompts]
    assert [s.token_ids for s in batched] == [s.token_ids for s in single]  # left padding does not change outputs
    sampled = policy.generate(prompts, n=3, max_new_tokens=12, temperature=1.0, seed=5)
    assert [s.prompt_index for s in sampled] == [0, 0, 0, 1, 1, 1]
    assert [s.text for s in sampled] == [s.text for s in policy.generate(prompts, 3, 12, 1.0, seed=5)]


@pytest.mark.parametrize("model", ["tiny_model", "tiny_qwen"])
def test_n_samples_share_one_prefill_and_sample_the_same_tokens(model: str, request: pytest.FixtureRequest) -> None:
    """HFPolicy.generate prefills each prompt once for its n rows; HF's generate on the n copies of each prompt (the
    same chunks of batch_size rows, the same seeds) must give the same tokens, greedy and sampled, also when a
    prompt's rows straddle two chunks (n = 3, 4 rows a chunk)."""
    from transformers import GenerationConfig

    policy = HFPolicy(request.getfixturevalue(model), "float32", "cpu", batch_size=4)
    for name, p in policy.params.items():  # sharp attention: a random model attends uniformly, blind to positions
        p.data.mul_(30 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1)
    prompts = ["short", "a much longer prompt here", "mid-size one"]
    for temperature in (0.0, 1.0):
        shared = policy.generate(prompts, n=3, max_new_tokens=10, temperature=temperature, seed=7)
        config = GenerationConfig(max_new_tokens=10, do_sample=temperature > 0, pad_token_id=0, eos_token_id=[1],
                                  **({"temperature": 1.0, "top_k": 0} if temperature else {}))
        rows = [i for i in range(3) for _ in range(3)]
        for start in range(0, 9, 4):
            batch = policy.tokenizer([prompts[i] for i in rows[start:start + 4]], return_tensors="pt", padding=True,
                                     add_special_tokens=False)
            torch.manual_seed(derive_seed(7, start))
            out = policy.model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:]
            for sample, row in zip(shared[start:start + 4], out.tolist()):
                end = next((j + 1 for j, t in enumerate(row) if t == 1), len(row))
                assert sample.token_ids == row[:end], (temperature, start)


# ---------------------------------------------------------------------------------------------------- Countdown
def solvable(numbers: tuple[int, ...], target: int) -> bool:
    """Brute force over every way to combine the numbers with + − * /."""
    def values(items: tuple[Fraction, ...]) -> set[Fraction]:
        if len(items) == 1:
            return {items[0]}
        out = set()
        for i, j in itertools.permutations(range(len(items)), 2):
            rest = tuple(x for k, x in enumerate(items) if k not in (i, j))
            a, b = items[i], items[j]
            for v in {a + b, a - b, a * b} | ({a / b} if b else set()):
                out |= values(rest + (v,))
        return out

    return Fraction(target) in values(tuple(Fraction(x) for x in numbers))


def test_countdown_draws_with_a_zero_divisor_are_discarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A random tree that divides by zero is discarded: the operand left over must not become the target.
    Scripted draws: numbers (92, 92, 37, 27); 92 − 92 = 0, then 37 / 0 leaves 27 over (the old pool had it)."""
    class Scripted(random.Random):
        def __init__(self, seed: int) -> None:
            super().__init__(seed)
            self.numbers, self.ops = itertools.cycle([92, 92, 37, 27]), iter("-/" + "+" * 100)
            self.picks = iter([0, 0, 0, 1] + [0] * 100)

        def randint(self, a: int, b: int) -> int:
            return next(self.numbers)

        def choice(self, seq):  # the size (from a list), else an operator
            return 4 if isinstance(seq, list) else next(self.ops)

        def randrange(self, n: int) -> int:
            return next(self.picks)

    monkeypatch.setattr(common.random, "Random", Scripted)
    problems = make_countdown(1, seed=0, max_target=1000)  # draw 2, all "+": 92 + 92 + 37 + 27
    assert [(p.numbers, p.target) for p in problems] == [((92, 92, 37, 27), 248)]
    monkeypatch.undo()
    pool = load_task("countdown", "train") + load_task("countdown", "test")
    assert not [p for p in pool if sorted(p.numbers) == [27, 37, 92, 92] and p.target == 27]


def test_countdown_split_is_fixed_disjoint_and_solvable() -> None:
    train, test = load_task("countdown", "train"), load_task("countdown", "test")
    assert len(train) == 10_000 and len(test) == 2_000
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    assert len({key(p) for p in train}) == len(train) and not {key(p) for p in train} & {key(p) for p in test}
    assert all(3 <= len(p.numbers) <= 4 and all(1 <= x <= 99 for x in p.numbers) and 1 <= p.target <= 100
               for p in train + test)
    assert all(solvable(p.numbers, p.target) for p in train[:100] + test[:100])
    assert all(solvable(p.numbers, p.target) for p in random.Random(0).sample(train + test, 300))
    assert load_task("countdown", "test")[0] == test[0]
    small = make_countdown(50, seed=1, sizes=(3,), max_number=9, max_target=20)
    assert all(len(p.numbers) == 3 and p.target <= 20 and solvable(p.numbers, p.target) for p in small)


def test_countdown_prompt_is_exactly_the_reference_text(tiny_model: str) -> None:
    expected = ("You are a helpful assistant. You first think about the reasoning process in your mind and then "
                "provide the user with the answer.Using the numbers [44 19 35], create an equation that equals 98. "
                "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. Show "
                "your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, for "
                "example <answer> (1 + 2) / 3 </answer>.Let me solve this step by step.\n<think>")
    problem = Problem(numbers=(44, 19, 35), target=98)
    assert render_prompt("countdown", problem) == expected
    chat = render_prompt("countdown", problem, HFPolicy(tiny_model, device="cpu").tokenizer, chat_template=True)
    assert chat.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert chat.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")


P = Problem(numbers=(44, 19, 35), target=98)
COUNTDOWN_CASES = [  # (completion after the prompt's "<think>", numbers/target, expected reward)
    (" add them</think>\n<answer>44 + 19 + 35</answer>", P, 0.1 * 1.0 + 1),  # exact format, correct
    (" add</think>\n<answer>(44 + 19) + 35</answer>", P, 1.1),
    (" add</think>\n<answer>44 + 19 + 35</answer> done", P, 0.1 * 0.6 + 1),  # text after </answer>
    (" add</think><answer>44 + 19 + 35</answer>", P, 0.1 * 0.6 + 1),  # no newline between the tags
    ("<answer>44 + 19 + 35</answer>", P, 0.1 * 0.5 + 1),  # no </think>: answer pair only
    (" hmm</think>\n<answer>44 + 19 + 34</answer>", P, 0.1),  # evaluates to 97
    (" hmm</think>\n<answer>44 + 19 + 19</answer>", P, 0.1),  # wrong number use
    (" hmm</think>\n<answer>44 + 19 + 35 + 0</answer>", P, 0.1),  # extra literal
    (" hmm</think>\n<answer>44 + 54</answer>", P, 0.1),  # = 98 but misses numbers
    (" hmm</think>\n<answer></answer>", P, 0.1),  # empty
    # the last answer counts; the format regex's lazy `.*?` spans the inner tags, so the format still matches
    (" hmm</think>\n<answer>1 + 2</answer> x <answer>44+19+35</answer>", P, 1.1),
    (" hmm</think>\n<answer>44+19+35</answer> x <answer>1 + 2</answer>", P, 0.1),
    (" hmm</think>\n<answer>44+19+35</answer>\n", P, 1.1),  # `$` matches before a final newline
    (" hmm</think>\n<answer>44+19+35</answer>\n\n", P, 0.1 * 0.6 + 1),
    (" hmm</think>\n<answer>044 + 19 + 35</answer>", P, 0.1),  # leading zero: not a Python int literal
    (" hmm</think>\n<answer>44 + 19 + 35 = 98</answer>", P, 0.1),  # '=' is not allowed
    (" hmm</think>\n<answer>\n44 + 19 + 35</answer>", P, 0.1),  # only digits, + - * / ( ) and spaces: no newline
    (" hmm</think>\n<answer>44 +\t19 + 35</answer>", P, 0.1),  # no tab
    (" hmm</think>\n<answer> 44 + 19 + 35 </answer>", P, 1.1),  # spaces are fine
    (" hmm</think>\n<answer>\u0664\u0664 + 19 + 35</answer>", P, 0.1),  # Arabic-Indic digits
    (" hmm</think>\n<answer>\uff14\uff14 + 19 + 35</answer>", P, 0.1),  # full-width digits
    (" hmm</think>\n<answer>__import__('os').system('true')</answer>", P, 0.1),
    (" hmm</think>\n<answer>2**3*1</answer>", Problem(numbers=(2, 3, 1), target=8), 0.1),  # power is rejected
    (" hmm</think>\n<answer>5 / (2 - 2)</answer>", Problem(numbers=(2, 2, 5), target=5), 0.1),  # division by zero
    (" hmm</think>\n<answer>6 / 3 * 4</answer>", Problem(numbers=(6, 4, 3), target=8), 1.1),  # exact via fractions
    (" hmm</think>\n<answer>(1 - 7) * -2</answer>", Problem(numbers=(1, 7, 2), target=12), 1.1),  # unary minus allowed
    ("no tags at all", P, 0.0),
    (" only think</think>", P, 0.1 * 0.1),
]


@pytest.mark.parametrize("completion,problem,expected", COUNTDOWN_CASES)
def test_countdown_reward_table(completion: str, problem: Problem, expected: float) -> None:
    reward, correct = score("countdown", problem, completion)
    assert reward == pytest.approx(expected)
    assert correct == (expected >= 1)


def test_countdown_format_equals_the_spec_regex_on_random_strings() -> None:
    spec_regex = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", "\n", "x", " ", "1+2"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "<think>" + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        by_regex = 1.0 if spec_regex.match(text) else 0.1 * bool(re.search(r"<think>.*?</think>", text, re.DOTALL)) \
            + 0.5 * bool(re.search(r"<answer>.*?</answer>", text, re.DOTALL))
        assert score("countdown", P, text[len("<think>"):])[0] == pytest.approx(0.1 * by_regex), text


def test_countdown_reward_of_hostile_input_is_zero_and_fast() -> None:
    huge = " x</think>\n<answer>" + "(" * 500_000 + "1" + ")" * 500_000 + "</answer>"
    deep = " x</think>\n<answer>" + "-" * 100_000 + "44 + 19 + 35</answer>"
    start = time.perf_counter()
    assert score("countdown", P, huge) == (pytest.approx(0.1), False)
    assert score("countdown", P, deep) == (pytest.approx(0.1), False)
    assert score("countdown", P, "<answer>" * 200_000) == (pytest.approx(0.0), False)
    assert score("countdown", P, "</think>\n<answer>" * 100_000) == (pytest.approx(0.01), False)  # think pair only
    assert time.perf_counter() - start < 5  # generous bound: a regex or ast blow-up would take minutes


# ---------------------------------------------------------------------------------------------------- GSM8K, MATH-500
def test_gsm8k_loader_and_reward_on_real_records() -> None:
    problems = load_task("gsm8k", "test", str(DATA / "gsm8k"))
    assert [p.answer for p in problems] == ["18", "3", "70000", "540", "20"]
    assert problems[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    p = problems[2]
    assert score("gsm8k", p, "So the profit is \\boxed{70000}.") == (1.0, True)
    assert score("gsm8k", p, "So the profit is \\boxed{70,000}.") == (0.1, True)  # training: no comma removal
    assert score("gsm8k", p, "He made 5 then 70000 dollars") == (0.0, True)  # no box: reward 0, verdict right
    assert score("gsm8k", p, "The answer is \\boxed{7000}") == (0.1, False)  # formatted but wrong
    assert score("gsm8k", p, "I think it is 70000 or maybe 12") == (0.0, False)
    assert score("gsm8k", p, "nothing") == (0.0, False)


# The [ES-LLM] artifact's own cases and the issue's: (completion, gold, training reward, eval verdict)
PROTOCOL_CASES = [
    ("Reasoning. \\boxed{18}", "18", 1.0, True),
    ("Reasoning. \\boxed{19}", "18", 0.1, False),
    ("The answer is 18.", "18", 0.0, True),  # no box: no training reward, but the evaluation finds 18
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, True),  # 0.5 normalises to \frac{1}{2}
    ("\\boxed{\\$18}", "18", 1.0, True),
    ("\\boxed{18\\%}", "18", 1.0, True),
    ("\\boxed{ 18 }", "18", 1.0, True),
    ("\\boxed{\t18\t}", "18", 1.0, True),  # the box's content is stripped: the normalisation drops no tabs
    ("\\boxed{\\dfrac12}", "1/2", 1.0, False),  # training: dfrac → frac, \\frac12 → \\frac{1}{2}, 1/2 → \\frac{1}{2};
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0, True),  # math-verify reads \\dfrac{1}{2}, not the brace-less \\dfrac12
    ("so \\boxed{x = 7}", "7", 1.0, True),  # a short "x =" prefix is dropped
    ("\\boxed{5 \\text{ cm}}", "5", 1.0, True),  # a trailing unit is dropped
    ("\\boxed{.5}", "0.5", 1.0, True),
    ("\\boxed{18} then \\boxed{19}", "19", 1.0, False),  # training: the last box counts; math-verify (boxed="all")
    ("\\boxed{19} then \\boxed{18}", "19", 0.1, False),  # reads both boxes as one answer, which is neither
    ("Work. \\boxed{1,024}", "1024", 0.1, True),  # the verdict compares numbers without commas
    ("Work.\n#### -3.5", "-3.5", 0.0, True),
    ("Therefore, the answer is 42.", "42", 0.0, True),
    ("No numeric result", "42", 0.0, False),
    ("\\boxed{18", "18", 0.0, False),  # unclosed: no box
    # the artifact's box: the last `\\boxed`, then optional whitespace and its `{` (math-verify reads none of these)
    ("\\boxed {18}", "18", 1.0, True),
    ("\\boxed\n{18}", "18", 1.0, True),
    ("\\boxed{18}. Remember to use \\boxed", "18", 0.0, True),  # the last \\boxed has no `{`: no box
    ("\\boxed{18}\n\\boxed {19}", "18", 0.1, False),
]


@pytest.mark.parametrize("completion,gold,reward,verdict", PROTOCOL_CASES)
def test_gsm8k_protocol_reward_and_verdict(completion: str, gold: str, reward: float, verdict: bool) -> None:
    assert score("gsm8k", Problem("q", gold), completion) == (reward, verdict)


def test_gsm8k_fallback_extraction_and_exact_answers() -> None:
    """The artifact's fallback (when math-verify extracts nothing): the last `#### x`, else the last \\boxed{x}, else
    "answer is x"; numbers without commas. Majority votes compare exact values: 1e6 and 1e6 + 1 differ."""
    assert common._fallback_answer("Work. \\boxed{1,024}") == "1024"
    assert common._fallback_answer("Work.\n#### -3.5") == "-3.5"
    assert common._fallback_answer("Therefore, the answer is 42.") == "42"
    assert common._fallback_answer("#### 1 and the answer is 2 and \\boxed{3}") == "1"
    assert common._fallback_answer("#### 5 then #### 7, and the answer is 9") == "7"  # the last ####
    assert common._fallback_answer("No numeric result") is None
    assert extract_answer("gsm8k", "\\boxed{1000000}") != extract_answer("gsm8k", "\\boxed{1000001}")
    assert extract_answer("gsm8k", "so \\boxed{70,000.0}") == "70000" == extract_answer("gsm8k", "it is 70000")
    assert extract_answer("gsm8k", "\\boxed{0.5}") == "1/2" == extract_answer("gsm8k", "\\boxed{\\frac{1}{2}}")


def test_vote_keys_are_exact_and_fast_on_hostile_numbers() -> None:
    """Only plain decimals and ratios of them, of bounded length, reach Fraction (`1e10000000` took 12 s); a negative
    ratio gets one key however it is written."""
    start = time.perf_counter()
    assert extract_answer("gsm8k", "\\boxed{1e10000000}") == "1e10000000"  # compared as text
    assert extract_answer("gsm8k", "\\boxed{" + "7" * 1_000_000 + "}") is not None
    assert extract_answer("gsm8k", "\\boxed{\\frac{" + "7" * 1_000_000 + "}{3}}") is not None
    assert extract_answer("math500", "\\boxed" + " " * 5_000_000) is None  # no `{` after the whitespace
    assert extract_answer("math500", "\\boxed{" + "\\sqrt" * 1_000_000 + "}") is not None
    assert time.perf_counter() - start < 5  # generous bound: Fraction on the first input alone took 12 s
    keys = {extract_answer("gsm8k", f"\\boxed{{{x}}}") for x in ("-1/2", "-0.5", "-\\frac{1}{2}", "\\frac{1}{-2}")}
    assert keys == {"-1/2"}
    assert common._exact("1/0") != common._exact("1") and common._exact("1.50") == "3/2"


def test_sqrt_is_braced_like_the_artifact() -> None:
    """The artifact splits on \\sqrt and braces the first character of every part that does not open with `{`."""
    assert common._normalize_math("\\sqrt2") == "\\sqrt{2}" == common._normalize_math("\\sqrt{2}")
    assert common._normalize_math("3\\sqrt 2") == "3\\sqrt{}2"  # the space is braced, then removed
    assert common._normalize_math("\\sqrt\\sqrt2") == "\\sqrt{}\\sqrt{2}"  # not \\sqrt{\\}sqrt2
    assert common._normalize_math("2\\sqrt") == "2\\sqrt{}"


def test_non_numeric_gold_does_not_crash() -> None:
    problem = Problem("q", "twelve")
    assert score("gsm8k", problem, "#### 12") == (0.0, False)
    assert score("gsm8k", problem, "\\boxed{twelve}")[0] == 1.0  # the boxed text equals the gold text


HOSTILE = [" x \\boxed{" + "1 + " * 2_500_000,  # 10 MB after an unclosed \\boxed{
           "\\boxed{" + "\\frac{1}{" * 500 + "2" + "}" * 501,  # 500-deep \\frac
           "so \\boxed{9^{9^{9^{9}}}}"]  # sympy would compute the power tower for hours


def test_scorers_are_bounded_on_hostile_completions_also_off_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "VERIFY_TIMEOUT_S", 3.0)
    score("math500", Problem("q", "1"), "\\boxed{1}")  # start the worker outside the timed part
    results: list = []

    def run() -> None:
        for text in HOSTILE:
            start = time.perf_counter()
            results.append((score("gsm8k", Problem("q", "18"), text), score("math500", Problem("q", "18"), text),
                            time.perf_counter() - start))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive() and len(results) == 3
    for (gsm8k, math500, seconds), text in zip(results, HOSTILE):
        assert not gsm8k[1] and not math500[1], text[:40]
        # two verdicts, each at most the time limit + the start of a fresh worker (the killed one's replacement: ~7 s
        # here, as it imports common, hence torch), with slack for a loaded machine
        assert seconds < 2 * (3.0 + 20)
    assert score("gsm8k", Problem("q", "18"), "\\boxed{18}") == (1.0, True)  # a killed worker is replaced


def children() -> dict[int, str]:
    """This process's children and their states ("Z": dead, not yet reaped); /proc/PID/stat is "PID (NAME) STATE
    PPID …"."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
            if int(ppid) == os.getpid():
                out[int(stat.parent.name)] = state
    return out


def test_a_stuck_or_dead_verifier_is_gone_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "VERIFY_TIMEOUT_S", 2.0)
    problem = Problem("q", "18")
    assert score("math500", problem, "\\boxed{18}") == (1.0, True)  # a worker is running
    before, timeouts = children().keys(), common.verify_timeouts
    # stuck in sympy: killed, and no verdict (None, not False), so the fallback's `#### 18` decides; counted
    assert score("gsm8k", problem, "#### 18 so \\boxed{9^{9^{9^{9}}}}") == (0.1, True)
    assert common.verify_timeouts == timeouts + 1
    after = children().keys()
    assert len(before - after) == 1 and not after - before  # the stuck worker is gone, not even as a zombie
    assert score("math500", problem, "\\boxed{18}") == (1.0, True)  # a fresh worker
    (fresh,) = children().keys() - after
    os.kill(fresh, signal.SIGKILL)  # it dies between two calls (out of memory, say)
    while children()[fresh] != "Z":
        time.sleep(0.01)
    assert score("math500", problem, "\\boxed{18}") == (1.0, True)  # replaced before the call: no verdict lost
    assert fresh not in children()


def test_math500_loader_and_reward_on_real_records() -> None:
    problems = load_task("math500", "test", str(DATA / "math500"))
    assert len(problems) == 5 and problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    for p in problems:
        assert score("math500", p, f"Therefore the answer is $\\boxed{{{p.answer}}}$.") == (1.0, True)
    assert score("math500", problems[0], "So \\boxed{(3, \\pi)}") == (0.1, False)
    assert score("math500", problems[3], "the answer is \\boxed{\\frac{8}{2}}") == (1.0, True)  # 4 == 8/2
    assert score("math500", problems[3], "I do not know") == (0.0, False)
    assert extract_answer("math500", "so \\boxed{ \\frac{1}{2} }") == "\\frac{1}{2}"


def test_gsm8k_prompt_is_the_artifacts_chat_prompt(tiny_model: str) -> None:
    """System message = the box instruction, user message = the question stripped, generation prompt added."""
    problem = Problem("  How many?  \n", "3")
    chat = render_prompt("gsm8k", problem, HFPolicy(tiny_model, device="cpu").tokenizer, chat_template=True)
    assert chat == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                    "<|im_end|>\n<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n")


def test_make_arith_refuses_an_impossible_count() -> None:
    """make_arith(226, max_number=15, ops="*") looped forever (15² = 225 distinct products)."""
    assert len({p.question for p in common.make_arith(225, 1, max_number=15, ops="*")}) == 225
    with pytest.raises(SystemExit, match="226 problems asked for, but there are only 225 distinct"):
        common.make_arith(226, 1, max_number=15, ops="*")


def test_arith_task_is_generated_disjoint_and_scored_like_gsm8k() -> None:
    train, test = load_task("arith", "train"), load_task("arith", "test")
    assert (len(train), len(test)) == (400, 200) and not {p.question for p in train} & {p.question for p in test}
    for p in train + test:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", p.question).groups()
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) and 1 <= int(a) <= 20
    p = train[0]
    assert score("arith", p, f"{p.question[8:-1]} = \\boxed{{{p.answer}}}") == (1.0, True)
    # the verdict is the final answer, never the question restated (math-verify would evaluate "21 + 17" to 38)
    q = Problem("What is 21 + 17?", "38")
    assert score("arith", q, "To find 21 + 17, we simply add them: 21 + 17") == (0.0, False)
    assert score("arith", q, "21 + 17 = 38.") == (0.0, True)  # unboxed: no reward, but right
    assert score("arith", q, "21 + 17 = 38. The answer is \\boxed{39}.") == (0.1, False)  # the box is the answer
    assert score("arith", Problem("What is 5 - 9?", "-4"), "5 - 9 = -4") == (0.0, True)
    example = "Q: What is 2 + 3?\nA: 2 + 3 = 5. The answer is \\boxed{5}.\n"
    assert render_prompt("arith", p) == f"{example}Q: {p.question}\nA:"


def test_evaluate_greedy_scores_each_problem_once_across_batches() -> None:
    """Five problems in batches of 2 (the engine answers each prompt of a batch in reverse order): each completion is
    scored against its own problem, rewards and accuracy are the means by hand."""
    problems = [Problem(f"What is {a} + 1?", str(a + 1)) for a in range(5)]
    answers = {0: "\\boxed{1}", 1: "\\boxed{9}", 2: "2 + 1 = 3", 3: "none", 4: "\\boxed{5}"}  # 1, .1, 0, 0, 1

    class Engine:
        tokenizer, batch_size, calls = None, 2, []

        def generate(self, prompts: list[str], max_new_tokens: int) -> list[common.Sample]:
            self.calls.append(len(prompts))
            found = [int(re.findall(r"What is (\d+)", prompt)[-1]) for prompt in prompts]
            return [common.Sample(i, answers[found[i]], []) for i in reversed(range(len(prompts)))]

    engine = Engine()
    row = common.evaluate_greedy(engine, "arith", problems, 8, chat_template=False)
    assert engine.calls == [2, 2, 1] and row == {"eval/reward": pytest.approx(2.1 / 5), "eval/accuracy": 3 / 5}


def test_schedule_epochs_are_permutations_and_random_is_per_update() -> None:
    """epoch order: each epoch's batches (contiguous, the last shorter) cover every problem exactly once, a fresh
    shuffle per epoch; random order: independent draws without replacement."""
    epoch0 = [plan(0, 10, 4, None, 1, "epoch")[2](t) for t in range(3)]
    assert [len(b) for b in epoch0] == [4, 4, 2] and sorted(np.concatenate(epoch0).tolist()) == list(range(10))
    epoch1 = np.concatenate([plan(0, 10, 4, None, 1, "epoch")[2](t) for t in range(3, 6)])
    assert sorted(epoch1.tolist()) == list(range(10)) and epoch1.tolist() != np.concatenate(epoch0).tolist()
    assert plan(1, 10, 4, None, 1, "epoch")[2](0).tolist() != epoch0[0].tolist()
    draws = [plan(0, 10, 4, None, 1, "random")[2](t) for t in range(3)]
    assert all(len(set(d.tolist())) == 4 for d in draws) and draws[0].tolist() != draws[1].tolist()


def test_missing_data_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no train.jsonl or train.json"):
        load_task("gsm8k", "train", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3]}\n')
    with pytest.raises(SystemExit, match="every record needs the fields numbers, target"):
        load_task("countdown", "test", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3], "target": 6}\n\n{oops\n')
    with pytest.raises(SystemExit, match="test.jsonl, line 3: not valid JSON"):  # the file's line, blank lines counted
        load_task("countdown", "test", str(tmp_path))
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no problems in it"):  # an empty split would train on NaN rewards
        load_task("countdown", "test", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3], "target": 6}\n')
    assert load_task("countdown", "test", str(tmp_path)) == [Problem(numbers=(1, 2, 3), target=6)]
    with pytest.raises(SystemExit, match="not a folder, a hub id"):
        HFPolicy("./no/such/model")


def test_countdown_reference_data_with_fractional_targets(tmp_path: Path) -> None:
    """[Qiu]'s countdown.json has non-integer targets ("27.4"): numbers compared within 1e-5, as the reference does."""
    (tmp_path / "train.json").write_text(json.dumps([{"numbers": [2, 5, 7], "target": "0.4"},
                                                     {"numbers": ["3", "4"], "target": 12}]))
    problems = load_task("countdown", "train", str(tmp_path))
    assert [(p.numbers, p.target) for p in problems] == [((2, 5, 7), 0.4), ((3, 4), 12.0)]
    assert score("countdown", problems[0], " x</think>\n<answer>2 / 5</answer>") == (0.1, False)  # 7 unused
    assert score("countdown", Problem(numbers=(2, 5, 10), target=0.04), " </think>\n<answer>2 / 5 / 10</answer>") \
        == (1.1, True)
    assert "equals 0.04." in render_prompt("countdown", Problem(numbers=(2, 5, 10), target=0.04))
