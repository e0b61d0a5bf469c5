"""The policy forward pass (alignzoo.kernels.forward) on a tiny untrained model: the log-probs
the sampler recorded, the LM head in chunks, evaluating()."""

from __future__ import annotations

import pytest
import torch

from alignzoo.kernels.forward import evaluating, policy_forward

from ..tiny_world import build_world, sampled


@pytest.fixture(scope="module")
def world() -> tuple[object, object]:
    return build_world()


def test_training_logprobs_are_the_samplers_logprobs(world) -> None:
    """policy_forward reads the logits of the token *before* each response token: it must give
    the log-probs the backend recorded while sampling (off by one position, it would not)."""
    model, tokenizer = world
    batch = sampled(model, tokenizer)
    with evaluating(model), torch.no_grad():
        logprobs, _ = policy_forward(model, batch)
    torch.testing.assert_close(
        logprobs * batch.response_mask, batch.rollout_logprobs, atol=1e-4, rtol=0
    )


def test_a_large_vocabulary_runs_the_head_in_chunks_with_the_same_numbers(
    world, monkeypatch
) -> None:
    """Where a batch's logits would exceed forward.LOGITS_AT_ONCE, policy_forward runs the LM
    head a few positions at a time (ops.head_token_outputs): the same log-probs, entropy,
    log Σ_v p_v² and gradients as the whole logits give."""
    from alignzoo import ops
    from alignzoo.kernels import forward

    model, tokenizer = world
    batch = sampled(model, tokenizer)
    vocab = model.lm_head.weight.shape[0]

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        model.zero_grad(set_to_none=True)
        out = forward.policy_outputs(model, batch, entropy=True, log_sum_sq_probs=True)
        logprobs, entropy, sq = out
        assert entropy is not None and sq is not None and not sq.requires_grad
        mask = batch.response_mask
        ((logprobs * mask).sum() + (entropy * mask).sum() * 0.3).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert calls == ([1] if chunked else [])
        return logprobs.detach(), entropy.detach(), sq, *grads

    calls: list[int] = []
    whole = run(chunked=False)
    real = ops.head_token_outputs
    monkeypatch.setattr(forward, "LOGITS_AT_ONCE", vocab * 3)  # 3 positions at a time
    monkeypatch.setattr(
        forward, "head_token_outputs", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    chunked = run(chunked=True)
    assert len(chunked) == len(whole)
    for mine, theirs in zip(chunked, whole, strict=True):
        # The gradients sum the positions' terms in another order (chunk by chunk): float32
        # rounding of that order, scaled by the tensor's size, is all that may differ (seen:
        # 1.1e-6 on one element of 8,256 on an AVX2 EPYC); a wrong chunk would be off by O(1).
        scale = float(theirs.abs().max().clamp(min=1.0))
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * scale)


def test_evaluating_restores_the_mode(world) -> None:
    model, _ = world
    model.train()
    with evaluating(model):
        assert not model.training and not any(m.training for m in model.modules())
    assert model.training
