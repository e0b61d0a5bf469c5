"""Simulated annotators and sample pools for the human queue: the classic RLHF pipeline, and
its tests, without people.

A simulated annotator judges like a person with a known rule behind them: a labeler (the
*rule*, e.g. ``arithmetic``) gives each response a score in [0, 1], and each annotator adds
their own ``bias`` and Gaussian ``noise`` (on that scale) and, with probability
``cannot_judge``, declines. A rating is the noisy score mapped onto the item's scale (rounded
when the scale's ends are whole numbers); a pair is A (1) or B (0) by the noisy scores'
difference, a tie (0.5) within ``tie_margin`` (a shared bias cancels in a pair). Each
annotator's draws are seeded from the seed, their name and the item's text, so the same queue
is judged the same way every time.

:func:`simulate` answers the queue as they would (``alignzoo annotate simulate``);
:func:`sample_pool` samples responses from an experiment's starting policy and queues them
(``alignzoo annotate pool``), as the first step of the pipeline.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.config.schema import ComponentRef
from alignzoo.errors import UserError
from alignzoo.human.queue import HumanQueue, Item, QueueError
from alignzoo.types import LabelRequest


class Annotator(BaseModel):
    """One simulated annotator."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, description="Their name in the queue.")
    noise: float = Field(0.0, ge=0, description="Std of the noise added to the rule's score.")
    bias: float = Field(0.0, description="Added to the rule's score (0..1 scale).")
    cannot_judge: float = Field(
        0.0, ge=0, le=1, description="Probability of answering 'cannot judge'."
    )


class Simulation(BaseModel):
    """Who judges, by which rule (a YAML file for ``alignzoo annotate simulate``)."""

    model_config = ConfigDict(extra="forbid")

    rule: ComponentRef = Field(description="The labeler whose score (0..1) they start from.")
    annotators: list[Annotator] = Field(min_length=1, description="The annotators.")
    seed: int = Field(0, description="Seeds every annotator's draws.")
    tie_margin: float = Field(
        0.1, ge=0, description="Pairs whose noisy scores differ by at most this are ties."
    )


Scorer = Callable[[list[LabelRequest]], list[float | None]]


def read_simulation(path: str | Path, what: str = "") -> Simulation:
    """The simulation YAML at ``path`` (UserError naming ``what`` and the file when it cannot
    be read or is not one)."""
    import yaml
    from pydantic import ValidationError

    from alignzoo.config.yamlfile import safe_load

    try:
        return Simulation.model_validate(safe_load(Path(path).read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        prefix = f"{what}: " if what else ""
        raise UserError(
            f"{prefix}{path}: not a simulation (rule, annotators, seed): {exc}"
        ) from None


def rule_scorer(ref: ComponentRef, run: Any = None) -> Scorer:
    """The rule labeler named by ``ref`` as a function of requests -> score in [0, 1] (None
    where it gives no value); ``run``: a run context for its ``on_run_start``."""
    from alignzoo.registry import build_plugin_manager, get_registry
    from alignzoo.types import Outcome

    cls = get_registry().get("labeler", ref.name)
    manager = build_plugin_manager([cls(cls.Params.model_validate(ref.params))])
    if run is not None:
        manager.hook.on_run_start(run=run)

    def score(requests: list[LabelRequest]) -> list[float | None]:
        scores = manager.hook.score_batch(requests=requests) if requests else []
        return [
            min(1.0, max(0.0, float(s.value))) if s.outcome == Outcome.VALUE else None
            for s in scores
        ]

    return score


def _rating(item: Item, score: float, who: Annotator, rng: random.Random) -> float:
    noisy = min(1.0, max(0.0, score + who.bias + rng.gauss(0.0, who.noise)))
    value = item.low + noisy * (item.high - item.low)
    if float(item.low).is_integer() and float(item.high).is_integer():
        value = float(round(value))
    return min(item.high, max(item.low, value))


def _choice(a: float, b: float, who: Annotator, rng: random.Random, margin: float) -> float:
    diff = (a + rng.gauss(0.0, who.noise)) - (b + rng.gauss(0.0, who.noise))
    if diff > margin:
        return 1.0
    if diff < -margin:
        return 0.0
    return 0.5


def simulate(
    queue: HumanQueue,
    simulation: Simulation,
    scorer: Scorer,
    only: Sequence[int] | None = None,
) -> int:
    """Every annotator of ``simulation`` judges each open item (those in ``only``, when
    given) that they have not judged and that still wants judgements; returns how many
    judgements were stored."""
    wanted = None if only is None else set(only)
    todo = []
    for item, given in queue.items():
        if (wanted is None or item.id in wanted) and len(given) < item.raters:
            todo.append((item, {rater for rater, _ in given}, len(given)))
    texts: dict[tuple[str, str], float | None] = {}
    requests = {}
    for item, _, _ in todo:
        for response in (item.response, item.other):
            if response is not None:
                requests[(item.prompt, response)] = LabelRequest(
                    prompt=item.prompt, response=response, extra=dict(item.extra)
                )
    keys = list(requests)
    texts.update(zip(keys, scorer([requests[k] for k in keys]), strict=True))
    stored = 0
    for item, judged, count in todo:
        for who in simulation.annotators:
            if count >= item.raters:
                break
            if who.name in judged:
                continue
            rng = random.Random(
                f"{simulation.seed}/{who.name}/{item.prompt}/{item.response}/{item.other}"
            )
            a = texts[(item.prompt, item.response)]
            b = texts[(item.prompt, item.other)] if item.other is not None else None
            value: float | None
            if (
                rng.random() < who.cannot_judge
                or a is None
                or (item.other is not None and b is None)
            ):
                value = None
            elif item.kind == "pair":
                assert b is not None
                value = _choice(a, b, who, rng, simulation.tie_margin)
            else:
                value = _rating(item, a, who, rng)
            try:
                queue.submit(item.id, who.name, value)
            except QueueError:  # judged meanwhile (a person, another simulation): theirs stays
                continue
            stored += 1
            count += 1
    return stored


def sample_pool(
    loaded: Any,
    arm: str,
    prompts: int,
    samples: int = 2,
    log: Callable[[str], None] = lambda _: None,
) -> list[tuple[str, list[str], dict[str, Any]]]:
    """``samples`` responses to each of the ``prompts`` training prompts a run with seed 0 draws first, sampled from
    ``arm``'s starting policy with its sampling settings and per-prompt seeds (as a run would
    at step 1): ``(prompt, responses, extra columns)`` per prompt."""
    from types import SimpleNamespace

    from alignzoo.engine.datasets import load_split
    from alignzoo.engine.models import load_actor, load_tokenizer
    from alignzoo.engine.modes import split_rows
    from alignzoo.engine.policy import policy_path
    from alignzoo.engine.sampler import PromptSampler
    from alignzoo.weights import PolicyWeights

    spec = loaded.spec
    arm_spec = spec.arms[arm]
    path = policy_path(arm_spec.model, spec.data, log)
    tokenizer = load_tokenizer(path)
    actor = load_actor(path, arm_spec.model, "cpu")
    rows, seeds = PromptSampler(load_split(spec.data, "train", "online", tokenizer), 0).next_seeded(
        prompts
    )
    built = loaded.components[arm]["backend"]  # the arm's own backend, from the registry
    backend: Any = type(built)(built.params)
    backend.on_run_start(
        SimpleNamespace(tokenizer=tokenizer, device=lambda role: "cpu", actor=actor)
    )
    backend.sync_weights(PolicyWeights(actor, 0))
    texts, extras = split_rows(rows)
    batch = backend.generate(texts, extras, samples, arm_spec.training.sampling, seeds)
    out = []
    for i, (prompt, extra) in enumerate(zip(texts, extras, strict=True)):
        responses = batch.responses[i * samples : (i + 1) * samples]
        out.append((prompt, responses, {k: v for k, v in extra.items() if _plain(v)}))
    return out


def _plain(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (str, bool, int))
        or (isinstance(value, float) and math.isfinite(value))
    )
