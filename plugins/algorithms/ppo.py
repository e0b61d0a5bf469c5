"""PPO for language models (Schulman et al. 2017; Ouyang et al. 2022, "InstructGPT").

The response is an episode: each token is an action, the labeler's score is the reward at the
last token and, when ``kl_in_reward``, every token is also penalised by ``kl_coef * KL_t`` to the
reference policy (Ouyang et al. 2022, eq. 2; Ziegler et al. 2019). A critic gives per-token
values; advantages come from GAE(gamma, lambda) (Schulman et al. 2016). The loss is

    L = L_clip + vf_coef * L_vf - entropy_coef * H + kl_loss_coef * KL

with the clipped surrogate (PPO eq. 7), optionally dual-clipped for negative advantages
(Ye et al. 2020), a clipped value loss, and KL either in the reward (fixed coefficient or the
adaptive controller of Ziegler et al. 2019, section 2.2) or as a loss term (k1, k2 or k3 estimator).

Dense rewards: when the labeler scores steps (``Score.steps``, a process reward model), each
step's score sits on the last token of its step (``batch.dense_rewards``) and
``dense_reward_coef`` times it is added to that token's reward before GAE, beside the
sequence score on the last token (PRIME's combination, Cui et al. 2025). Without step scores
the rewards, and so the whole update, are exactly those of sequence-level PPO.

The adaptive controller is the paper's proportional rule, counted in training steps:

    e_t = clip(KL_t / kl_target - 1, -0.2, 0.2)        beta_{t+1} = beta_t * (1 + e_t / H)

once per training step (one optimizer step with ``epochs: 1`` and one minibatch), with ``KL_t``
the step's measured KL of the sampled tokens to the reference (the reward's estimator, k1 by
default) in ``kl_target_unit``: per token (the mean over the step's response tokens) or per
sequence (the mean over responses of the sum over their tokens). ``H = kl_horizon_steps`` is
the time constant: a persistent error e multiplies beta by ``(1 + e/H)^H ~ e^e`` every H steps,
so at most by e^0.2 = 1.22 up or 0.82 down, and a factor of 2 takes about 3.5 H steps.

Choosing them. ``kl_target`` is the KL you accept per generated token (per response with
``kl_target_unit: sequence``, a number that grows with the response length). The default, 0.1
nats per token, is what PPO reaches by itself against the embedded world's 0/1 rule (0.1-0.2
per token with a fixed 0.02), so it barely constrains a sound reward, and it is a thirtieth of
where PPO against the embedded reward model ran away to (3 nats per token, exact match 0.5 ->
0.01). ``kl_horizon_steps`` H is how many steps the controller takes to react: well under the
run's length, yet several steps, since one step's KL is noisy (often half or twice its running
mean here) and each step moves beta by at most 0.2 / H. ``init_kl_coef`` is the penalty before
the controller has moved it, and beta falls at the maximum rate for the first steps while the
policy is still at the reference (KL 0), so start it near the value that holds the target: a
token's penalty ``beta * KL_t`` weighs against the spread of the scores, and a reward of larger
spread needs a proportionally larger beta (here beta settled near 0.2 for the 0/1 rule, score
std 0.5, and near 0.45 for the reward model, std 1.1-1.8). With the defaults (0.1 per token,
H 5, beta 0.3) the 10-step mean of ``kl/measured`` was within 0.5-1.5x the target over 77-100%
of steps 20-150 in both worlds (3 seeds each). Watch ``kl/coef``, ``kl/measured`` and
``kl/target``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from alignzoo._lazy import lazy_import
from alignzoo.algorithms.policy_term import (
    PolicyTermParams,
    batch_policy_mask,
    mask_truncated,
    truncation_metrics,
)
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


KL_TARGET = 0.1
"""Default ``kl_target``: nats per response token."""
KL_HORIZON_STEPS = 5
"""Default ``kl_horizon_steps``: at most 4% change of the coefficient per step, x2.2 in 20."""
INIT_KL_COEF = 0.3
"""Default ``init_kl_coef`` of the adaptive controller."""
KL_ERROR_CLIP = 0.2
"""The controller's error clip (Ziegler et al. 2019)."""


class PPOParams(AggregationParams, PolicyTermParams):
    """Parameters of PPO; defaults follow Ouyang et al. 2022 and Ziegler et al. 2019, those of the
    adaptive KL controller (its unit, target, horizon and initial value) were measured on the
    embedded world (see the module docstring). TRL's options on the policy term (``delta``,
    ``top_entropy_quantile``, ``off_policy_mask_threshold``, ``mask_truncated_completions``) are
    :class:`~alignzoo.algorithms.policy_term.PolicyTermParams`'s; a response masked as truncated
    trains neither the policy nor the critic."""

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
    init_kl_coef: float = Field(
        INIT_KL_COEF,
        ge=0.0,
        description="initial KL coefficient (adaptive, > 0); raise it for rewards of larger spread",
    )
    kl_target: float = Field(
        KL_TARGET,
        gt=0.0,
        description="target KL to the reference in nats per kl_target_unit (adaptive): the KL "
        "you accept per generated token (or per response)",
    )
    kl_target_unit: Literal["token", "sequence"] = Field(
        "token",
        description="unit of kl_target and kl/measured: 'token' (mean over the step's response "
        "tokens) or 'sequence' (mean over responses of their summed KL)",
    )
    kl_horizon_steps: int = Field(
        KL_HORIZON_STEPS,
        ge=1,
        description="time constant of the adaptive controller in training steps: a persistent "
        "error e changes the coefficient by (1 + e / H)^H ~ exp(e) every H steps",
    )
    kl_loss_coef: float = Field(0.0, ge=0.0, description="weight of a KL term in the loss")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="per-token KL estimator, in the reward and in the loss"
    )
    dense_reward_coef: float = Field(
        1.0,
        ge=0.0,
        description="weight of the labeler's step scores (batch.dense_rewards, a process reward "
        "model's) added to the per-token reward before GAE, each on the last token of its "
        "step; 0 ignores them. Without step scores nothing changes",
    )
    whiten_advantages: bool = Field(True, description="normalise advantages over the batch")
    loss_aggregation: LossAggregation = Field(
        "token-mean", description="how per-token losses are reduced (see ops.aggregate_loss)"
    )

    @model_validator(mode="before")
    @classmethod
    def _horizon_was_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "horizon" in data:
            raise ValueError(
                "ppo: 'horizon' (samples) was replaced by 'kl_horizon_steps' (training steps, "
                "the controller's time constant); horizon / (prompts_per_step * "
                "samples_per_prompt) gives the old rate, e.g. kl_horizon_steps: "
                f"{KL_HORIZON_STEPS}. kl_target is now per token unless kl_target_unit: sequence"
            )
        return data

    @model_validator(mode="after")
    def _adaptive_needs_reward_kl(self) -> PPOParams:
        if self.kl_controller == "adaptive" and not self.kl_in_reward:
            raise ValueError("kl_controller 'adaptive' adapts the reward's KL: set kl_in_reward")
        if self.kl_controller == "adaptive" and self.init_kl_coef <= 0:
            raise ValueError("kl_controller 'adaptive' multiplies init_kl_coef: it must be > 0")
        return self


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["kl_coef"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient towards a target (Ziegler et al. 2019, sec. 2.2).

    ``e = clip(KL / kl_target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n / horizon_steps)``
    with ``n`` the training steps since the last update (1: it updates once per step). The
    paper counts ``n`` and the horizon in samples; here both are in steps, so the time
    constant does not depend on the batch size: a persistent error ``e`` multiplies beta by
    ``(1 + e / H)^H`` over H steps. ``current_kl`` and ``kl_target`` are in the same unit
    (nats per token or per sequence, see :func:`measured_kl`).
    """

    def __init__(self, init_kl_coef: float, kl_target: float, horizon_steps: int) -> None:
        if init_kl_coef <= 0 or kl_target <= 0 or horizon_steps < 1:
            raise ValueError(
                "AdaptiveKLController needs init_kl_coef > 0, kl_target > 0, horizon_steps >= 1"
            )
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon_steps = int(horizon_steps)

    def error(self, current_kl: float) -> float:
        """e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)."""
        return min(max(current_kl / self.target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        # beta_{t+1} = beta_t (1 + K_beta e_t), K_beta = n / H
        self.value *= 1.0 + self.error(current_kl) * n_steps / self.horizon_steps

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["kl_coef"])


def measured_kl(
    kl: torch.Tensor, mask: torch.Tensor, unit: Literal["token", "sequence"]
) -> torch.Tensor:
    """The step's KL in the controller's unit, over every data-parallel rank (a scalar).

    ``kl`` is the per-token KL ``[B, R]`` of the sampled tokens (0 on padding). ``token``: the
    mean over all valid response tokens of the step, sum_{i,t} m_it KL_it / sum_{i,t} m_it;
    ``sequence``: the mean over responses of each response's summed KL.
    """
    if unit == "token":
        return ops.global_masked_mean(kl, mask)
    if unit == "sequence":
        return ops.global_mean(ops.masked_sum(kl, mask, dim=-1))
    raise ValueError(f"unknown KL unit {unit!r}: 'token' or 'sequence'")


# --------------------------------------------------------------------------- pure functions


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``[B, R]`` and where a clip decides it: the prediction
    lies outside the clip range (|V - V_old| > c) and the clipped term is the larger one.

    L_vf = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)   (value clipping of OpenAI baselines' PPO)

    Inside the range the clipped value is V itself, not ``V_old + (V - V_old)``, which float
    rounding can move one unit in the last place away from V: no clip is counted there.
    """
    mask_b = mask.bool()
    values = torch.where(mask_b, values, 0.0)
    old_values = torch.where(mask_b, old_values, 0.0)
    returns = torch.where(mask_b, returns, 0.0)
    unclipped = (values - returns).square()
    if cliprange_value is None:
        return 0.5 * unclipped, torch.zeros_like(mask_b)
    delta = values - old_values
    outside = delta.abs() > cliprange_value  # where clip(V - V_old, -c, c) changes anything
    clipped_values = torch.where(
        outside, old_values + delta.clamp(-cliprange_value, cliprange_value), values
    )
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), outside & (clipped > unclipped) & mask_b


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens (1 is a perfect critic)."""
    values, returns = ops.upcast(values.detach()), ops.upcast(returns.detach())
    var_returns = ops.masked_var(returns, mask)
    var_residual = ops.masked_var(returns - values, mask)
    return float(1.0 - var_residual / var_returns.clamp(min=1e-8))


def ppo_loss(
    batch: RolloutBatch,
    outputs: PolicyOutputs,
    params: PPOParams,
    context: LossContext | None = None,
    policy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss of one micro-batch and its metrics (everything but the ``kl/*`` controller ones).

    Every term is aggregated over the optimizer step's counts in ``context`` (this batch's own
    without it); the reported losses are this micro-batch's own means. ``policy_mask``: the
    0/1 tokens the clipped surrogate keeps (TRL's options,
    :func:`~alignzoo.algorithms.policy_term.policy_mask`).
    """
    mask = batch.response_mask
    mask_b = mask.bool()
    assert batch.old_logprobs is not None and batch.advantages is not None

    def aggregate(mat: torch.Tensor, ctx: LossContext | None = context) -> torch.Tensor:
        weighted = ops.weight_samples(mat, batch.weights)
        return ops.aggregate_loss(
            weighted, mask, params.loss_aggregation, params.norm_constant, ctx
        )

    loss, pg_metrics = ops.clipped_policy_loss(
        outputs.logprobs,
        batch.old_logprobs,
        batch.advantages,
        mask,
        params.clip_eps,
        params.clip_eps,
        dual_clip=params.dual_clip,
        delta=params.delta,
        policy_mask=policy_mask,  # the off-policy mask, the entropy quantile (TRL's options)
        aggregation=params.loss_aggregation,
        norm_constant=params.norm_constant,
        weights=batch.weights,
        token_weights=batch.rollout_is_weights,  # TIS (rollout_correction)
        context=context,
    )  # L_clip = -min(r A, clip(r, 1 - eps, 1 + eps) A)  (Schulman 2017, eq. 7; dual clip: Ye 2020)
    metrics: dict[str, Any] = dict(pg_metrics)

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
    """PPO (Schulman et al. 2017) with a critic, GAE and KL to the reference (InstructGPT style).

    Besides the loss's metrics it logs the KL controller's, in the unit of ``kl_target_unit``
    (nats per token by default, per sequence with ``sequence``): ``kl/coef``, the coefficient
    of this step's reward (before the step's update), and, when the KL is in the reward,
    ``kl/measured``, the step's KL that the controller reads; the adaptive controller also
    logs ``kl/target``.
    """

    Params = PPOParams
    params: PPOParams
    watched_metrics = ("actor/clipfrac", "critic/vf_loss")

    def __init__(self, params: PPOParams | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.kl_ctl: FixedKLController | AdaptiveKLController
        if p.kl_controller == "adaptive":
            self.kl_ctl = AdaptiveKLController(p.init_kl_coef, p.kl_target, p.kl_horizon_steps)
        else:
            self.kl_ctl = FixedKLController(p.kl_coef if p.kl_in_reward else 0.0)
        self._kl_metrics: dict[str, float] = {}  # this step's, from compute_advantages

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
            weights=True,
            dense_rewards=self.params.dense_reward_coef > 0,
            truncation=self.params.mask_truncated_completions,
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
        self._kl_metrics = {"kl/coef": self.kl_ctl.value}  # the coefficient of this step's reward
        kl = None
        if p.kl_in_reward and self.kl_ctl.value > 0:
            if batch.ref_logprobs is None:
                raise UserError("ppo: a KL penalty in the reward needs batch.ref_logprobs")
            kl = ops.masked_kl_penalty(
                batch.old_logprobs, batch.ref_logprobs, mask, p.kl_estimator
            )  # KL_t of the sampled tokens to the reference
        # R(x, y) = r(x, y) - beta * log(pi(y|x) / pi_ref(y|x))   (Ouyang et al. 2022, eq. 2)
        # + c * d_t, a step's process reward on its last token (PRIME, Cui et al. 2025)
        batch.token_rewards = ops.token_level_rewards(
            batch.scores, mask, kl, self.kl_ctl.value, batch.dense_rewards, p.dense_reward_coef
        )
        advantages, returns = ops.gae(batch.token_rewards, batch.values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = ops.masked_whiten(advantages, mask)
        batch.advantages, batch.returns = advantages, returns
        if kl is not None:  # the step's KL in the target's unit, then adapt (once per step)
            observed = float(measured_kl(kl, mask, p.kl_target_unit))
            self._kl_metrics["kl/measured"] = observed
            self.kl_ctl.update(observed, n_steps=1)
        if isinstance(self.kl_ctl, AdaptiveKLController):
            self._kl_metrics["kl/target"] = self.kl_ctl.target
        if p.mask_truncated_completions:  # after GAE: their rewards count in the whitening
            mask_truncated(batch, "ppo")
        return batch

    @hookimpl
    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> LossOutput:
        if batch.advantages is None or batch.old_logprobs is None:
            raise UserError("ppo: compute_loss needs batch.advantages and batch.old_logprobs")
        if self.params.kl_loss_coef > 0 and batch.ref_logprobs is None:
            raise UserError("ppo: kl_loss_coef > 0 needs batch.ref_logprobs")
        masks = batch_policy_mask(self.params, batch, outputs, "ppo")
        loss, metrics = ppo_loss(batch, outputs, self.params, context, policy_mask=masks.keep)
        metrics.update({k: float(v) for k, v in masks.metrics.items()})
        metrics.update({k: float(v) for k, v in truncation_metrics(self.params, batch).items()})
        metrics.update(self._kl_metrics or {"kl/coef": self.kl_ctl.value})
        return LossOutput(loss, metrics, entropy_mask=masks.entropy)
