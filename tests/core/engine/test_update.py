"""The update and scoring stages on a tiny untrained model (no warm start): gradient
accumulation, non-finite gradients, the lr metric, the loss's and the preference batch's checks."""

from __future__ import annotations

import copy

import pytest
import torch

from alignzoo.config.schema import TrainingConfig
from alignzoo.engine.behaviour import SeparatePass
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import Learner, build_scheduler
from alignzoo.engine.models import Models
from alignzoo.engine.modes import select_mode
from alignzoo.engine.scoring import Scorer
from alignzoo.engine.update import update
from alignzoo.errors import RunError
from alignzoo.ops import aggregate_loss
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.registry import build_plugin_manager
from alignzoo.types import AlgorithmRequirements, LossOutput

from ..tiny_world import build_world, sampled


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    return build_world()


class FnAlgorithm(Algorithm):
    """An algorithm whose loss is a given function of (batch, outputs)."""

    def __init__(self, loss_fn, paired: bool) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.requirements = AlgorithmRequirements(data="preference" if paired else "online")

    @hookimpl
    def compute_advantages(self, batch):
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        return LossOutput(self.loss_fn(batch, outputs, context), {})


class Updater:
    """The update stage of a run with a one-function algorithm, on a given model."""

    def __init__(self, model, cfg: TrainingConfig, loss_fn, paired: bool = False) -> None:
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        models = Models(tokenizer=None, actor=model, policy_path="")
        self.learner = Learner(
            models=models,
            optimizer=optimizer,
            scheduler=build_scheduler(optimizer, cfg, None),
            cfg=cfg,
            seed=0,
        )
        algorithm = FnAlgorithm(loss_fn, paired)
        self.requirements = algorithm.requirements
        self.hooks = Hooks(build_plugin_manager([algorithm]), "test_algo")
        self.mode = select_mode(self.requirements, online=not paired)
        self.behaviour = SeparatePass(Scorer(models, cfg.micro_batch_size), self.mode.online)
        self.scheduler = self.learner.scheduler

    def __call__(self, batch, step: int) -> dict:
        return update(
            self.learner, self.hooks, self.requirements, self.mode, batch, step, self.behaviour
        )


def _seq_mean_nll(batch, outputs, context):
    return aggregate_loss(
        -outputs.logprobs, batch.response_mask, "seq-mean-token-mean", None, context
    )


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_gradient_accumulation_matches_one_full_batch_step(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)  # 8 samples of varied lengths
    start = _params(model)
    deltas = []
    for micro in (8, 2, 3):  # one forward; four; three of uneven sizes (3, 3, 2)
        m = copy.deepcopy(model)
        cfg = TrainingConfig(lr=1.0, micro_batch_size=micro, max_grad_norm=None)
        Updater(m, cfg, _seq_mean_nll)(batch, step=1)
        deltas.append(_params(m) - start)
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[1], deltas[0], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(deltas[2], deltas[0], atol=1e-6, rtol=1e-4)


def test_minibatches_and_epochs_give_one_optimizer_step_each(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    cfg = TrainingConfig(lr=0.0, micro_batch_size=2, minibatch_size=4, epochs=3)
    seen: list[int] = []

    def counting(batch, outputs, context):
        seen.append(batch.size)
        return _seq_mean_nll(batch, outputs, context)

    updater = Updater(copy.deepcopy(model), cfg, counting)
    updater(batch, step=1)
    assert updater.scheduler.last_epoch == 3 * 2  # 3 epochs x 2 minibatches of 4
    assert seen == [2] * 12  # every sample once per epoch, in micro-batches of 2


def test_the_lr_metric_is_the_lr_the_step_used(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    cfg = TrainingConfig(lr=1e-3, micro_batch_size=8, warmup_steps=4)
    updater = Updater(copy.deepcopy(model), cfg, _seq_mean_nll)
    assert updater(batch, step=1)["lr"] == pytest.approx(1e-3 / 4)
    assert updater(batch, step=2)["lr"] == pytest.approx(2e-3 / 4)


def test_a_non_finite_gradient_stops_before_the_weights_change(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)

    def finite_loss_nan_grad(batch, outputs, context):
        return (outputs.logprobs.sum() * 0.0).sqrt()  # value 0, gradient 0 * inf = nan

    m = copy.deepcopy(model)
    before = _params(m)
    cfg = TrainingConfig(lr=1.0, micro_batch_size=8)
    with pytest.raises(RunError, match=r"step 5: the actor's gradient norm is nan.*test_algo"):
        Updater(m, cfg, finite_loss_nan_grad)(batch, step=5)
    assert torch.equal(_params(m), before)


def test_a_loss_that_is_not_a_scalar_is_a_clear_error(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    cfg = TrainingConfig(lr=1.0, micro_batch_size=8)
    with pytest.raises(RunError, match=r"scalar tensor.*shape \[8\]"):
        Updater(copy.deepcopy(model), cfg, lambda b, o, c: -o.logprobs.sum(-1))(batch, 1)
    with pytest.raises(RunError, match="requires_grad=False"):
        Updater(copy.deepcopy(model), cfg, lambda b, o, c: torch.tensor(0.0))(batch, 1)


def test_a_preference_batch_with_a_broken_pair_is_refused(world) -> None:
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    batch.group_ids = torch.arange(4).repeat_interleave(2)
    cfg = TrainingConfig(lr=1.0, micro_batch_size=8)
    updater = Updater(copy.deepcopy(model), cfg, _seq_mean_nll, paired=True)
    updater(batch, step=1)  # adjacent pairs: fine
    with pytest.raises(RunError, match="step 2: the preference batch is no longer adjacent"):
        updater(batch.select([0, 1, 2, 4, 5, 6]), step=2)
    with pytest.raises(RunError, match="7 samples"):
        updater(batch.select(list(range(7))), step=3)
