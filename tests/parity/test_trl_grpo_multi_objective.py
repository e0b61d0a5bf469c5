"""Parity of GRPO's several-reward advantages with TRL 1.16's GRPOTrainer, under TRL's names:
``multi_objective_aggregation`` (``sum_then_normalize``, and ``normalize_then_sum``: GDPO) and
``reward_weights``, with ``scale_rewards`` group, batch and none, several seeds, group sizes
and reward counts, and rewards that do not apply (TRL: a reward function's None).

The same reward functions score both sides. TRL's side is its own
``_generate_and_score_completions`` (generation replaced by fixed completions, the reward
functions TRL's, called by its ``_calculate_rewards``), whose ``advantages`` TRL's
``_compute_loss`` then trains on. alignzoo's side is a labeler that reports the functions'
values apart (``Score.info["rewards"]``, None kept), a real labeling pass (``label``) that puts
them in ``batch.reward_components``, and GRPO's ``compute_advantages`` then ``compute_loss``.
Advantages agree within 1e-6, losses and gradients within 1e-5 (both sides' rewards are
float32, as TRL's are).

alignzoo GRPOParams ↔ TRL GRPOConfig, besides test_trl_parity's map:
  multi_objective_aggregation ↔ multi_objective_aggregation (the same values);
  reward_weights ↔ reward_weights (None: all 1, in both), in the labeler's order of
    info["rewards"] ↔ the order of reward_funcs;
  eps 1e-4 ↔ TRL's fixed 1e-4 on every std it divides by;
  scale_rewards ↔ scale_rewards under sum_then_normalize (normalize_then_sum reads none: TRL
    ignores it, alignzoo accepts only its default);
  samples of one prompt (group_ids) ↔ num_generations consecutive completions.
Where the two differ by construction (none of the cases below): a group whose values of a
reward are all equal gets exactly 0 in alignzoo, TRL's rounding noise over eps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from alignzoo import Labeler
from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.labeling.orchestrator import LabelingStage, label
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest, Score
from tests.parity import test_trl_parity as parity
from tests.parity.test_trl_parity import (
    GRPOTrainer,
    Rollouts,
    make_rollouts,
    run_alignzoo,
    set_attributes,
    set_grpo,
    trl_grpo_loss,
)

tokenizer, trl_args, grpo_trainer = parity.tokenizer, parity.trl_args, parity.grpo_trainer

ADVANTAGE_TOLERANCE = {"rtol": 0.0, "atol": 1e-6}
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def draw_rewards(seed: int, size: int, count: int, missing: bool) -> list[list[float | None]]:
    """``size`` completions' values of ``count`` reward functions: the first a 0/1 verdict,
    the others on scales of their own (so the aggregations differ); with ``missing``, some
    functions return None for some completions and one completion gets None from all."""
    gen = torch.Generator().manual_seed(seed)
    columns = [torch.randint(0, 2, (size,), generator=gen).float()]
    for k in range(1, count):
        scale = 3.0**k
        columns.append(scale * torch.rand(size, generator=gen, dtype=torch.float64).float())
    table: list[list[float | None]] = [[float(c[i]) for c in columns] for i in range(size)]
    if missing:
        holes = torch.rand(size, count, generator=gen) < 0.2
        for i, k in holes.nonzero().tolist():
            table[i][k] = None
        table[int(torch.randint(0, size, (1,), generator=gen))] = [None] * count
    return table


def reward_functions(table: list[list[float | None]]) -> list[Any]:
    """One TRL reward function per column of ``table``: completion ``str(i)`` gets row i."""

    def column(k: int) -> Any:
        def reward(completions: list[str], **_: Any) -> list[float | None]:
            return [table[int(c)][k] for c in completions]

        reward.__name__ = f"reward_{k}"
        return reward

    return [column(k) for k in range(len(table[0]))]


def trl_advantages(
    trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    table: list[list[float | None]],
    generations: int,
    options: dict[str, Any],
) -> torch.Tensor:
    """TRL's advantages of completions ``"0", "1", ...`` scored by ``table``'s functions."""
    funcs = reward_functions(table)
    size, count = len(table), len(funcs)
    weights = options.get("reward_weights") or [1.0] * count
    set_attributes(
        monkeypatch,
        trainer,
        beta=0.0,  # no reference pass while scoring
        num_generations=generations,
        reward_funcs=funcs,
        reward_func_names=[f.__name__ for f in funcs],
        reward_processing_classes=[None] * count,
        reward_weights=torch.tensor(weights, dtype=torch.float32),
        multi_objective_aggregation=options.get(
            "multi_objective_aggregation", "sum_then_normalize"
        ),
        scale_rewards=options.get("scale_rewards", "group"),
    )

    def generate(prompts: list[Any]) -> tuple[Any, ...]:
        assert len(prompts) == size
        completions = [str(i) for i in range(size)]
        return [[7, 7, 7]] * size, [[9, 9]] * size, None, completions, None, {}, None, None

    monkeypatch.setattr(trainer, "_generate", generate)
    out = trainer._generate_and_score_completions([{"prompt": "1+1="}] * size)
    return out["advantages"]


class Functions(Labeler):
    """The same reward functions as one alignzoo labeler: each one's value apart in
    ``info["rewards"]`` (None kept: it does not apply), their sum as the value."""

    def __init__(self, table: list[list[float | None]]) -> None:
        super().__init__()
        self.funcs = reward_functions(table)

    def score(self, request: LabelRequest) -> Score:
        values = [f(completions=[request.response])[0] for f in self.funcs]
        rewards = {f.__name__: v for f, v in zip(self.funcs, values, strict=True)}
        return Score(sum(v for v in values if v is not None), info={"rewards": rewards})


def alignzoo_side(
    r: Rollouts, table: list[list[float | None]], generations: int, params: dict[str, Any]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """alignzoo's sequence advantages, loss and gradient for the rollouts ``r`` whose
    completion i is scored by row i of ``table`` through a real labeling pass."""
    batch, outputs = r.alignzoo_batch(reference=params["beta"] > 0)
    size = batch.size
    batch.advantages, batch.group_ids = None, torch.arange(size) // generations
    batch.prompts, batch.responses = ["1+1="] * size, [str(i) for i in range(size)]
    batch.extras = [{} for _ in range(size)]
    labeler = Functions(table)
    hooks = Hooks(build_plugin_manager([labeler]))
    stage = LabelingStage.build(LabelingConfig(store=None), [("functions", labeler, hooks)])
    report = label(hooks, batch, stage)
    assert report.keep == list(range(size))  # every sample has a value (TRL keeps them all)
    assert batch.reward_components is not None
    assert batch.reward_names == tuple(f.__name__ for f in labeler.funcs)
    algorithm = GRPO(params)
    loss, grad = run_alignzoo(algorithm, batch, outputs)
    assert batch.advantages is not None
    return batch.advantages[:, 0].float(), (loss, grad)


def both_sides(
    trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    generations: int,
    count: int,
    options: dict[str, Any],
    missing: bool = False,
) -> None:
    size, width, beta = 4 * generations, 6, 0.04
    table = draw_rewards(seed, size, count, missing)
    theirs = trl_advantages(trainer, monkeypatch, table, generations, options)
    r = make_rollouts(seed, size, width)
    params = {"beta": beta, "eps": 1e-4, "loss_aggregation": "seq-mean-token-mean", **options}
    ours, (az_loss, az_grad) = alignzoo_side(r, table, generations, params)
    # premise: the case has signal in every group (not all advantages zero)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, **ADVANTAGE_TOLERANCE)

    set_grpo(
        monkeypatch,
        trainer,
        loss_type="grpo",
        level="token",
        beta=beta,
        eps_low=0.2,
        eps_high=0.2,
        max_completion_length=width,
    )
    trl_rollouts = Rollouts(r.lengths, r.logps, r.old_logps, r.ref_logps, theirs.double())
    leaf = r.logps.clone().requires_grad_(True)
    inputs = trl_rollouts.trl_inputs(torch.arange(size), beta, num_items=float(r.mask.sum()))
    trl_loss = trl_grpo_loss(trainer, monkeypatch, leaf, inputs)
    trl_loss.backward()
    assert leaf.grad is not None and az_grad.abs().max() > 1e-4
    torch.testing.assert_close(az_loss, trl_loss.detach(), **LOSS_TOLERANCE)
    torch.testing.assert_close(az_grad, leaf.grad, **LOSS_TOLERANCE)


WEIGHTS = {2: [1.0, 0.25], 3: [2.0, -0.5, 0.3]}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("generations", "count"), [(4, 2), (3, 3), (8, 2)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_sum_then_normalize_matches_trl(
    grpo_trainer, monkeypatch, seed, generations, count, weighted, scale
):
    options: dict[str, Any] = {"scale_rewards": scale}
    if weighted:
        options["reward_weights"] = WEIGHTS[count]
    both_sides(grpo_trainer, monkeypatch, seed, generations, count, options)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("generations", "count"), [(4, 2), (3, 3), (8, 2)])
@pytest.mark.parametrize("weighted", [False, True])
def test_normalize_then_sum_matches_trl(
    grpo_trainer, monkeypatch, seed, generations, count, weighted
):
    options: dict[str, Any] = {"multi_objective_aggregation": "normalize_then_sum"}
    if weighted:
        options["reward_weights"] = WEIGHTS[count]
    both_sides(grpo_trainer, monkeypatch, seed, generations, count, options)


@pytest.mark.parametrize("seed", [3, 4, 5])
@pytest.mark.parametrize(
    "options",
    [
        {"multi_objective_aggregation": "normalize_then_sum"},
        {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [2.0, -0.5, 0.3]},
        {"reward_weights": [2.0, -0.5, 0.3]},
        {"reward_weights": [2.0, -0.5, 0.3], "scale_rewards": "batch"},
        {"reward_weights": [2.0, -0.5, 0.3], "scale_rewards": "none"},
    ],
    ids=["gdpo", "gdpo-weighted", "sum", "sum-batch", "sum-none"],
)
def test_rewards_that_do_not_apply_match_trl(grpo_trainer, monkeypatch, seed, options):
    """A reward function's None: left out of that reward's statistics and of the sample's sum;
    a completion every function returns None for gets advantage 0 and counts in no statistic."""
    both_sides(grpo_trainer, monkeypatch, seed, 4, 3, options, missing=True)


def test_the_missing_rewards_case_has_holes_and_an_unscorable_completion() -> None:
    table = draw_rewards(3, 16, 3, missing=True)
    assert any(row == [None] * 3 for row in table)
    assert any(None in row and row != [None] * 3 for row in table)
    assert not math.isnan(sum(v for row in table for v in row if v is not None))
