"""common.py: noise, exact perturb/restore/update, tasks, prompts and rewards."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from common import (HFPolicy, Problem, derive_seed, extract_answer, load_task, make_countdown, noise, render_prompt,
                    score)

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


def test_derive_seed_is_stable_across_processes() -> None:
    code = "from common import derive_seed; print(derive_seed(3, 'member', 5, 1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={"PYTHONHASHSEED": "123"}).stdout
    assert int(out) == derive_seed(3, "member", 5, 1) and derive_seed(3, "member", 5, 1) != derive_seed(3, "member", 5, 2)


# ---------------------------------------------------------------------------------------------------- ES primitives
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_restore_is_bit_exact_after_many_cycles(tiny_model: str, dtype: str) -> None:
    policy = HFPolicy(tiny_model, dtype, "cpu", es=True)
    before = {k: p.clone() for k, p in policy.params.items()}
    for cycle in range(25):
        policy.perturb(seed=cycle, scale=1e-2)
        # the member is exactly cast(master + σ·ε), computed in fp32 (torch.add with alpha: one rounding)
        name, p = next(iter(policy.params.items()))
        expected = policy.master[name].add(noise(cycle, name, p.shape, "cpu"), alpha=1e-2).to(p.dtype)
        assert torch.equal(p, expected)
        policy.restore()
    assert all(torch.equal(before[k], p) for k, p in policy.params.items())


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
    policy = HFPolicy(tiny_model, "float32", "cpu", es=True)
    master0 = {k: m.clone() for k, m in policy.master.items()}
    seeds, coefs, scale = [11, 12, 13], [0.5, -1.25, 0.75], 1e-3
    stored = [{k: noise(s, k, m.shape, "cpu") for k, m in master0.items()} for s in seeds]  # what we never keep
    norm = policy.add_noise(seeds, coefs, scale)
    total_sq = 0.0
    for k, m in master0.items():
        delta = scale * sum(c * eps[k] for c, eps in zip(coefs, stored))
        assert torch.allclose(policy.master[k], m + delta, rtol=0, atol=1e-8)  # a few fp32 ulps
        total_sq += float(delta.double().square().sum())
    assert norm == pytest.approx(total_sq**0.5, rel=1e-5)
    assert all(torch.equal(policy.params[k], policy.master[k]) for k in policy.params)  # model = cast(master)


def test_shrink_to_base_and_drift(tiny_model: str) -> None:
    policy = HFPolicy(tiny_model, "float32", "cpu", es=True)
    assert policy.drift() == 0.0
    policy.add_noise([1], [1.0], 1e-3)
    d = policy.drift()
    policy.shrink_to_base(0.5)  # θ₀ + 0.5(θ − θ₀): the drift halves
    assert policy.drift() == pytest.approx(d / 2, rel=1e-4)
    policy.shrink_to_base(0.0)
    assert policy.drift() == 0.0


def test_generate_greedy_is_deterministic_and_batched_like_single(tiny_model: str) -> None:
    policy = HFPolicy(tiny_model, "float32", "cpu", batch_size=8)
    prompts = ["short", "a much longer prompt here"]
    batched = policy.generate(prompts, max_new_tokens=12)
    single = [policy.generate([p], max_new_tokens=12)[0] for p in prompts]
    assert [s.token_ids for s in batched] == [s.token_ids for s in single]  # left padding does not change outputs
    sampled = policy.generate(prompts, n=3, max_new_tokens=12, temperature=1.0, seed=5)
    assert [s.prompt_index for s in sampled] == [0, 0, 0, 1, 1, 1]
    assert [s.text for s in sampled] == [s.text for s in policy.generate(prompts, 3, 12, 1.0, seed=5)]


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


def test_countdown_split_is_fixed_disjoint_and_solvable() -> None:
    train, test = load_task("countdown", "train"), load_task("countdown", "test")
    assert len(train) == 10_000 and len(test) == 2_000
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    assert len({key(p) for p in train}) == len(train) and not {key(p) for p in train} & {key(p) for p in test}
    assert all(3 <= len(p.numbers) <= 4 and all(1 <= x <= 99 for x in p.numbers) and 1 <= p.target <= 100
               for p in train + test)
    assert all(solvable(p.numbers, p.target) for p in train[:100] + test[:100])
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
    assert score("gsm8k", p, "So the profit is \\boxed{70,000}.") == (1.0, True)
    assert score("gsm8k", p, "He made 5 then 70000 dollars") == (1.0, True)  # last number, no box
    assert score("gsm8k", p, "The answer is \\boxed{7000}") == (0.1, False)  # formatted but wrong
    assert score("gsm8k", p, "I think it is 70000 or maybe 12") == (0.0, False)
    assert score("gsm8k", p, "nothing") == (0.0, False)
    assert extract_answer("gsm8k", "so \\boxed{70,000.0}") == "70000" == extract_answer("gsm8k", "it is 70000")


def test_math500_loader_and_reward_on_real_records() -> None:
    problems = load_task("math500", "test", str(DATA / "math500"))
    assert len(problems) == 5 and problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    for p in problems:
        assert score("math500", p, f"Therefore the answer is $\\boxed{{{p.answer}}}$.") == (1.0, True)
    assert score("math500", problems[0], "So \\boxed{(3, \\pi)}") == (0.1, False)
    assert score("math500", problems[3], "the answer is \\boxed{\\frac{8}{2}}") == (1.0, True)  # 4 == 8/2
    assert score("math500", problems[3], "I do not know") == (0.0, False)
    assert extract_answer("math500", "so \\boxed{ \\frac{1}{2} }") == "\\frac{1}{2}"


def test_missing_data_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no train.jsonl or train.json"):
        load_task("gsm8k", "train", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3]}\n')
    with pytest.raises(SystemExit, match="every record needs the fields numbers, target"):
        load_task("countdown", "test", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3], "target": 6}\n{oops\n')
    with pytest.raises(SystemExit, match="is not valid JSON"):
        load_task("countdown", "test", str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"numbers": [1, 2, 3], "target": 6}\n')
    assert load_task("countdown", "test", str(tmp_path)) == [Problem(numbers=(1, 2, 3), target=6)]
    with pytest.raises(SystemExit, match="not a folder, a hub id"):
        HFPolicy("./no/such/model")
