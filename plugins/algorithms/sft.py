"""Supervised fine-tuning: maximum likelihood of demonstrated completions (the first stage of
the post-training pipeline, and TRL's SFTTrainer with its completion-only loss).

On prompt / completion rows (the ``demonstrations`` data mode, read offline), the loss is the
negative log-likelihood of the completion's tokens given the prompt and the tokens before them:

    L = -1/N sum_i sum_t log pi(y_{i,t} | x_i, y_{i,<t})        (maximum likelihood, token mean)

with N the completion tokens of the optimizer step (``loss_aggregation: token-mean``, TRL's;
``seq-mean-token-mean`` averages each completion first). The prompt is context only: its tokens
carry no loss. Nothing is sampled and no labeler is called for training; the arm is evaluated
as every arm is, so an A/B puts SFT in the same table as RL. With ``seq_kd`` the completions
are the teacher's own samples of the step's prompts (sequence-level knowledge distillation,
Kim & Rush 2016): the same loss on what the teacher writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.plugin import Algorithm, hookimpl
from alignzoo.types import (
    AggregationParams,
    AlgorithmRequirements,
    LossAggregation,
    LossContext,
    LossOutput,
)

if TYPE_CHECKING:
    from alignzoo.batch import PolicyOutputs, RolloutBatch

ops = lazy_import("alignzoo.ops")


class SFTParams(AggregationParams):
    """Parameters of supervised fine-tuning; defaults follow TRL's SFTTrainer."""

    model_config = ConfigDict(extra="forbid")

    loss_aggregation: LossAggregation = Field(
        "token-mean",
        description="how per-token losses are reduced: TRL's token mean over the step's "
        "completion tokens, or seq-mean-token-mean (each completion weighs the same)",
    )
    seq_kd: bool = Field(
        False,
        description="sequence-level distillation: train on the teacher's own samples of each "
        "step's prompts (model.teacher, at training.sampling) instead of the rows' completions "
        "(Kim & Rush 2016; TRL GKD's seq_kd)",
    )


class SFT(Algorithm):
    """Supervised fine-tuning: the negative log-likelihood of demonstrated completions."""

    Params = SFTParams
    params: SFTParams

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        seq_kd = self.params.seq_kd
        return AlgorithmRequirements(
            data="demonstrations",
            weights=True,
            teacher=seq_kd,
            teacher_completions=seq_kd,
            teacher_logprobs=False,  # the teacher writes; its scores are not read
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return batch  # maximum likelihood has no advantages: every demonstrated token counts

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        mask = batch.response_mask
        nll = -ops.upcast(outputs.logprobs)  # -log pi(y_t | x, y_<t)  (maximum likelihood)
        loss = ops.aggregate_loss(
            ops.weight_samples(nll, batch.weights),
            mask,
            self.params.loss_aggregation,
            norm_constant=self.params.norm_constant,
            context=context,
        )
        metrics = {
            "sft/nll": float(ops.masked_mean(nll.detach(), mask)),
            "sft/completion_tokens": float(mask.sum()),
        }
        return LossOutput(loss, metrics)
