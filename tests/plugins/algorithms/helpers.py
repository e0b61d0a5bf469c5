"""Shared helpers for the online RL algorithm tests: batch builders and a tiny trainable policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from alignzoo import testing
from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.plugin import Algorithm


def make_batch(
    mask: torch.Tensor | Sequence[Sequence[float]],
    *,
    response_ids: torch.Tensor | None = None,
    **fields: object,
) -> RolloutBatch:
    """A RolloutBatch of B samples from its response mask (the public builder,
    :func:`alignzoo.testing.make_batch`, with placeholder policy log-probs); every other field
    (scores, group_ids, old_logprobs, ref_logprobs, values, advantages, returns, weights) is
    passed on, and unspecified ones stay None."""
    mask_t = torch.as_tensor(mask, dtype=torch.float32)
    if response_ids is None:
        response_ids = torch.zeros(mask_t.shape, dtype=torch.long)
    batch, _ = testing.make_batch(
        torch.zeros(mask_t.shape),
        mask=mask_t,
        response_ids=response_ids,
        requires_grad=False,
        **fields,  # type: ignore[arg-type]
    )
    return batch


def right_padded_mask(lengths: Sequence[int], width: int | None = None) -> torch.Tensor:
    """``[B, R]`` float mask with ``lengths[i]`` leading ones in row i."""
    width = max(lengths) if width is None else width
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


@st.composite
def any_masks(draw: st.DrawFn, max_b: int = 4, max_r: int = 6) -> torch.Tensor:
    """Arbitrary 0/1 masks ``[B, R]`` (holes, empty rows and all)."""
    b = draw(st.integers(1, max_b))
    r = draw(st.integers(1, max_r))
    bits = draw(st.lists(st.booleans(), min_size=b * r, max_size=b * r))
    return torch.tensor(bits, dtype=torch.float32).reshape(b, r)


@st.composite
def padded_masks(draw: st.DrawFn, max_b: int = 4, max_r: int = 6) -> torch.Tensor:
    """Right-padded masks ``[B, R]`` with at least one real token per row."""
    b = draw(st.integers(1, max_b))
    r = draw(st.integers(1, max_r))
    lengths = draw(st.lists(st.integers(1, r), min_size=b, max_size=b))
    return right_padded_mask(lengths, r)


def floats_tensor(draw: st.DrawFn, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    """A float32 tensor of ``shape`` with entries drawn in [lo, hi]."""
    n = 1
    for dim in shape:
        n *= dim
    values = draw(
        st.lists(
            st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=32),
            min_size=n,
            max_size=n,
        )
    )
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


# --------------------------------------------------------------------------- a tiny policy


class TinyPolicy(torch.nn.Module):
    """A position-wise logits table ``[R, V]`` (the policy) and value table ``[R, V]`` (critic).

    The log-prob of token ``y_t`` is ``log_softmax(logits[t])[y_t]``: samples that share a
    position compete for the same distribution, so training must raise the high-reward tokens
    at the expense of the low-reward ones.
    """

    def __init__(self, length: int, vocab: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(0.1 * torch.randn(length, vocab, generator=gen))
        self.value_table = torch.nn.Parameter(torch.zeros(length, vocab))

    def forward(self, response_ids: torch.Tensor) -> PolicyOutputs:
        logp_all = torch.log_softmax(self.logits, dim=-1).expand(response_ids.shape[0], -1, -1)
        logprobs = torch.gather(logp_all, -1, response_ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        values = torch.gather(
            self.value_table.expand(response_ids.shape[0], -1, -1), -1, response_ids.unsqueeze(-1)
        ).squeeze(-1)
        return PolicyOutputs(logprobs=logprobs, entropy=entropy, values=values)


@dataclass
class TrainingResult:
    """Losses and log-probs before and after training on a fixed batch."""

    first_loss: float
    last_loss: float
    logprobs_before: torch.Tensor
    logprobs_after: torch.Tensor


def online_batch(policy: TinyPolicy, response_ids: torch.Tensor, mask: torch.Tensor, **kw):
    """A batch sampled 'by' ``policy``: old/ref log-probs and values from its current weights."""
    with torch.no_grad():
        out = policy(response_ids)
    return make_batch(
        mask,
        response_ids=response_ids,
        old_logprobs=out.logprobs.clone(),
        ref_logprobs=out.logprobs.clone(),
        values=out.values.clone(),
        **kw,
    )


def train_on_fixed_batch(
    algorithm: Algorithm,
    policy: TinyPolicy,
    batch: RolloutBatch,
    steps: int = 30,
    lr: float = 0.1,
) -> TrainingResult:
    """compute_advantages once, then ``steps`` Adam steps on compute_loss over the same batch."""
    batch = algorithm.compute_advantages(batch)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    losses = []
    with torch.no_grad():
        before = policy(batch.response_ids).logprobs.clone()
    for _ in range(steps):
        out = algorithm.compute_loss(batch, policy(batch.response_ids), batch.loss_context())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
    with torch.no_grad():
        after = policy(batch.response_ids).logprobs.clone()
        final = float(
            algorithm.compute_loss(batch, policy(batch.response_ids), batch.loss_context()).loss
        )
    return TrainingResult(losses[0], final, before, after)


def contrast_batch_ids(length: int = 4) -> torch.Tensor:
    """Four responses over vocab 4: two use token 1 everywhere, two use token 2 everywhere."""
    return torch.tensor([[1] * length, [2] * length, [1] * length, [2] * length])
