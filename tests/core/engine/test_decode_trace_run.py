"""``training.decode_trace`` in a run: where the update follows the sampling with the same
weights, every micro-batch's backward pass runs against the decode loop's activations and the
step trains as the forward pass does (the same loss and gradient norm to float rounding); an
arm whose update does not follow the sampling (two epochs, labeling overlap) or that turns it
off records nothing; the trace is released before the optimizer step."""

from __future__ import annotations

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.kernels import forward
from alignzoo.kernels import trace as decode_trace

from .conftest import read_jsonl, tiny_experiment

ARMS = {
    "traced": {"algorithm": "grpo", "labeler": "arithmetic"},
    "forward": {"algorithm": "grpo", "labeler": "arithmetic", "training": {"decode_trace": False}},
    "two_epochs": {"algorithm": "grpo", "labeler": "arithmetic", "training": {"epochs": 2}},
    "overlap": {"algorithm": "grpo", "labeler": "arithmetic", "labeling": {"overlap": True}},
}


def _run(write_experiment, tmp_path, arm: str, monkeypatch) -> tuple[list[dict], dict[str, int]]:
    """The arm's metrics over 2 steps of 32 new tokens, 16 samples in micro-batches of 6 (three
    subsets of the trace's rows), and how often the trace served a pass and was recorded."""
    counts = {"served": 0, "recorded": 0, "kept after the update": 0}
    traced_hidden, start = forward.traced_hidden, decode_trace.start

    def counting_hidden(model, batch):
        out = traced_hidden(model, batch)
        counts["served"] += out is not None
        return out

    def counting_start(*args, **kwargs):
        if decode_trace.current() is not None:
            counts["kept after the update"] += 1
        out = start(*args, **kwargs)
        counts["recorded"] += out is not None
        return out

    monkeypatch.setattr(forward, "traced_hidden", counting_hidden)
    monkeypatch.setattr(decode_trace, "start", counting_start)
    spec = tiny_experiment(
        budget={"steps": 2},
        training={"micro_batch_size": 6, "sampling": {"max_new_tokens": 32}, "checkpoint_every": 2},
        evaluation={"every": 2},
        arms={arm: ARMS[arm]},
    )
    out = tmp_path / arm
    assert run_one(load_experiment(write_experiment(spec)), arm, 0, out).status == "finished"
    return read_jsonl(out / "metrics.jsonl"), counts


def test_the_traced_update_trains_as_the_forward_pass(write_experiment, tmp_path, monkeypatch):
    traced, counts = _run(write_experiment, tmp_path, "traced", monkeypatch)
    assert counts == {"served": 2 * 3, "recorded": 2, "kept after the update": 0}
    assert decode_trace.current() is None, "released before the optimizer step"
    with monkeypatch.context() as patched:
        plain, plain_counts = _run(write_experiment, tmp_path, "forward", patched)
    assert plain_counts["served"] == plain_counts["recorded"] == 0
    first, expected = traced[0], plain[0]  # the same weights sampled the same first batch
    assert first["reward/mean"] == expected["reward/mean"]
    for key in ("loss", "actor/pg_loss", "actor/grad_norm", "entropy", "kl/ref"):
        assert first[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    # The update trains on the log-probs the decode loop sampled with (the LM head's GEMM
    # over all positions at once is the only difference left).
    assert all(row["rollout/logprob_diff"] < 1e-5 for row in traced)


@pytest.mark.parametrize("arm", ["two_epochs", "overlap"])
def test_an_update_that_does_not_follow_the_sampling_records_nothing(
    write_experiment, tmp_path, monkeypatch, arm
):
    _, counts = _run(write_experiment, tmp_path, arm, monkeypatch)
    assert counts["served"] == counts["recorded"] == 0
