"""bench/task_data.py (the CPU experiments' task variants), bench/plot_curves.py, bench/paired_greedy.py,
bench/es_iteration.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import harness  # noqa: E402
import es_iteration  # noqa: E402
import eval_passk  # noqa: E402
import paired_greedy  # noqa: E402
import plot_curves  # noqa: E402
import task_data  # noqa: E402


def template_regex(template: str) -> re.Pattern:
    """A template as a regex: {a}, {b}, {c} capture integers; names and items match words."""
    pattern = re.escape(template)
    for field in ("a", "b", "c"):
        pattern = pattern.replace(re.escape("{" + field + "}"), rf"(?P<{field}>\d+)", 1)
        pattern = pattern.replace(re.escape("{" + field + "}"), rf"(?P={field})")
    for field in ("n", "i"):
        pattern = pattern.replace(re.escape("{" + field + "}"), r"\w+")
    return re.compile(pattern + "$")


def expected(question: str, a: int, b: int, c: int) -> int:
    """The answer read off the English, independently of the generator's lambdas."""
    if "earns" in question:
        return a * b - c
    if "box holds" in question:
        return a * b + c
    if "found" in question:
        return a - b + c
    if "packs with" in question:
        return a + b * c if " has " in question else a * b
    return a + b if "more" in question else a - b


@pytest.mark.parametrize("steps", [1, 2])
def test_arith_answers_recomputed_from_the_question(tmp_path: Path, steps: int) -> None:
    """Every written problem parses back to exactly one template; its numbers give the gold answer; GSM8K's loader and
    verifier read the folder; train and test are disjoint."""
    out = tmp_path / "arith"
    task_data.main(task_data.Args(out=str(out), kind="arith", steps=steps, max_number=12, train=60, test=40))
    templates = task_data.ONE_STEP if steps == 1 else task_data.TWO_STEP
    train, test = common.load_task("gsm8k", "train", str(out)), common.load_task("gsm8k", "test", str(out))
    assert (len(train), len(test)) == (60, 40)
    assert not {p.question for p in train} & {p.question for p in test}
    for p in train + test:
        matches = [(m, f) for t, f in templates if (m := template_regex(t).match(p.question))]
        assert len(matches) == 1, p.question
        m, answer = matches[0]
        numbers = [int(m.group(k)) if k in m.groupdict() else 0 for k in "abc"]
        assert all(2 <= x <= 12 for x in numbers[: 2 if steps == 1 else 3])
        assert int(p.answer) == answer(*numbers) == expected(p.question, *numbers) > 0
        assert common.score("gsm8k", p, f"so \\boxed{{{p.answer}}}") == (1.0, True)


def test_sums_with_products_are_right_and_scored(tmp_path: Path) -> None:
    """--ops "*" writes "What is a * b?" with the product as gold; the arith task reads and scores it."""
    task_data.main(task_data.Args(out=str(tmp_path / "p"), kind="sums", ops="*", max_number=12, train=30, test=20))
    problems = [p for split in ("train", "test") for p in common.load_task("arith", split, str(tmp_path / "p"))]
    assert len({p.question for p in problems}) == 50
    for p in problems:
        a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", p.question).groups())
        assert int(p.answer) == a * b and 1 <= a <= 12 and 1 <= b <= 12
        assert common.score("arith", p, f"{a} * {b} = {a * b}. The answer is \\boxed{{{a * b}}}.") == (1.0, True)


def test_countdown_variant_is_solvable_and_in_range(tmp_path: Path) -> None:
    out = tmp_path / "cd"
    task_data.main(task_data.Args(out=str(out), kind="countdown", sizes=(3,), max_number=10, max_target=30,
                                  train=50, test=20))
    problems = common.load_task("countdown", "train", str(out)) + common.load_task("countdown", "test", str(out))
    assert len({(tuple(sorted(p.numbers)), p.target) for p in problems}) == 70
    for p in problems:
        assert len(p.numbers) == 3 and all(1 <= x <= 10 for x in p.numbers) and 1 <= p.target <= 30


def test_existing_out_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, "bench/task_data.py", "--out", str(tmp_path / "x")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "already exists" in r.stderr.strip().splitlines()[-1]
    assert [f.name for f in (tmp_path / "x").iterdir()] == ["keep.txt"]


def test_plot_curves_reads_every_script(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Every script keys its rows by "step" (grpo_es.py: the global one); first → last per metric."""
    layouts = {"es": [{"step": 0, "eval/accuracy": 0.1},
                      {"step": 1, "train/reward_mean": 0.2, "es/js_succ_bits": 0.3},
                      {"step": 2, "train/reward_mean": 0.4, "es/js_succ_bits": 0.1, "eval/accuracy": 0.25}],
               "grpo": [{"step": 1, "train/reward_mean": 0.5}, {"step": 2, "train/reward_mean": 0.75}],
               "mix": [{"step": 1, "stage_step": 1, "train/reward_mean": 0.1},
                       {"step": 3, "stage_step": 1, "train/reward_mean": 0.9}]}
    for name, rows in layouts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert harness.load_curves(tmp_path / "mix", ["train/reward_mean"])["train/reward_mean"] == [(1, 0.1), (3, 0.9)]
    plot_curves.main(plot_curves.Args(runs=tuple(f"{n}={tmp_path / n}" for n in layouts), out=str(tmp_path / "c.png")))
    table = capsys.readouterr().out
    assert "| es | 0.200 → 0.400 | – | 0.100 → 0.250 | 0.300 → 0.100 | – |" in table
    assert "| grpo | 0.500 → 0.750 | – | – | – | – |" in table
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_paired_greedy_by_hand() -> None:
    """Per-problem greedy rewards base (1, 0.1, 0, 1) and es (1, 1, 0.1, 0): d = (0, 0.9, 0.1, −1), mean 0;
    correctness d = (0, 1, 0, −1): one problem won (x = 1), one lost (x = 3); the accuracy interval is eval_passk's."""
    def rows(model: str, rewards: list[float]) -> list[dict]:
        return [{"model": model, "set": "arith", "problem": x, "greedy": {"reward": r, "correct": r == 1}}
                for x, r in enumerate(rewards)]
    other_set = [{**row, "set": "other"} for row in rows("base", [0, 0, 0, 0])]  # no es rows: not compared
    (r,) = paired_greedy.compare(rows("es", [1, 1, 0.1, 0]) + rows("base", [1, 0.1, 0, 1]) + other_set, "base")
    assert (r["model"], r["set"], r["problems"], r["won"], r["lost"]) == ("es", "arith", 4, 1, 1)
    assert r["reward"][:3] == pytest.approx((0.525, 0.525, 0.0)) and r["correct"][:3] == pytest.approx((0.5, 0.5, 0.0))
    assert -1 <= r["reward"][3] < 0 < r["reward"][4] <= 0.9  # within the extreme resample means, min d and max d
    greedy = {m: np.random.default_rng(i).integers(0, 2, 200).tolist() for i, m in enumerate(("base", "es"))}
    (r200,) = paired_greedy.compare([row for m, g in greedy.items() for row in rows(m, g)], "base")
    report = {"n": 1, "ks": [1], "results": {m: {"arith": {"correct_counts": g, "greedy_correct": g}}
                                             for m, g in greedy.items()}}
    cell = eval_passk.uncertainty(report, "base", 2000, 0)["rows"]["es"]["arith"]["greedy"]
    assert [cell["diff"], *cell["diff_ci"]] == list(r200["correct"][2:])  # the same resamples of the same problems
    assert (cell["won"], cell["lost"]) == (r200["won"], r200["lost"])
    up = paired_greedy.compare(rows("es", [1, 1, 1, 1]) + rows("base", [1, 0.1, 0, 1]), "base")[0]
    assert up["reward"][2] == pytest.approx(0.475) and up["won"] == 2 and up["lost"] == 0
    assert 0 <= up["correct"][3] <= up["correct"][4] <= 1  # d ≥ 0 on every problem


def test_the_accumulating_update_is_the_regenerating_one(tiny_model: str) -> None:
    """bench/es_iteration.py's accumulate candidate: Σ Z_n ε_n = (Σ R_n ε_n − mean R·Σ ε_n)/(std R + 1e-8), summed
    while the members are evaluated, moves θ where es.py's update (ε drawn again) does, to fp32 rounding; and the
    fixed-length generation makes both runs produce N·P·T tokens."""
    import torch

    args = es_iteration.Args(prompts=2, max_new_tokens=3, sigma=0.05, alpha=0.1)
    prompts, thetas = ["ab", "cd"], []
    for mode in ("regenerate", "accumulate"):
        policy = common.HFPolicy(tiny_model, "float32", "cpu")
        es_iteration.fixed_length(policy)
        master = common.Master(policy.params)
        s = es_iteration.es_iteration(policy, master, prompts, args, 4, mode, "cpu")
        assert s["tokens"] == 4 * 2 * 3 and s["update"] > 0
        thetas.append(master.theta)
        assert all(torch.equal(policy.params[k], m) for k, m in master.theta.items())  # restored to the new θ
    moved = [k for k in thetas[0] if not torch.equal(thetas[0][k], common.Master(
        common.HFPolicy(tiny_model, "float32", "cpu").params).theta[k])]
    assert moved  # the update ran
    for k in thetas[0]:
        torch.testing.assert_close(thetas[1][k], thetas[0][k], rtol=0, atol=1e-6)


def test_es_iteration_table_has_a_row_per_population_and_mode(tiny_model: str) -> None:
    """bench/es_iteration.py on the tiny model: a row per (N, mode), each generating exactly N·P·T tokens (the N×P×T
    column is measured: tokens // (N·P)), a ratio to batched inference, and the command that reproduces the table."""
    text = es_iteration.main(es_iteration.Args(models=(tiny_model,), modes=("regenerate", "lowrank"), pops=(2, 4),
                                               prompts=2, max_new_tokens=3, threads=1))
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(f"| {tiny_model}")]
    assert [(r[3], r[4]) for r in rows] == [("regenerate", "2×2×3"), ("lowrank", "2×2×3"), ("regenerate", "4×2×3"),
                                           ("lowrank", "4×2×3")]
    assert all(r[7].endswith("%") and float(r[5]) > 0 for r in rows)
    assert "--modes regenerate lowrank --pops 2 4 --prompts 2 --max-new-tokens 3" in text


def test_shared_prefill_bench_samples_the_reference_tokens(tiny_model: str) -> None:
    """bench/shared_prefill.py on the tiny model: 3 problems × n = 3 in chunks of 4 rows (a problem's rows straddle
    two chunks); HFPolicy.generate's tokens equal HF generate's on the copies, and both rows of the table are timed."""
    result = subprocess.run([sys.executable, "bench/shared_prefill.py", "--model", tiny_model, "--problems", "3",
                             "--n", "3", "--batch-size", "4", "--max-new-tokens", "6", "--repeats", "1",
                             "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 problems × n = 3" in result.stdout and "same tokens: True" in result.stdout
    assert "| shared prefill (HFPolicy.generate) |" in result.stdout and "speed-up" in result.stdout


def test_freed_memory_bench_compares_the_two_mallocs_on_the_same_tokens(tiny_model: str) -> None:
    """bench/freed_memory.py on the tiny model: one process a side, both timed, the same tokens sampled."""
    result = subprocess.run([sys.executable, "bench/freed_memory.py", "--model", tiny_model, "--rounds", "1", "--n", "2",
                             "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| default |" in result.stdout and "| kept |" in result.stdout and "same tokens: True" in result.stdout


def test_sums_keep_commuted_twins_on_one_side_of_the_split(tmp_path: Path) -> None:
    """a + b in test and b + a in train (30 of the findings study's 300 test sums) let a model be tested on what it
    trained on; task_data.py --kind sums keeps every twin pair on one side."""
    import task_data

    problems = common.make_arith(300, 1, max_number=15, ops="+-")
    train, test = task_data.split_twins(problems, 100)
    assert len(test) == 100 and sorted(map(str, train + test)) == sorted(map(str, problems))

    def twin(p: common.Problem) -> str:
        a, op, b = p.question[8:-1].split()
        return f"What is {b} {op} {a}?" if op == "+" else p.question

    held = {p.question for p in test}
    assert not [p for p in train if twin(p) in held]
    assert sum(twin(p) in {q.question for q in problems} and twin(p) != p.question for p in test) > 0  # twins exist
    pairs = [common.Problem("What is 1 + 2?", "3"), common.Problem("What is 3 - 1?", "2"), common.Problem("What is 2 + 1?", "3")]
    assert [p.question for p in task_data.split_twins(pairs, 2)[1]] == ["What is 1 + 2?", "What is 2 + 1?"]
    with pytest.raises(SystemExit, match="cannot hold out exactly 1"):
        task_data.split_twins(pairs[::2], 1)
    out = tmp_path / "sums"
    task_data.main(task_data.Args(out=str(out), kind="sums", max_number=15, train=300, test=100, seed=1))
    train_q, test_q = ({json.loads(line)["question"] for line in (out / f"{s}.jsonl").read_text().splitlines()}
                       for s in ("train", "test"))
    assert len(test_q) == 100 and not {twin(common.Problem(q, "")) for q in train_q} & test_q


def test_chains_are_multi_step_and_keep_reordered_twins_on_one_side(tmp_path: Path) -> None:
    """task_data.py --kind chains: 'What is a + b - c?' with the value Python's precedence gives, ≥ 0, distinct; the
    same sum reordered (a + b - c, b + a - c, a - c + b) never straddles the split, while a - b + c and a + b - c do
    not count as twins."""
    import task_data

    problems = task_data.make_chains(400, 3, max_number=9, terms=3, ops="+-*")
    assert len({p.question for p in problems}) == 400
    for p in problems:
        a, op1, b, op2, c = p.question[8:-1].split()
        x, y, z = int(a), int(b), int(c)
        value = {("+", "+"): x + y + z, ("+", "-"): x + y - z, ("-", "+"): x - y + z, ("-", "-"): x - y - z,
                 ("*", "+"): x * y + z, ("*", "-"): x * y - z, ("+", "*"): x + y * z, ("-", "*"): x - y * z,
                 ("*", "*"): x * y * z}[op1, op2]  # by hand: * binds first
        assert int(p.answer) == value >= 0
    twins = [common.Problem(q, "0") for q in ("What is 1 + 2 - 3?", "What is 4 - 1 + 2?", "What is 2 + 1 - 3?",
                                              "What is 1 - 3 + 2?", "What is 2 * 3 + 1?", "What is 1 + 3 * 2?")]
    train, test = task_data.split_twins(twins, 5)  # groups {0, 2, 3}, {1}, {4, 5}: only {1} can stay in train
    assert [p.question for p in train] == ["What is 4 - 1 + 2?"]
    with pytest.raises(SystemExit, match="cannot hold out exactly 4"):
        task_data.split_twins(twins, 4)
    pair = lambda a, b: [common.Problem(f"What is {a}?", "0"), common.Problem(f"What is {b}?", "0")]  # noqa: E731
    for a, b in (("5 + 6 - 7", "5 + 7 - 6"), ("2 * 3 + 1", "2 * 3 - 1"), ("2 * 3", "2 + 3")):  # not twins
        assert [p.question for p in task_data.split_twins(pair(a, b), 1)[1]] == [f"What is {b}?"]
    for a, b in (("2 * 3 + 1", "1 + 3 * 2"), ("2 * 3 * 4", "4 * 2 * 3"), ("9 - 1 - 2", "9 - 2 - 1")):  # twins
        with pytest.raises(SystemExit, match="cannot hold out exactly 1"):
            task_data.split_twins(pair(a, b), 1)
    out = tmp_path / "chains"
    task_data.main(task_data.Args(out=str(out), kind="chains", max_number=20, train=200, test=50, seed=1))
    rows = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and all(r["question"].count(" ") == 6 and r["answer"].startswith("#### ") for r in rows)
