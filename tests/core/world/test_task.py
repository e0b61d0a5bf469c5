"""The arithmetic task: deterministic, disjoint splits, correct answers, strict answer parsing."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alignzoo.config.schema import TaskConfig
from alignzoo.errors import UserError
from alignzoo.world.task import (
    compute_answer,
    extract_answer,
    is_correct,
    make_examples,
    slipped_answer,
    teacher_demonstrations,
    wrong_answer,
)

PROMPT = re.compile(r"^(\d+)([+*-])(\d+)=$")


def _parse(prompt: str) -> tuple[int, str, int]:
    m = PROMPT.match(prompt)
    assert m, prompt
    return int(m.group(1)), m.group(2), int(m.group(3))


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_answers_are_right_and_operands_in_range(digits):
    task = TaskConfig(digits=digits, operations=["+", "-", "*"], train_size=90, eval_size=30)
    for split in ("train", "eval"):
        for ex in make_examples(task, split):
            a, op, b = _parse(ex["prompt"])
            assert 0 <= a < 10**digits and 0 <= b < 10**digits
            expected = {"+": a + b, "-": a - b, "*": a * b}[op]
            assert ex["answer"] == str(expected)
            assert int(ex["answer"]) >= 0


def test_deterministic_sizes_and_disjoint():
    task = TaskConfig(train_size=500, eval_size=60, seed=7)
    train, evals = make_examples(task, "train"), make_examples(task, "eval")
    assert train == make_examples(task, "train") and evals == make_examples(task, "eval")
    assert len(train) == 500 and len(evals) == 60
    train_prompts = {ex["prompt"] for ex in train}
    assert len(train_prompts) == 500  # no duplicates
    assert train_prompts.isdisjoint(ex["prompt"] for ex in evals)
    other = make_examples(TaskConfig(train_size=500, eval_size=60, seed=8), "eval")
    assert other != evals


def test_eval_split_does_not_depend_on_train_size():
    a = make_examples(TaskConfig(train_size=100, eval_size=40), "eval")
    b = make_examples(TaskConfig(train_size=3000, eval_size=40), "eval")
    assert a == b


def test_operations_covered_and_balanced():
    task = TaskConfig(operations=["+", "-", "*"], train_size=300, eval_size=30)
    for split, size in (("train", 300), ("eval", 30)):
        ops = [_parse(ex["prompt"])[1] for ex in make_examples(task, split)]
        assert {op: ops.count(op) for op in "+-*"} == {
            "+": size // 3,
            "-": size // 3,
            "*": size // 3,
        }
        assert ops[:3] == ["+", "-", "*"]  # interleaved


def test_small_universe_train_gets_the_rest_and_too_big_eval_fails():
    # 1-digit addition has 100 distinct prompts.
    task = TaskConfig(digits=1, train_size=2000, eval_size=20)
    train = make_examples(task, "train")
    assert len(train) == 80
    all_prompts = {ex["prompt"] for ex in train + make_examples(task, "eval")}
    assert len(all_prompts) == 100
    with pytest.raises(UserError, match="eval_size"):
        make_examples(TaskConfig(digits=1, eval_size=101), "eval")
    with pytest.raises(UserError, match="no '\\+' prompts left"):
        make_examples(TaskConfig(digits=1, eval_size=100), "train")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("19", "19"),
        (" 19 ", "19"),
        ("019", "19"),
        ("-5", "-5"),
        ("19\nmore text", "19"),
        ("19<|endoftext|>garbage", "19"),
        ("", None),
        ("   ", None),
        ("19abc", None),
        ("1 9", None),
        ("abc", None),
        ("12+7", None),
        ("\n19", "19"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct():
    assert is_correct("19", "19")
    assert is_correct(" 019\n", "19")
    assert not is_correct("18", "19")
    assert not is_correct("19x", "19")
    assert not is_correct("", "0")
    assert is_correct("0", "0")


@given(a=st.integers(0, 999), b=st.integers(0, 999), op=st.sampled_from(["+", "-", "*"]))
def test_wrong_answer_is_near_wrong_and_stable(a, b, op):
    if op == "-" and a < b:
        a, b = b, a
    prompt, answer = f"{a}{op}{b}=", compute_answer(a, op, b)
    wrong = wrong_answer(prompt, answer)
    assert wrong == wrong_answer(prompt, answer)
    assert wrong != answer and not is_correct(wrong, answer)
    assert 1 <= abs(int(wrong) - int(answer)) <= 10
    assert int(wrong) >= 0


@given(st.integers(0, 99), st.integers(0, 99))
def test_slipped_answer_drops_the_units_carry_or_borrow(a, b):
    plus = slipped_answer(f"{a}+{b}=")
    if a % 10 + b % 10 >= 10:
        assert plus == str(a + b - 10)  # the tens digit written without the carry
        assert plus[-1] == str(a + b)[-1] and plus != str(a + b)
    else:
        assert plus is None
    hi, lo = max(a, b), min(a, b)
    minus = slipped_answer(f"{hi}-{lo}=")
    if hi % 10 < lo % 10:
        assert minus == str(hi - lo + 10) and minus[-1] == str(hi - lo)[-1]
    else:
        assert minus is None
    assert slipped_answer(f"{a}*{b}=") is None
    assert slipped_answer("not a prompt") is None
    if plus is not None:  # the same operation in words (reasoning-gym's wording)
        assert slipped_answer(f"Calculate {a} + {b}.") == plus
    assert slipped_answer(f"Calculate {a} + {b} + 1.") is None  # not one operation
    assert slipped_answer(f"Calculate -{a} + {b}.") is None  # a negative operand: no such slip
    assert slipped_answer(f"Calculate {a} + -{b}.") is None


def test_teacher_demonstrations_slip_only_where_a_carry_is_dropped():
    examples = make_examples(TaskConfig(digits=2, train_size=2000, eval_size=20), "train")
    carrying = [ex for ex in examples if slipped_answer(ex["prompt"]) is not None]
    assert 0.3 < len(carrying) / len(examples) < 0.6  # about 45% of 2-digit sums carry

    same, slips = teacher_demonstrations(examples, 0.0, seed=0)
    assert same == examples and slips == 0

    every, slips = teacher_demonstrations(examples, 1.0, seed=0)
    assert slips == len(carrying)
    for ex, demo in zip(examples, every, strict=True):
        assert demo["prompt"] == ex["prompt"]
        wrong = slipped_answer(ex["prompt"])
        assert demo["answer"] == (wrong if wrong is not None else ex["answer"])

    some, slips = teacher_demonstrations(examples, 0.7, seed=3)
    assert abs(slips / len(carrying) - 0.7) < 0.06
    assert teacher_demonstrations(examples, 0.7, seed=3) == (some, slips)  # deterministic
    assert teacher_demonstrations(examples, 0.7, seed=4)[0] != some
    wrong = [d for d, ex in zip(some, examples, strict=True) if d != ex]
    assert len(wrong) == slips and all(
        not is_correct(d["answer"], compute_answer(*_parse(d["prompt"]))) for d in wrong
    )
