"""Plugin building blocks: the hook implementation marker and the component base classes.

A *component* is a class with a ``kind``, a ``Params`` pydantic model and ``@hookimpl`` methods.
The registry finds component classes through entry points; a run instantiates the arm's
components with their validated params and registers the instances in its PluginManager.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import pluggy
from pydantic import BaseModel, ConfigDict

from alignzoo.types import AlgorithmRequirements, LabelRequest, Score

PROJECT = "alignzoo"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a method of a component as the implementation of an alignzoo hook."""

KINDS = ("algorithm", "labeler", "backend", "device_mapper", "modifier", "environment")


@runtime_checkable
class Stateful(Protocol):
    """A component that keeps state across steps (a KL controller, a running baseline, ...).

    A component with both methods is saved in every checkpoint and restored on ``--resume``:
    ``state_dict()`` returns plain data (numbers, strings, lists, dicts, tensors: what
    ``torch.save`` writes and ``torch.load(weights_only=True)`` reads back) and
    ``load_state_dict(state)`` restores it. A component without them is rebuilt from its params.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoParams(BaseModel):
    """Params model of a component that takes no parameters."""

    model_config = ConfigDict(extra="forbid")


class Component:
    """Base of every component. Subclasses set ``kind`` (via the kind base) and ``Params``.

    The first line of the class docstring is the one-line summary that ``alignzoo plugins`` shows.
    """

    kind: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        if params is None:
            params = self.Params()
        elif isinstance(params, dict):
            params = self.Params.model_validate(params)
        self.params = params

    @classmethod
    def params_for_arm(cls, params: dict[str, Any], arm: Any) -> dict[str, Any]:
        """The params to validate for this component in ``arm`` (an ArmSpec): a component may
        fill one from the arm's own settings (the reward_model labeler takes its ``path``
        from ``model.reward_model``). By default ``params`` as given."""
        return params

    @classmethod
    def summary(cls) -> str:
        """One line describing the component (the first line of its docstring)."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"


class Algorithm(Component):
    """Base for algorithms: implement ``compute_advantages`` and ``compute_loss`` hooks.

    Set the class attribute ``requirements`` or override the ``algorithm_requirements`` hook
    when what the algorithm needs depends on its params (GRPO with β = 0 needs no reference).
    """

    kind = "algorithm"
    requirements: ClassVar[AlgorithmRequirements] = AlgorithmRequirements()
    watched_metrics: ClassVar[tuple[str, ...]] = ()
    """The algorithm's own metrics its users watch; the console line shows them after the
    canonical ones (e.g. ``("actor/clipfrac", "critic/vf_loss")`` for PPO)."""

    @hookimpl(trylast=True)
    def algorithm_requirements(self) -> AlgorithmRequirements:
        return self.requirements


class Labeler(Component):
    """Base for labelers: implement ``score(request) -> Score`` (a plain method), or the
    ``score_batch`` hook itself.

    The default ``score_batch`` hook calls ``score`` once per request, in order. Labelers that
    batch for real (a reward model, a remote service) override ``score_batch`` (with
    ``@hookimpl``). See the ``score_batch`` hookspec for what a :class:`Score` may carry.
    """

    kind = "labeler"
    version: ClassVar[str] = "1"
    """Part of the label store's key: bump it when a change makes the labeler score the same
    request differently, so stored labels of the old version are not reused."""
    marks_correct: ClassVar[bool | None] = None
    """Whether every Score it returns says ``info["correct"]`` (what ``eval/exact_match`` and
    ``pass@k`` count): True for a verifier such as the arithmetic rule, False for a labeler
    that only scores (a reward model), None when it depends on its params or is not declared.
    ``alignzoo validate`` refuses ``evaluation.metric: exact_match`` for an arm whose labeler
    says False, and arms are compared on ``exact_match`` by default only when every arm's
    labeler says True."""
    stats_counters: ClassVar[frozenset[str]] = frozenset()
    """The keys of the labeler's ``stats()`` that are running totals (calls, errors, seconds
    waited): the step metrics ``labeler/<name>/<key>`` and the Prometheus counters report their
    increase per labeling pass, also from a worker process. Other keys are reported as they
    are (a current value)."""
    deterministic: ClassVar[bool] = True
    """Whether the same request always gets the same Score. False for people or a sampled
    judge: ``alignzoo check labeler`` then does not hold it to the same answer twice."""

    @property
    def gives_steps(self) -> bool:
        """Whether its Scores carry per-step scores (``Score.steps``: dense rewards, a process
        reward model's). ``alignzoo validate`` refuses such a labeler in front of an algorithm
        that does not read ``batch.dense_rewards`` (``AlgorithmRequirements.dense_rewards``).
        False by default; a labeler that gives steps overrides it (it may depend on params)."""
        return False

    @property
    def reward_components(self) -> dict[str, float] | None:
        """The rewards its Scores report apart in ``info["rewards"]``, in order, each with the
        weight its value gives it (value = sum of weight x reward), when that is known before
        the run; None (the default) when it is not. ``alignzoo validate`` holds it against an
        algorithm that weighs the rewards itself (``AlgorithmRequirements.reward_components``:
        their number, and weights of 1 in the value). A labeler that reports several rewards
        overrides it (``combine`` gives its parts and weights)."""
        return None

    def score(self, request: LabelRequest) -> Score:
        """Score one response to one prompt (called by the default ``score_batch``)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither score nor score_batch")

    @hookimpl(trylast=True)
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        return [self.score(request) for request in requests]


class Backend(Component):
    """Base for rollout backends: implement ``generate`` and ``sync_weights``."""

    kind = "backend"


class DeviceMapper(Component):
    """Base for device mappers: implement ``place_roles``."""

    kind = "device_mapper"


class Modifier(Component):
    """Base for modifiers: hook wrappers around algorithm hooks, batch transforms, lifecycle hooks.

    A modifier with ``default_on = True`` joins every arm that does not list it, with default
    params (an arm lists it to change its params, e.g. ``enabled: false``).
    """

    kind = "modifier"
    default_on: ClassVar[bool] = False
    sets_weights: ClassVar[bool] = False
    """True for a modifier that sets ``batch.weights``: ``alignzoo validate`` refuses it around
    an algorithm whose requirements do not declare ``weights`` (the weights would apply to
    nothing)."""


class Environment(Component):
    """Base for environments of multi-turn episodes: implement ``env_reset`` and ``env_step``
    (and ``env_close`` when an episode holds resources); see :mod:`alignzoo.hookspecs`."""

    kind = "environment"
