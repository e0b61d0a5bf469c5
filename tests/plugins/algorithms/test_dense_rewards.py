"""Dense rewards in PPO and REINFORCE++: nothing changes without them (exactly), a positive
step reward raises the advantage of the tokens up to it and leaves later tokens alone, and the
algorithms that read them say so in their requirements."""

from __future__ import annotations

import pytest
import torch

from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.plugins.algorithms.ppo import PPO
from alignzoo.plugins.algorithms.reinforce_pp import ReinforcePlusPlus
from alignzoo.plugins.algorithms.rloo import RLOO

from .helpers import make_batch, right_padded_mask

LENGTHS = [5, 3, 6, 4]


def ppo_batch(dense: torch.Tensor | None = None):
    torch.manual_seed(0)
    mask = right_padded_mask(LENGTHS)
    shape = tuple(mask.shape)
    return make_batch(
        mask,
        scores=torch.tensor([1.0, 0.0, 0.5, -0.5]),
        old_logprobs=torch.randn(shape) * mask - 1.0,
        ref_logprobs=torch.randn(shape) * mask - 1.0,
        values=torch.randn(shape) * mask,
        dense_rewards=dense,
        dense_mask=None if dense is None else (dense != 0).float(),
    )


def advantages_of(algorithm, batch):
    out = algorithm.compute_advantages(batch)
    return out.token_rewards, out.advantages, out.returns


@pytest.mark.parametrize(
    "make",
    [
        lambda: PPO({"kl_coef": 0.05}),
        lambda: PPO({"whiten_advantages": False}),
        lambda: ReinforcePlusPlus({"kl_coef": 0.05}),
    ],
    ids=["ppo", "ppo-unwhitened", "reinforce_pp"],
)
def test_all_zero_dense_rewards_change_nothing_exactly(make) -> None:
    without = advantages_of(make(), ppo_batch())
    zeros = torch.zeros_like(right_padded_mask(LENGTHS))
    with_zeros = advantages_of(make(), ppo_batch(zeros))
    for a, b in zip(without, with_zeros, strict=True):
        assert torch.equal(a, b)


def test_ppo_loss_with_zero_dense_rewards_equals_the_loss_without() -> None:
    losses = []
    for dense in (None, torch.zeros_like(right_padded_mask(LENGTHS))):
        algorithm = PPO({"kl_coef": 0.05})
        batch = algorithm.compute_advantages(ppo_batch(dense))
        torch.manual_seed(1)
        logprobs = (
            batch.old_logprobs + 0.1 * torch.randn_like(batch.old_logprobs)
        ).requires_grad_()
        values = (batch.values + 0.1).requires_grad_()
        out = algorithm.compute_loss(
            batch, PolicyOutputs(logprobs=logprobs, values=values), batch.loss_context()
        )
        out.loss.backward()
        losses.append((out.loss.detach(), logprobs.grad, values.grad))
    for a, b in zip(*losses, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PPO({"whiten_advantages": False, "lam": 1.0}),
        lambda: PPO({"whiten_advantages": False, "lam": 0.9, "gamma": 0.99}),
        lambda: ReinforcePlusPlus({"kl_coef": 0.0}),
    ],
    ids=["ppo-lam1", "ppo-lam0.9", "reinforce_pp"],
)
def test_a_positive_step_reward_raises_the_advantage_up_to_its_token_only(make) -> None:
    mask = right_padded_mask(LENGTHS)
    dense = torch.zeros_like(mask)
    row, token = 2, 3  # a step of sample 2 ends on token 3 of its 6
    dense[row, token] = 0.8
    base_rewards, base, base_returns = advantages_of(make(), ppo_batch())
    rewards, raised, returns = advantages_of(make(), ppo_batch(dense))
    torch.testing.assert_close(rewards - base_rewards, dense * mask, rtol=0, atol=1e-6)
    if isinstance(make(), ReinforcePlusPlus):  # batch-normalised: compare the returns
        assert torch.equal(returns[row, token + 1 :], base_returns[row, token + 1 :])
        assert (returns[row, : token + 1] > base_returns[row, : token + 1]).all()
        return
    assert raised[row, token] > base[row, token]  # the step's own token
    assert (raised[row, :token] > base[row, :token]).all()  # and the tokens before it
    assert torch.equal(raised[row, token + 1 :], base[row, token + 1 :])  # not those after
    others = [i for i in range(len(LENGTHS)) if i != row]
    assert torch.equal(raised[others], base[others])  # nor other samples


def test_reinforce_pp_batch_normalised_advantage_of_the_step_token_rises() -> None:
    mask = right_padded_mask(LENGTHS)
    dense = torch.zeros_like(mask)
    dense[2, 3] = 0.8
    base = ReinforcePlusPlus({"kl_coef": 0.0}).compute_advantages(ppo_batch()).advantages
    raised = ReinforcePlusPlus({"kl_coef": 0.0}).compute_advantages(ppo_batch(dense)).advantages
    assert raised[2, 3] > base[2, 3]


def test_dense_reward_coef_zero_ignores_them_and_scales_them_otherwise() -> None:
    mask = right_padded_mask(LENGTHS)
    dense = torch.zeros_like(mask)
    dense[0, 1] = 1.0
    plain = advantages_of(PPO(), ppo_batch())
    off = advantages_of(PPO({"dense_reward_coef": 0.0}), ppo_batch(dense))
    for a, b in zip(plain, off, strict=True):
        assert torch.equal(a, b)
    half = PPO({"dense_reward_coef": 0.5}).compute_advantages(ppo_batch(dense)).token_rewards
    assert half[0, 1] - plain[0][0, 1] == pytest.approx(0.5)


def test_requirements_say_which_algorithms_read_dense_rewards() -> None:
    assert PPO().algorithm_requirements().dense_rewards
    assert not PPO({"dense_reward_coef": 0.0}).algorithm_requirements().dense_rewards
    assert ReinforcePlusPlus().algorithm_requirements().dense_rewards
    assert not ReinforcePlusPlus({"dense_reward_coef": 0}).algorithm_requirements().dense_rewards
    assert ReinforcePlusPlus({"kl_coef": 0}).algorithm_requirements().reference is False
    assert not GRPO().algorithm_requirements().dense_rewards
    assert not RLOO().algorithm_requirements().dense_rewards
