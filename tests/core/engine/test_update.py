"""The update and scoring stages on a tiny untrained model (no warm start): log-prob alignment
with the sampler, gradient accumulation, non-finite gradients, the lr metric, contract checks."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import EmbeddedModelConfig, TrainingConfig
from alignzoo.engine.behaviour import SeparatePass
from alignzoo.engine.hooks import Hooks, check_layout
from alignzoo.engine.learner import Learner, build_scheduler
from alignzoo.engine.models import Models
from alignzoo.engine.modes import select_mode
from alignzoo.engine.scoring import Scorer
from alignzoo.engine.tokenize import tokenized_batch
from alignzoo.engine.update import update
from alignzoo.errors import RunError, UserError
from alignzoo.kernels.forward import evaluating, policy_forward
from alignzoo.labeling.orchestrator import label
from alignzoo.ops import aggregate_loss
from alignzoo.plugin import Algorithm, Labeler, hookimpl
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.registry import build_plugin_manager
from alignzoo.types import AlgorithmRequirements, LossOutput, SamplingParams, Score
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

TINY = EmbeddedModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, sft_steps=0, seed=3
)
PROMPTS = ["12+7=", "3+45=", "1+1=", "100+250="]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    tokenizer = build_tokenizer()
    return build_model(TINY, tokenizer), tokenizer


def _sampled(model, tokenizer, n: int = 2) -> RolloutBatch:
    backend = HFBackend({"max_batch_size": 3})
    backend.on_run_start(
        SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=model)
    )
    torch.manual_seed(0)
    return backend.generate(PROMPTS, [], n, SamplingParams(max_new_tokens=6))


def test_training_logprobs_are_the_samplers_logprobs(world) -> None:
    """policy_forward reads the logits of the token *before* each response token: it must give
    the log-probs the backend recorded while sampling (off by one position, it would not)."""
    model, tokenizer = world
    batch = _sampled(model, tokenizer)
    with evaluating(model), torch.no_grad():
        logprobs, _ = policy_forward(model, batch)
    torch.testing.assert_close(
        logprobs * batch.response_mask, batch.rollout_logprobs, atol=1e-4, rtol=0
    )


def test_a_large_vocabulary_runs_the_head_in_chunks_with_the_same_numbers(
    world, monkeypatch
) -> None:
    """Where a batch's logits would exceed forward.LOGITS_AT_ONCE, policy_forward runs the LM
    head a few positions at a time (ops.head_logprobs): the same log-probs, entropy and
    gradients as the whole logits give."""
    from alignzoo import ops
    from alignzoo.kernels import forward

    model, tokenizer = world
    batch = _sampled(model, tokenizer)
    vocab = model.lm_head.weight.shape[0]

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        model.zero_grad(set_to_none=True)
        logprobs, entropy = policy_forward(model, batch, entropy=True)
        mask = batch.response_mask
        ((logprobs * mask).sum() + (entropy * mask).sum() * 0.3).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert calls == ([1] if chunked else [])
        return logprobs.detach(), entropy.detach(), *grads

    calls: list[int] = []
    whole = run(chunked=False)
    real = ops.head_logprobs
    monkeypatch.setattr(forward, "LOGITS_AT_ONCE", vocab * 3)  # 3 positions at a time
    monkeypatch.setattr(forward, "head_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunked = run(chunked=True)
    assert len(chunked) == len(whole)
    for mine, theirs in zip(chunked, whole, strict=True):
        # The gradients sum the positions' terms in another order (chunk by chunk): float32
        # rounding of that order, scaled by the tensor's size, is all that may differ (seen:
        # 1.1e-6 on one element of 8,256 on an AVX2 EPYC); a wrong chunk would be off by O(1).
        scale = float(theirs.abs().max().clamp(min=1.0))
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * scale)


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
    batch = _sampled(model, tokenizer)  # 8 samples of varied lengths
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
    batch = _sampled(model, tokenizer)
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
    batch = _sampled(model, tokenizer)
    cfg = TrainingConfig(lr=1e-3, micro_batch_size=8, warmup_steps=4)
    updater = Updater(copy.deepcopy(model), cfg, _seq_mean_nll)
    assert updater(batch, step=1)["lr"] == pytest.approx(1e-3 / 4)
    assert updater(batch, step=2)["lr"] == pytest.approx(2e-3 / 4)


def test_a_non_finite_gradient_stops_before_the_weights_change(world) -> None:
    model, tokenizer = world
    batch = _sampled(model, tokenizer)

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
    batch = _sampled(model, tokenizer)
    cfg = TrainingConfig(lr=1.0, micro_batch_size=8)
    with pytest.raises(RunError, match=r"scalar tensor.*shape \[8\]"):
        Updater(copy.deepcopy(model), cfg, lambda b, o, c: -o.logprobs.sum(-1))(batch, 1)
    with pytest.raises(RunError, match="requires_grad=False"):
        Updater(copy.deepcopy(model), cfg, lambda b, o, c: torch.tensor(0.0))(batch, 1)


def test_offline_prompts_are_encoded_like_the_backend_encodes_them() -> None:
    calls: list[tuple[str, bool]] = []

    class Tok:
        eos_token_id, pad_token_id = 1, 0

        def __call__(self, texts, add_special_tokens=True):  # batched, as the engine calls it
            assert isinstance(texts, list)
            calls.extend((text, add_special_tokens) for text in texts)
            bos = [7] if add_special_tokens else []
            return {"input_ids": [bos + [ord(c) for c in text] for text in texts]}

    batch = tokenized_batch(Tok(), ["ab"], ["c"], [{}], max_new_tokens=8)
    assert ("ab", True) in calls and ("c", False) in calls  # BOS on prompts, not on responses
    assert batch.prompt_ids[0].tolist() == [7, ord("a"), ord("b")]
    assert batch.response_ids[0].tolist() == [ord("c"), 1]


def test_a_backend_batch_that_breaks_the_contract_is_named(world) -> None:
    model, tokenizer = world
    batch = _sampled(model, tokenizer)
    check_layout(batch, 2)
    with pytest.raises(RunError, match="group_ids must be i // n"):
        check_layout(batch, 4)
    bad = copy.copy(batch)
    bad.response_mask = batch.response_mask[:, :-1]
    with pytest.raises(RunError, match="response_mask has shape"):
        check_layout(bad, 2)
    bad = copy.copy(batch)
    bad.responses = batch.responses[:-1]
    with pytest.raises(RunError, match="responses has 7 items for 8"):
        check_layout(bad, 2)


def test_a_crashing_or_wrong_labeler_fails_with_a_named_error(world) -> None:
    model, tokenizer = world
    batch = _sampled(model, tokenizer)

    def hooks(fn):
        class FnLabeler(Labeler):
            @hookimpl
            def score_batch(self, requests):
                return fn(requests)

        return Hooks(build_plugin_manager([FnLabeler()]))

    with pytest.raises(RunError, match="the labeler failed: KeyError"):
        label(hooks(lambda requests: {}["x"]), batch)
    with pytest.raises(RunError, match="Score\\(value='high'\\) for response 0"):
        label(hooks(lambda requests: [Score("high") for _ in requests]), batch)  # type: ignore[arg-type]
    with pytest.raises(RunError, match=r"non-finite score \(nan\) for response 0"):
        label(hooks(lambda requests: [Score(float("nan")) for _ in requests]), batch)
    with pytest.raises(UserError, match="fix me"):  # a user error keeps its own message
        label(hooks(lambda requests: (_ for _ in ()).throw(UserError("fix me"))), batch)


def test_hf_backend_refuses_a_rollout_device_other_than_the_actors(world) -> None:
    model, tokenizer = world
    devices = {"actor": "cpu", "rollout": "cuda:1"}
    run = SimpleNamespace(tokenizer=tokenizer, device=devices.__getitem__, actor=model)
    with pytest.raises(UserError, match=r"rollout.*actor's device"):
        HFBackend().on_run_start(run)


def test_evaluating_restores_the_mode(world) -> None:
    model, _ = world
    model.train()
    with evaluating(model):
        assert not model.training and not any(m.training for m in model.modules())
    assert model.training


def test_a_preference_batch_with_a_broken_pair_is_refused(world) -> None:
    model, tokenizer = world
    batch = _sampled(model, tokenizer)
    batch.group_ids = torch.arange(4).repeat_interleave(2)
    cfg = TrainingConfig(lr=1.0, micro_batch_size=8)
    updater = Updater(copy.deepcopy(model), cfg, _seq_mean_nll, paired=True)
    updater(batch, step=1)  # adjacent pairs: fine
    with pytest.raises(RunError, match="step 2: the preference batch is no longer adjacent"):
        updater(batch.select([0, 1, 2, 4, 5, 6]), step=2)
    with pytest.raises(RunError, match="7 samples"):
        updater(batch.select(list(range(7))), step=3)
