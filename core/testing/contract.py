"""The algorithm contract suite: properties every registered algorithm must satisfy.

:func:`check_algorithm` runs each property with hypothesis on batches drawn for the
algorithm's own :class:`~alignzoo.types.AlgorithmRequirements` (see
:func:`alignzoo.testing.strategies.batch_cases`) and returns one :class:`CheckResult` per
property. Each evaluation goes through the real hook path: a fresh instance (default params, or
a copy of the instance given) is registered alone in a PluginManager built by
:func:`alignzoo.registry.build_plugin_manager`; ``compute_advantages`` runs on the whole batch,
then ``compute_loss`` on the result, then ``loss.backward()``.

The properties (check names):

- ``instantiate``: the class builds with its default params and its ``algorithm_requirements``
  hook returns an :class:`AlgorithmRequirements`.
- ``output_types``: ``compute_loss`` returns a :class:`LossOutput` whose loss is a 0-dim floating
  tensor that requires grad and back-propagates to ``outputs.logprobs``; ``compute_advantages``
  returns a batch of the same size whose ``advantages`` / ``returns`` (when set) are ``[B, R]``,
  finite, and 0 on padding.
- ``metrics_finite_floats``: every metric is a finite Python float under a ``str`` key that
  is not one of the engine's canonical names (:mod:`alignzoo.metrics`).
- ``finite_extreme_logprobs``: with every log-prob (policy, old, reference, mismatched) drawn
  near 0 or near -50, the loss and the gradients are finite.
- ``padding_invariance``: overwriting padding with arbitrary values and appending more masked
  columns changes neither the loss nor the gradient on real tokens (and gives none on padding).
- ``sample_permutation``: shuffling the samples (with their group ids) keeps the loss and the
  metrics, and permutes the gradient rows the same way.
- ``group_permutation``: reordering whole groups and renaming their ids keeps the same.
- ``micro_batch_invariance``: splitting the batch into micro-batches (whole groups each), each
  ``compute_loss`` given the whole batch's :class:`~alignzoo.types.LossContext`, gives shares
  that add up to the whole batch's loss and gradients that add up to its gradient (gradient
  accumulation changes nothing, for every loss aggregation). One documented exception: TRL's
  ``top_entropy_quantile`` below 1 takes its quantile over each forward's tokens, as TRL does
  (:mod:`alignzoo.algorithms.policy_term`), so its tests skip this check.
- ``direction``: one gradient-descent step on the loss moves the policy the way the algorithm's
  kind promises, on an on-policy batch built for it (every log-prob -1, the reference and the
  behaviour policy equal to the policy, values 0, every entropy 1; the group structure and
  lengths drawn):
  online algorithms raise the log-probability of each group's best-scored sample (scores 1 and
  0; in a group of one a baseline may take its whole signal) and raise it more than the
  others'; preference algorithms raise each pair's chosen-minus-rejected margin; unpaired ones raise the desirable completions and lower the undesirable; imitation (demonstrations) raises every demonstrated completion. A loss with
  its sign flipped, or advantages with theirs, fails it.
- ``weights_honoured``: for an algorithm whose requirements declare ``weights``, a sample
  (a pair, for preference data) given weight 0 in ``batch.weights`` gets no gradient, and
  given twice its weight gets twice its gradient (a 0/1 mask made of the weights fails); an
  algorithm that does not declare it passes with that said (a weight-setting modifier around it
  is refused by ``alignzoo validate``).
- ``state_roundtrip``: an instance that has seen one batch, saved with ``state_dict`` (through
  ``torch.save`` / ``torch.load(weights_only=True)``, as a checkpoint does) and restored into a
  fresh instance with ``load_state_dict``, gives the same losses and metrics on the next batches
  as the instance that never stopped. An algorithm that keeps state across steps (a running
  baseline, an adaptive coefficient) without :class:`~alignzoo.plugin.Stateful` fails it: its
  state would be lost on ``--resume``.

Use it from pytest in a plugin's own test suite::

    from alignzoo.testing import assert_algorithm_contract

    def test_my_algorithm_meets_the_contract():
        assert_algorithm_contract(MyAlgorithm)          # or a registered name, or an instance

and from the command line: ``alignzoo check algorithm NAME``. Runs are deterministic
(``derandomize=True``) and write no hypothesis database.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import math
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.reporting import with_reporter

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.metrics import owned_by_engine
from alignzoo.plugin import Algorithm
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.testing.strategies import (
    BatchCase,
    batch_cases,
    extreme_logprob_values,
    padding_fill,
)
from alignzoo.types import AlgorithmRequirements, LossOutput

__all__ = [
    "CHECKS",
    "DEFAULT_SHRINK_SECONDS",
    "CheckResult",
    "ContractViolation",
    "Evaluation",
    "assert_algorithm_contract",
    "check_algorithm",
    "evaluate",
]

RTOL = 1e-4
"""Relative tolerance of the invariance checks (float32 sums in another order differ slightly)."""
ATOL = 1e-5
"""Absolute tolerance of the invariance checks."""


DEFAULT_SHRINK_SECONDS = 10.0
"""How long hypothesis may shrink one check's failing example unless told otherwise."""

CHECKS = (
    "instantiate",
    "output_types",
    "metrics_finite_floats",
    "finite_extreme_logprobs",
    "padding_invariance",
    "sample_permutation",
    "group_permutation",
    "micro_batch_invariance",
    "direction",
    "weights_honoured",
    "state_roundtrip",
)
"""The names of the checks, in the order :func:`check_algorithm` reports them."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one contract check: ``detail`` explains a failure and shows the example."""

    name: str
    passed: bool
    detail: str = ""


class ContractViolation(AssertionError):
    """Raised inside a property when an algorithm breaks the contract."""


@dataclass
class Evaluation:
    """One pass through the hooks: the loss, its metrics and the gradients it produced."""

    batch: RolloutBatch
    outputs: PolicyOutputs
    result: LossOutput
    loss: float = math.nan
    logprob_grad: torch.Tensor | None = None
    extra_grads: dict[str, torch.Tensor] = field(default_factory=dict)


# --------------------------------------------------------------------------- running the hooks


def _manager(component: Any) -> Any:
    """A PluginManager of the component alone, or of its ``parts`` (an algorithm with the
    modifiers around it, as the modifier suite checks it)."""
    return build_plugin_manager(list(getattr(component, "parts", [component])))


def _resolve(algorithm: str | type[Algorithm] | Algorithm) -> tuple[str, Callable[[], Any]]:
    """A label for messages and a factory of fresh, independent algorithm instances (a
    callable that is neither a class nor an algorithm is taken as that factory)."""
    if callable(algorithm) and not isinstance(algorithm, (type, Algorithm)):
        return str(getattr(algorithm, "__qualname__", "factory")), algorithm
    if isinstance(algorithm, str):
        cls = get_registry().get("algorithm", algorithm)
        return algorithm, cls
    if isinstance(algorithm, type):
        return algorithm.__qualname__, algorithm
    return type(algorithm).__qualname__, lambda: copy.deepcopy(algorithm)


def evaluate(component: Any, case: BatchCase, backward: bool = True) -> Evaluation:
    """Run ``compute_advantages`` then ``compute_loss`` on ``case`` through a PluginManager.

    With ``backward`` the loss is back-propagated and the gradients w.r.t. ``outputs.logprobs``
    (and ``outputs.values`` when present) are collected. ``compute_loss`` gets the batch's own
    :class:`~alignzoo.types.LossContext` (the batch is one optimizer step).
    Warnings the algorithm emits are silenced.
    """
    pm = _manager(component)
    batch, outputs = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        advantaged = pm.hook.compute_advantages(batch=batch)
        if advantaged is not None:
            batch = advantaged
        result = pm.hook.compute_loss(batch=batch, outputs=outputs, context=batch.loss_context())
    if not isinstance(result, LossOutput):
        raise ContractViolation(f"compute_loss returned {type(result).__name__}, not LossOutput")
    loss = result.loss
    if not isinstance(loss, torch.Tensor):
        raise ContractViolation(f"LossOutput.loss is a {type(loss).__name__}, not a torch.Tensor")
    evaluation = Evaluation(batch=batch, outputs=outputs, result=result)
    evaluation.loss = float(loss.detach().reshape(-1)[0]) if loss.numel() else math.nan
    if backward and loss.requires_grad and loss.numel() == 1:
        loss.reshape(()).backward()
        evaluation.logprob_grad = logprob_gradient(outputs, batch.response_ids)
        for name in ("values",):
            tensor = getattr(outputs, name)
            if tensor is not None and tensor.grad is not None:
                evaluation.extra_grads[name] = tensor.grad
    return evaluation


def logprob_gradient(outputs: PolicyOutputs, response_ids: torch.Tensor) -> torch.Tensor | None:
    """d loss / d logprobs ``[B, R]``, or None when the loss reached neither the log-probs nor
    the logits. For a loss over whole distributions (``outputs.logits`` a leaf) it is the
    logits' gradient seen from the sampled token: a descent step of size eta on the logits
    changes log pi(y_t) by -eta (g_y - sum_v pi_v g_v), which is what a gradient
    ``g_y - sum_v pi_v g_v`` on log pi(y_t) itself would do, so every property reads it alike."""
    grad = outputs.logprobs.grad if outputs.logprobs.is_leaf else None
    logits = outputs.logits
    if logits is None or not logits.is_leaf or logits.grad is None:
        return grad
    g = logits.grad.detach()
    ids = response_ids.to(g.device)
    probs = torch.softmax(logits.detach(), dim=-1)
    seen = g.gather(-1, ids[..., None])[..., 0] - (probs * g).sum(dim=-1)
    return seen if grad is None else grad + seen


def _close(a: float, b: float) -> bool:
    """a ≈ b within the tolerances; non-finite values are close only to themselves."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= ATOL + RTOL * max(abs(a), abs(b))


def _grad(evaluation: Evaluation) -> torch.Tensor:
    grad = evaluation.logprob_grad
    return torch.zeros_like(evaluation.outputs.logprobs) if grad is None else grad.detach()


def _assert_grads_close(
    expected: torch.Tensor, actual: torch.Tensor, what: str, mask: torch.Tensor
) -> None:
    same = (expected == actual) | (expected.isnan() & actual.isnan())
    finite = torch.isfinite(expected) & torch.isfinite(actual)
    scale = float(torch.where(finite, expected.abs().maximum(actual.abs()), 0.0).max())
    diff = torch.where(same | ~mask.bool(), 0.0, (expected - actual).abs().nan_to_num(math.inf))
    worst = float(diff.max()) if diff.numel() else 0.0
    if not worst <= ATOL + RTOL * scale:
        row, col = divmod(int(diff.argmax()), diff.shape[1])
        raise ContractViolation(
            f"{what}: d loss / d logprobs[{row}, {col}] is {float(actual[row, col])!r}, "
            f"expected {float(expected[row, col])!r}"
        )


def _assert_metrics_close(expected: dict[str, Any], actual: dict[str, Any], what: str) -> None:
    if set(expected) != set(actual):
        raise ContractViolation(
            f"{what}: metric keys differ: {sorted(set(expected) ^ set(actual))}"
        )
    for key, value in expected.items():
        other = actual[key]
        if isinstance(value, float) and isinstance(other, float) and not _close(value, other):
            raise ContractViolation(f"{what}: metric {key!r} is {other!r}, expected {value!r}")


# --------------------------------------------------------------------------- the properties


def _prop_output_types(factory: Callable[[], Any], case: BatchCase) -> None:
    ev = evaluate(factory(), case, backward=False)
    loss = ev.result.loss
    if loss.dim() != 0:
        raise ContractViolation(f"loss has shape {tuple(loss.shape)}; expected a 0-dim scalar")
    if not loss.dtype.is_floating_point:
        raise ContractViolation(f"loss has dtype {loss.dtype}; expected a floating dtype")
    if not loss.requires_grad:
        raise ContractViolation("loss does not require grad: it is not connected to the policy")
    loss.backward()
    if logprob_gradient(ev.outputs, ev.batch.response_ids) is None:
        what = "outputs.logprobs" if ev.outputs.logits is None else "outputs.logits"
        raise ContractViolation(f"loss.backward() gave no gradient for {what}")
    if not isinstance(ev.batch, RolloutBatch):
        raise ContractViolation(
            f"compute_advantages returned {type(ev.batch).__name__}, not RolloutBatch"
        )
    if ev.batch.size != case.size:
        raise ContractViolation(
            f"compute_advantages changed the batch size from {case.size} to {ev.batch.size}"
        )
    mask = ev.batch.response_mask.bool()
    for name in ("advantages", "returns"):
        tensor = getattr(ev.batch, name)
        if tensor is None:
            continue
        if tuple(tensor.shape) != (case.size, case.width):
            raise ContractViolation(
                f"batch.{name} has shape {tuple(tensor.shape)}; expected [B, R] = "
                f"{[case.size, case.width]}"
            )
        if not torch.isfinite(tensor[mask]).all():
            raise ContractViolation(f"batch.{name} is not finite on real tokens")
    if ev.batch.advantages is not None and (ev.batch.advantages.detach()[~mask] != 0).any():
        raise ContractViolation("batch.advantages is not 0 on padding (see the hookspec)")


def _prop_metrics(factory: Callable[[], Any], case: BatchCase) -> None:
    ev = evaluate(factory(), case, backward=False)
    metrics = ev.result.metrics
    if not isinstance(metrics, dict):
        raise ContractViolation(f"LossOutput.metrics is a {type(metrics).__name__}, not a dict")
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ContractViolation(f"metric key {key!r} is not a str")
        if owned_by_engine(key):
            raise ContractViolation(
                f"metric {key!r} is a name the engine computes for every arm (alignzoo.metrics); "
                "put the algorithm's own value under its namespace"
            )
        if isinstance(value, bool) or not isinstance(value, float):
            raise ContractViolation(
                f"metric {key!r} is a {type(value).__name__} ({value!r}); expected a Python "
                "float (use float(tensor))"
            )
        if not math.isfinite(value):
            raise ContractViolation(f"metric {key!r} is {value!r}; expected a finite float")


def _prop_finite(factory: Callable[[], Any], case: BatchCase) -> None:
    ev = evaluate(factory(), case)
    if not math.isfinite(ev.loss):
        raise ContractViolation(f"loss is {ev.loss!r}")
    grad = _grad(ev)
    if not torch.isfinite(grad).all():
        row, col = divmod(int((~torch.isfinite(grad)).float().argmax()), grad.shape[1])
        raise ContractViolation(f"d loss / d logprobs[{row}, {col}] is {float(grad[row, col])!r}")
    for name, extra in ev.extra_grads.items():
        if not torch.isfinite(extra).all():
            raise ContractViolation(f"the gradient w.r.t. outputs.{name} is not finite")


ON_POLICY_LOGPROB = -1.0
"""Every log-prob of the ``direction`` check's batch (policy, behaviour and reference alike)."""


TEACHER_PREFERS, TEACHER_DOUBTS = -0.5, -2.0
"""The teacher's log-prob of each token of a group's best sample, and of the others', in the
``direction`` check's batch (a distillation algorithm raises what its teacher prefers)."""


def directional(case: BatchCase, data: str) -> BatchCase:
    """``case`` made into the ``direction`` check's batch (see the module docstring): on
    policy, log-probs :data:`ON_POLICY_LOGPROB`, values 0, entropy 1 (so an entropy quantile
    keeps every token), no weights; online scores 1 for the first sample of each group and 0
    for the others."""

    def rows(value: float) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(value for _ in range(case.width)) for _ in range(case.size))

    logp = rows(ON_POLICY_LOGPROB)
    updates: dict[str, Any] = {"logprobs": logp, "weights": None}
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(case, name) is not None:
            updates[name] = logp
    for name in ("values", "policy_values"):
        if getattr(case, name) is not None:
            updates[name] = rows(0.0)
    if case.entropy is not None:  # flat, as the log-probs: no token stands out by its entropy
        updates["entropy"] = rows(1.0)
    if case.mismatched_ref_logprobs is not None and case.mismatched_logprobs is not None:
        updates["mismatched_ref_logprobs"] = case.mismatched_logprobs
    if data == "online":
        seen: set[int] = set()
        scores = []
        for group in case.group_ids:
            scores.append(0.0 if group in seen else 1.0)
            seen.add(group)
        updates["scores"] = tuple(scores)
        if case.teacher_logprobs is not None:  # the teacher agrees: it prefers the best sample
            updates["teacher_logprobs"] = tuple(
                tuple(TEACHER_PREFERS if s == 1.0 else TEACHER_DOUBTS for _ in range(case.width))
                for s in scores
            )
    elif data == "demonstrations" and case.teacher_logprobs is not None:
        updates["teacher_logprobs"] = rows(TEACHER_PREFERS)  # the teacher agrees with them
    return dataclasses.replace(case, **updates)


def _prop_direction(factory: Callable[[], Any], case: BatchCase, data: str) -> None:
    """See ``direction`` in the module docstring."""
    built = directional(case, data)
    ev = evaluate(factory(), built)
    mask = ev.batch.response_mask.detach()
    # The change of each sample's log-probability under a small descent step: -dL/dlogp summed
    # over its real tokens.
    step = (-_grad(ev) * mask).sum(dim=1).tolist()
    hint = (
        "is the loss's sign, or the advantages', flipped?"
        if data == "online"
        else "is the loss's sign, or the chosen and rejected (desirable) sides, flipped?"
    )

    def fail(i: int, what: str) -> ContractViolation:
        return ContractViolation(
            f"direction: a gradient step on the loss {what}: sample {i}'s log-probability "
            f"changes by {step[i]:+.3g} ({built.size} samples, lengths {list(built.lengths)}, "
            f"groups {list(built.group_ids)}); {hint}"
        )

    if data == "online":
        assert built.scores is not None
        best = {g: i for i, (g, sc) in enumerate(zip(built.group_ids, built.scores, strict=True))
                if sc == 1.0}  # fmt: skip
        for i, (group, score) in enumerate(zip(built.group_ids, built.scores, strict=True)):
            if score == 1.0 and list(built.group_ids).count(group) > 1 and not step[i] > 0:
                raise fail(i, "does not raise the log-probability of its group's best sample")
            if score == 0.0 and not step[best[group]] > step[i]:
                raise fail(
                    i,
                    f"raises this worse sample's log-probability at least as much as its "
                    f"group's best one's (sample {best[group]}: {step[best[group]]:+.3g})",
                )
    elif data == "preference":
        assert built.labels is not None
        pairs = zip(built.group_ids, built.labels, strict=True)
        chosen = {g: i for i, (g, y) in enumerate(pairs) if y == 1.0}
        for i, (group, label) in enumerate(zip(built.group_ids, built.labels, strict=True)):
            if label == 0.0 and not step[chosen[group]] - step[i] > 0:
                raise fail(i, "does not raise the chosen-minus-rejected margin of this pair")
    elif data == "demonstrations":
        for i in range(built.size):
            if not step[i] > 0:
                raise fail(i, "does not raise a demonstrated completion's log-probability")
    else:
        assert built.labels is not None
        for i, label in enumerate(built.labels):
            if label == 1.0 and not step[i] > 0:
                raise fail(i, "does not raise a desirable completion's log-probability")
            if label == 0.0 and not step[i] < 0:
                raise fail(i, "does not lower an undesirable completion's log-probability")


def _prop_weights(factory: Callable[[], Any], case: BatchCase, data: str) -> None:
    """See ``weights_honoured`` in the module docstring."""
    assert case.weights is not None
    zeroed = [0] if data != "preference" else [
        i for i, g in enumerate(case.group_ids) if g == case.group_ids[0]
    ]  # fmt: skip
    weights = tuple(0.0 if i in zeroed else w for i, w in enumerate(case.weights))
    ev = evaluate(factory(), dataclasses.replace(case, weights=weights))
    grad = _grad(ev)
    leaked = float(grad[zeroed].abs().nan_to_num(math.inf).max())
    what = "sample 0" if data != "preference" else f"the pair of samples {zeroed}"
    if leaked > 0.0:
        raise ContractViolation(
            f"weights_honoured: {what} has weight 0 in batch.weights but gets gradient up to "
            f"{leaked:.3g}; multiply each sample's loss by batch.weights, or do not declare "
            "AlgorithmRequirements(weights=True)"
        )
    doubled = tuple(2.0 * w if i in zeroed else w for i, w in enumerate(case.weights))
    once = _grad(evaluate(factory(), case))[zeroed]
    twice = _grad(evaluate(factory(), dataclasses.replace(case, weights=doubled)))[zeroed]
    if not torch.allclose(twice, 2.0 * once, rtol=RTOL, atol=ATOL):
        ratio = float(twice.abs().sum() / once.abs().sum().clamp_min(1e-30))
        raise ContractViolation(
            f"weights_honoured: doubling {what}'s weight in batch.weights scaled its gradient by "
            f"{ratio:.3g}, not 2; multiply each sample's loss by its weight (not by a 0/1 mask "
            "of the weights, nor normalised by their sum)"
        )


def _prop_padding(factory: Callable[[], Any], case: BatchCase, padded: BatchCase) -> None:
    base = evaluate(factory(), case)
    more = evaluate(factory(), padded)
    if not _close(base.loss, more.loss):
        raise ContractViolation(
            f"loss changed from {base.loss!r} to {more.loss!r} when padding was changed/added"
        )
    width = case.width
    real = base.batch.response_mask.detach()
    g_base, g_more = _grad(base), _grad(more)
    _assert_grads_close(g_base, g_more[:, :width], "padding changed the gradient", real)
    pad = ~more.batch.response_mask.detach().bool()
    leaked = torch.where(pad, g_more.abs().nan_to_num(math.inf), 0.0)
    if float(leaked.max()) > 0.0:
        row, col = divmod(int(leaked.argmax()), leaked.shape[1])
        raise ContractViolation(
            f"padding position logprobs[{row}, {col}] gets gradient {float(g_more[row, col])!r}"
        )


def _prop_permutation(
    factory: Callable[[], Any], case: BatchCase, moved: BatchCase, order: list[int], what: str
) -> None:
    base = evaluate(factory(), case)
    perm = evaluate(factory(), moved)
    if not _close(base.loss, perm.loss):
        raise ContractViolation(f"{what} changed the loss from {base.loss!r} to {perm.loss!r}")
    expected = _grad(base)[torch.tensor(order)]
    mask = perm.batch.response_mask.detach()
    _assert_grads_close(expected, _grad(perm), f"{what} (rows in the new order)", mask)
    _assert_metrics_close(base.result.metrics, perm.result.metrics, what)


def _prop_micro_batches(
    factory: Callable[[], Any], case: BatchCase, parts: list[list[int]]
) -> None:
    whole = evaluate(factory(), case)
    pm = _manager(factory())
    batch, outputs = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        advantaged = pm.hook.compute_advantages(batch=batch)
        batch = batch if advantaged is None else advantaged
        context = batch.loss_context(micro_batches=len(parts))
        total = 0.0
        for part in parts:
            index = torch.tensor(part, dtype=torch.long)

            micro = PolicyOutputs(
                logprobs=outputs.logprobs[index],
                entropy=None if outputs.entropy is None else outputs.entropy[index],
                values=None if outputs.values is None else outputs.values[index],
                logits=None if outputs.logits is None else outputs.logits[index],
                teacher_logits=(
                    None if outputs.teacher_logits is None else outputs.teacher_logits[index]
                ),
                log_sum_sq_probs=(
                    None if outputs.log_sum_sq_probs is None else outputs.log_sum_sq_probs[index]
                ),
            )
            result = pm.hook.compute_loss(batch=batch.select(part), outputs=micro, context=context)
            loss = result.loss.reshape(())
            total += float(loss.detach())
            if loss.requires_grad:
                loss.backward()
    what = f"micro-batches {parts} given the whole batch's LossContext"
    if not _close(whole.loss, total):
        raise ContractViolation(
            f"{what}: their losses add up to {total!r}, the whole batch's loss is {whole.loss!r} "
            "(normalise by context.tokens / context.sequences, not by the micro-batch's own)"
        )
    gradient = logprob_gradient(outputs, batch.response_ids)
    accumulated = gradient if gradient is not None else torch.zeros_like(outputs.logprobs)
    mask = batch.response_mask.detach()
    _assert_grads_close(_grad(whole), accumulated.detach(), f"{what}: accumulated gradient", mask)


def _checkpointed(component: Any, factory: Callable[[], Any]) -> Any:
    """A fresh instance restored from ``component``'s state the way a checkpoint restores it."""
    import io

    from alignzoo.plugin import Stateful

    fresh = factory()
    if isinstance(component, Stateful):
        buffer = io.BytesIO()
        torch.save(component.state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        if not isinstance(fresh, Stateful):  # pragma: no cover - same class
            raise ContractViolation("a fresh instance has no load_state_dict")
        fresh.load_state_dict(state)
    return fresh


def _prop_state_roundtrip(factory: Callable[[], Any], cases: list[BatchCase]) -> None:
    steady = factory()
    first = [evaluate(steady, case, backward=False) for case in cases]
    stopped = factory()
    evaluate(stopped, cases[0], backward=False)
    resumed = _checkpointed(stopped, factory)
    for i, case in enumerate(cases[1:], start=1):
        again = evaluate(resumed, case, backward=False)
        what = f"batch {i} after a save and restore at batch 0"
        hint = (
            ". The algorithm keeps state across steps that a checkpoint does not carry: "
            "implement state_dict() and load_state_dict(state) (alignzoo.Stateful)"
        )
        if not _close(first[i].loss, again.loss):
            raise ContractViolation(
                f"{what}: loss {again.loss!r}, without the restart {first[i].loss!r}{hint}"
            )
        try:
            _assert_metrics_close(first[i].result.metrics, again.result.metrics, what)
        except ContractViolation as exc:
            raise ContractViolation(f"{exc}{hint}") from None


# --------------------------------------------------------------------------- strategies per check


@st.composite
def _micro_split(
    draw: st.DrawFn, cases: st.SearchStrategy[BatchCase], by_group: bool
) -> tuple[BatchCase, list[list[int]]]:
    """A case and a split of its rows into 2-3 micro-batches (whole groups when ``by_group``)."""
    case = draw(cases)
    keys = list(dict.fromkeys(case.group_ids)) if by_group else list(range(case.size))
    parts = draw(st.integers(2, 3))
    assign = {key: draw(st.integers(0, parts - 1)) for key in keys}
    split: list[list[int]] = [[] for _ in range(parts)]
    for row in range(case.size):
        split[assign[case.group_ids[row] if by_group else row]].append(row)
    return case, [p for p in split if p]


@st.composite
def _padded_pair(
    draw: st.DrawFn, cases: st.SearchStrategy[BatchCase]
) -> tuple[BatchCase, BatchCase]:
    case = draw(cases)
    fill, ids = draw(padding_fill(case))
    return case, case.repadded(fill, ids)


@st.composite
def _sample_permutation(
    draw: st.DrawFn, cases: st.SearchStrategy[BatchCase]
) -> tuple[BatchCase, list[int]]:
    case = draw(cases)
    return case, list(draw(st.permutations(range(case.size))))


@st.composite
def _group_permutation(
    draw: st.DrawFn, cases: st.SearchStrategy[BatchCase]
) -> tuple[BatchCase, list[int], dict[int, int]]:
    case = draw(cases)
    groups = sorted(set(case.group_ids))
    new_ids = draw(
        st.lists(st.integers(0, 999), min_size=len(groups), max_size=len(groups), unique=True)
    )
    mapping = dict(zip(groups, new_ids, strict=True))
    group_order = draw(st.permutations(groups))
    rank = {g: i for i, g in enumerate(group_order)}
    order = sorted(range(case.size), key=lambda i: (rank[case.group_ids[i]], i))
    return case, order, mapping


# --------------------------------------------------------------------------- running a check


def _format_failure(exc: BaseException, last_example: list[Any]) -> str:
    """The failure in a few lines: the message, then the smallest failing example summarised
    (:func:`summarise`), never dumped whole."""
    if isinstance(exc, ContractViolation):
        message = str(exc)
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        message = f"{type(exc).__name__}: {exc}{where}"
    lines = [message]
    if last_example:  # the last failing call is the shrunk example hypothesis reports
        lines.append(f"Smallest failing example: {summarise(last_example[-1])}")
    return "\n".join(lines)


SUMMARY_CHARS = 600
"""Most characters of a summarised example."""


def summarise(value: Any, depth: int = 0) -> str:
    """A short description of a test example: tensors as shape, dtype and a few values, long
    text and long lists cut, dataclasses by their fields; at most :data:`SUMMARY_CHARS`."""
    text = _summary(value, depth)
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def _summary(value: Any, depth: int) -> str:
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()[:4].tolist()
        shown = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in flat)
        more = ", …" if value.numel() > 4 else ""
        return f"tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')} [{shown}{more}]"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"{value[:37]!r}… ({len(value)} chars)"
    if depth >= 3:
        return "…"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [
            f"{f.name}={_summary(getattr(value, f.name), depth + 1)}"
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        ]
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, dict):
        items = [f"{k!r}: {_summary(v, depth + 1)}" for k, v in list(value.items())[:4]]
        more = f", … {len(value) - 4} more" if len(value) > 4 else ""
        return "{" + ", ".join(items) + more + "}"
    if isinstance(value, (list, tuple)):
        items = [_summary(v, depth + 1) for v in value[:3]]
        more = f", … ({len(value)} items)" if len(value) > 3 else ""
        ends = "[]" if isinstance(value, list) else "()"
        return ends[0] + ", ".join(items) + more + ends[1]
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


@contextlib.contextmanager
def _shrink_budget(seconds: float) -> Iterator[None]:
    """Cap the time hypothesis spends shrinking a failure (its default is 5 minutes).

    Uses a module constant of hypothesis' engine when it exists; otherwise does nothing.
    """
    try:
        engine = importlib.import_module("hypothesis.internal.conjecture.engine")
    except ImportError:  # pragma: no cover - a hypothesis without this module
        engine = None
    previous = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if previous is None:
        yield
        return
    setattr(engine, "MAX_SHRINKING_SECONDS", seconds)  # noqa: B010 - a module constant
    try:
        yield
    finally:
        setattr(engine, "MAX_SHRINKING_SECONDS", previous)  # noqa: B010


def component_factory(
    kind: str, component: Any, params: Any = None
) -> tuple[str, Callable[[], Any]]:
    """A label and a factory of fresh instances: from a registered name, a class (with
    ``params``) or an instance (copied each time)."""
    if isinstance(component, str):
        cls = get_registry().get(kind, component)
        return component, lambda: cls(params)
    if isinstance(component, type):
        return component.__qualname__, lambda: component(params)
    return type(component).__qualname__, lambda: copy.deepcopy(component)


def build_for_check(label: str, factory: Callable[[], Any], kind: str) -> CheckResult | Any:
    """A fresh instance from ``factory``, or the failed ``instantiate`` check saying why (it
    raised, or it is not of ``kind``)."""
    try:
        instance = factory()
    except Exception as exc:
        hint = " (give its params: --params on the command line, params= in Python)"
        return CheckResult("instantiate", False, f"{label}: {type(exc).__name__}: {exc}{hint}")
    if getattr(instance, "kind", None) != kind:
        return CheckResult(
            "instantiate", False, f"{label}: kind {getattr(instance, 'kind', None)!r}, not {kind}"
        )
    return instance


REBUILD_HINT = "rebuild a case's tensors with BatchCase(...).build()"
"""How to reproduce a failing algorithm or modifier example."""


def run_property(
    name: str,
    strategy: st.SearchStrategy[Any],
    prop: Callable[[Any], None],
    max_examples: int,
    shrink_seconds: float,
    legend: str = "",
    hint: str = "",
) -> CheckResult:
    """Check ``prop`` on ``max_examples`` drawn from ``strategy`` (hypothesis, no deadline,
    shrinking for at most ``shrink_seconds``): one :class:`CheckResult` named ``name``, with the
    smallest failing example summarised, ``legend`` (what the example's fields mean) and
    ``hint`` (how to reproduce it, for the component's kind) when it fails."""
    last_example: list[Any] = []

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(strategy)
    def check(example: Any) -> None:
        try:
            prop(example)
        except Exception:
            last_example.append(example)
            raise

    reports: list[str] = []  # hypothesis' own messages (a shrink timeout): kept out of stdout
    try:
        with _shrink_budget(shrink_seconds), with_reporter(lambda text: reports.append(str(text))):
            check()
    except HypothesisException as exc:
        return CheckResult(name, False, f"hypothesis could not run the check: {exc}")
    except Exception as exc:
        detail = _format_failure(exc, last_example)
        if legend or hint:
            detail += f"\n({'; '.join(t for t in (legend, hint) if t)})"
        return CheckResult(name, False, detail)
    return CheckResult(name, True, f"{max_examples} examples")


def check_algorithm(
    algorithm: str | type[Algorithm] | Algorithm,
    max_examples: int = 50,
    shrink_seconds: float | None = None,
    checks: Iterable[str] | None = None,
) -> list[CheckResult]:
    """Run the contract suite on an algorithm; one :class:`CheckResult` per name in :data:`CHECKS`.

    ``algorithm`` is a registered name (looked up with
    ``get_registry().get("algorithm", name)``; an unknown or broken name raises its UserError),
    an :class:`Algorithm` subclass (instantiated with default params) or an instance (copied
    for every evaluation, so its params are checked). ``max_examples`` is the number of
    hypothesis examples per property; ``shrink_seconds`` caps the time spent shrinking a
    failing example before it is reported (default :data:`DEFAULT_SHRINK_SECONDS`).
    ``checks`` restricts the run to those check names (``instantiate`` always runs).
    """
    if shrink_seconds is None:
        shrink_seconds = DEFAULT_SHRINK_SECONDS
    selected = set(CHECKS if checks is None else checks) | {"instantiate"}
    unknown = selected - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown check names {sorted(unknown)}; known: {', '.join(CHECKS)}")
    label, factory = _resolve(algorithm)
    try:
        instance = factory()
        requirements = _manager(instance).hook.algorithm_requirements()
        if not isinstance(requirements, AlgorithmRequirements):
            raise ContractViolation(
                f"algorithm_requirements returned {requirements!r}, not AlgorithmRequirements"
            )
    except Exception as exc:
        detail = f"{label}: {type(exc).__name__}: {exc}"
        return [CheckResult("instantiate", False, detail)] + [
            CheckResult(name, False, "not run: the algorithm could not be instantiated")
            for name in CHECKS[1:]
            if name in selected
        ]

    cases = batch_cases(requirements)
    extreme = batch_cases(requirements, logprobs=extreme_logprob_values())

    def shuffled(ex: tuple[BatchCase, list[int]]) -> None:
        case, order = ex
        _prop_permutation(factory, case, case.permuted(order), order, "shuffling the samples")

    def regrouped(ex: tuple[BatchCase, list[int], dict[int, int]]) -> None:
        case, order, mapping = ex
        moved = case.permuted(order).relabeled(mapping)
        _prop_permutation(factory, case, moved, order, "reordering and renaming whole groups")

    one = "example = one batch"
    properties: list[tuple[str, st.SearchStrategy[Any], Callable[[Any], None], str]] = [
        ("output_types", cases, lambda c: _prop_output_types(factory, c), one),
        ("metrics_finite_floats", cases, lambda c: _prop_metrics(factory, c), one),
        ("finite_extreme_logprobs", extreme, lambda c: _prop_finite(factory, c), one),
        (
            "padding_invariance",
            _padded_pair(cases),
            lambda ex: _prop_padding(factory, *ex),
            "example = (batch, the same batch with its padding rewritten and extended)",
        ),
        (
            "sample_permutation",
            _sample_permutation(cases),
            shuffled,
            "example = (batch, order): row i of the shuffled batch is row order[i]",
        ),
        (
            "group_permutation",
            _group_permutation(cases),
            regrouped,
            "example = (batch, order, renaming of group ids)",
        ),
        (
            "micro_batch_invariance",
            _micro_split(cases, by_group=requirements.data == "preference"),
            lambda ex: _prop_micro_batches(factory, *ex),
            "example = (batch, the rows of each micro-batch)",
        ),
        (
            "direction",
            cases,
            lambda c: _prop_direction(factory, c, requirements.data),
            "example = one batch, before it is made on-policy with scores 1 and 0",
        ),
        (
            "state_roundtrip",
            st.lists(cases, min_size=3, max_size=3),
            lambda ex: _prop_state_roundtrip(factory, ex),
            "example = three batches, one per step; saved and restored after the first",
        ),
    ]
    if requirements.weights:
        properties.insert(
            -1,
            (
                "weights_honoured",
                batch_cases(requirements, weighted=True),
                lambda c: _prop_weights(factory, c, requirements.data),
                "example = one weighted batch, sample 0 (or its pair) then given weight 0, then twice "
                "its weight",
            ),
        )
    results = [CheckResult("instantiate", True, f"{label}: {requirements}")]
    if "weights_honoured" in selected and not requirements.weights:
        results.append(
            CheckResult(
                "weights_honoured",
                True,
                "not declared (AlgorithmRequirements.weights is False): a modifier that sets "
                "weights is refused around it",
            )
        )
    for name, strategy, prop, legend in properties:
        if name in selected:
            results.append(
                run_property(
                    name, strategy, prop, max_examples, shrink_seconds, legend, REBUILD_HINT
                )
            )
    return sorted(results, key=lambda r: CHECKS.index(r.name))  # in the order of CHECKS


def assert_algorithm_contract(
    algorithm: str | type[Algorithm] | Algorithm,
    max_examples: int = 50,
    skip: Iterable[str] = (),
    shrink_seconds: float | None = None,
) -> list[CheckResult]:
    """Run :func:`check_algorithm` and raise AssertionError listing every failed check.

    ``skip`` names checks not to run (documented exceptions of an algorithm). Returns the
    results when every check that ran passed.
    """
    skipped = set(skip)
    unknown = skipped - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown check names {sorted(unknown)}; known: {', '.join(CHECKS)}")
    results = check_algorithm(
        algorithm,
        max_examples=max_examples,
        shrink_seconds=shrink_seconds,
        checks=[name for name in CHECKS if name not in skipped],
    )
    failed = [r for r in results if not r.passed]
    if failed:
        report = "\n\n".join(f"[{r.name}] {r.detail}" for r in failed)
        raise AssertionError(f"{len(failed)} contract check(s) failed:\n\n{report}")
    return results
