"""The stage between labeling and advantages, for one step's collected batch: the behaviour
policy's no-grad passes (:meth:`~alignzoo.engine.behaviour.Behaviour.before_update`: the
behaviour snapshot, reference log-probs and critic values, unless the run's strategy takes
them elsewhere), the mode's selection (pairs, desirability), the arm's batch transforms and
the mode's no-grad extras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignzoo import distributed
from alignzoo.batch import RolloutBatch
from alignzoo.engine.hooks import Hooks

if TYPE_CHECKING:
    from alignzoo.engine.behaviour import Behaviour
    from alignzoo.engine.context import RunContext
    from alignzoo.engine.modes import Collected, DataMode
    from alignzoo.engine.scoring import Scorer


def prepare_step(
    collected: Collected,
    behaviour: Behaviour,
    mode: DataMode,
    hooks: Hooks,
    context: RunContext,
    scorer: Scorer,
    step: int,
) -> RolloutBatch | None:
    """The batch the advantages are computed on: the behaviour policy's passes over the
    collected batch, the mode's selection, the arm's batch transforms and the mode's no-grad
    extras. Their canonical metrics go into ``collected.metrics``. None when nothing is left
    to train on (nothing collected, online pairs with no untied group, or a transform that
    filtered every sample); every rank has a batch of the same size (their collectives would
    otherwise hang)."""
    # Every sample dropped (unlabeled, or its episode failed): nothing to score. Every rank
    # agrees first, so none runs the scoring passes' collectives while another skips them.
    empty = collected.batch.size == 0
    distributed.all_equal(int(empty), f"whether step {step}'s batch is empty")
    if empty:
        return None
    collected.metrics.update(behaviour.before_update(collected.batch))
    batch = mode.select(collected.batch, collected.metrics)
    if batch is not None:
        batch = hooks.transform_batch(batch, context)
    distributed.all_equal(batch.size if batch is not None else 0, f"step {step}'s batch size")
    if batch is None or batch.size == 0:
        return None
    return mode.prepare(batch, scorer)
