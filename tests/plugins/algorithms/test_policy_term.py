"""TRL's options on the policy term (alignzoo.algorithms.policy_term) in every algorithm that
takes them: GRPO, RLOO, REINFORCE++ and PPO compute the same policy gradient with each option
on (one shared path; GRPO's is TRL-parity tested in tests/parity/test_trl_grpo_options.py), the
contract suite holds with each on, the entropy quantile keeps what torch.quantile says, and
mask_truncated_completions keeps the cut responses' rewards in each algorithm's statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from alignzoo.algorithms.policy_term import high_entropy_mask
from alignzoo.batch import PolicyOutputs
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.plugins.algorithms.ppo import PPO
from alignzoo.plugins.algorithms.reinforce_pp import ReinforcePlusPlus
from alignzoo.plugins.algorithms.rloo import RLOO
from alignzoo.testing import make_batch
from alignzoo.testing.contract import CHECKS, check_algorithm

ALGORITHMS = {"grpo": GRPO, "rloo": RLOO, "reinforce_pp": ReinforcePlusPlus, "ppo": PPO}
OPTIONS = [
    {"delta": 1.3},
    {"top_entropy_quantile": 0.2},
    {"off_policy_mask_threshold": 0.05},
    {"delta": 1.5, "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.0},
]


def plain_params(name: str) -> dict[str, Any]:
    """Params that make each algorithm's policy term PPO's clip at 0.2 with token-mean
    aggregation and nothing else in the loss's gradient w.r.t. the log-probs."""
    if name == "grpo":
        return {"beta": 0.0, "loss_aggregation": "token-mean"}
    if name == "ppo":
        return {"kl_coef": 0.0, "loss_aggregation": "token-mean"}
    return {"kl_coef": 0.0, "loss_aggregation": "token-mean"}


def rollouts(seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A batch with given advantages, behaviour log-probs off the policy both ways (the clip
    and delta bind), padding, and per-token entropies; returns (batch, logprobs, entropy)."""
    gen = torch.Generator().manual_seed(seed)
    size, width = 8, 6
    lengths = torch.randint(2, width + 1, (size,), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(1)).float()
    logprobs = -torch.rand(size, width, generator=gen) * 2.0 - 0.05
    shift = torch.tensor([0.5, -0.15, 0.0])[torch.arange(size) % 3].unsqueeze(1)  # meets both signs
    old = logprobs - shift - (torch.rand(size, width, generator=gen) - 0.5) * 0.2
    advantages = torch.where(torch.arange(size) % 2 == 0, 1.0, -1.0) * (
        0.2 + torch.rand(size, generator=gen)
    )
    entropy = torch.rand(size, width, generator=gen) * 3.0
    batch, _ = make_batch(
        logprobs,
        mask=mask,
        old_logprobs=old,
        advantages=advantages.unsqueeze(1) * mask,
        values=torch.zeros(size, width),
        returns=torch.zeros(size, width),
        group_ids=torch.arange(size) // 2,
    )
    return batch, logprobs, entropy


def policy_gradient(name: str, options: dict[str, Any], seed: int) -> torch.Tensor:
    batch, logprobs, entropy = rollouts(seed)
    leaf = logprobs.clone().requires_grad_(True)
    outputs = PolicyOutputs(logprobs=leaf, entropy=entropy, values=torch.zeros_like(logprobs))
    algorithm = ALGORITHMS[name]({**plain_params(name), **options})
    result = algorithm.compute_loss(batch, outputs, batch.loss_context())
    result.loss.backward()
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "ppo"])
def test_each_algorithm_takes_the_options_as_grpo_does(name, options, seed) -> None:
    """The same advantages give RLOO, REINFORCE++ and PPO GRPO's policy gradient with each
    option on, and each option changes it (the premise that it does something here)."""
    grpo = policy_gradient("grpo", options, seed)
    torch.testing.assert_close(policy_gradient(name, options, seed), grpo, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(grpo, policy_gradient("grpo", {}, seed)), "premise: it acts"


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_contract_holds_with_each_option_on(name, options) -> None:
    """Direction included. The entropy quantile is taken over each forward's tokens, as TRL's,
    so it is the one documented exception to micro-batch invariance."""
    checks = [c for c in CHECKS if c != "micro_batch_invariance"]
    if "top_entropy_quantile" not in options:
        checks = list(CHECKS)
    algorithm = ALGORITHMS[name]({**plain_params(name), **options})
    failed = [r for r in check_algorithm(algorithm, max_examples=20, checks=checks) if not r.passed]
    assert failed == [], [(r.name, r.detail) for r in failed]


def test_an_entropy_quantile_is_the_one_option_that_depends_on_the_micro_batches() -> None:
    """The documented exception holds only for it: the check fails with it on (the quantile
    moves with the forward's tokens), so skipping it is not hiding anything else."""
    results = check_algorithm(
        GRPO({"top_entropy_quantile": 0.3}), max_examples=20, checks=["micro_batch_invariance"]
    )
    assert [r.passed for r in results if r.name == "micro_batch_invariance"] == [False]


def test_the_entropy_quantile_keeps_the_tokens_torch_quantile_puts_above() -> None:
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 99.0, 99.0]])
    # the 8 real entropies 1..8: quantile 0.8 (rho 0.2) is 6.6 by linear interpolation
    kept = high_entropy_mask(entropy, mask, 0.2)
    assert kept.tolist() == [[False] * 5, [False, True, True, False, False]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    assert int(high_entropy_mask(entropy, mask, 0.0).sum()) == 1  # the maximum, 8, alone
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.5).any()


def test_the_entropy_quantile_is_taken_over_every_ranks_tokens(monkeypatch) -> None:
    """Under data parallelism the threshold comes from every rank's response tokens: here a
    second rank holds the entropies 4..9, so this rank's 0.3..2.0 are all below the top 40%."""
    from alignzoo import distributed

    other_rank = torch.tensor([4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "all_gather_object", lambda mine: [mine, other_rank])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    entropy = torch.tensor([[0.3, 2.0, 50.0], [1.0, 0.1, 1.5]])
    assert not high_entropy_mask(entropy, mask, 0.4).any()
    monkeypatch.setattr(distributed, "all_gather_object", lambda mine: [mine, other_rank - 4.0])
    # the union of 0.1..2.0 and 0..5, 11 values: the 0.6 quantile is the 7th, 2.0
    assert high_entropy_mask(entropy, mask, 0.4).tolist() == [
        [False, True, False],
        [False, False, False],
    ]


def test_the_entropy_quantile_needs_the_entropy() -> None:
    from alignzoo.errors import UserError

    batch, logprobs, _ = rollouts(0)
    outputs = PolicyOutputs(logprobs=logprobs.clone().requires_grad_(True), entropy=None)
    with pytest.raises(UserError, match="top_entropy_quantile < 1 needs"):
        RLOO({"top_entropy_quantile": 0.5}).compute_loss(batch, outputs, batch.loss_context())


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "ppo"])
def test_truncated_responses_keep_their_reward_and_lose_their_loss(name) -> None:
    """Advantages are computed with the cut responses' rewards in them (the others' are the
    option-off ones), then the cut responses' masks are zeroed (PPO's critic too)."""

    def batch() -> Any:
        b, _ = make_batch(
            torch.full((4, 3), -1.0),
            mask=[[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]],
            group_ids=[0, 0, 0, 1],
            scores=[1.0, 0.0, 0.5, 1.0],
            old_logprobs=torch.full((4, 3), -1.0),
            values=torch.zeros(4, 3),
        )
        return b

    params = plain_params(name)
    plain = ALGORITHMS[name](params).compute_advantages(batch())
    cut = batch()
    cut.columns["truncated"] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    algorithm = ALGORITHMS[name]({**params, "mask_truncated_completions": True})
    assert algorithm.algorithm_requirements().truncation
    masked = algorithm.compute_advantages(cut)
    keep = [0, 2, 3]
    torch.testing.assert_close(masked.advantages[keep], plain.advantages[keep])
    assert masked.response_mask[1].sum() == 0
    assert torch.equal(masked.response_mask[keep], plain.response_mask[keep])
    values = torch.zeros(4, 3, requires_grad=True)
    logprobs = torch.full((4, 3), -1.0, requires_grad=True)
    outputs = PolicyOutputs(logprobs=logprobs, entropy=torch.ones(4, 3), values=values)
    result = algorithm.compute_loss(masked, outputs, masked.loss_context())
    result.loss.backward()
    assert logprobs.grad is not None and float(logprobs.grad[1].abs().sum()) == 0.0
    assert float(logprobs.grad[0].abs().sum()) > 0.0
    if name == "ppo":
        assert values.grad is not None and float(values.grad[1].abs().sum()) == 0.0
    assert result.metrics["actor/truncated_masked"] == pytest.approx(0.25)


def test_validate_refuses_truncation_masking_for_an_environment(tmp_path) -> None:
    from alignzoo.config.loader import load_experiment
    from alignzoo.errors import ConfigError

    (tmp_path / "tools.py").write_text(
        'def add(a: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n    """\n    return a\n'
    )
    env = f"{{name: tools, params: {{functions: ['{tmp_path / 'tools.py'}:add']}}}}"
    algorithm = "{name: rloo, params: {mask_truncated_completions: true}}"
    (tmp_path / "e.yaml").write_text(
        "name: demo\nseeds: [0]\nbudget: {steps: 1}\narms:\n"
        f"  a: {{algorithm: {algorithm}, environment: {env}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_experiment(tmp_path / "e.yaml")
    issues = {issue.path: issue.message for issue in info.value.issues}
    field = "arms.a.algorithm.params.mask_truncated_completions"
    assert list(issues) == [field], issues
    assert "single-turn samples only" in issues[field]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"top_entropy_quantile": -0.1}, "top_entropy_quantile"),
        ({"delta": 1.0}, "delta"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
    ],
)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_out_of_range_values_are_refused_naming_the_field(name, params, says) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        ALGORITHMS[name].Params(**params)
