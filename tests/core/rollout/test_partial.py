"""Partial rollouts in the episode runner (alignzoo.rollout.partial): newer weights taken between
the model's turns, each turn's tokens recorded with the version that sampled them; the
environment's tokens carry none; without a feed nothing is recorded."""

from __future__ import annotations

import torch

from alignzoo.rollout import partial

from .test_multiturn import Echo, run
from .test_multiturn import policy as chat_policy  # noqa: F401  (the fixture)


def test_episodes_take_the_newer_weights_between_turns(chat_policy):  # noqa: F811
    """Each of the model's turns is sampled with the version the feed gives before it (here
    1, 2, 3: one more per call); the environment's tokens between them have none (-1)."""
    plain, _, _ = run(chat_policy, ["1+1=", "2+3="])
    assert plain.token_versions is None

    calls = []

    def feed() -> int:
        calls.append(1)
        return len(calls)

    with partial.feeding(feed):
        batch, metrics, _ = run(chat_policy, ["1+1=", "2+3="])
    assert metrics["env/turns"] == 3.0 and len(calls) == 3
    versions, trained = batch.token_versions, batch.response_mask.bool()
    assert versions is not None
    assert versions[~trained].eq(-1).all()
    for row in range(batch.size):
        turns = []  # the version of each run of trained tokens
        for t in range(versions.shape[1]):
            starts = trained[row, t] and (t == 0 or not trained[row, t - 1])
            if starts:
                turns.append(int(versions[row, t]))
            if trained[row, t]:
                assert int(versions[row, t]) == turns[-1]  # one version per turn
        assert turns == [1, 2, 3]
    # The same episodes otherwise: the weights did not change, so neither did the tokens.
    assert torch.equal(batch.response_ids, plain.response_ids)
    assert Echo.closed
