"""Reward scale: per-labeler running / fixed normalisation and clipping in the label stage,
its checkpointed state, and advantages that do not see a labeler's shift and scale."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import ArmSpec, ComponentRef, LabelingConfig, NormalizeConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.labeling.normalize import (
    STATE_KEY,
    RunningStats,
    arm_normalization,
    describe,
    resolve,
    transform,
)
from alignzoo.labeling.orchestrator import LabelingStage
from alignzoo.registry import build_plugin_manager
from alignzoo.testing.strategies import make_batch
from alignzoo.types import Outcome


class Affine(Labeler):
    """Scores a response by a fixed pseudo-random number per response text, as ``a * x + b``;
    abstains on responses starting with ``?``."""

    def __init__(self, a: float = 1.0, b: float = 0.0, params=None) -> None:
        super().__init__(params)
        self.a, self.b = a, b

    @hookimpl
    def score_batch(self, requests):
        out = []
        for r in requests:
            if r.response.startswith("?"):
                out.append(Score.abstain("no idea"))
                continue
            x = random.Random(r.response).gauss(0.0, 1.0)
            out.append(Score(self.a * x + self.b, info={"x": x}))
        return out


def stage_of(labeler: Labeler, **normalize) -> LabelingStage:
    cfg = LabelingConfig(normalize=NormalizeConfig(**normalize) if normalize else None, store=None)
    return LabelingStage.build(cfg, [("l0", labeler, Hooks(build_plugin_manager([labeler])))])


def passes(n: int = 4, size: int = 8) -> list[list[LabelRequest]]:
    return [
        [LabelRequest(prompt=f"p{j // 4}", response=f"r{k}-{j}") for j in range(size)]
        for k in range(n)
    ]


def values(report) -> list[float]:
    return [float(s.value) for s in report.scores]


def test_welford_matches_the_mean_and_std_of_every_value_seen():
    rng = random.Random(0)
    seen: list[float] = []
    stats = RunningStats()
    for _ in range(5):
        batch = [rng.uniform(-3, 7) for _ in range(rng.randint(1, 9))]
        stats.update(batch)
        seen += batch
    t = torch.tensor(seen, dtype=torch.float64)
    assert stats.count == len(seen)
    assert stats.mean == pytest.approx(float(t.mean()), abs=1e-12)
    assert stats.std == pytest.approx(float(t.std(unbiased=False)), abs=1e-12)


def test_running_whitening_includes_this_pass_and_keeps_the_raw_value():
    st = stage_of(Affine(3.0, 10.0), mode="running")
    report = st.label(passes(1)[0], normalize=True)
    v = torch.tensor(values(report), dtype=torch.float64)
    assert float(v.mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(v.std(unbiased=False)) == pytest.approx(1.0, abs=1e-9)
    raw = [s.info["raw"] for s in report.scores]
    assert raw == pytest.approx([3.0 * s.info["x"] + 10.0 for s in report.scores])
    m = report.metrics()
    assert m["label/l0/norm_mean"] == pytest.approx(sum(raw) / len(raw))
    assert m["label/l0/norm_std"] > 0


def test_fixed_scale_and_clip():
    cfg = NormalizeConfig(mode="fixed", shift=1.0, scale=2.0, clip=3.0)
    assert transform(cfg, [0.0, 1.0, 2.0, 9.0], RunningStats()) == [-2.0, 0.0, 2.0, 3.0]
    cfg = NormalizeConfig(clip=0.5)  # a clip alone
    assert transform(cfg, [-2.0, 0.25, 2.0], RunningStats()) == [-0.5, 0.25, 0.5]
    st = stage_of(Affine(), mode="fixed", shift=0.5, scale=-1.0)
    report = st.label(passes(1)[0], normalize=True)
    assert values(report) == pytest.approx([-(s.info["raw"] - 0.5) for s in report.scores])
    assert st.state_dict() == {}  # nothing to keep


def test_abstains_are_not_values_and_are_left_alone():
    st = stage_of(Affine(2.0, 1.0), mode="running")
    reqs = passes(1)[0] + [LabelRequest(prompt="p9", response="?skip")]
    report = st.label(reqs, normalize=True)
    assert report.outcomes[-1] == Outcome.ABSTAIN
    assert "raw" not in report.scores[-1].info
    assert st.norm_stats["l0"].count == len(reqs) - 1


def test_evaluation_passes_are_raw_and_leave_the_state_alone():
    st = stage_of(Affine(2.0, 1.0), mode="running")
    st.label(passes(1)[0], normalize=True)
    before = st.state_dict()
    report = st.label(passes(2)[1])  # normalize=False: what evaluation asks
    assert values(report) == pytest.approx([2.0 * s.info["x"] + 1.0 for s in report.scores])
    assert st.state_dict() == before


def test_the_state_round_trips_through_a_checkpoint_and_resumes_exactly(tmp_path):
    all_passes = passes(6)
    steady = stage_of(Affine(4.0, -2.0), mode="running", momentum=0.3, clip=2.5)
    expected = [values(steady.label(p, normalize=True)) for p in all_passes]

    # The same run, checkpointed after pass 3 (run.state saved as JSON, as state.json is)
    # and resumed in a new stage.
    context = SimpleNamespace(state={})
    first = stage_of(Affine(4.0, -2.0), mode="running", momentum=0.3, clip=2.5)
    first.attach(context)
    got = [values(first.label(p, normalize=True)) for p in all_passes[:3]]
    assert context.state[STATE_KEY] == first.state_dict()
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"run_state": dict(context.state)}), encoding="utf-8")

    resumed_context = SimpleNamespace(state=json.loads(path.read_text())["run_state"])
    resumed = stage_of(Affine(4.0, -2.0), mode="running", momentum=0.3, clip=2.5)
    resumed.attach(resumed_context)
    assert resumed.state_dict() == first.state_dict()
    resumed.attach(resumed_context)  # attaching again (before each step) changes nothing
    got += [values(resumed.label(p, normalize=True)) for p in all_passes[3:]]
    assert got == expected  # exactly, not approximately

    # state_dict / load_state_dict on their own
    other = stage_of(Affine(4.0, -2.0), mode="running", momentum=0.3, clip=2.5)
    other.load_state_dict(json.loads(json.dumps(steady.state_dict())))
    more = passes(7)[6]
    assert values(other.label(more, normalize=True)) == values(steady.label(more, normalize=True))


@pytest.mark.parametrize("momentum", [None, 0.2])
def test_normalised_advantages_ignore_the_labelers_shift_and_scale(momentum):
    from alignzoo.plugins.algorithms.grpo import GRPO

    algo = GRPO(GRPO.Params(scale_rewards="none"))  # advantages that do see the scale

    def advantages(stage: LabelingStage, reqs: list[LabelRequest], norm: bool) -> torch.Tensor:
        report = stage.label(reqs, normalize=norm)
        scores = torch.tensor(values(report))
        groups = torch.tensor([int(r.prompt[1:]) for r in reqs])
        batch, _ = make_batch(torch.zeros(len(reqs), 3), scores=scores, group_ids=groups)
        return algo.compute_advantages(batch).advantages

    plain = stage_of(Affine(1.0, 0.0), mode="running", momentum=momentum)
    moved = stage_of(Affine(7.5, -40.0), mode="running", momentum=momentum)
    for reqs in passes(5):
        a, b = advantages(plain, reqs, True), advantages(moved, reqs, True)
        assert torch.allclose(a, b, atol=1e-5)
    # without normalisation the same labelers give different advantages
    raw_a = advantages(stage_of(Affine(1.0, 0.0)), passes(1)[0], True)
    raw_b = advantages(stage_of(Affine(7.5, -40.0)), passes(1)[0], True)
    assert not torch.allclose(raw_a, raw_b, atol=1e-3)


def test_the_reward_model_default_and_the_report_line():
    from alignzoo.plugins.labelers.reward_model import RewardModelLabeler

    cfg = resolve(None, RewardModelLabeler)
    assert (cfg.mode, cfg.target_mean, cfg.target_std) == ("running", 0.5, 0.5)
    assert resolve(NormalizeConfig(mode="none"), RewardModelLabeler).mode == "none"
    assert resolve(None, Affine).mode == "none"
    arm = ArmSpec(algorithm=ComponentRef(name="grpo"), labeler=ComponentRef(name="reward_model"))
    assert arm_normalization(arm) == describe(cfg)
    assert "running whitening" in arm_normalization(arm)
    assert arm_normalization(ArmSpec(algorithm=ComponentRef(name="grpo"))) == "none"
    fixed = ArmSpec(
        algorithm=ComponentRef(name="grpo"),
        labeling=LabelingConfig(normalize=NormalizeConfig(mode="fixed", scale=0.1, clip=1)),
    )
    assert arm_normalization(fixed) == "fixed (v - 0) * 0.1, clipped to ±1"
    assert not math.isnan(resolve(None, RewardModelLabeler).eps)
