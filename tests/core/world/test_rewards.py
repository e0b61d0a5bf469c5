"""alignzoo.world.rewards.exact_match: the arithmetic rule's scores after a fixed wait."""

from __future__ import annotations

import time

import pytest

from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
from alignzoo.types import LabelRequest
from alignzoo.world.rewards import exact_match


def test_scores_as_the_arithmetic_rule_after_its_latency():
    completions = ["82\n", " 019", "81", "eighty", ""]
    answers = ["82", "19", "82", "80", "5"]
    start = time.perf_counter()
    scores = exact_match(completions, answers, latency_s=0.2)
    assert time.perf_counter() - start >= 0.2
    rule = ArithmeticLabeler()
    expected = [
        rule.score(LabelRequest(prompt="", response=c, extra={"answer": a}))
        for c, a in zip(completions, answers, strict=True)
    ]
    assert [(s.value, s.valid, s.info["correct"]) for s in scores] == [
        (e.value, e.valid, e.info["correct"]) for e in expected
    ]
    assert [s.info["correct"] for s in scores] == [True, True, False, False, False]


def test_a_negative_latency_is_refused():
    with pytest.raises(ValueError, match="latency_s"):
        exact_match(["1"], ["1"], latency_s=-1)
