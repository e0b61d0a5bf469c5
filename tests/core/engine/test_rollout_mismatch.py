"""The train/inference mismatch: a backend's own sampling log-probs are compared with the
trainer's (``rollout/logprob_diff``), and truncated importance sampling (TIS) reweights the
policy-gradient surrogate by min(pi_old / pi_rollout, C), per token or per sequence."""

from __future__ import annotations

import math
from importlib import metadata

import pytest
import torch

from alignzoo import hookimpl
from alignzoo import metrics as canonical
from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.errors import ConfigError
from alignzoo.ops import rollout_is_weights
from alignzoo.plugins.algorithms.grpo import GRPO, GRPOParams, grpo_loss
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import ENTRY_POINT_GROUP, Registry

from .conftest import read_jsonl, tiny_experiment

SHIFT = 0.1  # the mismatched engine's log-probs are the trainer's minus this
SEEN: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rollout_is_weights, response_mask) per call


class ShiftedEngine(HFBackend):
    """The hf backend, reporting sampling log-probs SHIFT below the true ones (a mismatched engine)."""

    @hookimpl
    def generate(self, prompts, extras, n, sampling):
        batch = HFBackend.generate(self, prompts, extras, n, sampling)
        batch.rollout_logprobs = batch.rollout_logprobs - SHIFT * batch.response_mask
        return batch


class Unrecorded(HFBackend):
    """The hf backend, keeping no sampling log-probs."""

    @hookimpl
    def generate(self, prompts, extras, n, sampling):
        batch = HFBackend.generate(self, prompts, extras, n, sampling)
        batch.rollout_logprobs = None
        return batch


class WatchedGRPO(GRPO):
    """GRPO that records the importance weights each compute_loss call receives."""

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        SEEN.append((batch.rollout_is_weights, batch.response_mask))
        return GRPO.compute_loss(self, batch, outputs, context)


def _registry() -> Registry:
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(ShiftedEngine, "shifted")
    registry.register(WatchedGRPO, "watched_grpo")
    registry.register(Unrecorded, "unrecorded")
    return registry


def test_importance_weights_are_truncated_ratios_per_token_or_per_sequence():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.1], [-0.3, -0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = rollout_is_weights(old, rollout, mask, cap=1.5)
    expected = torch.tensor([[1.5, math.exp(-1.0), math.exp(-0.4)], [math.exp(0.1), 1.0, 0.0]])
    torch.testing.assert_close(token, expected)
    sequence = rollout_is_weights(old, rollout, mask, cap=2.0, level="sequence")
    row0 = min(math.exp(0.5 - 1.0 - 0.4), 2.0)
    torch.testing.assert_close(
        sequence, torch.tensor([[row0] * 3, [math.exp(0.1), math.exp(0.1), 0.0]])
    )
    assert not token.requires_grad


def test_masked_importance_weights_leave_out_what_exceeds_the_cap():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.1], [-0.3, -0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = rollout_is_weights(old, rollout, mask, cap=1.5, mode="mask")
    # exp(0.5) = 1.65 > 1.5: masked (0), where truncation would give 1.5; the rest unchanged.
    expected = torch.tensor([[0.0, math.exp(-1.0), math.exp(-0.4)], [math.exp(0.1), 1.0, 0.0]])
    torch.testing.assert_close(token, expected)
    truncated = rollout_is_weights(old, rollout, mask, cap=1.5)
    assert truncated[0, 0] == 1.5 and torch.equal(truncated[0, 1:], token[0, 1:])
    # Per sequence: row 0's product exp(-0.9) stays, row 1's exp(0.1) > 1.05 is masked whole.
    sequence = rollout_is_weights(old, rollout, mask, cap=1.05, level="sequence", mode="mask")
    torch.testing.assert_close(sequence, torch.tensor([[math.exp(-0.9)] * 3, [0.0, 0.0, 0.0]]))


def test_grpo_weights_its_surrogate_and_not_its_kl_term():
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 5) - 1).requires_grad_()
    old = logprobs.detach() + 0.05 * torch.randn(4, 5)
    ref = logprobs.detach() + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4, 1).expand(4, 5)
    mask = torch.ones(4, 5)
    weights = torch.full((4, 5), 1.7)
    params = GRPOParams(beta=0.0)
    plain, _ = grpo_loss(logprobs, old, adv, mask, params)
    weighted, _ = grpo_loss(logprobs, old, adv, mask, params, is_weights=weights)
    torch.testing.assert_close(weighted, 1.7 * plain)
    # With a KL term, only the surrogate is scaled.
    params = GRPOParams(beta=0.3)
    both, _ = grpo_loss(logprobs, old, adv, mask, params, ref_logprobs=ref)
    both_w, _ = grpo_loss(logprobs, old, adv, mask, params, ref_logprobs=ref, is_weights=weights)
    torch.testing.assert_close(both_w - both, 0.7 * plain)


@pytest.mark.slow
def test_the_engine_reports_the_mismatch_and_corrects_for_it(write_experiment, tmp_path):
    arms = {
        "hf": {"algorithm": "grpo", "backend": "hf"},
        "shifted": {"algorithm": "grpo", "backend": "shifted"},
        "token": {
            "algorithm": "watched_grpo",
            "backend": "shifted",
            "training": {"rollout_correction": {"level": "token", "cap": 2.0}},
        },
        "token_separate_pass": {
            "algorithm": "watched_grpo",
            "backend": "shifted",
            "training": {
                "fuse_behaviour": False,
                "rollout_correction": {"level": "token", "cap": 2.0},
            },
        },
        "sequence": {
            "algorithm": "watched_grpo",
            "backend": "shifted",
            "training": {"rollout_correction": {"level": "sequence", "cap": 1.25}},
        },
        "masked": {
            "algorithm": "watched_grpo",
            "backend": "shifted",
            "training": {"rollout_correction": {"level": "token", "cap": 1.05, "mode": "mask"}},
        },
    }
    spec = tiny_experiment(
        budget={"steps": 2}, evaluation={"every": 2, "num_prompts": 4}, arms=arms
    )
    loaded = load_experiment(write_experiment(spec), registry=_registry())
    rows = {}
    seen = {}
    for arm in arms:
        SEEN.clear()
        summary = run_one(loaded, arm, 0, tmp_path / arm)
        assert summary.status == "finished", summary.error
        rows[arm] = read_jsonl(tmp_path / arm / "metrics.jsonl")
        seen[arm] = list(SEEN)
    for row in rows["hf"]:  # the hf backend samples with the trainer's own forward
        assert row[canonical.ROLLOUT_LOGPROB_DIFF] < 1e-4
    for row in rows["shifted"]:
        assert row[canonical.ROLLOUT_LOGPROB_DIFF] == pytest.approx(SHIFT, abs=1e-4)
        assert row[canonical.ROLLOUT_LOGPROB_DIFF_MAX] == pytest.approx(SHIFT, abs=1e-4)
    for arm in ("token", "token_separate_pass"):
        assert seen[arm], arm
        for weights, mask in seen[arm]:
            on = mask.bool()
            assert torch.allclose(
                weights[on], torch.full_like(weights[on], math.exp(SHIFT)), atol=1e-4
            ), arm
            assert weights[~on].eq(0).all(), arm
    for weights, mask in seen["sequence"]:
        lengths = mask.sum(dim=1)
        expected = torch.exp(SHIFT * lengths).clamp(max=1.25)
        torch.testing.assert_close(weights[:, 0], expected, atol=1e-4, rtol=0)
    assert any(m.sum(dim=1).max() >= 3 for _, m in seen["sequence"]), "premise: a capped sequence"
    # Every token's ratio is exp(SHIFT) = 1.105: under the cap 2 (weighted, none clipped), over
    # the cap 1.05 of the masked arm (every weight 0, every token counted as over the cap).
    for row in rows["token"]:
        assert row[canonical.ROLLOUT_IS_WEIGHT_MEAN] == pytest.approx(math.exp(SHIFT), abs=1e-4)
        assert row[canonical.ROLLOUT_IS_WEIGHT_MAX] == pytest.approx(math.exp(SHIFT), abs=1e-4)
        assert row[canonical.ROLLOUT_IS_CLIPPED] == 0.0
    for weights, _ in seen["masked"]:
        assert weights.eq(0).all()
    for row in rows["masked"]:
        assert row[canonical.ROLLOUT_IS_WEIGHT_MEAN] == 0.0
        assert row[canonical.ROLLOUT_IS_CLIPPED] == 1.0
    assert all(canonical.ROLLOUT_IS_WEIGHT_MEAN not in row for row in rows["shifted"])


def test_the_correction_is_refused_where_it_has_no_meaning(write_experiment, tmp_path):
    correction = {"rollout_correction": {"level": "token"}}
    for arm in (
        {"algorithm": "dpo", "training": correction},
        {"algorithm": "kto", "online": False, "training": correction},
    ):
        path = write_experiment(tiny_experiment(arms={"a": arm}))
        with pytest.raises(
            ConfigError,
            match=r"arms.a.training.rollout_correction.level: 'token' needs an online policy-gradient",
        ):
            load_experiment(path)
    spec = tiny_experiment(
        arms={"a": {"algorithm": "grpo", "backend": "unrecorded", "training": correction}}
    )
    loaded = load_experiment(write_experiment(spec), registry=_registry())
    summary = run_one(loaded, "a", 0, tmp_path / "unrecorded")
    assert (
        summary.status == "failed"
        and "backend 'Unrecorded' returned none (batch.rollout_logprobs)" in summary.error
    )
