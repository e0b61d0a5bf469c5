"""The engine's one way to call plugins: a typed facade over a run's PluginManager.

Every hook call of the engine goes through :class:`Hooks`, which checks what the plugin
returned against the contract in :mod:`alignzoo.hookspecs` and, when it breaks it, raises a
:class:`~alignzoo.errors.RunError` that names the hook, the component and what was expected.
An exception raised inside a plugin is wrapped the same way (a :class:`UserError` or
:class:`RunError` passes through unchanged: the plugin already said what is wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from alignzoo.devices import check_placement
from alignzoo.errors import RunError, UserError
from alignzoo.metrics import owned_by_engine
from alignzoo.ops import sampling_rows
from alignzoo.types import AlgorithmRequirements, LossContext, LossOutput, Placement

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import PolicyOutputs, RolloutBatch
    from alignzoo.engine.context import RunContext
    from alignzoo.rollout.multiturn import Episodes
    from alignzoo.types import SamplingParams
    from alignzoo.weights import PolicyWeights

T = TypeVar("T")


def implementers(pm: pluggy.PluginManager, hook: str) -> str:
    """The components implementing ``hook`` in call order, as ``'EntropyBonus, GRPO'`` (wrappers first)."""
    caller = getattr(pm.hook, hook)
    names = []
    for impl in reversed(caller.get_hookimpls()):
        plugin = impl.plugin
        names.append(type(plugin).__name__ if not isinstance(plugin, type) else str(plugin))
    return ", ".join(names) or "no component"


class Hooks:
    """Typed, checked calls to the hooks of one run's PluginManager; it holds nothing else."""

    def __init__(self, pm: pluggy.PluginManager, algorithm: str = "the algorithm") -> None:
        self.pm = pm
        self.algorithm = algorithm

    # ------------------------------------------------------------------ plumbing
    def _call(self, hook: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.pm.hook, hook)(**kwargs)
        except (UserError, RunError):
            raise
        except Exception as exc:  # name the hook and the plugin: a bare traceback says little
            raise RunError(
                f"{hook} failed in {implementers(self.pm, hook)}: {type(exc).__name__}: {exc}"
            ) from exc

    def _expect(self, hook: str, value: Any, kind: type[T], what: str) -> T:
        if not isinstance(value, kind):
            got = "nothing" if value is None else type(value).__name__
            raise RunError(
                f"{hook} of {implementers(self.pm, hook)} returned {got}; expected {what}"
            )
        return value

    # ------------------------------------------------------------------ algorithm
    def algorithm_requirements(self) -> AlgorithmRequirements:
        """What the arm's algorithm needs (checked to be an AlgorithmRequirements)."""
        value = self._call("algorithm_requirements")
        if value is None:
            raise UserError(f"{self.algorithm}: the algorithm states no requirements")
        return self._expect(
            "algorithm_requirements", value, AlgorithmRequirements, "an AlgorithmRequirements"
        )

    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """The step batch with advantages; the same size as ``batch``."""
        from alignzoo.batch import RolloutBatch

        result = self._call("compute_advantages", batch=batch)
        result = batch if result is None else result
        result = self._expect("compute_advantages", result, RolloutBatch, "a RolloutBatch")
        if result.size != batch.size:
            raise RunError(
                f"compute_advantages of {implementers(self.pm, 'compute_advantages')} returned "
                f"{result.size} samples for {batch.size}"
            )
        return result

    def compute_loss(
        self, batch: RolloutBatch, outputs: PolicyOutputs, context: LossContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss share (a scalar tensor with a gradient) and float metrics."""
        import torch

        result = self._call("compute_loss", batch=batch, outputs=outputs, context=context)
        result = self._expect("compute_loss", result, LossOutput, "a LossOutput")
        loss = result.loss
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            got = (
                f"a tensor of shape {list(loss.shape)}, requires_grad={loss.requires_grad}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise RunError(
                f"algorithm {self.algorithm!r}: compute_loss must return a scalar tensor that "
                f"depends on outputs.logprobs; got {got}"
            )
        metrics: dict[str, float] = {}
        for key, value in result.metrics.items():
            if not isinstance(key, str):
                raise RunError(f"algorithm {self.algorithm!r}: metric name {key!r} is not a str")
            if owned_by_engine(key):
                raise RunError(
                    f"algorithm {self.algorithm!r}: compute_loss returned the metric {key!r}, "
                    "which the engine computes for every arm (alignzoo.metrics); report the "
                    f"algorithm's own value as '{self.algorithm}/{key.replace('/', '_')}'"
                )
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError):
                raise RunError(
                    f"algorithm {self.algorithm!r}: metric {key!r} is {value!r}, not a number"
                ) from None
        return loss, metrics

    # Labeler calls go through the labeling stage (alignzoo.labeling), which turns
    # what a labeler returns into typed outcomes instead of raising.

    # ------------------------------------------------------------------ backend
    def rollout(
        self,
        prompts: list[str],
        extras: list[dict[str, Any]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None = None,
        episodes: Episodes | None = None,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """``n`` samples per prompt and their ``env/*`` metrics: multi-turn ``episodes`` (the
        episode runner of an arm with an environment), else the backend's ``generate`` (no
        metrics); the batch records the sampling parameters it was drawn with
        (``batch.sampling``)."""
        if episodes is None:
            batch, metrics = self.generate(prompts, extras, n, sampling, seeds), {}
        else:
            batch, metrics = episodes.run(self.pm, prompts, extras, n, sampling, seeds)
        # what the trainer recomputes the sampled tokens' log-probs under
        batch.sampling = sampling_rows(sampling.temperature, sampling.top_k, sampling.top_p,
                                       batch.size)  # fmt: skip
        return batch, metrics

    def generate(
        self,
        prompts: list[str],
        extras: list[dict[str, Any]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """``n`` responses per prompt, checked against ``generate``'s layout contract."""
        from alignzoo.batch import RolloutBatch

        if seeds is not None and len(seeds) != len(prompts):
            raise RunError(f"{len(seeds)} sampling seeds for {len(prompts)} prompts")
        batch = self._call(
            "generate", prompts=prompts, extras=extras, n=n, sampling=sampling, seeds=seeds
        )
        if not isinstance(batch, RolloutBatch):
            raise RunError(
                f"the backend's generate returned {type(batch).__name__}, not a RolloutBatch"
            )
        if batch.size != len(prompts) * n:
            raise RunError(f"the backend returned {batch.size} samples for {len(prompts)} x {n}")
        if not batch.extras:
            batch.extras = [dict(e) for e in extras for _ in range(n)]
        if batch.rollout_logprobs is None and batch.old_logprobs is not None:
            batch.rollout_logprobs = batch.old_logprobs  # the contract's former name for them
        batch.old_logprobs = None  # the trainer's own forward pass computes the behaviour's
        check_layout(batch, n)
        return batch

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Hand the actor's current weights (a stream of named tensors, with a version) to the backend."""
        self._call("sync_weights", weights=weights)

    # ------------------------------------------------------------------ device mapper
    def place_roles(self, roles: Sequence[str], available: Sequence[str]) -> dict[str, Placement]:
        """A validated :class:`Placement` for every role in ``roles``."""
        placed = self._call("place_roles", roles=list(roles), available=list(available))
        if placed is None:
            raise UserError("the arm's device mapper placed no roles")
        if not isinstance(placed, dict):
            raise RunError(
                f"place_roles of {implementers(self.pm, 'place_roles')} returned "
                f"{type(placed).__name__}; expected a dict of role -> device or Placement"
            )
        missing = [r for r in roles if r not in placed]
        if missing:
            raise UserError(f"the device mapper did not place role(s) {', '.join(missing)}")
        where = f"devices ({implementers(self.pm, 'place_roles')})"
        return {
            str(role): check_placement(str(role), value, available, where=where)
            for role, value in placed.items()
        }

    # ------------------------------------------------------------------ lifecycle
    def on_run_start(self, run: RunContext) -> None:
        """Components set themselves up (models are loaded)."""
        self._call("on_run_start", run=run)

    @property
    def transforms_batch(self) -> bool:
        """Whether any component implements ``transform_batch``."""
        return bool(self.pm.hook.transform_batch.get_hookimpls())

    def transform_batch(self, batch: RolloutBatch, run: RunContext) -> RolloutBatch:
        """Every ``transform_batch`` implementation in turn, each on the previous output.

        Each implementation is called through pluggy on its own (a subset hook caller), in
        pluggy's order (LIFO, ``tryfirst`` first), so argument passing and hook monitoring
        work as for any hook.
        """
        from alignzoo.batch import RolloutBatch

        impls = self.pm.hook.transform_batch.get_hookimpls()
        plugins = [impl.plugin for impl in impls]
        for impl in reversed(impls):
            others = [p for p in plugins if p is not impl.plugin]
            caller = self.pm.subset_hook_caller("transform_batch", remove_plugins=others)
            results = caller(batch=batch, run=run)
            result = results[0] if results else None
            if result is not None:
                if not isinstance(result, RolloutBatch):
                    raise RunError(
                        f"transform_batch of {type(impl.plugin).__name__} returned "
                        f"{type(result).__name__}; expected a RolloutBatch or None"
                    )
                batch = result
        return batch

    def on_step_end(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        """Components see (and may add to) the step's metrics."""
        self.pm.hook.on_step_end(run=run, step=step, metrics=metrics)

    def on_run_end(self, run: RunContext, status: str) -> None:
        """Components release what they hold."""
        self.pm.hook.on_run_end(run=run, status=status)


def check_layout(batch: RolloutBatch, n: int) -> None:
    """Raise a RunError naming the field when a backend's batch breaks the ``generate`` contract
    (shapes that disagree, texts of the wrong length, groups not ``i // n``)."""
    import torch

    b = batch.size
    shapes = {
        "prompt_mask": (batch.prompt_mask, tuple(batch.prompt_ids.shape)),
        "response_mask": (batch.response_mask, tuple(batch.response_ids.shape)),
        "old_logprobs": (batch.old_logprobs, tuple(batch.response_ids.shape)),
        "rollout_logprobs": (batch.rollout_logprobs, tuple(batch.response_ids.shape)),
        "group_ids": (batch.group_ids, (b,)),
    }
    for name, (tensor, expected) in shapes.items():
        if tensor is not None and tuple(tensor.shape) != expected:
            raise RunError(
                f"the backend's batch: {name} has shape {list(tensor.shape)}, "
                f"expected {list(expected)}"
            )
    if batch.prompt_ids.shape[0] != b:
        raise RunError(
            f"the backend's batch: prompt_ids has {batch.prompt_ids.shape[0]} rows for {b}"
        )
    for name in ("prompts", "responses", "extras"):
        if len(getattr(batch, name)) != b:
            raise RunError(
                f"the backend's batch: {name} has {len(getattr(batch, name))} items for {b} samples"
            )
    if not torch.equal(batch.group_ids.cpu(), torch.arange(b) // n):
        raise RunError("the backend's batch: group_ids must be i // n (samples grouped by prompt)")
