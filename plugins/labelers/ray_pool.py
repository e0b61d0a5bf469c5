"""Labeler "ray_pool": another labeler replicated as a pool of Ray actors (the ``ray`` extra).

Each of ``replicas`` actors builds the inner labeler itself, from its registry name and params
(nothing live is pickled), with ``num_cpus`` / ``num_gpus`` of the cluster's resources, and
calls its ``on_run_start`` with a small run of its own (``device("labeler")`` is ``cuda:0``
when the actor holds a GPU, else ``cpu``; ``seed`` is the run's). ``score_batch`` splits the
requests into one contiguous slice per actor, scores the slices in parallel and returns the
scores in request order. It sits behind the labeling stage like any labeler, so the arm's
timeouts, retries, fallbacks and circuit breaker apply to the pool as a whole; an actor that
dies makes the call fail (and the stage's policy decide) until Ray restarts it
(``max_restarts``).

The pool joins the Ray instance the process is connected to (``alignzoo run --executor ray``
runs each arm inside one), or ``address``, or starts a local one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.config.schema import ComponentRef
from alignzoo.errors import UserError


class _ActorRun:
    """What the inner labeler's ``on_run_start`` sees inside an actor."""

    def __init__(self, device: str, seed: int) -> None:
        self._device, self.seed = device, seed
        self.step = 0
        self.state: dict[str, Any] = {}

    def device(self, role: str) -> str:
        return self._device


class _Replica:
    """One actor's labeler (the body of the Ray actor class)."""

    def __init__(self, name: str, params: dict[str, Any], seed: int) -> None:
        from alignzoo.registry import build_plugin_manager, get_registry

        cls = get_registry().get("labeler", name)
        self.hook = build_plugin_manager([cls(cls.Params.model_validate(params))]).hook
        gpu = bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.hook.on_run_start(run=_ActorRun("cuda:0" if gpu else "cpu", seed))

    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        return list(self.hook.score_batch(requests=requests))

    def pid(self) -> int:
        return os.getpid()


class RayPoolLabeler(Labeler):
    """Another labeler replicated over a pool of Ray actors; requests split across them."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        labeler: ComponentRef = Field(description="The labeler each actor runs: {name, params}.")
        replicas: int = Field(2, ge=1, description="Actors in the pool.")
        num_cpus: float = Field(1.0, ge=0.0, description="CPUs each actor reserves.")
        num_gpus: float = Field(0.0, ge=0.0, description="GPUs (or a share of one) per actor.")
        max_restarts: int = Field(1, ge=0, description="Times Ray restarts an actor that died.")
        address: str | None = Field(
            None,
            description="Ray cluster to join when this process is not connected to one "
            "(default: start a local Ray).",
        )

    params: Params

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        from alignzoo.registry import get_registry

        get_registry().get("labeler", self.params.labeler.name)  # unknown names fail at validate
        self.actors: list[Any] = []
        self.seed = 0

    @hookimpl
    def on_run_start(self, run: Any) -> None:
        self.seed = int(getattr(run, "seed", 0))
        self._start()

    def _start(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            paths = os.pathsep.join(p for p in sys.path if p)
            ray.init(  # without an address a new local instance, not whichever Ray runs here
                address=self.params.address or "local",
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=None if self.params.address else {"env_vars": {"PYTHONPATH": paths}},
            )
        replica = ray.remote(
            num_cpus=self.params.num_cpus,
            num_gpus=self.params.num_gpus,
            max_restarts=self.params.max_restarts,
        )(_Replica)
        inner = self.params.labeler
        self.actors = [
            replica.remote(inner.name, inner.params, self.seed) for _ in range(self.params.replicas)
        ]

    def pids(self) -> list[int]:
        """The process id of every actor (they are other processes, on any node)."""
        ray = _ray()
        return list(ray.get([actor.pid.remote() for actor in self.actors]))

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        if not requests:
            return []
        if not self.actors:
            self._start()
        ray = _ray()
        per = -(-len(requests) // len(self.actors))  # ceil: contiguous slices, in order
        slices = [requests[i : i + per] for i in range(0, len(requests), per)]
        futures = [
            actor.score_batch.remote(part) for actor, part in zip(self.actors, slices, strict=False)
        ]
        scores: list[Score] = []
        for part in ray.get(futures):
            scores.extend(part)
        return scores

    @hookimpl
    def on_run_end(self, run: Any, status: str) -> None:
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(
            "labeler ray_pool needs Ray: pip install 'alignzoo[ray]' (or pip install ray)"
        ) from None
    return ray
