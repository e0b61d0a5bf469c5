"""ArithmeticLabeler: exact match, partial credit, malformed output, missing answer column."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest, Score


def req(response: str, answer: object = "19", field: str = "answer") -> LabelRequest:
    return LabelRequest(prompt="12+7=", response=response, extra={field: answer})


def test_exact_match_scores_one():
    labeler = ArithmeticLabeler()
    for response in ("19", " 19\n", "019", "19<|endoftext|>"):
        score = labeler.score(req(response))
        assert (score.value, score.valid) == (1.0, True), response
        assert score.info["correct"] is True


def test_wrong_number_scores_partial_credit():
    assert ArithmeticLabeler().score(req("18")).value == 0.0
    score = ArithmeticLabeler({"partial_credit": 0.25}).score(req("18"))
    assert score == Score(0.25, valid=True, info={"extracted": "18", "correct": False})


def test_malformed_scores_zero_and_is_flagged():
    labeler = ArithmeticLabeler({"partial_credit": 0.5})
    for response in ("", "abc", "19abc", "1 9", "+"):
        score = labeler.score(req(response))
        assert score == Score(0.0, valid=False, info={"malformed": True, "correct": False}), (
            response
        )


def test_integer_reference_and_other_field():
    labeler = ArithmeticLabeler({"answer_field": "target"})
    assert labeler.score(req("19", answer=19, field="target")).value == 1.0
    assert labeler.score(req("-3", answer=-3, field="target")).value == 1.0


def test_missing_answer_field_names_it():
    with pytest.raises(UserError, match=r"'target'.*found: answer"):
        ArithmeticLabeler({"answer_field": "target"}).score(req("19"))


def test_non_numeric_reference_is_an_error():
    with pytest.raises(UserError, match="not an integer"):
        ArithmeticLabeler().score(req("19", answer="nineteen"))


def test_params_are_validated():
    with pytest.raises(ValidationError):
        ArithmeticLabeler({"partial_credit": 2.0})
    with pytest.raises(ValidationError):
        ArithmeticLabeler({"partial": 0.1})


def test_score_batch_through_the_hook_keeps_order():
    pm = build_plugin_manager([ArithmeticLabeler({"partial_credit": 0.1})])
    requests = [req("19"), req("x"), req("20"), req("19", answer="20")]
    scores = pm.hook.score_batch(requests=requests)
    assert [s.value for s in scores] == [1.0, 0.0, 0.1, 0.1]
    assert [s.valid for s in scores] == [True, False, True, True]
    # every score says whether the answer is right: what eval/exact_match is computed from
    assert [s.info["correct"] for s in scores] == [True, False, False, False]
    assert not hasattr(pm.hook, "score")  # score is a plain method, score_batch the hook


def test_import_does_not_load_torch():
    code = (
        "import sys; import alignzoo.plugins.labelers.arithmetic; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
