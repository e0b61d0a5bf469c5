"""Shared helpers of the preference-algorithm tests (DPO, SimPO, KTO)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.plugin import Algorithm
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch
from alignzoo.types import LossOutput


def neg_log_sigmoid(x: float) -> float:
    """-log σ(x) = log(1 + e^(-x)), written out for hand-computed expectations."""
    return math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    """σ(x) = 1 / (1 + e^(-x))."""
    return 1.0 / (1.0 + math.exp(-x))


def run_loss(algorithm: Algorithm, batch: RolloutBatch, outputs: PolicyOutputs) -> LossOutput:
    """compute_advantages then compute_loss through a PluginManager holding only ``algorithm``."""
    pm = build_plugin_manager([algorithm])
    batch = pm.hook.compute_advantages(batch=batch)
    return pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())


def pair_batch(
    chosen: list[float],
    rejected: list[float],
    ref_chosen: list[float] | None = None,
    ref_rejected: list[float] | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[RolloutBatch, PolicyOutputs]:
    """Pairs of one-token responses whose sequence log-probs are the given numbers.

    Rows are ordered rejected-first ([r0, c0, r1, c1, ...]) with group ids 10, 11, ...
    """
    logps, refs, labels, groups = [], [], [], []
    ref_chosen = ref_chosen or [0.0] * len(chosen)
    ref_rejected = ref_rejected or [0.0] * len(rejected)
    for i, (c, r, rc, rr) in enumerate(
        zip(chosen, rejected, ref_chosen, ref_rejected, strict=True)
    ):
        logps += [[r], [c]]
        refs += [[rr], [rc]]
        labels += [0.0, 1.0]
        groups += [10 + i, 10 + i]
    return make_batch(logps, ref_logprobs=refs, labels=labels, group_ids=groups, dtype=dtype)


# --------------------------------------------------------------------------- optimisation check


@dataclass
class PreferenceProblem:
    """A fixed batch over a learnable logits table ``[prompts, R, V]`` (a tiny policy).

    Sample i answers prompt ``prompt_of[i]`` with ``response_ids[i]`` (right-padded by ``mask``).
    """

    prompt_of: list[int]
    response_ids: torch.Tensor
    mask: torch.Tensor
    group_ids: list[int]
    labels: list[float]
    vocab: int = 5

    def logprobs(self, table: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs ``[B, R]`` of the responses under the table."""
        logp = torch.log_softmax(table[self.prompt_of], dim=-1)
        return torch.gather(logp, -1, self.response_ids.unsqueeze(-1)).squeeze(-1)

    def mismatched(self, table: torch.Tensor) -> torch.Tensor:
        """Sequence log-probs ``[B]`` of prompt i with sample (i+1)'s response."""
        shift = [(i + 1) % len(self.prompt_of) for i in range(len(self.prompt_of))]
        logp = torch.log_softmax(table[self.prompt_of], dim=-1)
        tokens = self.response_ids[shift]
        per_token = torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)
        return (per_token * self.mask[shift]).sum(-1)

    def sequence_logps(self, table: torch.Tensor) -> torch.Tensor:
        return (self.logprobs(table) * self.mask).sum(-1)


def default_problem() -> PreferenceProblem:
    """Two prompts, each with a chosen and a rejected response (different lengths, shuffled)."""
    response_ids = torch.tensor([[1, 2, 3], [4, 4, 0], [0, 1, 0], [2, 3, 4]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return PreferenceProblem(
        prompt_of=[0, 1, 0, 1],
        response_ids=response_ids,
        mask=mask,
        group_ids=[0, 1, 0, 1],
        labels=[1.0, 0.0, 0.0, 1.0],
    )


def train(
    algorithm: Algorithm, problem: PreferenceProblem, steps: int = 40, lr: float = 0.1
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Optimise the table with the algorithm's loss; returns (losses, initial and final seq logps)."""
    torch.manual_seed(0)
    table = torch.nn.Parameter(0.01 * torch.randn(2, problem.response_ids.shape[1], problem.vocab))
    with torch.no_grad():
        ref_logprobs = problem.logprobs(table).clone()
        ref_mismatched = problem.mismatched(table).clone()
        initial = problem.sequence_logps(table).clone()
    optimiser = torch.optim.Adam([table], lr=lr)
    losses = []
    for _ in range(steps):
        batch, _ = make_batch(
            ref_logprobs,
            mask=problem.mask,
            group_ids=problem.group_ids,
            labels=problem.labels,
            ref_logprobs=ref_logprobs,
            mismatched_ref_logprobs=ref_mismatched,
            response_ids=problem.response_ids,
        )
        with torch.no_grad():  # the behaviour snapshot, as the unpaired data mode computes it
            batch.columns["mismatched_logprobs"] = problem.mismatched(table)
        outputs = PolicyOutputs(logprobs=problem.logprobs(table))
        result = run_loss(algorithm, batch, outputs)
        optimiser.zero_grad()
        result.loss.backward()
        optimiser.step()
        losses.append(result.loss.item())
    with torch.no_grad():
        final = problem.sequence_logps(table)
    return losses, initial, final
