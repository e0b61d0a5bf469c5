"""The replay buffer: draws follow the configured priorities; groups are mixed in whole, kept
across checkpoints, and a run with replay trains."""

from __future__ import annotations

import io
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignzoo.plugins.modifiers.replay import Replay, draw
from alignzoo.registry import build_plugin_manager
from alignzoo.testing.strategies import make_batch


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.0, 4.0), min_size=2, max_size=6),
    st.sampled_from([0.0, 1.0, 2.0]),
    st.integers(0, 2**16),
)
def test_single_draws_follow_priority_to_the_alpha(priorities, alpha, seed):
    rng = random.Random(seed)
    n = 4000
    counts = [0] * len(priorities)
    for _ in range(n):
        [i] = draw(priorities, 1, alpha, 1e-3, rng)
        counts[i] += 1
    weights = [p**alpha + 1e-3 for p in priorities]
    for count, w in zip(counts, weights, strict=True):
        expected = w / sum(weights)
        assert abs(count / n - expected) < 0.035, (counts, weights)


@given(st.lists(st.floats(0.0, 4.0), min_size=1, max_size=8), st.integers(0, 10))
def test_draws_are_distinct_and_bounded(priorities, k):
    chosen = draw(priorities, k, 1.0, 1e-3, random.Random(0))
    assert len(chosen) == min(k, len(priorities)) and len(set(chosen)) == len(chosen)


class Run:
    def __init__(self, step: int) -> None:
        self.step = step


def fresh(step: int, scores: list[list[float]]):
    flat = [s for group in scores for s in group]
    groups = [g for g, group in enumerate(scores) for _ in group]
    batch, _ = make_batch([[-1.0, -1.0]] * len(flat), group_ids=groups, scores=flat,
                          old_logprobs=[[-0.5 - step, -0.5]] * len(flat))  # fmt: skip
    batch.prompts = [f"s{step}g{g}" for g in groups]
    batch.responses = ["r"] * len(flat)
    return batch


def test_groups_are_replayed_whole_with_their_sampling_logprobs():
    replay = Replay(Replay.Params(ratio=0.5, priority="variance", alpha=1.0))
    pm = build_plugin_manager([replay])
    first = fresh(1, [[0.0, 1.0], [1.0, 1.0]])
    assert pm.hook.transform_batch(batch=first, run=Run(1))[0].size == 4  # nothing to replay yet
    out = pm.hook.transform_batch(batch=fresh(2, [[0.0, 0.0], [0.0, 1.0]]), run=Run(2))[0]
    assert out.size == 8  # two fresh groups + two replayed (ratio 0.5)
    replayed = out.select(list(range(4, 8)))
    assert set(replayed.prompts) <= {"s1g0", "s1g1"}
    assert replayed.old_logprobs[:, 0].tolist() == [-1.5] * 4  # the sampling-time log-probs
    ids = out.group_ids.tolist()
    assert (
        len(set(ids[4:6])) == 1 and len(set(ids[6:8])) == 1 and set(ids[4:]) & set(ids[:4]) == set()
    )
    metrics: dict[str, float] = {}
    pm.hook.on_step_end(run=None, step=2, metrics=metrics)
    assert metrics == {"replay/added": 4.0, "replay/size": 4.0}


def test_the_buffer_survives_a_checkpoint():
    replay = Replay(Replay.Params(ratio=0.5))
    pm = build_plugin_manager([replay])
    pm.hook.transform_batch(batch=fresh(1, [[0.0, 1.0], [1.0, 1.0]]), run=Run(1))
    buffer = io.BytesIO()
    torch.save(replay.state_dict(), buffer)
    buffer.seek(0)
    restored = Replay(Replay.Params(ratio=0.5))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    a = pm.hook.transform_batch(batch=fresh(2, [[0.0, 1.0]]), run=Run(2))[0]
    b = build_plugin_manager([restored]).hook.transform_batch(
        batch=fresh(2, [[0.0, 1.0]]), run=Run(2)
    )[0]
    assert a.prompts == b.prompts and torch.equal(a.scores, b.scores)
