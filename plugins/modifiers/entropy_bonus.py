"""Entropy bonus: a modifier that wraps any algorithm's ``compute_loss`` hook.

    L' = L - coef * mean_t H[pi(. | x, y_<t)]

where the mean runs over the response tokens of the optimizer step (Williams & Peng 1991;
Mnih et al. 2016, A3C). Adding it to an arm turns "GRPO" into "GRPO + entropy bonus" without
editing GRPO. ``coef`` is TRL GRPOConfig's ``entropy_coef``.

When the algorithm keeps its policy term to the highest-entropy tokens
(``top_entropy_quantile``, ``LossOutput.entropy_mask``), the bonus acts on those tokens only, as
TRL's: then it is the mean over each micro-batch's kept tokens, divided by the step's
micro-batches and, under data parallelism, by the number of ranks (the mean of the ranks' means,
as TRL's averaged gradients give). The off-policy mask does not restrict it (TRL's neither).

Adaptive coefficient (Skywork-OR1, He et al. 2025; TRL's
``use_adaptive_entropy``): after each optimizer step the coefficient moves by
``entropy_coef_delta``, up when the step's mean entropy H (over the tokens the bonus acts on,
every micro-batch and rank) is at or below ``entropy_target`` and down otherwise, within
``[entropy_coef_min, entropy_coef_max]``; the bonus applies only while the last optimizer
step's H was at or below the target:

    c_{k+1} = clip(c_k + delta * sign(H* - H_k), c_min, c_max)     applied: c_k * 1[H_{k-1} <= H*]

(the first optimizer step, with no H yet, applies none). With the controller on, the
coefficient and the last H are saved in checkpoints and restored on resume; without it the
modifier keeps no state, and a resumed run takes ``coef`` from its configuration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo import distributed
from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.plugin import Modifier, hookimpl

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.types import LossContext, LossOutput

torch = lazy_import("torch")
ops = lazy_import("alignzoo.ops")


class EntropyBonusParams(BaseModel):
    """Parameters of the entropy bonus; the adaptive controller's take TRL 1.16's names and
    defaults."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(
        0.01,
        description="weight of the mean token entropy subtracted from the loss (TRL's "
        "entropy_coef); with use_adaptive_entropy, the controller's first coefficient",
    )
    use_adaptive_entropy: bool = Field(
        False,
        description="adapt coef after each optimizer step (Skywork-OR1): up by "
        "entropy_coef_delta while the step's mean entropy is at or below entropy_target, down "
        "otherwise; the bonus applies only while the last step's entropy was at or below it",
    )
    entropy_target: float = Field(
        0.2,
        ge=0.0,
        description="adaptive: the mean token entropy (nats) below which the bonus engages, over "
        "the tokens the bonus acts on; set it near the entropy the policy starts at",
    )
    entropy_coef_min: float = Field(0.0, ge=0.0, description="adaptive: the coefficient's floor")
    entropy_coef_max: float = Field(1.0, ge=0.0, description="adaptive: the coefficient's cap")
    entropy_coef_delta: float = Field(
        0.005, ge=0.0, description="adaptive: the coefficient's change per optimizer step"
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> EntropyBonusParams:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min:g}) must not exceed "
                f"entropy_coef_max ({self.entropy_coef_max:g})"
            )
        if self.use_adaptive_entropy and not (
            self.entropy_coef_min <= self.coef <= self.entropy_coef_max
        ):
            raise ValueError(
                f"coef ({self.coef:g}) is the adaptive controller's first coefficient: it must "
                f"lie within [entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min:g}, "
                f"{self.entropy_coef_max:g}]"
            )
        return self


class EntropyBonus(Modifier):
    """Subtract coef * mean token entropy from any algorithm's loss (encourages exploration)."""

    Params = EntropyBonusParams
    params: EntropyBonusParams

    def __init__(self, params: EntropyBonusParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self.coef = float(self.params.coef)  # the adaptive controller moves it
        self.last_entropy = math.inf  # H of the last optimizer step (none yet)
        self._window: list[float] = [0.0, 0.0]  # entropy sum, tokens: this optimizer step's
        self._calls = 0  # micro-batches seen in this optimizer step

    def state_dict(self) -> dict[str, Any]:
        """The adaptive controller's state (saved between steps, when no window is open);
        empty without the controller."""
        if not self.params.use_adaptive_entropy:
            return {}
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.params.use_adaptive_entropy and state:
            self.coef = float(state["coef"])
            self.last_entropy = float(state["last_entropy"])
        self._window, self._calls = [0.0, 0.0], 0

    @hookimpl(wrapper=True)
    def algorithm_requirements(self) -> Generator[None, Any, Any]:
        # The bonus needs the entropy with gradients, whatever the algorithm asked for.
        requirements = yield
        return dataclasses.replace(requirements, entropy=True)

    def applied_coef(self) -> float:
        """The coefficient this optimizer step's micro-batches apply."""
        if not self.params.use_adaptive_entropy:
            return self.coef
        return self.coef if self.last_entropy <= self.params.entropy_target else 0.0

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
        mask = batch.response_mask
        if result.entropy_mask is not None:  # the tokens the entropy quantile kept (TRL's)
            mask = mask * result.entropy_mask.to(mask.device, mask.dtype)
            count = mask.sum().clamp(min=1.0)
            shares = max(context.micro_batches, 1) * distributed.world_size()
            entropy = (outputs.entropy * mask).sum() / count / shares
        else:  # the token mean over the optimizer step (this micro-batch's share), like the loss
            entropy = ops.aggregate_loss(outputs.entropy, mask, "token-mean", None, context)
        coef = self.applied_coef()
        result.loss = result.loss - coef * entropy
        result.metrics["entropy_bonus"] = float(
            coef * ops.masked_mean(outputs.entropy.detach(), mask)
        )
        if self.params.use_adaptive_entropy:
            result.metrics["entropy_bonus/coef"] = coef
            self._observe(outputs.entropy.detach(), mask, context)
        return result

    def _observe(self, entropy: torch.Tensor, mask: torch.Tensor, context: LossContext) -> None:
        """Add a micro-batch to the optimizer step's window; after its last one, move the
        coefficient from the step's mean entropy over every rank."""
        self._window[0] += float((entropy * mask).sum())
        self._window[1] += float(mask.sum())
        self._calls += 1
        if self._calls < max(context.micro_batches, 1):
            return
        total = torch.tensor(self._window, dtype=torch.float64, device=entropy.device)
        total = distributed.all_sum(total)  # the collective backend's device (NCCL: the GPU)
        step_entropy = float(total[0] / total[1].clamp(min=1.0))
        p = self.params
        if step_entropy <= p.entropy_target:  # c + delta when H <= H*, else c - delta
            self.coef = min(self.coef + p.entropy_coef_delta, p.entropy_coef_max)
        else:
            self.coef = max(self.coef - p.entropy_coef_delta, p.entropy_coef_min)
        self.last_entropy = step_entropy
        self._window, self._calls = [0.0, 0.0], 0
