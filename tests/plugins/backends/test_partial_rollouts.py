"""Partial rollouts in the hf backend (alignzoo.rollout.partial): newer weights taken before a
decode step, the generation going on with them, its cache kept. The tokens before come from the
old weights exactly as without a feed, those after from the new ones (checked against the new
weights computed by hand), each with its version; with packed weights (long generations) the
packed copy is rebuilt; without a feed nothing is recorded."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from alignzoo.plugins.backends.hf import PACK_FROM_NEW_TOKENS, HFBackend
from alignzoo.rollout import partial
from alignzoo.types import SamplingParams
from alignzoo.weights import PolicyWeights

from .conftest import load_policy

PROMPTS = ["12+7=", "3+45=", "1+1="]


def embedding_only(model):
    """The same model with every layer's output projections zeroed: each position's logits
    then depend on its own token alone (the residual stream is the token's embedding), so the
    log-prob of a token after another is computed by hand."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in other.model.layers.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    return other


def by_hand(model, previous: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """log p(token | previous) under :func:`embedding_only`'s model."""
    with torch.no_grad():
        hidden = model.model.norm(model.model.embed_tokens(previous))
        logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
    return logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


class Feed:
    """A weight feed that loads ``then`` at its ``at``-th call (the first is before the
    prefill, call k + 1 before decode step k): through ``load``."""

    def __init__(self, at: int, load) -> None:
        self.at, self.load, self.calls, self.version = at, load, 0, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls == self.at:
            self.load()
            self.version = 1
        return self.version


@pytest.mark.parametrize("weights", ["shared", "copy"])
@pytest.mark.parametrize("new_tokens", [8, PACK_FROM_NEW_TOKENS + 8])  # packed weights too
def test_a_generation_goes_on_with_the_weights_that_arrive(policy_dirs, weights, new_tokens):
    model, tokenizer = load_policy(policy_dirs["plain"])
    backend = HFBackend({"weights": weights})
    backend.on_run_start(SimpleNamespace(tokenizer=tokenizer, device=lambda r: "cpu", actor=model))
    backend.sync_weights(PolicyWeights(model, 0))
    newer = embedding_only(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    seeds = [5, 6, 7]
    before = backend.generate(PROMPTS, [{}] * 3, 2, sampling, seeds)
    assert before.token_versions is None  # no feed: nothing recorded

    switch = 5  # decode step 5 onwards: the newer weights (token 5's logits and after)
    if weights == "shared":  # the backend samples with the trainer's own module

        def load() -> None:
            model.load_state_dict(newer.state_dict())
    else:  # its own copy, loaded from the weight stream

        def load() -> None:
            backend.sync_weights(PolicyWeights(newer, 1))

    with partial.feeding(Feed(switch + 1, load)):
        batch = backend.generate(PROMPTS, [{}] * 3, 2, sampling, seeds)

    mask = batch.response_mask.bool()
    assert mask[:, switch:].any(), "premise: the responses run past the switch"
    versions = batch.token_versions
    assert versions is not None and versions.shape == batch.response_ids.shape
    assert versions[:, :switch][mask[:, :switch]].eq(0).all()
    assert versions[:, switch:][mask[:, switch:]].eq(1).all()
    assert versions[~mask].eq(-1).all()
    # Before the switch: the old weights' tokens and log-probs, exactly as without a feed.
    assert torch.equal(batch.response_ids[:, :switch], before.response_ids[:, :switch])
    assert torch.equal(batch.rollout_logprobs[:, :switch], before.rollout_logprobs[:, :switch])
    # After: each token drawn from the new weights (whose logits depend on the previous token
    # alone), its log-prob the one it was drawn with.
    ids = batch.response_ids
    expected = by_hand(newer, ids[:, switch - 1 : -1], ids[:, switch:])
    after = mask[:, switch:]
    assert torch.allclose(batch.rollout_logprobs[:, switch:][after], expected[after], atol=1e-5)
