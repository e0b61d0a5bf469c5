"""The algorithm contract suite (alignzoo.testing): every built-in passes it, broken ones are caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from alignzoo.cli import main
from alignzoo.errors import UnknownComponentError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.plugins.algorithms.dpo import DPO, pair_indices
from alignzoo.plugins.algorithms.kto import KTO
from alignzoo.registry import Registry, get_registry
from alignzoo.testing import (
    CHECKS,
    BatchCase,
    assert_algorithm_contract,
    batch_cases,
    check_algorithm,
    group_ids,
    preference_pairs,
    response_masks,
)
from alignzoo.testing import contract as contract_module
from alignzoo.types import AlgorithmRequirements, LossOutput

EXAMPLES = max(10, settings().max_examples // 2)  # from the hypothesis profile (ci: 25 -> 12)


@pytest.mark.parametrize("name", get_registry().names("algorithm"))
def test_every_builtin_algorithm_meets_the_contract(name):
    cls = get_registry().get("algorithm", name)  # a built-in that fails to load fails here
    results = assert_algorithm_contract(cls, max_examples=EXAMPLES)
    assert [r.name for r in results] == list(CHECKS)
    assert all(r.passed for r in results)


@pytest.mark.parametrize(
    "algorithm",
    [
        DPO({"label_smoothing": 0.2}),
        DPO({"loss_type": "ipo"}),
        DPO({"loss_type": "hinge"}),
        DPO({"loss_type": "robust", "label_smoothing": 0.3}),
        DPO({"reference_free": True}),
        KTO({"desirable_weight": 1.33, "undesirable_weight": 0.5}),
    ],
    ids=repr,
)
def test_preference_variants_meet_the_contract(algorithm):
    assert_algorithm_contract(algorithm, max_examples=EXAMPLES)


# --------------------------------------------------------------------------- broken algorithms


class _OnlineBase(Algorithm):
    requirements = AlgorithmRequirements(data="online", entropy=False)

    @hookimpl
    def compute_advantages(self, batch):
        # group-mean baseline, written correctly (any order, any ids, zero on padding)
        same = batch.group_ids[:, None] == batch.group_ids[None, :]
        baseline = (same * batch.scores[None, :]).sum(1) / same.sum(1)
        batch.advantages = (batch.scores - baseline)[:, None] * batch.response_mask
        return batch

    def token_mean(self, batch, per_token, context):
        # the token mean over the optimizer step (context), written correctly
        mask = batch.response_mask
        return (per_token * mask).sum() / context.tokens


class MeanOverPadding(_OnlineBase):
    """Broken: averages the per-token loss over padding too."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        width = outputs.logprobs.shape[1]  # padding counted as tokens: the bug
        loss = -(outputs.logprobs * batch.advantages).sum() / (context.sequences * width)
        return LossOutput(loss, {"toy/loss": float(loss.detach())})


class FirstSampleBaseline(_OnlineBase):
    """Broken: the baseline is the first sample's score, so the order of samples matters."""

    @hookimpl
    def compute_advantages(self, batch):
        batch.advantages = (batch.scores - batch.scores[0])[:, None] * batch.response_mask
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        loss = self.token_mean(batch, -outputs.logprobs * batch.advantages, context)
        return LossOutput(loss, {"toy/loss": float(loss.detach())})


class GroupIdValues(_OnlineBase):
    """Broken: reads the value of a group id (odd ids count double), so renaming groups matters."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        scale = (1 + batch.group_ids % 2).to(outputs.logprobs.dtype)[:, None]
        loss = self.token_mean(batch, -outputs.logprobs * batch.advantages * scale, context)
        return LossOutput(loss, {"toy/loss": float(loss.detach())})


class ProbabilityRatio(_OnlineBase):
    """Broken: log(1 - p) is -inf when a token is certain (log-prob 0)."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        loss = self.token_mean(batch, -torch.log1p(-outputs.logprobs.exp()), context)
        return LossOutput(loss, {"toy/loss": float(loss.detach())})


class TensorMetrics(_OnlineBase):
    """Broken: returns a tensor as a metric."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        loss = self.token_mean(batch, -outputs.logprobs * batch.advantages, context)
        return LossOutput(loss, {"toy/loss": loss.detach()})


class LocalTokenMean(_OnlineBase):
    """Broken: normalises by the micro-batch's own tokens, so gradient accumulation bends it."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        mask = batch.response_mask
        loss = (-outputs.logprobs * batch.advantages * mask).sum() / mask.sum()
        return LossOutput(loss, {"toy/loss": float(loss.detach())})


class EngineMetricName(_OnlineBase):
    """Broken: reports a metric under a name the engine computes for every arm."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        loss = self.token_mean(batch, -outputs.logprobs * batch.advantages, context)
        return LossOutput(loss, {"kl/ref": 0.0})


class PerSampleLoss(_OnlineBase):
    """Broken: returns the per-sample losses instead of a scalar."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        mask = batch.response_mask
        loss = -(outputs.logprobs * batch.advantages * mask).sum(-1)
        return LossOutput(loss, {})


class MovingBaseline(_OnlineBase):
    """Broken: a running-mean baseline kept across steps, but not saved in checkpoints."""

    def __init__(self, params=None):
        super().__init__(params)
        self.baseline = 0.0

    @hookimpl
    def compute_advantages(self, batch):
        self.baseline = 0.9 * self.baseline + 0.1 * float(batch.scores.mean())
        batch.advantages = (batch.scores - self.baseline)[:, None] * batch.response_mask
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        loss = self.token_mean(batch, -outputs.logprobs * batch.advantages, context)
        return LossOutput(loss, {"toy/baseline": self.baseline})


class SavedMovingBaseline(MovingBaseline):
    """The same running baseline, saved and restored with the Stateful protocol."""

    def state_dict(self):
        return {"baseline": self.baseline}

    def load_state_dict(self, state):
        self.baseline = float(state["baseline"])


class RequiredParams(_OnlineBase):
    """Broken: a parameter without a default, so it cannot be built with default params."""

    class Params(BaseModel):
        lr: float

    @hookimpl
    def compute_loss(self, batch, outputs):  # pragma: no cover - never reached
        raise AssertionError


@pytest.mark.parametrize(
    ("cls", "failing"),
    [
        (MeanOverPadding, {"padding_invariance"}),
        (FirstSampleBaseline, {"sample_permutation", "group_permutation"}),
        (GroupIdValues, {"group_permutation"}),
        (ProbabilityRatio, {"finite_extreme_logprobs"}),
        (TensorMetrics, {"metrics_finite_floats"}),
        (PerSampleLoss, {"output_types"}),
        (LocalTokenMean, {"micro_batch_invariance"}),
        (EngineMetricName, {"metrics_finite_floats"}),
        (MovingBaseline, {"state_roundtrip"}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_broken_algorithms_are_caught_with_their_example(cls, failing):
    results = {r.name: r for r in check_algorithm(cls, max_examples=15, shrink_seconds=2)}
    assert set(results) == set(CHECKS)
    failed = {name for name, r in results.items() if not r.passed}
    assert failing <= failed, {n: r.detail for n, r in results.items()}
    for name in failing:
        detail = results[name].detail
        assert "BatchCase(" in detail, detail  # the falsifying example is shown


def test_state_kept_through_the_stateful_protocol_passes_the_roundtrip():
    results = {
        r.name: r for r in check_algorithm(SavedMovingBaseline, max_examples=15, shrink_seconds=2)
    }
    assert results["state_roundtrip"].passed, results["state_roundtrip"].detail
    broken = check_algorithm(MovingBaseline, max_examples=15, checks=["state_roundtrip"])
    assert "alignzoo.Stateful" in broken[-1].detail


def test_padding_bug_is_the_only_failure_of_an_otherwise_correct_algorithm():
    results = {
        r.name: r.passed
        for r in check_algorithm(MeanOverPadding, max_examples=15, shrink_seconds=2)
    }
    assert results == {name: name != "padding_invariance" for name in CHECKS}


def test_uninstantiable_algorithm_fails_instantiate_and_skips_the_rest():
    results = check_algorithm(RequiredParams, max_examples=5)
    assert not results[0].passed
    assert results[0].name == "instantiate"
    assert "lr" in results[0].detail
    assert all(not r.passed and "not run" in r.detail for r in results[1:])


def test_assert_algorithm_contract_raises_with_the_details():
    with pytest.raises(AssertionError, match="padding_invariance") as info:
        assert_algorithm_contract(MeanOverPadding, max_examples=15, shrink_seconds=2)
    assert "BatchCase(" in str(info.value)
    # a documented exception can be skipped: that check does not run
    results = assert_algorithm_contract(
        MeanOverPadding, max_examples=10, skip=["padding_invariance"]
    )
    assert "padding_invariance" not in [r.name for r in results]
    with pytest.raises(ValueError, match="unknown check"):
        assert_algorithm_contract(MeanOverPadding, skip=["padding"])


def test_checks_can_be_selected():
    results = check_algorithm("dpo", max_examples=5, checks=["sample_permutation"])
    assert [r.name for r in results] == ["instantiate", "sample_permutation"]
    assert all(r.passed for r in results)


def test_unknown_algorithm_name_is_a_user_error():
    with pytest.raises(UnknownComponentError, match="did you mean 'dpo'"):
        check_algorithm("dpoo")


# --------------------------------------------------------------------------- CLI


def test_cli_check_passes_a_builtin(capsys):
    assert main(["check", "algorithm", "simpo", "--max-examples", "5"]) == 0
    out = capsys.readouterr().out
    for name in CHECKS:
        assert name in out


def test_cli_check_reports_the_failing_example(capsys, monkeypatch):
    registry = Registry(entry_points=[])
    registry.register(MeanOverPadding, "mean_over_padding")
    monkeypatch.setattr(contract_module, "get_registry", lambda: registry)
    monkeypatch.setattr(contract_module, "DEFAULT_SHRINK_SECONDS", 2.0)
    assert main(["check", "algorithm", "mean_over_padding", "--max-examples", "10"]) == 1
    out = capsys.readouterr().out
    assert "FAIL padding_invariance" in out
    assert "BatchCase(" in out


def test_cli_check_unknown_name_exits_2():
    assert main(["check", "algorithm", "no_such_algorithm", "--max-examples", "2"]) == 2


# --------------------------------------------------------------------------- strategies


@pytest.mark.parametrize(
    "requirements",
    [
        AlgorithmRequirements(data="online", critic=True, reference=True),
        AlgorithmRequirements(data="online", entropy=False),
        AlgorithmRequirements(data="preference", reference=True, entropy=False),
        AlgorithmRequirements(data="unpaired", reference=True),
    ],
    ids=lambda r: f"{r.data}-ref{int(r.reference)}-critic{int(r.critic)}",
)
@given(data=st.data())
def test_batch_cases_follow_the_requirements(requirements, data):
    case = data.draw(batch_cases(requirements))
    assert eval(repr(case), {"BatchCase": BatchCase}) == case  # a falsifying example reproduces
    batch, outputs = case.build()
    size, width = case.size, case.width
    assert outputs.logprobs.shape == (size, width) and outputs.logprobs.requires_grad
    mask = batch.response_mask
    assert (mask.sum(-1) >= 1).all()  # at least one real token per row
    assert (mask[:, 1:] <= mask[:, :-1]).all()  # right-padded
    assert (batch.ref_logprobs is not None) == requirements.reference
    assert (batch.values is not None) == requirements.critic == (outputs.values is not None)
    assert (outputs.entropy is not None) == requirements.entropy
    unpaired = requirements.data == "unpaired"
    assert ("mismatched_logprobs" in batch.columns) == unpaired
    assert ("mismatched_ref_logprobs" in batch.columns) == (unpaired and requirements.reference)
    online = requirements.data == "online"
    assert (batch.scores is not None) == online == (batch.old_logprobs is not None)
    assert (batch.labels is not None) == (not online)
    if requirements.data == "preference":
        chosen, rejected = pair_indices(batch.group_ids, batch.labels)  # raises if malformed
        assert len(chosen) + len(rejected) == size
    if online:
        counts = torch.unique(batch.group_ids, return_counts=True)[1]
        assert (counts >= 2).all()


@given(masks=st.integers(1, 5).flatmap(lambda b: response_masks(b, 4)))
def test_response_masks_have_a_real_token_per_row(masks):
    assert masks.shape[1] == 4
    assert (masks[:, 0] == 1).all()
    assert (masks[:, 1:] <= masks[:, :-1]).all()


@given(pairs=preference_pairs(), ids=group_ids())
def test_pairs_and_groups(pairs, ids):
    groups, labels = pairs
    for g in set(groups):
        assert sorted(lab for gg, lab in zip(groups, labels, strict=True) if gg == g) == [0.0, 1.0]
    sizes = [ids.count(g) for g in set(ids)]
    assert all(2 <= n <= 4 for n in sizes)
