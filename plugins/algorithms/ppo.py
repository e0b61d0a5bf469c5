"""PPO for language models (Schulman et al. 2017; Ouyang et al. 2022, "InstructGPT").

The response is an episode: each token is an action, the labeler's score is the reward at the
last token and, when ``kl_in_reward``, every token is also penalised by ``kl_coef * KL_t`` to the
reference policy (Ouyang et al. 2022, eq. 2; Ziegler et al. 2019). A critic gives per-token
values; advantages come from GAE(gamma, lambda) (Schulman et al. 2016). The loss is

    L = L_clip + vf_coef * L_vf - entropy_coef * H + kl_loss_coef * KL

with the clipped surrogate (PPO eq. 7), optionally dual-clipped for negative advantages
(Ye et al. 2020), a clipped value loss, and KL either in the reward (fixed coefficient or the
adaptive controller of Ziegler et al. 2019, section 2.2) or as a loss term (k1, k2 or k3 estimator).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
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


class PPOParams(AggregationParams):
    """Parameters of PPO; defaults follow Ouyang et al. 2022 and Ziegler et al. 2019."""

    model_config = ConfigDict(extra="forbid")

    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount factor of GAE")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="lambda of GAE")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="clip range of the ratio")
    dual_clip: float | None = Field(
        None, gt=1.0, description="dual-clip constant c > 1 for A < 0 (Ye et al. 2020); None: off"
    )
    cliprange_value: float | None = Field(
        0.2, gt=0.0, description="value clipping around the rollout values; None: no clipping"
    )
    vf_coef: float = Field(0.1, ge=0.0, description="weight of the value loss")
    entropy_coef: float = Field(0.0, ge=0.0, description="weight of the entropy bonus")
    kl_in_reward: bool = Field(True, description="penalise the per-token reward by kl_coef * KL")
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed kl_coef, or the adaptive controller of Ziegler et al. 2019"
    )
    kl_coef: float = Field(0.02, ge=0.0, description="KL coefficient in the reward (fixed)")
    init_kl_coef: float = Field(0.2, ge=0.0, description="initial KL coefficient (adaptive)")
    kl_target: float = Field(6.0, gt=0.0, description="target KL in nats per sequence (adaptive)")
    horizon: int = Field(10000, gt=0, description="samples over which the coefficient adapts")
    kl_loss_coef: float = Field(0.0, ge=0.0, description="weight of a KL term in the loss")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="per-token KL estimator, in the reward and in the loss"
    )
    whiten_advantages: bool = Field(True, description="normalise advantages over the batch")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="how per-token losses are reduced (see ops.aggregate_loss)"
    )

    @model_validator(mode="after")
    def _adaptive_needs_reward_kl(self) -> PPOParams:
        if self.kl_controller == "adaptive" and not self.kl_in_reward:
            raise ValueError("kl_controller 'adaptive' adapts the reward's KL: set kl_in_reward")
        return self


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["kl_coef"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient towards a target (Ziegler et al. 2019, sec. 2.2).

    ``e = clip(KL / KL_target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n / horizon)``,
    with ``n`` the number of samples seen since the last update.
    """

    def __init__(self, init_kl_coef: float, kl_target: float, horizon: int) -> None:
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(
            max(current_kl / self.target - 1.0, -0.2), 0.2
        )  # e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon  # beta_{t+1} = beta_t (1 + K_beta e_t)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["kl_coef"])


# --------------------------------------------------------------------------- pure functions


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``[B, R]`` and where the clipped term is the larger one.

    L_vf = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)   (value clipping of OpenAI baselines' PPO)
    """
    mask_b = mask.bool()
    values = torch.where(mask_b, values, 0.0)
    old_values = torch.where(mask_b, old_values, 0.0)
    returns = torch.where(mask_b, returns, 0.0)
    unclipped = (values - returns).square()
    if cliprange_value is None:
        return 0.5 * unclipped, torch.zeros_like(mask_b)
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped) & mask_b


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens (1 is a perfect critic)."""
    values, returns = values.detach().float(), returns.detach().float()
    var_returns = ops.masked_var(returns, mask)
    var_residual = ops.masked_var(returns - values, mask)
    return float(1.0 - var_residual / var_returns.clamp(min=1e-8))


def ppo_loss(
    batch: RolloutBatch,
    outputs: PolicyOutputs,
    params: PPOParams,
    context: LossContext | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss of one micro-batch and its metrics (everything but ``ppo/kl_coef``).

    Every term is aggregated over the optimizer step's counts in ``context`` (this batch's own
    without it); the reported losses are this micro-batch's own means.
    """
    mask = batch.response_mask
    mask_b = mask.bool()
    assert batch.old_logprobs is not None and batch.advantages is not None

    def aggregate(mat: torch.Tensor, ctx: LossContext | None = context) -> torch.Tensor:
        weighted = ops.weight_samples(mat, batch.weights)
        return ops.aggregate_loss(
            weighted, mask, params.loss_aggregation, params.norm_constant, ctx
        )

    logprobs = torch.where(mask_b, outputs.logprobs, 0.0)
    log_ratio = logprobs - torch.where(mask_b, batch.old_logprobs, 0.0)
    advantages = torch.where(mask_b, batch.advantages, 0.0)
    pg_mat, clipped_low, clipped_high = ops.clipped_surrogate(
        log_ratio, advantages, params.clip_eps, params.clip_eps, params.dual_clip
    )  # L_clip  (Schulman 2017, eq. 7; dual clip: Ye et al. 2020)
    pg_mat = ops.weight_tokens(pg_mat, batch.rollout_is_weights)  # TIS (rollout_correction)
    loss = aggregate(pg_mat)
    metrics: dict[str, Any] = {"actor/pg_loss": aggregate(pg_mat.detach(), None)}
    metrics.update(ops.clip_fractions(clipped_low, clipped_high, mask))
    metrics["actor/approx_kl"] = ops.approx_kl(outputs.logprobs, batch.old_logprobs, mask)

    if outputs.values is None or batch.returns is None or batch.values is None:
        raise UserError(
            "ppo: compute_loss needs outputs.values (critic), batch.values and batch.returns"
        )
    vf_mat, vf_clipped = value_loss(
        outputs.values, batch.values, batch.returns, mask, params.cliprange_value
    )
    loss = loss + params.vf_coef * aggregate(vf_mat)  # + c1 * L_vf  (Schulman 2017, eq. 9)
    metrics["critic/vf_loss"] = aggregate(vf_mat.detach(), None)
    metrics["critic/vf_clipfrac"] = ops.masked_mean(vf_clipped.float(), mask)
    metrics["critic/explained_variance"] = explained_variance(outputs.values, batch.returns, mask)

    if outputs.entropy is not None:
        entropy = torch.where(mask_b, outputs.entropy, 0.0)
        if params.entropy_coef > 0:
            loss = loss - params.entropy_coef * aggregate(entropy)  # - c2 S[pi]  (PPO eq. 9)

    if batch.ref_logprobs is not None:
        kl_mat = ops.masked_kl_penalty(
            outputs.logprobs, batch.ref_logprobs, mask, params.kl_estimator
        )
        if params.kl_loss_coef > 0:
            loss = loss + params.kl_loss_coef * aggregate(kl_mat)
            metrics["actor/kl_loss"] = aggregate(kl_mat.detach(), None)
        metrics["ppo/kl_penalty"] = ops.masked_mean(kl_mat.detach(), mask)
    return loss, {name: float(value) for name, value in metrics.items()}


# --------------------------------------------------------------------------- plugin


class PPO(Algorithm):
    """PPO (Schulman et al. 2017) with a critic, GAE and KL to the reference (InstructGPT style)."""

    Params = PPOParams
    params: PPOParams
    watched_metrics = ("actor/clipfrac", "critic/vf_loss")

    def __init__(self, params: PPOParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.kl_ctl: FixedKLController | AdaptiveKLController
        if p.kl_controller == "adaptive":
            self.kl_ctl = AdaptiveKLController(p.init_kl_coef, p.kl_target, p.horizon)
        else:
            self.kl_ctl = FixedKLController(p.kl_coef if p.kl_in_reward else 0.0)

    def state_dict(self) -> dict[str, Any]:
        """The KL controller's state (for checkpoints)."""
        return {"kl_controller": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.kl_ctl.load_state_dict(state["kl_controller"])

    @hookimpl
    def algorithm_requirements(self) -> AlgorithmRequirements:
        reference = self.kl_ctl.value > 0 or self.params.kl_loss_coef > 0
        return AlgorithmRequirements(
            reference=reference,
            critic=True,
            data="online",
            old_logprobs_in_advantages=True,
            rollout_correction=True,
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        p = self.params
        for name in ("scores", "values", "old_logprobs"):
            if getattr(batch, name) is None:
                raise UserError(f"ppo: compute_advantages needs batch.{name}, which is missing")
        assert batch.scores is not None and batch.values is not None
        assert batch.old_logprobs is not None
        mask = batch.response_mask
        kl = None
        if p.kl_in_reward and self.kl_ctl.value > 0:
            if batch.ref_logprobs is None:
                raise UserError("ppo: a KL penalty in the reward needs batch.ref_logprobs")
            kl = ops.masked_kl_penalty(
                batch.old_logprobs, batch.ref_logprobs, mask, p.kl_estimator
            )  # KL_t of the sampled tokens to the reference
        # R(x, y) = r(x, y) - beta * log(pi(y|x) / pi_ref(y|x))   (Ouyang et al. 2022, eq. 2)
        batch.token_rewards = ops.token_level_rewards(batch.scores, mask, kl, self.kl_ctl.value)
        advantages, returns = ops.gae(batch.token_rewards, batch.values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = ops.masked_whiten(advantages, mask)
        batch.advantages, batch.returns = advantages, returns
        if kl is not None:  # observed KL per sequence, then adapt (Ziegler et al. 2019, sec. 2.2)
            observed = ops.global_mean(ops.masked_sum(kl, mask, dim=-1))
            self.kl_ctl.update(float(observed), n_steps=batch.size)
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError("ppo: compute_loss needs batch.advantages and batch.old_logprobs")
        if self.params.kl_loss_coef > 0 and batch.ref_logprobs is None:
            raise UserError("ppo: kl_loss_coef > 0 needs batch.ref_logprobs")
        loss, metrics = ppo_loss(batch, outputs, self.params, context)
        metrics["ppo/kl_coef"] = self.kl_ctl.value
        return LossOutput(loss, metrics)
