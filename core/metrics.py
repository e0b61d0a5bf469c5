"""The canonical metric names: what every arm reports, computed by the engine in one way.

An A/B comparison is only fair when the numbers it puts side by side mean the same thing in
every arm. The metrics listed here are computed by the engine, never by an algorithm, with one
estimator and at one policy snapshot, so GRPO's ``kl/ref`` and DPO's ``kl/ref`` are the same
quantity. The report, the console line and the health checks read only these names.
Algorithm-specific values live under the algorithm's own namespace (``grpo/kl_k3``,
``ppo/kl_penalty``, ``dpo/loss``, ``actor/clipfrac``, ...); ``compute_loss`` may not return a
canonical name (the engine refuses it, naming the key).

The *behaviour snapshot* is the policy's weights at the start of a training step, before its
update: the weights that sampled the step's responses in an online arm.
"""

from __future__ import annotations

KL_REF = "kl/ref"
"""Mean over the step's response tokens of the k3 estimate of KL(π || π_ref) (Schulman 2020),
π the behaviour snapshot. Reported by every arm that has a reference model loaded. In online
arms the tokens are samples of π, so this estimates the KL; in offline arms they are the
dataset's responses, so it measures the log-ratio on that data (not an on-policy KL)."""

ENTROPY = "entropy"
"""Mean per-token entropy of the behaviour snapshot over the step's response tokens."""

RESPONSE_LENGTH = "response_length/mean"
"""Mean number of response tokens (EOS included) per sample of the step's batch."""

REWARD_MEAN = "reward/mean"
"""Mean labeler score over the step's sampled responses (online arms)."""

REWARD_STD = "reward/std"
"""Population standard deviation of the labeler scores over the step's sampled responses."""

REWARD_VALID_FRAC = "reward/valid_frac"
"""Fraction of the step's responses the labeler could judge (``Score.valid``)."""

REWARD_DENSE_STEPS = "reward/dense_steps"
"""Mean over the step's responses of the tokens that carry a step's reward (``Score.steps``
placed on tokens, ``batch.dense_mask``): steps per sample, those ending on one token counted
once. Reported by arms whose labeler gave step scores in the step, whatever the algorithm."""

REWARD_DENSE_MEAN = "reward/dense_mean"
"""Mean step reward over the tokens that carry one (``batch.dense_rewards`` where
``batch.dense_mask`` is 1), in the labeler's units."""

REWARD_DENSE_UNPLACED = "reward/dense_unplaced"
"""Steps per response that found no trained token to sit on (the response text is not the
text of its trained tokens; see :mod:`alignzoo.labeling.dense`): 0 when every step was placed."""

LOSS = "loss"
"""The optimised loss, summed over the micro-batches of an optimizer step, averaged over the
step's optimizer steps. Its scale differs between algorithms: compare its trend, not its level."""

LR = "lr"
"""The actor's learning rate used by the step's optimizer steps (their mean)."""

BATCH_PROMPTS = "batch/prompts"
"""Prompts (dataset rows) the step used."""

BATCH_RESPONSES = "batch/responses"
"""Responses the step sampled (online) or read (offline)."""

STEP_SECONDS = "timing/step"
"""Wall-clock seconds of the whole training step."""

EVAL_SCORE = "eval/score"
"""Mean labeler score of greedy responses to the held-out prompts (unscaled: ``info['raw']``)."""

EVAL_EXACT_MATCH = "eval/exact_match"
"""Fraction of greedy held-out responses the labeler marks correct (``Score.info['correct']``)."""

EVAL_RESPONSE_LENGTH = "eval/response_length"
"""Mean number of tokens of the greedy held-out responses."""

PADDING_FRAC = "timing/padding_frac"
"""Share of the update's forward positions that hold padding, not a token (what
``training.packing`` removes), averaged over micro-batches."""

ROLLOUT_LOGPROB_DIFF = "rollout/logprob_diff"
"""Mean over the step's response tokens of |log π_old − log π_rollout|: the trainer's behaviour
log-probs against those the rollout backend recorded while sampling, on the same weights (the
train/inference mismatch). Reported by arms whose backend returns sampling log-probs."""

ROLLOUT_LOGPROB_DIFF_MAX = "rollout/logprob_diff_max"
"""The largest |log π_old − log π_rollout| over the step's response tokens."""

ROLLOUT_OUTSIDE_SUPPORT = "rollout/outside_support"
"""Sampled response tokens the trainer's own top-k / top-p cut from the distribution it
recomputes (the sampler kept them: a near tie at the boundary, computed another way): masked
out of the loss instead of trained through a log-prob of -inf. Reported by arms that sample
with top-k or top-p; counted over the step's batch, on every rank."""

ROLLOUT_IS_WEIGHT_MEAN = "rollout/is_weight_mean"
"""Mean over the step's response tokens of the rollout correction's importance weight
(``training.rollout_correction``, after truncation or masking)."""

ROLLOUT_IS_WEIGHT_MAX = "rollout/is_weight_max"
"""The largest importance weight of the step (after truncation or masking)."""

ROLLOUT_IS_CLIPPED = "rollout/is_clipped"
"""Share of the step's response tokens whose ratio pi_old / pi_rollout exceeded the cap:
truncated to it, or (mode mask) left out of the surrogate."""

ROLLOUT_STALENESS = "rollout/staleness"
"""Mean over the step's sampled response tokens of the steps between the weights that sampled
them and the weights that train on them (0 for a synchronous step; 1 with
``labeling.overlap``). A partial rollout's tokens may come from several weights."""

ROLLOUT_STALENESS_MAX = "rollout/staleness_max"
"""The largest staleness among the step's sampled tokens (``training.async``)."""

ROLLOUT_STALENESS_HIST = "rollout/staleness_hist/"
"""Prefix of the staleness histogram: ``rollout/staleness_hist/<k>`` is the share of the step's
sampled response tokens that are k steps old, for every k from 0 to ``max_staleness``
(``training.async``; the shares sum to 1)."""

ROLLOUT_KL_BEHAVIOUR = "rollout/kl_behaviour"
"""KL(pi_rollout || pi_old) per token (k3, on the sampled tokens): how far the weights that
sampled the step's batch are from those that train on it (``training.async``)."""

REFERENCE_SYNCS = "reference/syncs"
"""The syncs of a moving reference so far (``training.sync_ref_model``): after the step's
update, the optimizer steps taken divided by ``ref_model_sync_steps``, rounded down. It rises
by one at each step whose update ended on a sync's optimizer step; reported only with the
sync on."""

CANONICAL: dict[str, str] = {
    KL_REF: "KL to the reference (k3, behaviour snapshot)",
    ENTROPY: "policy entropy per token (behaviour snapshot)",
    RESPONSE_LENGTH: "response length (tokens)",
    REWARD_MEAN: "training reward (mean)",
    REWARD_STD: "training reward (std)",
    REWARD_VALID_FRAC: "responses the labeler could judge",
    REWARD_DENSE_STEPS: "step rewards per response",
    REWARD_DENSE_MEAN: "step reward (mean)",
    REWARD_DENSE_UNPLACED: "step rewards not placed on a token",
    LOSS: "loss",
    LR: "learning rate",
    BATCH_PROMPTS: "prompts per step",
    BATCH_RESPONSES: "responses per step",
    STEP_SECONDS: "seconds per step",
    PADDING_FRAC: "padding share of the update's forward positions",
    EVAL_SCORE: "held-out score",
    EVAL_EXACT_MATCH: "held-out exact match",
    EVAL_RESPONSE_LENGTH: "held-out response length",
    ROLLOUT_LOGPROB_DIFF: "train/inference log-prob difference (mean)",
    ROLLOUT_LOGPROB_DIFF_MAX: "train/inference log-prob difference (max)",
    ROLLOUT_OUTSIDE_SUPPORT: "sampled tokens outside the trainer's top-k / top-p",
    ROLLOUT_IS_WEIGHT_MEAN: "importance weight (mean)",
    ROLLOUT_IS_WEIGHT_MAX: "importance weight (max)",
    ROLLOUT_IS_CLIPPED: "tokens over the importance-weight cap",
    ROLLOUT_STALENESS: "sample staleness in steps (mean)",
    ROLLOUT_STALENESS_MAX: "sample staleness in steps (max)",
    ROLLOUT_KL_BEHAVIOUR: "KL(sampling policy || trained policy)",
}
"""Every canonical name with the label the report gives it."""

GRAD_NORMS = ("actor/grad_norm", "critic/grad_norm")
"""Gradient norms before clipping, per trainable role (engine-owned)."""

ENGINE_NAMESPACES = (
    "reward/",
    "batch/",
    "timing/",
    "throughput/",
    "eval/",
    "health/",
    "async/",
    "reference/",
)
"""Prefixes owned by the engine (and health checks): an algorithm's metrics may not use them."""


def owned_by_engine(name: str) -> bool:
    """True when ``name`` is a canonical metric or lies in a namespace the engine owns."""
    return name in CANONICAL or name in GRAD_NORMS or name.startswith(ENGINE_NAMESPACES)


_LOWER_IS_BETTER = ("loss", "error", "perplexity", "ppl", "wall_clock", "memory", "length")


def higher_is_better(metric: str) -> bool:
    """Default direction of a metric: lower is better for losses, errors, time and memory."""
    name = metric.lower()
    return not any(word in name for word in _LOWER_IS_BETTER)


def evaluation_key(metric: str | None) -> str:
    """The eval.jsonl key of an evaluation metric ('exact_match' -> 'eval/exact_match'; the
    default, None, is exact match)."""
    metric = metric or "exact_match"
    return metric if "/" in metric else f"eval/{metric}"
