"""The alignzoo hook specifications: the contract between the engine and every plugin.

Each run has its own :class:`pluggy.PluginManager`, into which the runner registers exactly the
arm's components (one algorithm, one labeler, one backend, one device mapper) and the modifiers
the arm lists. So ``compute_loss`` reaches the arm's algorithm, and a modifier's
``@hookimpl(wrapper=True)`` wraps it without editing it::

    class EntropyBonus(Modifier):
        @hookimpl(wrapper=True)
        def compute_loss(self, batch, outputs, context):
            result = yield                      # the algorithm's LossOutput
            bonus = aggregate_loss(outputs.entropy, batch.response_mask, "token-mean", None, context)
            result.loss = result.loss - self.params.coef * bonus
            return result

An implementation may take any subset of a hook's arguments, by name (pluggy passes only the
ones it declares). The engine calls every hook through :class:`alignzoo.engine.hooks.Hooks`,
which checks what a single-result hook returned and names the component when it is wrong.
``ALIGNZOO_TRACE_HOOKS=1`` prints every hook call with its components and its duration.

Shapes: ``B`` samples in a batch, ``P`` prompt tokens (left-padded), ``R`` response tokens
(right-padded). See :class:`alignzoo.batch.RolloutBatch` and :class:`alignzoo.batch.PolicyOutputs`.

Order of the calls in a run (tests/core/engine/test_hook_order.py pins it):
``algorithm_requirements``, ``place_roles``, ``on_run_start``, ``sync_weights`` (and again once
a resumed run has loaded its checkpoint); an evaluation
(``generate``, ``score_batch``, per 128 prompts, and again for ``evaluation.pass_at_k``); then
per training step: [``generate``, ``score_batch``] (online arms), ``transform_batch`` once per
implementation (no call when no component implements it), ``compute_advantages``,
``compute_loss`` once per micro-batch of every optimizer step of every epoch, ``sync_weights``,
``on_step_end``, and evaluations on their schedule; after the last step, an evaluation unless
that step had one; finally ``on_run_end``. ``score_batch`` is not called for requests whose
labels the label store already holds (``labeling.store``; identical requests of one call are
sent once). A step left with nothing to train on (no untied
online pair, or every sample filtered out) calls no further hook before ``on_step_end``.

State across steps: a component is built once per run from its params. One that keeps state
between steps (a running baseline, an adaptive KL coefficient) must implement
``state_dict()`` / ``load_state_dict(state)`` (:class:`alignzoo.Stateful`): the state is saved
in every checkpoint and restored on ``--resume``; without them the component is rebuilt from
its params and the state is lost (the contract suite's ``state_roundtrip`` check catches an
algorithm that does this). Small JSON-serialisable state may instead live in ``run.state``.
A plugin's own output files go through ``run.record(stream, row)``, which cuts them back to the
checkpoint on ``--resume`` like the engine's.
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
        EpisodeStart,
        LabelRequest,
        LossContext,
        LossOutput,
        Placement,
        RunContext,
        SamplingParams,
        Score,
        StepResult,
        Turn,
    )
    from alignzoo.weights import PolicyWeights

hookspec = pluggy.HookspecMarker(PROJECT)


# --------------------------------------------------------------------------- algorithm


@hookspec(firstresult=True)
def algorithm_requirements() -> AlgorithmRequirements:
    """Say what the arm's algorithm needs: reference model, critic, kind of data.

    Called once by the engine when a run is assembled, before any model is loaded, so that a
    reference model or a critic is loaded only if asked for; the kind of data picks the run's
    data mode (:mod:`alignzoo.engine.modes`). :class:`alignzoo.plugin.Algorithm` implements
    it from its ``requirements`` class attribute.
    """


@hookspec(firstresult=True)
def compute_advantages(batch: RolloutBatch) -> RolloutBatch:
    """Fill ``batch.advantages`` (``[B, R]``, zero on padding) and, for critic methods, ``batch.returns``.

    Called once per training step, after labeling and batch transforms, on the whole step
    batch (so group statistics, or a per-step quantity such as KTO's reference point, see every
    sample). ``batch.scores`` (``[B]``) holds the labeler's rewards (online data);
    ``batch.old_logprobs`` (online data), ``batch.ref_logprobs`` and ``batch.values`` are
    filled when the requirements ask for them, ``batch.columns`` holds what the data mode
    adds. Return the same batch (mutated) or a new one of the same size. Preference algorithms
    may return the batch unchanged.
    """


@hookspec(firstresult=True)
def compute_loss(batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext) -> LossOutput:
    """Return one micro-batch's share of the optimizer step's loss, and the algorithm's metrics.

    ``batch`` is a slice of the step batch (advantages already computed); ``outputs`` holds the
    current policy's per-token log-probs ``[B, R]`` with gradients (and ``entropy`` when the
    requirements ask for it, ``values`` with a critic). ``context`` gives the counts of the
    whole optimizer step (valid tokens, samples, groups; later summed over ranks): normalise by
    them, not by the micro-batch's own, e.g. ``aggregate_loss(..., context=context)`` or
    ``alignzoo.ops.mean_over_samples``. The engine back-propagates each share as it is and
    sums the gradients, so the update does not depend on ``micro_batch_size`` (``alignzoo
    check algorithm`` tests it).

    The loss is a scalar tensor to *minimise*; metrics are plain floats under the algorithm's
    own names (``actor/clipfrac``, ``grpo/kl_k3``, ``dpo/rewards/accuracy``, ...). Names that
    the engine computes for every arm (:mod:`alignzoo.metrics`: ``kl/ref``, ``entropy``,
    ``reward/*``, ...) are refused. Called for every micro-batch of every epoch; modifiers may
    wrap this hook to add terms.
    """


# --------------------------------------------------------------------------- labeler


@hookspec(firstresult=True)
def score_batch(requests: list[LabelRequest]) -> list[Score]:
    """Score a batch of responses; returns one :class:`Score` per request, in order.

    A :class:`LabelRequest` holds ``prompt`` and ``response`` (texts) and ``extra`` (the
    dataset's other columns for that prompt, such as a reference ``answer``). A :class:`Score`
    is ``Score(value, valid=True, info={})`` with ``value`` a finite number. Bad *model output*
    is a value (say 0 with ``info["malformed"] = True``, ``valid=False``), never an exception.
    When the labeler itself cannot give a value it says which way: ``Score.abstain(reason)``
    (it declines: no answer key, out of scope), ``Score.parse_failure(reason)`` (its own answer
    is unreadable, e.g. a judge's reply), or it raises
    :class:`alignzoo.errors.LabelerUnavailable` (infrastructure: connection, 5xx, 429 with
    ``retry_after``). Any other exception counts as an ``error`` outcome, and a NaN / inf value,
    an item that is not a Score or the wrong number of Scores as ``rejected``. The arm's
    ``labeling`` section decides per outcome (:class:`alignzoo.types.Outcome`): retry with
    backoff, the next labeler of ``labeling.fallbacks``, drop the sample or its group, or fail
    the run; samples without a value never reach a loss, and the step's ``label/*`` metrics
    account for every one (generated = valued + fallback_valued + dropped).
    ``info`` keys the engine reads: ``"correct"`` (bool, the response is right:
    ``eval/exact_match``, online KTO's desirability) and ``"raw"`` (the unscaled value of a
    normalising labeler: ``eval/score``).

    Called by the labeling stage once per training step with every sampled response (online
    arms), and at every evaluation. :class:`alignzoo.plugin.Labeler` implements it by calling
    its ``score(request)`` method per item; batched labelers override it.
    """


# --------------------------------------------------------------------------- rollout backend


@hookspec(firstresult=True)
def generate(
    prompts: list[str],
    extras: list[dict[str, Any]],
    n: int,
    sampling: SamplingParams,
    seeds: list[int] | None,
) -> RolloutBatch:
    """Sample ``n`` responses for each prompt.

    ``seeds`` (training steps; None at evaluation) holds one seed per prompt: a backend that
    honours it samples each prompt's ``n`` responses from a generator of their own seeded so,
    which makes the samples independent of how prompts are batched or spread over processes
    (data-parallel training then samples exactly what one process would). A backend may
    ignore it (and omit the argument) and use the global RNG.

    Returns a :class:`RolloutBatch` of ``B = len(prompts) * n`` samples, grouped by prompt
    (``group_ids[i] == i // n``), with ``prompt_ids``, ``response_ids``, ``response_mask``,
    the texts and ``extras`` repeated per sample. ``rollout_logprobs`` ``[B, R]`` may be set:
    the log-probs the backend's own engine gave the sampled tokens under the distribution it
    drew them from: the logits divided by ``sampling.temperature``, then cut to ``top_k`` and
    the ``top_p`` nucleus and renormalised (vLLM's ``processed_logprobs``; the raw logits'
    only when decoding greedily). The engine then computes the behaviour log-probs with the
    trainer's forward pass under the same distribution, logs ``rollout/logprob_diff`` between
    the two, and applies the arm's ``training.rollout_correction`` (``old_logprobs``, the
    former name of this field, is read as ``rollout_logprobs``); ``alignzoo check backend``
    fails a backend that returns the raw logits' log-probs at temperature 0.7 with top-k and
    top-p. ``sampling.temperature == 0`` decodes greedily (evaluation).
    Called by the engine at each training step of an online arm and at each evaluation.
    """


@hookspec(firstresult=True)
def generate_ids(
    contexts: list[list[int]],
    sampling: SamplingParams,
    seeds: list[int] | None,
    stop_token_ids: list[int] | None,
) -> list[tuple[list[int], list[float]]]:
    """Continue each token-id context by one sampled turn: token-in-token-out, for multi-turn
    episodes (:mod:`alignzoo.rollout.multiturn`), where nothing already generated may be
    re-tokenised.

    ``contexts``: the full token ids so far of each episode (prompt, earlier turns and the
    environment's answers), used exactly as given. Returns, per context, the sampled ids (at
    most ``sampling.max_new_tokens``, ending at the first EOS or ``stop_token_ids`` token,
    which is kept) and the log-prob the backend's engine gave each (under the distribution it
    drew from, as ``rollout_logprobs`` in ``generate``). ``seeds``: one per context, as in ``generate``.
    A backend without it cannot run an arm with an environment (``alignzoo validate`` says so).
    """


@hookspec
def sync_weights(weights: PolicyWeights) -> None:
    """Make the backend sample from the actor's current weights.

    ``weights`` is a :class:`alignzoo.weights.PolicyWeights`: ``weights.version`` (the
    optimizer steps applied so far: 0 at the start) and ``weights.named_tensors(dtype=...,
    device=...)``, the ``(name, tensor)`` pairs of the policy's plain Hugging Face checkpoint
    (LoRA merged, FSDP2 shards gathered), produced lazily. A backend with its own copy of the
    policy loads them (``load_state_dict``, a vLLM engine's weight loader); one that samples
    with the trainer's own module in this process notes the version and reads nothing.

    Called once when the run starts (after ``on_run_start``), after a resumed run has loaded
    its checkpoint, and after each training step's update (a step may hold several optimizer
    steps).
    """


# --------------------------------------------------------------------------- environment


@hookspec(firstresult=True)
def env_reset(row: dict[str, Any], seed: int) -> EpisodeStart:
    """Open one episode for the dataset ``row`` (every column, ``prompt`` included) and return
    its :class:`alignzoo.rollout.episode.EpisodeStart`: the episode's state, the messages the
    model starts from and the tools it is offered.

    ``seed`` is the episode's own seed (the same row and seed give the same episode: draw any
    randomness from it). May be ``async def``: the engine runs the episodes of a step
    concurrently on one event loop, so an environment that waits on I/O (a server, a
    subprocess) should await rather than block. An exception, or taking longer than the arm's
    ``episodes.step_timeout_s``, is the episode's ``error`` / ``timeout`` outcome (the arm's
    policy decides what becomes of the sample); it never stops the run.
    """


@hookspec(firstresult=True)
def env_step(state: Any, turn: Turn) -> StepResult:
    """Answer the model's ``turn`` (:class:`alignzoo.rollout.episode.Turn`: its text and the tool
    calls the arm's codec read in it) in the episode ``state`` and return a
    :class:`alignzoo.rollout.episode.StepResult`: the messages appended to the conversation,
    an optional reward, and whether the episode is done.

    Called once per model turn, in order, never again after ``done``. A malformed tool call
    arrives in ``turn.errors``: answer it as an error message so the model can recover, do not
    raise. May be ``async def``; exceptions and timeouts are outcomes as for ``env_reset``.
    The engine ends an episode itself when it reaches ``episodes.max_turns`` or
    ``episodes.max_tokens`` (recorded as truncated).
    """


@hookspec
def env_close(state: Any) -> None:
    """Release the episode ``state``'s resources (a subprocess, a connection). Called once per
    opened episode, whatever became of it (done, truncated, failed, timed out); may be
    ``async def``; an exception here is logged and ignored."""


# --------------------------------------------------------------------------- device mapper


@hookspec(firstresult=True)
def place_roles(roles: Sequence[str], available: Sequence[str]) -> dict[str, str | Placement]:
    """Place each role (``actor``, ``ref``, ``critic``, ``reward``, ``rollout``, ``labeler``).

    ``roles`` lists the roles this run has; ``available`` the devices that exist (``"cpu"``,
    ``"cuda:0"``, ...). Return, for every role, a device name or a
    :class:`alignzoo.types.Placement` (a device plus, on GPUs, a memory share and a
    tensor-parallel size). Validate with :func:`alignzoo.devices.check_placement`, which raises
    :class:`alignzoo.errors.UserError` naming the role and device when a device does not exist
    or a GPU setting is asked for elsewhere; the engine checks the result the same way. Called
    once when a run is assembled, before any model is loaded.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def on_run_start(run: RunContext) -> None:
    """Called once after the run's models are loaded and before the first step.

    ``run`` is the :class:`alignzoo.engine.context.RunContext`: experiment, arm, seed,
    ``out_dir``, the spec, ``models`` (tokenizer, actor, reference, critic and their devices;
    ``run.device(role)``), ``console`` and ``state``. Components that hold resources (a reward
    model, a backend's engine) set them up here.
    """


@hookspec
def transform_batch(batch: RolloutBatch, run: RunContext) -> RolloutBatch | None:
    """Filter, reweight, deduplicate or flag samples between labeling and advantage computation.

    Called once per training step per implementation, in plugin order, each receiving the
    previous one's output; return a new batch or None to keep the given one (after mutating it
    in place). A preference batch must stay adjacent (chosen, rejected) pairs.
    """


@hookspec
def on_step_end(run: RunContext, step: int, metrics: dict[str, float]) -> None:
    """Called after each training step with that step's metrics, before they reach the sinks.

    Modifiers may add entries to ``metrics`` (for example health warnings); they are then written.
    """


@hookspec
def on_run_end(run: RunContext, status: str) -> None:
    """Called once when a run stops; ``status`` is ``"finished"``, ``"failed"`` or ``"interrupted"``."""
