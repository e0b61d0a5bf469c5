"""The order and count of every plugin hook call in a run, read from the ALIGNZOO_TRACE_HOOKS trace.

Pins the order stated in :mod:`alignzoo.hookspecs` ("Order of the calls in a run") for a
two-step online GRPO arm and a two-step offline DPO arm: which hook is called, how often, and
which components it reaches (in pluggy's call order). The counts follow from the arm's shape
only (samples per step, ``micro_batch_size``, the evaluation schedule), never from the values
training computes.
"""

from __future__ import annotations

import re
from importlib import metadata

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.plugin import Algorithm, Modifier, hookimpl
from alignzoo.registry import (
    ENTRY_POINT_GROUP,
    TRACE_ENV,
    Registry,
    build_plugin_manager,
    trace_hook_calls,
)
from alignzoo.types import AlgorithmRequirements

from .conftest import tiny_experiment

HOOK_LINE = re.compile(
    r"^\[alignzoo hook\] (?P<hook>\w+) -> (?P<impls>.+): "
    r"(?P<ms>\d+\.\d) ms(?P<raised> \(raised\))?$"
)

Call = tuple[str, str]  # (hook name, the components it reached, in call order)

BACKEND, LABELER, DEVICES, HEALTH = "HFBackend", "ArithmeticLabeler", "SingleDevice", "HealthChecks"


class PassThrough(Modifier):
    """A batch transform that keeps the batch, and watches step ends (a test plugin)."""

    @hookimpl
    def transform_batch(self, batch, run):
        return None  # keep the batch as it is

    @hookimpl
    def on_step_end(self, run, step, metrics):
        pass


def traced_calls(stderr: str) -> list[Call]:
    """The (hook, implementers) of every ``[alignzoo hook]`` line, in order; none raised."""
    calls = []
    for line in stderr.splitlines():
        if not line.startswith("[alignzoo hook]"):
            continue
        match = HOOK_LINE.match(line)
        assert match is not None, f"malformed trace line: {line!r}"
        assert match["raised"] is None, line
        calls.append((match["hook"], match["impls"]))
    return calls


def assembly(algorithm: str) -> list[Call]:
    """assemble(): requirements, devices, then (models loaded) on_run_start and the first sync."""
    return [
        ("algorithm_requirements", algorithm),
        ("place_roles", DEVICES),
        ("on_run_start", BACKEND),
        ("sync_weights", BACKEND),
    ]


# One greedy evaluation: num_prompts (<= EVAL_CHUNK) prompts in one generate, one score_batch.
EVALUATION: list[Call] = [("generate", BACKEND), ("score_batch", LABELER)]


def check_trace(calls: list[Call], expected: list[Call]) -> None:
    # The names first (the clearest diff when the order changes), then who each call reached.
    assert [hook for hook, _ in calls] == [hook for hook, _ in expected]
    assert calls == expected


def test_an_online_grpo_run_calls_the_hooks_in_the_documented_order(
    write_experiment, tmp_path, monkeypatch, capsys
) -> None:
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(PassThrough, "pass_through")
    spec = tiny_experiment(
        budget={"steps": 2},
        # 4 prompts x 4 samples = 16 samples per step, one optimizer step (no minibatch_size,
        # one epoch) of 16 / 8 = 2 micro-batches: compute_loss twice per step.
        training={
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "micro_batch_size": 8,
            "checkpoint_every": 2,
        },
        evaluation={"every": 2, "num_prompts": 4},
    )
    spec["arms"] = {
        # No label store: with one, a request labeled before (the same greedy answers at two
        # evaluations) is not sent to score_batch again.
        "grpo": {
            "algorithm": "grpo",
            "labeler": "arithmetic",
            "modifiers": ["pass_through"],
            "labeling": {"store": None},
        }
    }
    loaded = load_experiment(write_experiment(spec), registry=registry)
    monkeypatch.setenv(TRACE_ENV, "1")  # after loading: only the run's own manager is traced
    capsys.readouterr()
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    assert summary.steps == 2

    step = [
        ("generate", BACKEND),
        ("score_batch", LABELER),
        ("transform_batch", "PassThrough"),
        ("compute_advantages", "GRPO"),
        ("compute_loss", "GRPO"),
        ("compute_loss", "GRPO"),
        ("sync_weights", BACKEND),
        # last registered first: the default-on HealthChecks joins after the listed modifiers
        ("on_step_end", f"{HEALTH}, PassThrough"),
    ]
    expected = [
        *assembly("GRPO"),
        *EVALUATION,  # step 0
        *step,  # step 1
        *step,  # step 2
        *EVALUATION,  # step 2 (every: 2); the last step was evaluated, so no extra one
        ("on_run_end", "nobody"),
    ]
    check_trace(traced_calls(capsys.readouterr().err), expected)


def test_an_offline_dpo_run_generates_and_scores_only_to_evaluate(
    write_experiment, tmp_path, monkeypatch, capsys
) -> None:
    spec = tiny_experiment(
        budget={"steps": 2},
        # 4 rows = 4 (chosen, rejected) pairs = 8 samples per step; micro-batches of 4 samples
        # (2 pairs, pairs are never split): compute_loss twice per step.
        training={"prompts_per_step": 4, "micro_batch_size": 4, "checkpoint_every": 2},
        evaluation={"every": 2, "num_prompts": 4},
    )
    spec["arms"] = {"dpo": {"algorithm": "dpo", "online": False}}
    loaded = load_experiment(write_experiment(spec))
    monkeypatch.setenv(TRACE_ENV, "1")
    capsys.readouterr()
    summary = run_one(loaded, "dpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    assert summary.steps == 2

    # No transform_batch line: no component of this arm implements it, so nothing is called.
    step = [
        ("compute_advantages", "DPO"),
        ("compute_loss", "DPO"),
        ("compute_loss", "DPO"),
        ("sync_weights", BACKEND),
        ("on_step_end", HEALTH),
    ]
    expected = [
        *assembly("DPO"),
        *EVALUATION,
        *step,
        *step,
        *EVALUATION,
        ("on_run_end", "nobody"),
    ]
    check_trace(traced_calls(capsys.readouterr().err), expected)


# --------------------------------------------------------------------------- the tracer itself


class ToyAlgorithm(Algorithm):
    """An algorithm whose loss is a constant and whose advantages fail (a test plugin)."""

    requirements = AlgorithmRequirements(reference=False)

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        return "loss"

    @hookimpl
    def compute_advantages(self, batch):
        raise ValueError("no advantages today")


class Wrap(Modifier):
    """Wraps compute_loss (a test plugin)."""

    @hookimpl(wrapper=True)
    def compute_loss(self, batch):
        result = yield
        return f"wrapped {result}"


def test_trace_hook_calls_writes_one_line_per_call_and_marks_raising_calls() -> None:
    pm = build_plugin_manager([ToyAlgorithm(), Wrap()])
    lines: list[str] = []
    undo = trace_hook_calls(pm, write=lines.append)

    assert pm.hook.compute_loss(batch=None, outputs=None, context=None) == "wrapped loss"
    with pytest.raises(ValueError, match="no advantages"):
        pm.hook.compute_advantages(batch=None)
    assert pm.hook.on_run_end(run=None, status="finished") == []

    parsed = [HOOK_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m["hook"], m["impls"], m["raised"]) for m in parsed] == [
        # call order: the wrapper is entered before the algorithm it wraps
        ("compute_loss", "Wrap, ToyAlgorithm", None),
        ("compute_advantages", "ToyAlgorithm", " (raised)"),
        ("on_run_end", "nobody", None),
    ]
    assert all(float(m["ms"]) >= 0 for m in parsed)

    undo()
    pm.hook.compute_loss(batch=None, outputs=None, context=None)
    assert len(lines) == 3


def test_the_environment_variable_turns_the_trace_on(monkeypatch, capsys) -> None:
    for value, traced in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv(TRACE_ENV, value)
        pm = build_plugin_manager([ToyAlgorithm()])
        capsys.readouterr()
        pm.hook.compute_loss(batch=None, outputs=None, context=None)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == int(traced), (value, lines)
        if traced:
            assert HOOK_LINE.match(lines[0])["hook"] == "compute_loss"
