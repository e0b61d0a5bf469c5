"""The comparison metric by default: exact_match when every arm's labeler says which answers
are correct, score otherwise; the report says which it is and why, and lists every component
of every arm with its params."""

from __future__ import annotations

import textwrap

import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.report.sections import _describe_arm, _metric_text

BASE = """\
name: m
seeds: [0]
budget: {steps: 2}
arms:
  a: {algorithm: grpo}
  b:
    algorithm: {name: grpo, params: {beta: 0.0}}
    labeler: LABELER
    backend: {name: hf, params: {max_batch_size: 8}}
    devices: single
    modifiers: [{name: entropy_bonus, params: {coef: 0.02}}, dedupe]
    labeling: {retries: 5}
    training: {lr: 0.001}
"""


def load(tmp_path, labeler: str, extra: str = ""):
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(BASE.replace("LABELER", labeler) + extra))
    return load_experiment(path).spec


def test_exact_match_when_every_labeler_marks_answers_correct(tmp_path):
    spec = load(tmp_path, "arithmetic")
    assert (spec.evaluation.metric, spec.evaluation.metric_chosen) == ("exact_match", "default")
    text = _metric_text(spec, "eval/exact_match")
    assert "the default, as every arm's labeler says which answers are correct" in text


def test_score_when_a_labeler_only_scores(tmp_path):
    spec = load(tmp_path, "{name: length_penalty, params: {max_chars: 10}}")
    assert (spec.evaluation.metric, spec.evaluation.metric_chosen) == ("score", "default")
    assert "not every arm's labeler" in _metric_text(spec, "eval/score")


def test_a_given_metric_is_kept_and_said_to_be_given(tmp_path):
    spec = load(tmp_path, "arithmetic", "evaluation: {metric: score}\n")
    assert (spec.evaluation.metric, spec.evaluation.metric_chosen) == ("score", "given")
    assert "default" not in _metric_text(spec, "eval/score")
    again = yaml.safe_load(yaml.safe_dump(spec.model_dump(mode="json")))
    assert again["evaluation"]["metric"] == "score"  # the resolved spec names it


def test_the_report_describes_every_component_of_an_arm(tmp_path):
    spec = load(tmp_path, "{name: length_penalty, params: {max_chars: 10}}")
    text = _describe_arm(spec, "b")
    for part in (
        'algorithm `grpo` `{"beta": 0.0}`',
        'labeler `length_penalty` `{"max_chars": 10}`',
        'backend `hf` `{"max_batch_size": 8}`',
        "devices `single`",
        'modifiers `entropy_bonus` `{"coef": 0.02}`, `dedupe`',
        'labeling `{"retries": 5}`',
        'training `{"lr": 0.001}`',
    ):
        assert part in text, (part, text)
    assert _describe_arm(spec, "a").count("`") == 8  # four components, no params, no overrides
