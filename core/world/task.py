"""The embedded arithmetic task: prompts like ``"12+7="`` whose answer (``"19"``) can be checked.

Examples are drawn deterministically from ``TaskConfig.seed``. Each operation gets an equal share
of each split (interleaved: +, -, *, +, ...). Operands have at most ``digits`` digits
(0 .. 10**digits - 1); subtraction keeps the first operand >= the second so answers are never
negative. The eval split is drawn first and independently of ``train_size``; the train split
never contains an eval prompt. When an operation has fewer distinct prompts than asked for
(e.g. 1-digit addition has 100), the train split gets what is left after the eval split.

A response is *well-formed* when its first line, stripped of whitespace (and of anything after
an end-of-text marker), is an integer; :func:`extract_answer` returns it normalised
(``"019"`` -> ``"19"``), or ``None`` when malformed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Literal

from alignzoo.config.schema import TaskConfig
from alignzoo.errors import UserError

Split = Literal["train", "eval"]

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_INTEGER = re.compile(r"[+-]?\d+")
_EOS_MARKERS = ("<|endoftext|>", "<|pad|>")
# Above this many operand pairs per operation, sample by rejection instead of listing them all.
_ENUMERATE_LIMIT = 200_000


def format_prompt(a: int, op: str, b: int) -> str:
    """The prompt text for ``a op b`` (no spaces): ``format_prompt(12, "+", 7) == "12+7="``."""
    return f"{a}{op}{b}="


def compute_answer(a: int, op: str, b: int) -> str:
    """The correct answer of ``a op b`` as text."""
    return str(_OPS[op](a, b))


def _valid(op: str, a: int, b: int) -> bool:
    return op != "-" or a >= b


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _draw(
    rng: random.Random, op: str, limit: int, count: int, exclude: set[tuple[int, int]]
) -> list[tuple[int, int]]:
    """``count`` distinct valid operand pairs below ``limit``, none in ``exclude`` (fewer if the
    universe runs out)."""
    if limit * limit <= _ENUMERATE_LIMIT:
        pool = [
            (a, b)
            for a in range(limit)
            for b in range(limit)
            if _valid(op, a, b) and (a, b) not in exclude
        ]
        rng.shuffle(pool)
        return pool[:count]
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < count:
        pair = (rng.randrange(limit), rng.randrange(limit))
        if not _valid(op, *pair) or pair in exclude or pair in seen:
            continue
        seen.add(pair)
        out.append(pair)
    return out


def _interleave(groups: list[list[dict[str, str]]]) -> Iterator[dict[str, str]]:
    for i in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if i < len(group):
                yield group[i]


def make_examples(task: TaskConfig, split: Split) -> list[dict[str, str]]:
    """The ``split`` examples of the task: dicts with ``prompt`` (``"12+7="``) and ``answer``.

    Deterministic from ``task.seed``; the eval split is disjoint from the train split and
    does not depend on ``task.train_size``.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not task.operations:
        raise UserError("data.task.operations: give at least one of '+', '-', '*'")
    limit = 10**task.digits
    ops = list(dict.fromkeys(task.operations))  # unique, in the order given
    groups: list[list[dict[str, str]]] = []
    for op, n_eval, n_train in zip(
        ops, _shares(task.eval_size, len(ops)), _shares(task.train_size, len(ops)), strict=True
    ):
        eval_pairs = _draw(random.Random(f"{task.seed}/{op}/eval"), op, limit, n_eval, set())
        if len(eval_pairs) < n_eval:
            raise UserError(
                f"data.task: eval_size asks for {n_eval} '{op}' prompts but {task.digits}-digit "
                f"'{op}' has only {len(eval_pairs)} distinct prompts; lower eval_size"
            )
        pairs = eval_pairs
        if split == "train":
            rng = random.Random(f"{task.seed}/{op}/train")
            pairs = _draw(rng, op, limit, n_train, set(eval_pairs))
            if not pairs:
                raise UserError(
                    f"data.task: no '{op}' prompts left for training after the eval split; "
                    "lower eval_size or raise digits"
                )
        groups.append(
            [
                {"prompt": format_prompt(a, op, b), "answer": compute_answer(a, op, b)}
                for a, b in pairs
            ]
        )
    return list(_interleave(groups))


def extract_answer(text: str) -> str | None:
    """The integer a response states, normalised (``" 019\\n..."`` -> ``"19"``), or ``None``.

    Only the first line counts, after cutting at an end-of-text marker and stripping whitespace;
    it must be an integer and nothing else.
    """
    for marker in _EOS_MARKERS:
        text = text.split(marker, 1)[0]
    lines = text.strip().splitlines()
    first = lines[0].strip() if lines else ""
    if not _INTEGER.fullmatch(first):
        return None
    return str(int(first))


def is_correct(response: str, answer: str) -> bool:
    """True when the response is well-formed and states ``answer`` (compared as integers)."""
    got = extract_answer(response)
    want = extract_answer(str(answer))
    return got is not None and got == want


def _operands(prompt: str) -> tuple[int, str, int] | None:
    """The two operands and the operator of a prompt that is one binary operation: the
    embedded task's ``"37+45="``, or the same in words and spaces (reasoning-gym's
    ``"Calculate 37 + 45."``)."""
    # Not after a digit, a decimal point or a minus sign (a negative first operand).
    found = re.findall(r"(?<![\d-])(?<!\d\.)(\d+)\s*([+*-])\s*(\d+)(?!\d|\.\d)", prompt)
    if len(found) != 1 or len(re.findall(r"\d+", prompt)) != 2:
        return None
    a, op, b = found[0]
    return int(a), op, int(b)


def slipped_answer(prompt: str) -> str | None:
    """The answer a sloppy teacher writes when it drops the units column's carry or borrow.

    ``"37+45="`` -> ``"72"`` (the carry of 7+5 forgotten), ``"52-37="`` -> ``"25"`` (the borrow
    of 2-7 forgotten), also written ``"Calculate 37 + 45."``; ``None`` when the units column has
    no carry or borrow (the slip cannot happen) or the prompt is not one addition or
    subtraction of two numbers.
    """
    parsed = _operands(prompt)
    if parsed is None:
        return None
    a, op, b = parsed
    if op == "+" and a % 10 + b % 10 >= 10:
        return str(a + b - 10)
    if op == "-" and a % 10 < b % 10:
        return str(a - b + 10)
    return None


def teacher_demonstrations(
    examples: list[dict[str, str]], slip: float, seed: int
) -> tuple[list[dict[str, str]], int]:
    """The warm start's demonstrations: ``examples`` as a teacher who slips with probability
    ``slip`` on every prompt where :func:`slipped_answer` can happen would write them.

    Returns the demonstrations and how many of them are slips. Deterministic from ``seed``;
    ``slip == 0`` returns the examples unchanged.
    """
    rng = random.Random(f"teacher/{seed}")
    out: list[dict[str, str]] = []
    slips = 0
    for ex in examples:
        wrong = slipped_answer(ex["prompt"])
        if wrong is not None and rng.random() < slip:
            out.append({"prompt": ex["prompt"], "answer": wrong})
            slips += 1
        else:
            out.append(ex)
    return out, slips


def near_miss(prompt: str, response: str) -> str | None:
    """``response`` with its last number off by a little (:func:`wrong_answer`): a synthetic
    negative for reward-model training (``alignzoo train-rm --negatives arithmetic``). None when
    the response has no number."""
    found = list(re.finditer(r"-?\d+", response))
    if not found:
        return None
    last = found[-1]
    return response[: last.start()] + wrong_answer(prompt, last.group()) + response[last.end() :]


SHIFTS = (-100, -50, -20, -10, -2, -1, 1, 2, 10, 20, 50, 100)
"""The offsets :func:`shifted_answers` applies: near misses and answers far off either way."""


def shifted_answers(prompt: str, response: str) -> list[str]:
    """``response`` with its last number moved by each of :data:`SHIFTS` (never below zero
    when the number is not): synthetic negatives that leave no shortcut such as "a bigger
    number is better", which pairs whose wrong side is always the same slip invite
    (``alignzoo train-rm --negatives arithmetic-shifts``). Empty when the response has no
    number."""
    found = list(re.finditer(r"-?\d+", response))
    if not found:
        return []
    last = found[-1]
    value = int(last.group())
    return [
        response[: last.start()] + str(value + d) + response[last.end() :]
        for d in SHIFTS
        if value < 0 or value + d >= 0
    ]


NEGATIVES = {"arithmetic": near_miss, "arithmetic-shifts": shifted_answers}
"""The embedded task's named perturbations, for ``train-rm --negatives`` and
``--perturbations``."""


def wrong_answer(prompt: str, answer: str) -> str:
    """A plausible wrong answer to ``prompt``: off by a small amount, the same on every call.

    Used for the rejected side of embedded preference pairs. Never negative when ``answer`` is
    not, never equal to ``answer``.
    """
    value = int(answer)
    rng = random.Random(f"wrong/{prompt}/{answer}")
    deltas = [d for d in (-10, -2, -1, 1, 2, 10) if value < 0 or value + d >= 0]
    return str(value + rng.choice(deltas))
