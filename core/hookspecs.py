"""The alignzoo hook specifications: the contract between the engine and every plugin.

Each run has its own :class:`pluggy.PluginManager`, into which the runner registers exactly the
arm's components (one algorithm, one labeler, one backend, one device mapper) and the modifiers
the arm lists. So ``compute_loss`` reaches the arm's algorithm, and a modifier's
``@hookimpl(wrapper=True)`` wraps it without editing it::

    class EntropyBonus(Modifier):
        @hookimpl(wrapper=True)
        def compute_loss(self, batch, outputs):
            result = yield                      # the algorithm's LossOutput
            bonus = masked_mean(outputs.entropy, batch.response_mask)
            result.loss = result.loss - self.params.coef * bonus
            return result

Shapes: ``B`` samples in a batch, ``P`` prompt tokens (left-padded), ``R`` response tokens
(right-padded). See :class:`alignzoo.batch.RolloutBatch` and :class:`alignzoo.batch.PolicyOutputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from alignzoo.plugin import PROJECT

if TYPE_CHECKING:
    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.types import (
        AlgorithmRequirements,
        LabelRequest,
        LossOutput,
        SamplingParams,
        Score,
    )

hookspec = pluggy.HookspecMarker(PROJECT)


# --------------------------------------------------------------------------- algorithm


@hookspec(firstresult=True)
def algorithm_requirements() -> AlgorithmRequirements:
    """Say what the arm's algorithm needs: reference model, critic, kind of data.

    Called once by the engine when a run is assembled, before any model is loaded, so that a
    reference model or a critic is loaded only if asked for.
    """


@hookspec(firstresult=True)
def compute_advantages(batch: RolloutBatch) -> RolloutBatch:
    """Fill ``batch.advantages`` (``[B, R]``, zero on padding) and, for critic methods, ``batch.returns``.

    Called once per training step, after labeling and batch transforms, on the whole step
    batch (so group statistics see every sample of a group). ``batch.scores`` (``[B]``) holds the
    labeler's rewards; ``batch.old_logprobs``, ``batch.ref_logprobs`` and ``batch.values`` are
    filled when the algorithm's requirements ask for them. Return the same batch (mutated) or a
    new one. Preference algorithms may return the batch unchanged.
    """


@hookspec(firstresult=True)
def compute_loss(batch: RolloutBatch, outputs: PolicyOutputs) -> LossOutput:
    """Return the loss of one micro-batch and the algorithm's own metrics.

    ``batch`` is a slice of the step batch (advantages already computed); ``outputs`` holds the
    current policy's per-token log-probs ``[B, R]`` (and entropy, values when required),
    computed with gradients by the engine. The loss is a scalar tensor to *minimise*, already
    aggregated over tokens (see :func:`alignzoo.ops.aggregate_loss`); metrics are plain floats
    (``actor/clipfrac``, ``kl``, ``dpo/accuracy``, ...). Called for every micro-batch of every
    epoch. Modifiers may wrap this hook to add terms.
    """


# --------------------------------------------------------------------------- labeler


@hookspec(firstresult=True)
def score(request: LabelRequest) -> Score:
    """Score one response to one prompt. ``request.extra`` holds extra dataset columns
    (for example the reference answer). Return a :class:`Score`; never raise for bad model
    output: return ``Score(0.0, valid=False)`` and say why in ``info``. A labeler that rescales
    its values (per-batch normalisation) puts the unscaled value in ``info["raw"]``: evaluation
    reports ``raw`` so that ``eval/score`` means the same thing at every step.
    """


@hookspec(firstresult=True)
def score_batch(requests: list[LabelRequest]) -> list[Score]:
    """Score a batch of responses; returns one :class:`Score` per request, in order.

    Called by the labeling stage once per step with every sampled response. The default
    (:class:`alignzoo.plugin.Labeler`) calls ``score`` per item; batched labelers override it.
    """


# --------------------------------------------------------------------------- rollout backend


@hookspec(firstresult=True)
def generate(
    prompts: list[str], extras: list[dict[str, Any]], n: int, sampling: SamplingParams
) -> RolloutBatch:
    """Sample ``n`` responses for each prompt.

    Returns a :class:`RolloutBatch` of ``B = len(prompts) * n`` samples, grouped by prompt
    (``group_ids[i] == i // n``), with ``prompt_ids``, ``response_ids``, ``response_mask``,
    the texts, ``extras`` repeated per sample and ``old_logprobs`` ``[B, R]``: the log-probs of
    the sampled tokens under the sampling distribution at temperature 1 of the current weights.
    ``sampling.temperature == 0`` decodes greedily (evaluation). Called by the engine each step
    and at each evaluation.
    """


@hookspec
def sync_weights(model: Any) -> None:
    """Make the backend sample from ``model``'s current weights.

    Called once when the run starts and after every optimizer step. A backend that shares the
    trainer's module (Hugging Face ``generate``) keeps a reference; one with its own copy
    (vLLM) loads the new state dict.
    """


# --------------------------------------------------------------------------- device mapper


@hookspec(firstresult=True)
def place_roles(roles: Sequence[str], available: Sequence[str]) -> dict[str, str]:
    """Map each role (``actor``, ``ref``, ``critic``, ``reward``, ``rollout``, ``labeler``) to a device.

    ``available`` lists the devices that exist (``"cpu"``, ``"cuda:0"``, ...). Raise
    :class:`alignzoo.errors.UserError` naming the role and device when a requested device does
    not exist. Called once when a run is assembled, before any model is loaded; also by
    ``alignzoo validate``.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def on_run_start(run: Any) -> None:
    """Called once after the run's models are loaded and before the first step.

    ``run`` is the :class:`alignzoo.engine.run.Run` (config, seed, out_dir, devices, models,
    tokenizer). Components that hold resources (a reward model, a backend's engine) set them up here.
    """


@hookspec
def transform_batch(batch: RolloutBatch, run: Any) -> RolloutBatch | None:
    """Filter, reweight, deduplicate or flag samples between labeling and advantage computation.

    Called once per step per implementation, in plugin order, each receiving the previous one's
    output; return a new batch or None to keep the given one (after mutating it in place).
    """


@hookspec
def on_step_end(run: Any, step: int, metrics: dict[str, float]) -> None:
    """Called after every optimizer step with that step's metrics, before they reach the sinks.

    Modifiers may add entries to ``metrics`` (for example health warnings); they are then written.
    """


@hookspec
def on_run_end(run: Any, status: str) -> None:
    """Called once when a run stops; ``status`` is ``"finished"``, ``"failed"`` or ``"interrupted"``."""
