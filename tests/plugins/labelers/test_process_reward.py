"""The process-reward-model labeler: steps split at a separator, one score per step from a local
sequence classifier on each step's prefix (batched, frozen), and their aggregate as the value."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from alignzoo.errors import UserError
from alignzoo.plugins.labelers.process_reward import ProcessRewardModelLabeler, split_steps
from alignzoo.registry import get_registry
from alignzoo.types import LabelRequest, StepScore

from .test_reward_model import save_reward_model

REQUESTS = [
    LabelRequest("12+7=", "12+7\nso 19\n19"),
    LabelRequest("3+45=", "48"),
    LabelRequest("1+1=", "first\n\nsecond\n"),
    LabelRequest("9+9=", ""),
    LabelRequest("2+2=", "a\nb\nc\nd"),
]


@pytest.fixture(scope="module")
def one_label(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("prm") / "one")


@pytest.fixture(scope="module")
def two_labels(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("prm") / "two", num_labels=2)


def started(path, **params) -> ProcessRewardModelLabeler:
    labeler = ProcessRewardModelLabeler({"path": str(path), **params})
    labeler.on_run_start(SimpleNamespace(device=lambda role: {"labeler": "cpu"}[role]))
    return labeler


def direct_logits(path, texts: list[str]) -> list[torch.Tensor]:
    """Each text alone, unpadded, through the model as its user would load it."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]


@pytest.mark.parametrize(
    ("text", "separator", "spans"),
    [
        ("a\nb\nc", "\n", [(0, 2), (2, 4), (4, 5)]),
        ("a\nb\n", "\n", [(0, 2), (2, 4)]),
        ("a\n\n\nb", "\n", [(0, 4), (4, 5)]),  # a run of separators ends one step
        ("a\n  \nb", "\n", [(0, 5), (5, 6)]),  # a blank piece joins the step before it
        ("\n\na\nb", "\n", [(0, 4), (4, 5)]),  # a leading blank piece joins the first step
        ("a\nb\n  ", "\n", [(0, 2), (2, 6)]),  # trailing blank: the last step takes it
        ("one. two. three", ". ", [(0, 5), (5, 10), (10, 15)]),
        ("", "\n", []),
        (" \n\n ", "\n", []),
        ("no separator", "\n", [(0, 12)]),
    ],
)
def test_steps_tile_the_response(text, separator, spans) -> None:
    assert split_steps(text, separator) == spans
    if spans:
        assert spans[0][0] == 0 and spans[-1][1] == len(text)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_one_score_per_step_on_its_prefix_with_the_right_spans(one_label) -> None:
    scores = started(one_label, batch_size=3).score_batch(REQUESTS)
    assert len(scores) == len(REQUESTS)
    for request, score in zip(REQUESTS, scores, strict=True):
        spans = split_steps(request.response, "\n")
        assert [(s.start, s.end) for s in score.steps] == spans
        if not spans:
            assert score.steps == [] and score.info["step_scores"] == []
            continue
        prefixes = [request.prompt + request.response[:end] for _, end in spans]
        expected = [float(torch.sigmoid(x[0])) for x in direct_logits(one_label, prefixes)]
        got = [s.score for s in score.steps]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert score.value == min(got)  # the default aggregate
        assert score.info["step_scores"] == got
    assert [len(s.steps) for s in scores] == [3, 1, 2, 0, 4]
    # different prefixes score differently (the head is large): a real per-step model
    assert len({round(s.score, 4) for s in scores[4].steps}) > 1


def test_batched_equals_one_by_one_and_a_stepless_response_scores_once(one_label) -> None:
    batched = started(one_label, batch_size=4).score_batch(REQUESTS)
    single = started(one_label, batch_size=1).score_batch(REQUESTS)
    for a, b in zip(batched, single, strict=True):
        assert a.value == pytest.approx(b.value, abs=1e-5)
        assert [(s.start, s.end) for s in a.steps] == [(s.start, s.end) for s in b.steps]
    empty = batched[3]
    (logit,) = direct_logits(one_label, ["9+9="])
    assert empty.value == pytest.approx(float(torch.sigmoid(logit[0])), abs=1e-5)


@pytest.mark.parametrize(
    ("aggregate", "of"),
    [("min", min), ("last", lambda v: v[-1]), ("mean", lambda v: sum(v) / len(v)),
     ("prod", math.prod)],
)  # fmt: skip
def test_the_value_aggregates_the_step_scores(one_label, aggregate, of) -> None:
    score = started(one_label, aggregate=aggregate).score_batch([REQUESTS[4]])[0]
    assert score.value == pytest.approx(of([s.score for s in score.steps]))


def test_two_labels_give_the_probability_of_label_one_or_the_logit_margin(two_labels) -> None:
    request = REQUESTS[0]
    prefixes = [
        request.prompt + request.response[:end] for _, end in split_steps(request.response, "\n")
    ]
    logits = direct_logits(two_labels, prefixes)
    prob = started(two_labels).score_batch([request])[0]
    margin = started(two_labels, output="logit").score_batch([request])[0]
    torch.testing.assert_close(
        [s.score for s in prob.steps],
        [float(torch.softmax(x, -1)[1]) for x in logits],
        atol=1e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        [s.score for s in margin.steps], [float(x[1] - x[0]) for x in logits], atol=1e-5, rtol=0
    )


def test_dense_false_gives_the_value_only(one_label) -> None:
    dense = started(one_label).score_batch(REQUESTS)
    plain = started(one_label, dense=False).score_batch(REQUESTS)
    assert all(s.steps == [] for s in plain)
    assert [s.value for s in plain] == pytest.approx([s.value for s in dense])
    assert started(one_label).gives_steps and not started(one_label, dense=False).gives_steps


def test_frozen_eval_mode_no_gradients(one_label) -> None:
    labeler = started(one_label)
    labeler.model.train()
    labeler.model.requires_grad_(True)
    scores = labeler.score_batch(REQUESTS[:1])
    assert not labeler.model.training
    assert not any(p.requires_grad for p in labeler.model.parameters())
    assert all(isinstance(s, StepScore) for s in scores[0].steps)


def test_a_missing_folder_and_bad_params_name_the_field(tmp_path) -> None:
    with pytest.raises(UserError, match=r"labeler\.params\.path"):
        started(tmp_path / "nowhere")
    for bad in ({"separator": ""}, {"aggregate": "max"}, {"batch_size": 0}, {"output": "x"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ProcessRewardModelLabeler({"path": str(tmp_path), **bad})


def test_registered_through_the_entry_points() -> None:
    assert get_registry().get("labeler", "process_reward_model") is ProcessRewardModelLabeler
