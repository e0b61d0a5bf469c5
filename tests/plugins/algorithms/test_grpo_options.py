"""GRPO's TRL-named objective options (delta, off_policy_mask_threshold): the contract suite,
direction included, holds with each on; out-of-range values and options the surrogate does not
read are refused naming the field. Their TRL parity is tests/parity/test_trl_grpo_options.py."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from alignzoo.algorithms.policy_term import off_policy_keep
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.testing.contract import check_algorithm


@pytest.mark.parametrize(
    "params",
    [
        {"delta": 1.3},
        {"off_policy_mask_threshold": 0.1},
        {"delta": 2.0, "off_policy_mask_threshold": 0.0, "importance_ratio": "sequence"},
    ],
)
def test_grpo_with_the_option_passes_the_contract(params: dict) -> None:
    failed = [r for r in check_algorithm(GRPO(params), max_examples=25) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.5}, "greater than 1"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold"),
        ({"surrogate": "cispo", "delta": 1.5}, "delta is read only by surrogate clip / luspo"),
    ],
)
def test_out_of_range_or_unread_options_are_refused(params: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        GRPO.Params(**params)


def test_the_off_policy_mask_drops_only_stale_sequences_with_negative_advantage() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    logprobs = torch.full((4, 3), -1.0)
    sampling = torch.tensor([[-0.2, -0.2, 9.0], [-0.2, -0.2, 9.0], [-1.0, -1.0, 9.0], [-1.2, -0.9, 9.0]])  # fmt: skip
    advantages = torch.tensor([[-1.0], [1.0], [-1.0], [-1.0]]) * mask
    keep = off_policy_keep(logprobs, sampling, advantages, mask, threshold=0.5)
    # KL per sequence 0.8, 0.8, 0, -0.05 (padding's 9.0 ignored): only the first is dropped
    assert keep.tolist() == [False, True, True, True]


def test_scale_rewards_takes_trls_booleans() -> None:
    assert GRPO.Params(scale_rewards=True).scale_rewards == "group"
    assert GRPO.Params(scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValidationError, match="scale_rewards"):
        GRPO.Params(scale_rewards="yes")


def test_truncated_responses_keep_their_reward_in_the_group_and_lose_their_loss() -> None:
    from alignzoo.errors import UserError
    from alignzoo.testing import make_batch

    def batch():
        b, _ = make_batch(
            torch.full((4, 3), -1.0),
            mask=[[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]],
            group_ids=[0, 0, 0, 1],
            scores=[1.0, 0.0, 0.5, 1.0],
        )
        return b

    plain = GRPO().compute_advantages(batch())
    cut = batch()
    cut.columns["truncated"] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    masked = GRPO({"mask_truncated_completions": True}).compute_advantages(cut)
    # sample 1's reward 0 still lowers its group's mean: the others' advantages are unchanged
    assert torch.equal(masked.advantages[[0, 2, 3]], plain.advantages[[0, 2, 3]])
    assert masked.response_mask[1].sum() == 0 and masked.advantages[1].abs().sum() == 0
    assert torch.equal(masked.response_mask[[0, 2, 3]], plain.response_mask[[0, 2, 3]])
    with pytest.raises(UserError, match="mask_truncated_completions needs"):
        GRPO({"mask_truncated_completions": True}).compute_advantages(batch())


def test_the_engine_records_which_sampled_responses_the_budget_cut() -> None:
    from types import SimpleNamespace

    from alignzoo.engine.modes.base import truncated
    from alignzoo.testing import make_batch

    eos = 7
    b, _ = make_batch(
        torch.full((4, 3), -1.0),
        mask=[[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]],
        response_ids=[[3, 4, 5], [3, 4, eos], [3, eos, 0], [3, 0, 0]],
    )
    tokenizer = SimpleNamespace(eos_token_id=eos)
    # full length without EOS: cut; full with EOS, or shorter (stopped otherwise): not cut
    assert truncated(b, tokenizer, max_new_tokens=3).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert truncated(b, tokenizer, max_new_tokens=1).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_a_replayed_part_without_the_truncation_record_counts_as_not_cut() -> None:
    """A group saved before the engine kept columns['truncated'] (an older checkpoint's replay
    buffer) joins a batch that has it as not truncated; batches without it stay without."""
    from alignzoo.batch import RolloutBatch
    from alignzoo.testing import make_batch

    new, _ = make_batch(torch.full((2, 3), -1.0))
    new.columns["truncated"] = torch.tensor([1.0, 0.0])
    old, _ = make_batch(torch.full((3, 2), -1.0))
    both = RolloutBatch.concat([new, old])
    assert both.columns["truncated"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert "truncated" not in RolloutBatch.concat([old, old]).columns
