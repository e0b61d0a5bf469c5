"""Gradient accumulation changes nothing: every built-in algorithm, every loss aggregation mode.

The update stage hands ``compute_loss`` the optimizer step's :class:`LossContext`, so the
gradient accumulated over micro-batches is the gradient of the whole minibatch's loss. Checked
through the real stages (no-grad scoring, data mode, advantages, update) on a tiny model, with
responses of very uneven lengths (1 to 14 tokens), for micro-batches of 1, 2, 3 and the whole
batch: the accumulated gradients agree to 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig, TrainingConfig
from alignzoo.engine.behaviour import SeparatePass
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import Learner, build_scheduler
from alignzoo.engine.models import Models, load_models
from alignzoo.engine.modes import select_mode
from alignzoo.engine.scoring import Scorer
from alignzoo.engine.tokenize import tokenized_batch
from alignzoo.engine.update import update
from alignzoo.ops import aggregate_loss
from alignzoo.plugin import Algorithm, Component, hookimpl
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.types import AlgorithmRequirements, LossOutput
from alignzoo.world.model import build_model, save_policy
from alignzoo.world.tokenizer import build_tokenizer

TINY = EmbeddedModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=0, seed=5
)
PROMPTS = ["1+2=", "12+7=", "3+45=", "100+250=", "9+9=", "5+5=", "40+2=", "7+77="]
RESPONSES = ["", "1234567890123", "7", "12", "98765", "3", "1234567890", "45"]  # + EOS: 1-14
SCORES = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.2, 0.9]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]  # online groups, and the (chosen, rejected) pairs offline
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _aggregation(mode: str) -> dict:
    return {"loss_aggregation": mode, **({"norm_constant": 16} if mode.endswith("norm") else {})}


DPO_OPTIONS = {
    "ld_alpha": 0.3,
    "f_divergence_type": "alpha_divergence",
    "f_alpha_divergence_coef": 0.3,
    "use_weighting": True,
}
"""DPO's TRL options all at once (LD-DPO, an f-divergence, WPO's weights)."""

CASES = [
    *[
        (name, _aggregation(mode))
        for name in ("ppo", "grpo", "rloo", "reinforce_pp")
        for mode in MODES
    ],
    ("grpo", {"importance_ratio": "sequence", "beta": 0.1}),
    ("ppo", {"entropy_coef": 0.01, "kl_in_reward": False, "kl_loss_coef": 0.1}),
    ("dpo", {}),
    ("dpo", {"loss_type": "ipo"}),
    ("dpo", {"loss_type": "hinge"}),
    ("dpo", {"loss_type": "robust", "label_smoothing": 0.2}),
    ("dpo", {"reference_free": True}),
    ("dpo", {"ld_alpha": 0.5}),
    ("dpo", {"f_divergence_type": "js_divergence", "loss_type": ["sigmoid", "sft"]}),
    ("dpo", {"use_weighting": True}),  # outputs.log_sum_sq_probs from the update's pass
    ("dpo", DPO_OPTIONS),
    ("simpo", {}),
    ("kto", {"desirable_weight": 1.2}),
]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny") / "policy"
    save_policy(build_model(TINY, tokenizer), tokenizer, folder)
    return folder


def _models(policy_dir: Path, req: AlgorithmRequirements) -> Models:
    return load_models(
        str(policy_dir),
        ModelConfig(attn_implementation="eager"),
        {"actor": "cpu", "ref": "cpu", "critic": "cpu"},
        req.reference,
        req.critic,
        seed=0,
    )


def _step_batch(
    models: Models, hooks: Hooks, req: AlgorithmRequirements, online: bool = False
) -> tuple:
    """The step batch as the engine builds it: tokenised, scored without gradients (the
    behaviour snapshot), picked by the data mode, extended by it, advantages computed.
    ``online`` (a preference or unpaired algorithm): the samples were drawn at temperature
    0.7 and the online mode pairs them by score."""
    online = online or req.data == "online"
    mode = select_mode(req, online=online)
    batch = tokenized_batch(models.tokenizer, PROMPTS, RESPONSES, [{}] * 8, max_new_tokens=16)
    assert sorted(batch.response_mask.sum(1).tolist()) == [1, 2, 2, 3, 3, 6, 11, 14]
    batch.group_ids = torch.tensor(GROUPS)
    batch.scores = torch.tensor(SCORES)
    batch.score_valid = torch.ones(8, dtype=torch.bool)
    if online and req.data != "online":
        batch.sampling = torch.tensor([[0.7, 0.0, 1.0]]).repeat(8, 1)
    elif req.data == "preference":
        batch.labels = torch.tensor([1.0, 0.0] * 4)
    if req.data == "unpaired":
        batch.labels = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    scorer = Scorer(models, micro_batch_size=3)
    SeparatePass(scorer, online=mode.online).before_update(batch)
    selected = mode.select(batch, {})
    assert selected is not None
    batch = mode.prepare(selected, scorer)
    return hooks.compute_advantages(batch), mode


def _accumulated_gradient(
    models: Models,
    hooks: Hooks,
    req,
    mode,
    batch: RolloutBatch,
    micro: int,
    metrics: dict[str, float] | None = None,
) -> torch.Tensor:
    trainable = [p for m in (models.actor, models.critic) if m is not None for p in m.parameters()]
    groups = [{"params": [p for p in models.actor.parameters()]}]
    if models.critic is not None:
        groups.append({"params": list(models.critic.parameters())})
    optimizer = torch.optim.SGD(groups, lr=0.0)  # lr 0: the weights stay, the gradients remain
    cfg = TrainingConfig(lr=0.0, micro_batch_size=micro, max_grad_norm=None)
    learner = Learner(models, optimizer, build_scheduler(optimizer, cfg, None), cfg, seed=0)
    behaviour = SeparatePass(Scorer(models, micro), online=mode.online)  # the snapshot is taken
    step = update(learner, hooks, req, mode, batch, 1, behaviour)  # one minibatch: one step
    if metrics is not None:
        metrics.update(step)
    return torch.cat([p.grad.flatten() for p in trainable if p.grad is not None])


@pytest.mark.parametrize(("name", "params"), CASES, ids=lambda v: str(v))
def test_accumulated_gradient_does_not_depend_on_the_micro_batching(policy_dir, name, params):
    component = get_registry().get("algorithm", name)(params)
    hooks = Hooks(build_plugin_manager([component]), name)
    req = hooks.algorithm_requirements()
    models = _models(policy_dir, req)
    batch, mode = _step_batch(models, hooks, req)
    whole = _accumulated_gradient(models, hooks, req, mode, batch, micro=batch.size)
    assert whole.abs().max() > 1e-4  # the premise: the loss has a gradient here
    for micro in (1, 2, 3):
        grad = _accumulated_gradient(models, hooks, req, mode, batch, micro)
        torch.testing.assert_close(grad, whole, atol=1e-6, rtol=1e-5, msg=f"micro {micro}")


@pytest.mark.parametrize("params", [{}, DPO_OPTIONS], ids=str)
def test_online_dpo_with_its_options_accumulates_the_same_gradient(policy_dir, params):
    """Online pairs (sampled at temperature 0.7, paired best vs worst by score): LD-DPO's
    lengths, the f-divergence and WPO's weights (log Σ_v p_v² of the tempered distribution,
    from the update's own pass) work there as offline, whatever the micro-batching."""
    component = get_registry().get("algorithm", "dpo")(params)
    hooks = Hooks(build_plugin_manager([component]), "dpo")
    req = hooks.algorithm_requirements()
    assert req.log_sum_sq_probs == bool(params)
    models = _models(policy_dir, req)
    batch, mode = _step_batch(models, hooks, req, online=True)
    assert mode.online and batch.size == 6  # group 2's two samples tie: no pair
    assert batch.sampling is not None and batch.labels is not None
    metrics: dict[str, float] = {}
    whole = _accumulated_gradient(models, hooks, req, mode, batch, batch.size, metrics)
    assert whole.abs().max() > 1e-4
    assert ("dpo/wpo_weight" in metrics) == bool(params)  # WPO's weights were applied
    if params:
        assert 0.0 < metrics["dpo/wpo_weight"] != 1.0
    for micro in (2, 4):
        grad = _accumulated_gradient(models, hooks, req, mode, batch, micro)
        torch.testing.assert_close(grad, whole, atol=1e-6, rtol=1e-5, msg=f"micro {micro}")


class TokenMeanOfGivenLosses(Algorithm):
    """Per-token loss 1 on every token of sample 0, 0 elsewhere, as a DAPO-style token mean."""

    requirements = AlgorithmRequirements(entropy=False)

    @hookimpl
    def compute_advantages(self, batch):
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        first = (batch.group_ids == 0).float()[:, None].expand_as(outputs.logprobs)
        per_token = first + 0.0 * outputs.logprobs
        return LossOutput(
            aggregate_loss(per_token, batch.response_mask, "token-mean", None, context)
        )


@pytest.mark.parametrize("micro", [1, 2])
def test_the_token_mean_of_one_1_token_loss_and_one_3_token_zero_is_a_quarter(policy_dir, micro):
    """The issue's example: sample 0 has 1 token of loss 1, sample 1 three tokens of loss 0. The
    step's token mean is 1/4; normalising each micro-batch by its own tokens would give 1/2."""
    component: Component = TokenMeanOfGivenLosses()
    hooks = Hooks(build_plugin_manager([component]), "token_mean")
    req = hooks.algorithm_requirements()
    models = _models(policy_dir, req)
    batch = tokenized_batch(models.tokenizer, ["1+2=", "3+4="], ["", "12"], [{}, {}], 16)
    assert batch.response_mask.sum(1).tolist() == [1.0, 3.0]  # EOS only; "1", "2", EOS
    behaviour = SeparatePass(Scorer(models, 2), online=True)
    behaviour.before_update(batch)
    optimizer = torch.optim.SGD(models.actor.parameters(), lr=0.0)
    cfg = TrainingConfig(lr=0.0, micro_batch_size=micro, max_grad_norm=None)
    learner = Learner(models, optimizer, build_scheduler(optimizer, cfg, None), cfg, seed=0)
    metrics = update(learner, hooks, req, select_mode(req, True), batch, 1, behaviour)
    assert metrics["loss"] == pytest.approx(0.25, abs=1e-7)
