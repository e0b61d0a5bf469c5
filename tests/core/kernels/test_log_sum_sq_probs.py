"""``log Σ_v p_v²`` per response token (``PolicyOutputs.log_sum_sq_probs``, WPO's weights in
DPO's ``use_weighting``) from the policy's own pass over the vocabulary: on the lean path, on
transformers' forward (sdpa, eager, GPT-2), with the LM head in chunks of positions, and on
packed rows, each against ``log Σ_v softmax(z)_v²`` of the model's plain full logits z (its
own ``forward``, padded) to 1e-5, tempered and truncated as the samples were drawn."""

from __future__ import annotations

import pytest
import torch

from alignzoo.batch import RolloutBatch
from alignzoo.kernels import forward
from alignzoo.kernels.forward import model_inputs, policy_forward, policy_outputs
from alignzoo.kernels.packing import Packing
from alignzoo.ops import warp_logits

from .test_packing import _batch, _model

TOLERANCE = {"atol": 1e-5, "rtol": 0.0}


def direct(model: torch.nn.Module, batch: RolloutBatch, truncate: bool = True) -> torch.Tensor:
    """log Σ_v p_v² ``[B, R]`` from the model's whole logits over the padded batch: the logits
    at positions P - 1 .. P + R - 2 (those that predict the response tokens), warped by the
    batch's sampling, then the sum over the vocabulary of the squared softmax."""
    prompt, response = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(**model_inputs(batch, "cpu")).logits[:, prompt - 1 : prompt + response - 1]
        probs = torch.softmax(warp_logits(logits.double(), batch.sampling, truncate), dim=-1)
        return torch.log((probs**2).sum(dim=-1)).float()


def sampled_batch(seed: int, top_k: int = 0) -> RolloutBatch:
    batch = _batch(seed=seed)
    temperatures = torch.tensor([0.7, 1.0, 1.3, 0.7, 1.0, 0.5])  # a row greedy-free mix
    batch.sampling = torch.stack(
        [temperatures, torch.full((batch.size,), float(top_k)), torch.ones(batch.size)], dim=1
    )
    return batch


def check(model: torch.nn.Module, batch: RolloutBatch, packing: Packing | None) -> None:
    """policy_outputs' log Σ_v p_v² equals the direct one on every response token, without
    gradients; its log-probs and entropy are policy_forward's and keep theirs."""
    expected = direct(model, batch)
    out = policy_outputs(
        model, batch, detached_entropy=True, packing=packing, log_sum_sq_probs=True
    )
    mask = batch.response_mask.bool()
    assert out.log_sum_sq_probs is not None and not out.log_sum_sq_probs.requires_grad
    got = out.log_sum_sq_probs
    torch.testing.assert_close(got[mask], expected[mask], **TOLERANCE)
    assert float(got[mask].max()) <= 1e-6  # Σ p² <= 1
    logprobs, entropy = policy_forward(model, batch, detached_entropy=True, packing=packing)
    torch.testing.assert_close(out.logprobs[mask], logprobs[mask], atol=1e-6, rtol=0)
    assert out.entropy is not None and entropy is not None
    torch.testing.assert_close(out.entropy[mask], entropy[mask], atol=1e-6, rtol=0)
    assert out.logprobs.requires_grad
    # Σ p² >= p(y)², so log Σ p² >= 2 log p(y): the same distribution as the log-probs'
    assert bool((got[mask] >= 2 * out.logprobs.detach()[mask] - 1e-5).all())


@pytest.mark.parametrize("kind", ["qwen2-lean", "qwen2-eager", "gpt2"])
@pytest.mark.parametrize("packing", [None, Packing(), Packing(length=1000)], ids=str)
@pytest.mark.parametrize("top_k", [0, 5])
def test_each_forward_path_gives_the_whole_logits_log_sum_sq_probs(
    kind: str, packing: Packing | None, top_k: int
) -> None:
    model = _model(kind).eval()
    check(model, sampled_batch(seed=3, top_k=top_k), packing)


@pytest.mark.parametrize("packing", [None, Packing()], ids=str)
def test_the_lm_head_in_chunks_gives_the_same_log_sum_sq_probs(
    monkeypatch: pytest.MonkeyPatch, packing: Packing | None
) -> None:
    """Past forward.LOGITS_AT_ONCE the lean path runs the head a few positions at a time
    (ops.head_token_outputs): log Σ_v p_v² from each chunk's logits, the temperature dividing
    the hidden states."""
    model = _model("qwen2-lean").eval()
    batch = sampled_batch(seed=4)
    calls: list[int] = []
    real = forward.head_token_outputs
    vocab = model.lm_head.weight.shape[0]
    monkeypatch.setattr(forward, "LOGITS_AT_ONCE", vocab * 4)  # 4 positions at a time
    monkeypatch.setattr(
        forward, "head_token_outputs", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    check(model, batch, packing)
    assert len(calls) == 2  # premise: policy_outputs and policy_forward each ran chunked


def test_it_is_computed_only_when_asked() -> None:
    model = _model("qwen2-lean").eval()
    out = policy_outputs(model, sampled_batch(seed=5))
    assert out.log_sum_sq_probs is None and out.entropy is None
