"""Entropy bonus: a modifier that wraps any algorithm's ``compute_loss`` hook.

    L' = L - coef * mean_t H[pi(. | x, y_<t)]

where the mean runs over the response tokens of the micro-batch (Williams & Peng 1991;
Mnih et al. 2016, A3C). Adding it to an arm turns "GRPO" into "GRPO + entropy bonus" without
editing GRPO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Modifier, hookimpl

if TYPE_CHECKING:
    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.types import LossContext, LossOutput

ops = lazy_import("alignzoo.ops")


class EntropyBonusParams(BaseModel):
    """Parameters of the entropy bonus."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(
        0.01, description="weight of the mean token entropy subtracted from the loss"
    )


class EntropyBonus(Modifier):
    """Subtract coef * mean token entropy from any algorithm's loss (encourages exploration)."""

    Params = EntropyBonusParams
    params: EntropyBonusParams

    @hookimpl(wrapper=True)
    def algorithm_requirements(self) -> Generator[None, Any, Any]:
        # The bonus needs the entropy with gradients, whatever the algorithm asked for.
        requirements = yield
        return dataclasses.replace(requirements, entropy=True)

    @hookimpl(wrapper=True)
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> Generator[None, Any, LossOutput]:
        result: LossOutput = yield
        if outputs.entropy is None:
            raise UserError(
                "modifier entropy_bonus: outputs.entropy is missing; the algorithm's requirements "
                "must keep entropy=True"
            )
        # the token mean over the optimizer step (this micro-batch's share), like the loss
        entropy = ops.aggregate_loss(
            outputs.entropy, batch.response_mask, "token-mean", None, context
        )
        bonus = self.params.coef * entropy
        result.loss = result.loss - bonus
        result.metrics["entropy_bonus"] = float(
            self.params.coef * ops.masked_mean(outputs.entropy.detach(), batch.response_mask)
        )
        return result
