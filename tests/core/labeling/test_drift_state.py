"""Per-labeler drift (a pass's mean value against the running mean of the labeler's earlier
passes) is part of the run's checkpointed state: a resumed run reports the same drift as an
uninterrupted one, and a swapped-in labeler starts a drift of its own."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

from alignzoo import Labeler, LabelRequest
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from alignzoo.engine.hooks import Hooks
from alignzoo.labeling.callers import Breaker, InlineCaller, Slot
from alignzoo.labeling.orchestrator import LabelingStage
from alignzoo.registry import build_plugin_manager

from ._labelers import Constant, Counting

PASSES = 7
CUT = 3  # the checkpoint is taken after this many passes


def build(*labelers: Labeler) -> LabelingStage:
    chain = [(f"l{i}", c, Hooks(build_plugin_manager([c]))) for i, c in enumerate(labelers)]
    return LabelingStage.build(LabelingConfig(store=None), chain)


def pass_requests(k: int) -> list[LabelRequest]:
    """Pass k: values that wander (a shift per pass, lengths that vary)."""
    shift = [0.0, 0.37, -1.25, 2.5, 0.1, 3.3, -0.7][k]
    return [
        LabelRequest(prompt=f"p{i}", response="x" * (1 + (i * 7 + k) % 5), extra={"shift": shift})
        for i in range(6)
    ]


def drifts(stage: LabelingStage, passes: range) -> list[dict[str, float]]:
    out = []
    for k in passes:
        metrics = stage.label(pass_requests(k)).metrics()
        out.append({key: v for key, v in metrics.items() if key.endswith("/drift")})
    return out


def test_drift_resumes_exactly_through_the_run_state_as_a_checkpoint_saves_it(tmp_path) -> None:
    expected = drifts(build(Counting()), range(PASSES))
    assert expected[0] == {} and all("labeler/l0/drift" in d for d in expected[1:])

    context = SimpleNamespace(state={})
    first = build(Counting())
    first.attach(context)
    got = drifts(first, range(CUT))
    # saved and read back the way state.json keeps run.state (JSON)
    saved = json.loads(json.dumps({"run_state": context.state}))["run_state"]
    resumed = build(Counting())
    resumed_context = SimpleNamespace(state=saved)
    resumed.attach(resumed_context)
    resumed.attach(resumed_context)  # attaching again (before each step) changes nothing
    got += drifts(resumed, range(CUT, PASSES))
    assert got == expected  # exactly, not approximately


def test_drift_state_round_trips_through_a_real_checkpoint(tmp_path) -> None:
    expected = drifts(build(Counting(), Constant()), range(PASSES))

    context = SimpleNamespace(state={"other": 1})
    first = build(Counting(), Constant())
    first.attach(context)
    got = drifts(first, range(CUT))
    actor = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    folder = save_checkpoint(
        tmp_path, TrainingState(step=CUT, run_state=context.state), actor, None, optimizer,
        scheduler, {},
    )  # fmt: skip
    state = load_checkpoint(folder, actor, None, optimizer, scheduler, {})
    resumed = build(Counting(), Constant())
    resumed.attach(SimpleNamespace(state=state.run_state))
    got += drifts(resumed, range(CUT, PASSES))
    assert got == expected


def test_the_drift_state_on_its_own_and_a_swapped_in_labeler_starting_over() -> None:
    steady = build(Counting())
    drifts(steady, range(CUT))
    state: dict[str, Any] = json.loads(json.dumps(steady.drift_state_dict()))
    assert set(state) == {"l0"}
    other = build(Counting())
    other.load_drift_state_dict(state)
    assert drifts(other, range(CUT, PASSES)) == drifts(steady, range(CUT, PASSES))

    context = SimpleNamespace(state={})
    stage = build(Counting())
    stage.attach(context)
    drifts(stage, range(2))
    assert "l0" in stage.drift_state_dict()
    new = Counting()
    stage.replace_head(
        Slot("l0", InlineCaller(Hooks(build_plugin_manager([new])), new), Breaker(stage.cfg.breaker))
    )  # fmt: skip
    assert stage.drift_state_dict() == {}  # a new labeler: its own distribution
    assert all(not v for k, v in context.state.items() if "drift" in k)  # so is the checkpoint's
    assert drifts(stage, range(2, 3)) == [{}]  # no drift on its first pass
    assert "labeler/l0/drift" in drifts(stage, range(3, 4))[0]


def test_an_evaluation_pass_reports_its_drift_and_leaves_the_running_mean_alone() -> None:
    """Training passes 0-2, then an evaluation pass (pass 3's values), then training pass 4:
    pass 4's drift is the one it has with no evaluation between, and the evaluation's drift is
    its values against the training passes' mean."""
    plain = drifts(build(Counting()), range(5))
    stage = build(Counting())
    drifts(stage, range(3))
    before = stage.drift_state_dict()
    report = stage.label(pass_requests(3), evaluation=True).metrics()
    assert stage.drift_state_dict() == before  # the evaluation left the running mean alone
    assert report["labeler/l0/drift"] == plain[3]["labeler/l0/drift"]  # against the same mean
    after = stage.label(pass_requests(4)).metrics()
    without = build(Counting())
    drifts(without, range(3))
    assert (
        after["labeler/l0/drift"] == without.label(pass_requests(4)).metrics()["labeler/l0/drift"]
    )
    assert (
        after["labeler/l0/drift"] != plain[4]["labeler/l0/drift"]
    )  # premise: pass 3 counted there
