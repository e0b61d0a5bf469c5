"""The dataflow transforms: dedupe, length filter, zero-variance filter, reward-hacking flag,
reweighting."""

from __future__ import annotations

import pytest
import torch

from alignzoo.plugins.modifiers.dataflow import (
    Dedupe,
    LengthFilter,
    RewardHacking,
    Reweight,
    ZeroVarianceFilter,
    is_pairs,
)
from alignzoo.registry import build_plugin_manager
from alignzoo.testing.strategies import make_batch


def batch(responses, groups, scores, lengths=None, labels=None):
    width = max(lengths or [1])
    mask = [
        [1.0 if t < n else 0.0 for t in range(width)] for n in (lengths or [1] * len(responses))
    ]
    built, _ = make_batch([[-1.0] * width for _ in responses], mask=mask, group_ids=groups,
                          scores=scores, labels=labels)  # fmt: skip
    built.responses = list(responses)
    built.prompts = [f"p{g}" for g in groups]
    return built


def run(modifier, b):
    pm = build_plugin_manager([modifier])
    [out] = [x for x in pm.hook.transform_batch(batch=b, run=None) if x is not None] or [b]
    metrics: dict[str, float] = {}
    pm.hook.on_step_end(run=None, step=1, metrics=metrics)
    return out, metrics


def test_dedupe_keeps_the_first_of_identical_responses_per_group():
    b = batch(["4", "4", "5", "4", "4"], [0, 0, 0, 1, 1], [1.0, 1.0, 0.0, 1.0, 1.0])
    out, metrics = run(Dedupe(), b)
    assert out.responses == ["4", "5", "4"] and out.group_ids.tolist() == [0, 0, 1]
    assert metrics == {"dataflow/dedupe/removed": 2.0}
    _, again = run(Dedupe(), batch(["1", "2"], [0, 0], [0.0, 1.0]))
    assert again == {"dataflow/dedupe/removed": 0.0}  # counts are per step


def test_length_filter_by_tokens():
    b = batch(["a", "bb", "ccc"], [0, 0, 0], [0.0, 1.0, 0.0], lengths=[1, 2, 3])
    out, metrics = run(LengthFilter(LengthFilter.Params(min_tokens=2, max_tokens=2)), b)
    assert out.responses == ["bb"] and metrics["dataflow/length_filter/removed"] == 2


def test_zero_variance_groups_are_left_out():
    b = batch(["a", "b", "c", "d", "e", "f"], [0, 0, 1, 1, 2, 2], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    out, metrics = run(ZeroVarianceFilter(), b)
    assert out.group_ids.tolist() == [1, 1]
    assert metrics["dataflow/zero_variance_filter/groups_removed"] == 2
    assert metrics["dataflow/zero_variance_filter/removed"] == 4


def test_reward_hacking_is_penalised_or_dropped():
    b = batch(["42", "42 because I said so", "7"], [0, 0, 0], [1.0, 1.0, 0.0])
    out, metrics = run(RewardHacking(), b)
    assert (
        out.scores.tolist() == [1.0, 0.0, 0.0] and metrics["dataflow/reward_hacking/flagged"] == 1
    )
    b = batch(["42", "42 because I said so", "7"], [0, 0, 0], [1.0, 1.0, 0.0])
    out, _ = run(RewardHacking(RewardHacking.Params(action="drop")), b)
    assert out.responses == ["42", "7"]


def test_preference_pairs_pass_through():
    pairs = batch(
        ["4", "4", "5", "5"], [0, 0, 1, 1], [1.0, 0.0, 1.0, 0.0], labels=[1.0, 0.0, 1.0, 0.0]
    )
    assert is_pairs(pairs)
    out, _ = run(Dedupe(), pairs)
    assert out.size == 4


def test_reweight_by_difficulty_favours_groups_solved_half_the_time():
    # group 0 solved 1 of 2 (p = 0.5), group 1 always (p = 1), group 2 never (p = 0)
    b = batch(list("abcdef"), [0, 0, 1, 1, 2, 2], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    params = Reweight.Params(min_weight=0.1, normalize=False)
    out, metrics = run(Reweight(params), b)
    assert out.weights.tolist() == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.1, 0.1])
    assert metrics["dataflow/reweight/max"] == pytest.approx(1.0)
    normalized, _ = run(Reweight(), batch(list("abcdef"), [0, 0, 1, 1, 2, 2], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]))  # fmt: skip
    assert float(normalized.weights.mean()) == pytest.approx(1.0)
    assert normalized.weights[0] / normalized.weights[2] == pytest.approx(10.0)


def test_reweight_by_info_multiplies_existing_weights_and_clips():
    b = batch(list("abc"), [0, 0, 0], [1.0, 0.0, 1.0])
    b.label_info = [{"agreement": 0.5}, {}, {"agreement": 50.0}]
    b.weights = torch.tensor([2.0, 1.0, 1.0])
    params = Reweight.Params(by="info", key="agreement", max_weight=4.0, normalize=False)
    out, _ = run(Reweight(params), b)
    assert out.weights.tolist() == pytest.approx([1.0, 1.0, 4.0])


def test_reweighted_samples_weigh_in_the_loss():
    from alignzoo.plugins.algorithms.grpo import GRPO

    b, outputs = make_batch([[-1.0]] * 4, group_ids=[0, 0, 1, 1], scores=[1.0, 0.0, 1.0, 1.0],
                            old_logprobs=[[-1.0]] * 4)  # fmt: skip
    pm = build_plugin_manager([GRPO(GRPO.Params(beta=0.0))])
    b = pm.hook.compute_advantages(batch=b)
    plain = pm.hook.compute_loss(batch=b, outputs=outputs, context=b.loss_context())
    assert float(plain.loss) == pytest.approx(0.0, abs=1e-7)  # +A and -A cancel in group 0
    b.label_info = [{"w": 1.0}, {"w": 0.2}, {}, {}]
    weighted, _ = run(Reweight(Reweight.Params(by="info", key="w", normalize=False)), b)
    loss = pm.hook.compute_loss(batch=weighted, outputs=outputs, context=weighted.loss_context())
    assert float(loss.loss) < -1e-3  # the right answer now outweighs the wrong one
