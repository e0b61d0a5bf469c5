"""Labeling, the heart of the data flow: every sample of a step gets a typed outcome.

Three layers, each a module:

- :mod:`~alignzoo.labeling.interface`: what a labeler is asked (:class:`LabelRequest`) and
  answers (:class:`Score`, :class:`Outcome`), and the check of that answer;
- :mod:`~alignzoo.labeling.orchestrator`: the arm's :class:`LabelingStage`, a chain of
  labelers called in batches through :mod:`~alignzoo.labeling.callers` (inline or in a
  worker process, timeouts, circuit breakers) with the policies per outcome (retry with
  backoff, fall back, drop, fail), reporting a :class:`LabelReport`
  (:mod:`~alignzoo.labeling.report`: the ledger, the ``label/*`` metrics and the run's
  Prometheus endpoint);
- :mod:`~alignzoo.labeling.store`: the SQLite store that keeps every label across steps and
  restarts (so a resumed run never asks twice).

Around them: :mod:`~alignzoo.labeling.dense` (a labeler's step scores, ``Score.steps``,
placed on the response's tokens as ``batch.dense_rewards``; the ``reward/dense_*`` metrics),
:mod:`~alignzoo.labeling.swap` (hot swap and shadow mode in a live run) and
:mod:`~alignzoo.labeling.service` (a labeler over HTTP, the wire format in
:mod:`~alignzoo.labeling.protocol`).

The engine calls labeling through the names below only. Importing this package is light: the
names load their modules (and torch) when first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alignzoo.labeling.dense import dense_metrics
    from alignzoo.labeling.interface import LabelRequest, Outcome, Score, start_labeler
    from alignzoo.labeling.orchestrator import LabelingStage, default_stage, label
    from alignzoo.labeling.report import LabelReport
    from alignzoo.labeling.store import STORE_FILE, LabelStore

_EXPORTS = {
    "dense_metrics": "dense",
    "LabelRequest": "interface",
    "Outcome": "interface",
    "Score": "interface",
    "start_labeler": "interface",
    "LabelingStage": "orchestrator",
    "default_stage": "orchestrator",
    "label": "orchestrator",
    "LabelReport": "report",
    "STORE_FILE": "store",
    "LabelStore": "store",
}

__all__ = [
    "STORE_FILE",
    "LabelReport",
    "LabelRequest",
    "LabelStore",
    "LabelingStage",
    "Outcome",
    "Score",
    "default_stage",
    "dense_metrics",
    "label",
    "start_labeler",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'alignzoo.labeling' has no attribute {name!r}")
    return getattr(import_module(f"alignzoo.labeling.{module}"), name)
