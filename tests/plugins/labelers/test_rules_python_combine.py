"""The python, rule (regex, format, length_penalty) and combine labelers."""

from __future__ import annotations

import math
import textwrap

import pytest
from pydantic import ValidationError

from alignzoo import LabelRequest, Score
from alignzoo.errors import UserError
from alignzoo.plugins.labelers.combine import CombineLabeler
from alignzoo.plugins.labelers.python_fn import PythonLabeler
from alignzoo.plugins.labelers.rules import FormatLabeler, LengthPenaltyLabeler, RegexLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import Outcome


def score(labeler, requests):
    return build_plugin_manager([labeler]).hook.score_batch(requests=requests)


REQS = [
    LabelRequest(prompt="1+1=", response="2", extra={"answer": "2"}),
    LabelRequest(prompt="2+2=", response=" 5\n", extra={"answer": "4"}),
    LabelRequest(prompt="3+3=", response="six", extra={"answer": "6"}),
]


def test_python_labeler_from_a_file_with_columns_and_abstain(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(
        textwrap.dedent(
            """
            def exact(prompts, completions, answer, bonus=0.0):
                assert len(prompts) == len(completions) == len(answer)
                return [None if not c.strip().isdigit() else float(c.strip() == a) + bonus
                        for c, a in zip(completions, answer)]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    labeler = PythonLabeler(PythonLabeler.Params(function="reward.py:exact", kwargs={"bonus": 0.5}))
    out = score(labeler, REQS)
    assert [s.value for s in out[:2]] == [1.5, 0.5]
    assert out[2].outcome == Outcome.ABSTAIN


def test_python_labeler_async_and_module_functions(tmp_path, monkeypatch):
    (tmp_path / "areward.py").write_text(
        "import asyncio\n"
        "async def length(prompts, completions, **columns):\n"
        "    await asyncio.sleep(0)\n"
        "    return [len(c) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    labeler = PythonLabeler(PythonLabeler.Params(function="areward:length"))
    assert [s.value for s in score(labeler, REQS)] == [1.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nofunction", "must be"),
        ("missing.py:fn", "does not exist"),
        ("no_such_module_xyz:fn", "cannot import"),
        ("json:no_such_fn", "has no function"),
    ],
)
def test_python_labeler_names_what_is_wrong(spec, message):
    with pytest.raises(UserError, match=message):
        PythonLabeler(PythonLabeler.Params(function=spec))


def test_regex_with_the_reference_marks_correct():
    labeler = RegexLabeler(RegexLabeler.Params(pattern=r"^\s*{answer}\s*$", answer_field="answer"))
    out = score(labeler, REQS)
    assert [s.value for s in out] == [1.0, 0.0, 0.0]
    assert [s.info["correct"] for s in out] == [True, False, False]
    with pytest.raises(ValidationError, match="regular expression"):
        RegexLabeler.Params(pattern="(unclosed")


def test_format_and_length_penalty():
    fmt = score(FormatLabeler(), REQS)
    assert [s.value for s in fmt] == [1.0, 1.0, 0.0]
    assert [s.info["format_ok"] for s in fmt] == [True, True, False]
    penalty = LengthPenaltyLabeler(LengthPenaltyLabeler.Params(max_chars=1, coef=0.5))
    assert [s.value for s in score(penalty, REQS)] == [0.0, 0.0, -1.0]


def test_combine_is_a_weighted_sum_with_each_part_kept():
    labeler = CombineLabeler(
        CombineLabeler.Params(
            labelers=["arithmetic", {"name": "format", "params": {"bad": -1.0}}],
            weights=[1.0, 0.25],
        )
    )
    out = score(labeler, REQS)
    assert [s.value for s in out] == [1.25, 0.25, -0.25]
    assert out[0].info["rewards"] == {"arithmetic": 1.0, "format": 1.0}
    assert [s.info["correct"] for s in out] == [True, False, False]
    with pytest.raises(ValidationError, match="weights has 1 entries for 2"):
        CombineLabeler.Params(labelers=["arithmetic", "format"], weights=[1.0])


def test_combine_passes_on_a_part_that_gives_no_value(tmp_path, monkeypatch):
    (tmp_path / "picky.py").write_text(
        "def f(prompts, completions, **c):\n    return [None if c == 'six' else 1.0 for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    labeler = CombineLabeler(
        CombineLabeler.Params(
            labelers=["arithmetic", {"name": "python", "params": {"function": "picky.py:f"}}]
        )
    )
    out = score(labeler, REQS)
    assert out[2].outcome == Outcome.ABSTAIN and not math.isfinite(out[2].value)
    assert out[0].value == 2.0 and isinstance(out[0], Score)


def test_panel_aggregates_and_filters_disagreement(tmp_path, monkeypatch):
    from hypothesis import given
    from hypothesis import strategies as st

    from alignzoo.human.agreement import largest_agreeing
    from alignzoo.plugins.labelers.panel import PanelLabeler

    (tmp_path / "raters.py").write_text(
        "def a(prompts, completions, **c):\n    return [0.9, 0.1, 0.5]\n"
        "def b(prompts, completions, **c):\n    return [0.8, 0.9, 0.5]\n"
        "def c(prompts, completions, **c):\n    return [0.2, 0.5, None]\n"
    )
    monkeypatch.chdir(tmp_path)
    raters = [{"name": "python", "params": {"function": f"raters.py:{n}"}} for n in "abc"]
    panel = PanelLabeler(PanelLabeler.Params(labelers=raters, agree_within=0.3, min_agree=2))
    out = score(panel, REQS)
    assert out[0].value == pytest.approx(0.85) and out[0].info["agreeing"] == 2
    assert out[1].outcome == Outcome.ABSTAIN and out[1].info["disagree"] is True
    assert out[2].value == pytest.approx(0.5)  # rater c gave no value: the other two agree
    median = PanelLabeler(PanelLabeler.Params(labelers=raters, aggregate="median"))
    assert [s.value for s in score(median, REQS)] == [0.8, 0.5, 0.5]

    @given(st.lists(st.floats(0, 1), min_size=1, max_size=8), st.floats(0, 1))
    def spread_is_bounded_and_maximal(values, within):
        kept = largest_agreeing(values, within, 0.0, 1.0, strict=False)
        assert max(kept) - min(kept) <= within + 1e-9
        for v in values:  # no larger agreeing set around any value
            assert sum(1 for w in values if v <= w <= v + within) <= len(kept)

    spread_is_bounded_and_maximal()


def test_python_labeler_calls_by_keyword_as_trl_does(tmp_path, monkeypatch):
    # TRL's documented reward function, verbatim: completions by keyword, the rest in kwargs.
    (tmp_path / "trl_rewards.py").write_text(
        textwrap.dedent(
            """
            def reward_len(completions, **kwargs):
                return [-abs(20 - len(completion)) for completion in completions]

            def by_answer(completions, answer):  # no **kwargs: only what it names
                return [float(c.strip() == a) for c, a in zip(completions, answer)]

            def wants_a_column(completions, solution):
                return [1.0 for _ in completions]

            seen = {}

            def records(**kwargs):
                seen.update(kwargs)
                return [0.0 for _ in kwargs["completions"]]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    out = score(PythonLabeler(PythonLabeler.Params(function="trl_rewards.py:reward_len")), REQS)
    assert [s.value for s in out] == [-19.0, -17.0, -17.0]
    out = score(PythonLabeler(PythonLabeler.Params(function="trl_rewards.py:by_answer")), REQS)
    assert [s.value for s in out] == [1.0, 0.0, 0.0]
    labeler = PythonLabeler(PythonLabeler.Params(function="trl_rewards.py:records"))
    score(labeler, REQS)
    seen = labeler.fn.__globals__["seen"]
    assert set(seen) == {
        "prompts", "completions", "answer", "completion_ids", "trainer_state", "step",
        "log_metric", "log_extra",
    }  # fmt: skip
    assert seen["prompts"] == ["1+1=", "2+2=", "3+3="]
    assert seen["completion_ids"] == [None, None, None]  # outside a run: no ids, no step
    assert seen["trainer_state"].global_step is None and seen["step"] is None
    trained = [LabelRequest(r.prompt, r.response, r.extra, [7, 8], step=3) for r in REQS]
    score(labeler, trained)
    assert seen["completion_ids"] == [[7, 8]] * 3
    assert seen["trainer_state"].global_step == 3 == seen["step"]
    broken = PythonLabeler(PythonLabeler.Params(function="trl_rewards.py:wants_a_column"))
    with pytest.raises(TypeError, match=r"asks for solution.*offers answer, completions, prompts"):
        broken._arguments({"prompts": [], "completions": [], "answer": []})


def test_each_combine_part_has_its_own_metric_name(tmp_path, monkeypatch):
    (tmp_path / "parts.py").write_text(
        "def reward_len(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def reward_digit(completions, **kw):\n    return [float(c.strip().isdigit()) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    parts = [
        {"name": "python", "params": {"function": "parts.py:reward_len"}},
        {"name": "python", "params": {"function": "parts.py:reward_digit"}},
        "arithmetic",
        "arithmetic",
    ]
    out = score(CombineLabeler(CombineLabeler.Params(labelers=parts)), REQS)
    assert list(out[0].info["rewards"]) == [
        "reward_len",
        "reward_digit",
        "arithmetic",
        "arithmetic_4",
    ]
    named = CombineLabeler(CombineLabeler.Params(labelers=parts, names=["n", "d", "a", "b"]))
    assert list(score(named, REQS)[0].info["rewards"]) == ["n", "d", "a", "b"]
    with pytest.raises(ValidationError, match="names must differ"):
        CombineLabeler.Params(labelers=parts, names=["n", "n", "a", "b"])


def test_a_failing_part_is_named_in_the_error(tmp_path, monkeypatch):
    """A reward function that raises inside a combine says which function and which part, so
    a run's failure points at the user's code, not at the chain."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_rewards.py").write_text(
        "def ratio(completions, **kwargs):\n    return [1 / 0 for _ in completions]\n"
    )
    combine = CombineLabeler(
        CombineLabeler.Params.model_validate(
            {
                "labelers": [
                    {"name": "format", "params": {"pattern": ".*"}},
                    {"name": "python", "params": {"function": "bad_rewards.py:ratio"}},
                ]
            }
        )
    )
    with pytest.raises(RuntimeError) as raised:
        score(combine, REQS)
    assert str(raised.value) == (
        "combine part 'ratio': FunctionFailed: bad_rewards.py:ratio raised "
        "ZeroDivisionError: division by zero"
    )
    assert isinstance(raised.value.__cause__.__cause__, ZeroDivisionError)
    alone = PythonLabeler(PythonLabeler.Params(function="bad_rewards.py:ratio"))
    assert "raised ZeroDivisionError: division by zero" in alone.dry_call(REQS[0])


def test_log_metric_and_log_extra_as_trl_passes_them(tmp_path, monkeypatch):
    """TRL hands reward functions log_metric (a scalar for the step's metrics) and log_extra
    (a column of the completions table): both work, through the labeling stage too."""
    from alignzoo.config.schema import LabelingConfig
    from alignzoo.engine.hooks import Hooks
    from alignzoo.labeling.orchestrator import LabelingStage

    monkeypatch.chdir(tmp_path)
    (tmp_path / "logging_rewards.py").write_text(
        "def reward(completions, log_metric, log_extra, **kwargs):\n"
        "    lengths = [len(c) for c in completions]\n"
        "    log_metric('mean_length', sum(lengths) / len(lengths))\n"
        "    log_extra('length', lengths)\n"
        "    return [float(n) for n in lengths]\n"
    )
    labeler = PythonLabeler(PythonLabeler.Params(function="logging_rewards.py:reward"))
    out = score(labeler, REQS)
    assert [s.info["extra"]["length"] for s in out] == [len(r.response) for r in REQS]
    lengths = [len(r.response) for r in REQS]
    assert labeler.stats() == {"mean_length": sum(lengths) / len(lengths)}
    assert labeler.stats() == {}  # each value is reported once

    hooks = Hooks(build_plugin_manager([labeler]))
    stage = LabelingStage.build(LabelingConfig(), [("python", labeler, hooks)])
    metrics = stage.label(REQS).metrics()
    assert metrics["labeler/python/mean_length"] == sum(lengths) / len(lengths)


def test_combine_passes_a_parts_steps_on_scaled_by_its_weight(monkeypatch):
    from alignzoo import Labeler, hookimpl
    from alignzoo.types import StepScore

    class Stepper(Labeler):
        @property
        def gives_steps(self) -> bool:
            return True

        @hookimpl
        def score_batch(self, requests):
            return [Score(1.0, steps=[StepScore(0, len(r.response), 2.0)]) for r in requests]

    labeler = CombineLabeler(CombineLabeler.Params(labelers=["arithmetic", "format"],
                                                   weights=[1.0, 0.5]))  # fmt: skip
    assert not labeler.gives_steps
    labeler.labelers["format"] = Stepper()
    labeler.parts[1] = ("format", build_plugin_manager([labeler.labelers["format"]]))
    assert labeler.gives_steps
    out = score(labeler, REQS)
    assert [s.value for s in out] == [1.5, 0.5, 0.5]  # arithmetic + 0.5 * 1.0
    assert [s.steps for s in out] == [[StepScore(0, len(r.response), 1.0)] for r in REQS]
