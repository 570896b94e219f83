"""Write an easier task variant as {out}/train.jsonl and {out}/test.jsonl, for the scripts' `--data`.

A 135M model never solves the default Countdown (3–4 numbers in 1..99) nor much of GSM8K, so the CPU-scale
experiments (README "Results (CPU, SmolLM2-135M)") train on easier variants that the existing task code reads:

  countdown   common.make_countdown with other sizes/ranges; records {numbers, target}; `--task countdown`.
  arith       one- or two-step word problems in GSM8K's format (question, answer "… #### N"); `--task gsm8k`, scored by
              GSM8K's rule (\\boxed{} answer, else the last number). Templates below; --max-number sets the size.
  sums        the `arith` task's "What is a ± b?" (common.make_arith) with other number ranges (--ops "*": "What is
              a * b?"); `--task arith`.
  chains      "What is a + b - c?": --terms numbers joined by operations from --ops (usual precedence), a value ≥ 0;
              more than one step to take, in the `arith` format; `--task arith`.

Train and test are disjoint (one seeded pool, split at the end; sums and chains keep a + b and b + a on one side):

    python bench/task_data.py --kind arith --steps 1 --max-number 20 --out data/arith1
    python es.py --task gsm8k --data data/arith1 --chat-template ...
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Problem, die, make_arith, make_countdown, require, write_atomic  # noqa: E402


@dataclass
class Args:
    out: str
    """output folder (train.jsonl, test.jsonl); must not exist yet"""
    kind: Literal["countdown", "arith", "sums", "chains"] = "arith"
    """countdown: {numbers, target} records; arith: GSM8K-format word problems; sums: "What is a ± b?"; chains:
    "What is a + b - c?" """
    sizes: tuple[int, ...] = (3,)
    """countdown: how many numbers a problem has (one drawn per problem)"""
    max_number: int = 10
    """numbers are drawn from 1..max_number (arith: 2..max_number)"""
    steps: Literal[1, 2] = 1
    """arith: operations per word problem"""
    ops: str = "+-"
    """sums, chains: the operations drawn from ("+-", or e.g. "*" for products)"""
    terms: int = 3
    """chains: numbers in an expression (≥ 2)"""
    max_target: int = 30
    """countdown: targets are integers in 1..max_target"""
    train: int = 1000
    """train problems"""
    test: int = 200
    """test problems (disjoint from train)"""
    seed: int = 0
    """generator seed"""


NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ben", "Zoe")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books")
# (question template, answer) over numbers a, b, c: one or two operations, the answer always a positive integer
ONE_STEP: tuple[tuple[str, Callable[[int, int, int], int]], ...] = (
    ("{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?", lambda a, b, c: a + b),
    ("{n} had {a} {i} and gave {b} away. How many {i} does {n} have left?", lambda a, b, c: a - b),
    ("{n} buys {a} packs with {b} {i} in each. How many {i} does {n} have?", lambda a, b, c: a * b),
)
TWO_STEP: tuple[tuple[str, Callable[[int, int, int], int]], ...] = (
    ("{n} has {a} {i}. {n} buys {b} packs with {c} {i} in each. How many {i} does {n} have now?",
     lambda a, b, c: a + b * c),
    ("{n} had {a} {i} and gave {b} away. Then {n} found {c} more. How many {i} does {n} have?",
     lambda a, b, c: a - b + c),
    ("A box holds {a} {i}. How many {i} are there in {b} boxes and {c} loose {i}?",
     lambda a, b, c: a * b + c),
    ("{n} earns {a} dollars an hour, works {b} hours and spends {c} dollars. How many dollars are left?",
     lambda a, b, c: a * b - c),
)


def split_twins(problems: list[Problem], test: int) -> tuple[list[Problem], list[Problem]]:
    """(train, test) with `test` problems taken from the end of the list, and a + b, b + a (likewise a * b, b * a) on
    the same side: a model must not be tested on the commuted twin of a problem it trained on."""
    def key(p: Problem) -> str:  # the expression's signed products, each with its factors sorted, sorted
        terms, sign = [], "+"
        for term in re.split(r" ([+-]) ", " + " + p.question.removeprefix("What is ").removesuffix("?"))[1:]:
            if term in "+-":
                sign = term
            else:
                terms.append(sign + "*".join(sorted(term.split(" * "), key=int)))
        return " ".join(sorted(terms))

    groups: dict[str, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(key(p), []).append(i)
    held: set[int] = set()
    for i in reversed(range(len(problems))):  # from the end: whole groups that still fit
        group = groups[key(problems[i])]
        if i not in held and len(held) + len(group) <= test:
            held.update(group)
    require(len(held) == test, f"split_twins: cannot hold out exactly {test} problems with twins kept together")
    return ([p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held])


def make_chains(count: int, seed: int, max_number: int, terms: int, ops: str) -> list[Problem]:
    """`count` distinct "What is a + b - c?" with `terms` numbers in 1..max_number and a value ≥ 0."""
    rng, seen, problems = random.Random(seed), set(), []
    for _ in range(1000 * count):
        if len(problems) == count:
            return problems
        parts = [str(rng.randint(1, max_number))]
        for _ in range(terms - 1):
            parts += [rng.choice(ops), str(rng.randint(1, max_number))]
        expression = " ".join(parts)
        value = eval(expression)  # noqa: S307  (digits and + - * only, written just above)
        if expression not in seen and value >= 0:
            seen.add(expression)
            problems.append(Problem(f"What is {expression}?", str(value)))
    die(f"could not generate {count} distinct chains of {terms} numbers ≤ {max_number} with value ≥ 0")


def make_word_problems(count: int, seed: int, max_number: int, steps: int) -> list[dict]:
    """`count` distinct word problems whose answer is a positive integer."""
    rng, seen, rows, templates = random.Random(seed), set(), [], ONE_STEP if steps == 1 else TWO_STEP
    for _ in range(1000 * count):
        if len(rows) == count:
            return rows
        k = rng.randrange(len(templates))
        a, b, c = rng.randint(2, max_number), rng.randint(2, max_number), rng.randint(2, max_number)
        template, answer = templates[k]
        if (k, a, b, c if steps == 2 else 0) in seen or answer(a, b, c) <= 0:
            continue
        seen.add((k, a, b, c if steps == 2 else 0))
        question = template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b, c=c)
        rows.append({"question": question, "answer": f"#### {answer(a, b, c)}"})
    die(f"could not generate {count} distinct arith problems with --max-number {max_number}")


def main(args: Args) -> None:
    out = Path(args.out)
    if out.exists():
        die(f"--out {out} already exists; pick a new folder")
    if min(args.sizes) < 2 or args.max_number < 3 or args.max_target < 1 or args.terms < 2:
        die("--sizes and --terms must be >= 2, --max-number >= 3 and --max-target >= 1")
    if not args.ops or set(args.ops) - set("+-*"):
        die(f"--ops '{args.ops}': use one or more of + - *")
    total = args.train + args.test
    if args.kind == "countdown":
        rows = [{"numbers": list(p.numbers), "target": p.target} for p in make_countdown(
            total, seed=args.seed, sizes=args.sizes, max_number=args.max_number, max_target=args.max_target)]
    elif args.kind in ("sums", "chains"):  # commuted twins (a + b, b + a) on one side of the split
        pool = (make_arith(total, args.seed, max_number=args.max_number, ops=args.ops) if args.kind == "sums" else
                make_chains(total, args.seed, args.max_number, args.terms, args.ops))
        rows = [{"question": p.question, "answer": f"#### {p.answer}"} for part in split_twins(pool, args.test)
                for p in part]
    else:
        rows = make_word_problems(total, args.seed, args.max_number, args.steps)
    def fill(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        for split, part in (("train", rows[:args.train]), ("test", rows[args.train:])):
            (tmp / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))

    write_atomic(out, fill)  # nothing half-written under --out
    print(f"wrote {args.train} train / {args.test} test {args.kind} problems to {out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
