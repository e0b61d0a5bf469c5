"""Partial rollouts: newer weights taken in the middle of a rollout.

An asynchronous producer (``training.async`` with ``partial_rollouts: true``) installs a *weight
feed* for the length of each batch it samples. The rollout then asks the feed at its own safe
points whether newer weights have arrived from the trainer:

- the hf backend's decode loop before each decode step of ``generate`` (the KV cache of the
  tokens so far is kept: the rollout *continues* with the new weights);
- the episode runner before each of the model's turns (any backend).

The feed loads them into the producer's policy and backend (``sync_weights``) and returns the
policy version now in force, which the rollout records for every token it samples after:
``RolloutBatch.token_versions`` then holds more than one version per batch, and each token's
behaviour log-prob is the one it was drawn with. Outside a feed (synchronous runs, producers
without partial rollouts) :func:`refresh` returns None and the rollout records nothing.

A backend whose ``generate`` cannot take weights between its steps (vllm: one call samples the
whole batch) still takes them between the turns of an episode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

WeightFeed = Callable[[], int]
"""Takes the newest weights the trainer has sent (if any) and returns the version in force."""

_feed: ContextVar[WeightFeed | None] = ContextVar("alignzoo_weight_feed", default=None)


def refresh() -> int | None:
    """The policy version to sample the next tokens with, after taking any newer weights; None
    when no feed is installed (nothing to record)."""
    feed = _feed.get()
    return None if feed is None else feed()


def active() -> bool:
    """Whether a weight feed is installed (the rollout should record per-token versions)."""
    return _feed.get() is not None


@contextmanager
def feeding(feed: WeightFeed) -> Iterator[None]:
    """Install ``feed`` for the rollouts sampled inside the block."""
    token = _feed.set(feed)
    try:
        yield
    finally:
        _feed.reset(token)
