"""Generalized knowledge distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"; TRL's GKDTrainer).

The student pi learns the teacher pi_T's whole next-token distribution at every completion
position, by the generalized Jensen-Shannon divergence (the paper's eq. 1):

    M = beta * pi_T + (1 - beta) * pi                                   (the mixture)
    JSD_beta(pi_T || pi) = beta * KL(pi_T || M) + (1 - beta) * KL(pi || M)

summed over the vocabulary at each position; beta = 0 is the forward KL(pi_T || pi) and
beta = 1 the reverse KL(pi || pi_T), taken directly (the mixture would be one of the two):

    L = 1/N sum_{i,t} D_beta(pi_T(. | x_i, y_{i,<t}) || pi(. | x_i, y_{i,<t}))

with N the completion tokens of the optimizer step (TRL's ``batchmean`` over completion tokens,
normalised over the whole step as its ``num_items_in_batch`` is). The distributions are the
models' own, at temperature 1, as TRL's loss takes them; ``training.sampling`` only shapes the
samples.

The data are the paper's mixture: with probability lambda a step trains on the student's own
responses to the step's prompts (on-policy, sampled at ``training.sampling``), otherwise on the
demonstrations' completions (the ``demonstrations`` data mode; ``batch/on_policy`` says which),
or with ``seq_kd`` on the teacher's own samples of the step's prompts.
lambda = 1 with beta = 1 is on-policy distillation with the reverse KL over the whole
vocabulary (``opd`` takes the same KL from the sampled tokens only).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import RunError
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.types import (
    AggregationParams,
    AlgorithmRequirements,
    LossAggregation,
    LossContext,
    LossOutput,
)

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch

torch = lazy_import("torch")
ops = lazy_import("alignzoo.ops")


class GKDParams(AggregationParams):
    """Parameters of GKD; names and defaults are TRL's GKDConfig's."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the JSD's interpolation: 0 is the forward KL(teacher || student), 1 the "
        "reverse KL(student || teacher), between them the generalized JSD",
    )
    lmbda: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="lambda: the share of steps trained on the student's own samples (the rest "
        "on the demonstrations' completions)",
    )
    loss_aggregation: LossAggregation = Field(
        "token-mean",
        description="how per-token divergences are reduced: TRL's mean over the step's "
        "completion tokens, or seq-mean-token-mean",
    )
    seq_kd: bool = Field(
        False,
        description="the steps not sampled by the student train on the teacher's own samples "
        "of their prompts instead of the demonstrations' completions (TRL's seq_kd)",
    )


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per position ``[...]``: D_beta(pi_T || pi) summed over the vocabulary (last dim)."""
    student = torch.log_softmax(ops.upcast(student_logits), dim=-1)
    teacher = torch.log_softmax(ops.upcast(teacher_logits), dim=-1)
    if beta == 0.0:  # KL(pi_T || pi)   (forward)
        return (teacher.exp() * (teacher - student)).sum(dim=-1)
    if beta == 1.0:  # KL(pi || pi_T)   (reverse)
        return (student.exp() * (student - teacher)).sum(dim=-1)
    # log M = logsumexp(log(1 - beta) + log pi, log beta + log pi_T)   (the mixture)
    mixture = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    kl_teacher = (teacher.exp() * (teacher - mixture)).sum(dim=-1)  # KL(pi_T || M)
    kl_student = (student.exp() * (student - mixture)).sum(dim=-1)  # KL(pi || M)
    return beta * kl_teacher + (1.0 - beta) * kl_student  # JSD_beta (eq. 1)


class GKD(Algorithm):
    """Generalized knowledge distillation: the generalized JSD to the teacher's distribution, on
    a lambda-mixture of the student's samples and demonstrations."""

    Params = GKDParams
    params: GKDParams

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return AlgorithmRequirements(
            data="demonstrations",
            weights=True,
            teacher=True,
            teacher_logits=True,
            teacher_logprobs=False,  # its logits give them: no separate scoring pass
            on_policy_fraction=self.params.lmbda,
            teacher_completions=self.params.seq_kd,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return batch  # a divergence to the teacher at every position: nothing to credit

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if outputs.logits is None or outputs.teacher_logits is None:
            raise RunError("gkd needs the policy's and the teacher's logits (teacher_logits)")
        mask = batch.response_mask
        # One tokenizer, two heads: a head padded to another width (Qwen2.5-7B's 152,064 rows
        # against 0.5B's 151,936) has rows no token reaches; both are read on the shared ones.
        width = min(outputs.logits.shape[-1], outputs.teacher_logits.shape[-1])
        divergence = generalized_jsd(
            outputs.logits[..., :width], outputs.teacher_logits[..., :width], self.params.beta
        )
        loss = ops.aggregate_loss(
            ops.weight_samples(divergence, batch.weights),
            mask,
            self.params.loss_aggregation,
            norm_constant=self.params.norm_constant,
            context=context,
        )
        metrics = {"gkd/jsd": float(ops.masked_mean(divergence.detach(), mask))}
        teacher = torch.log_softmax(ops.upcast(outputs.teacher_logits[..., :width]), dim=-1)
        ids = batch.response_ids.to(teacher.device).clamp(max=width - 1).unsqueeze(-1)
        metrics["gkd/teacher_logprob"] = float(
            ops.masked_mean(teacher.gather(-1, ids)[..., 0], mask)
        )
        return LossOutput(loss, metrics)
