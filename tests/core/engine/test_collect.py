"""The collection stage (alignzoo.engine.collect): each batch a collector produces reaches the
behaviour policy once, as it is produced. labeling.overlap: a step's labeling runs in the
background while the next step generates; the step trains on one-step-old samples, on the same
prompts as without overlap; a resumed run continues exactly as an uninterrupted one; each
step's slowest labeler calls are recorded."""

from __future__ import annotations

import functools

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.behaviour import AtGeneration, Behaviour
from alignzoo.engine.loop import run_one
from alignzoo.plugins.backends.hf import HFBackend

from . import _labelers
from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "labeler/")


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _spec(overlap: bool, labeler="arithmetic", steps=4):
    return tiny_experiment(
        budget={"steps": steps},
        arms={"grpo": {"algorithm": "grpo", "labeler": labeler, "labeling": {"overlap": overlap}}},
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_each_collected_batch_reaches_the_behaviour_policy_once(
    write_experiment, tmp_path, monkeypatch, overlap
):
    """At collection, the behaviour policy sees every batch once: after its labeling from a
    plain collector, before it (as it is generated) from a look-ahead one, whose last batch is
    generated but never trained on."""
    seen: list[bool] = []  # per call: whether the batch was labeled already

    def recorded(original):
        @functools.wraps(original)
        def at_collection(self, batch):
            seen.append(batch.scores is not None)
            return original(self, batch)

        return at_collection

    for cls in (Behaviour, AtGeneration):
        monkeypatch.setattr(cls, "at_collection", recorded(cls.at_collection))
    loaded = load_experiment(write_experiment(_spec(overlap)))
    assert run_one(loaded, "grpo", 0, tmp_path / "run").status == "finished"
    assert seen == ([False] * 5 if overlap else [True] * 4)


def test_labeling_runs_while_the_next_step_generates(write_experiment, tmp_path, monkeypatch):
    original = HFBackend.generate

    @functools.wraps(original)  # keeps the hookimpl marker
    def counted(self, prompts, extras, n, sampling, seeds=None):
        if len(prompts) == 4 and n == 4:  # a training batch (evaluation asks for 8 prompts)
            _labelers.generation_began()
        return original(self, prompts, extras, n, sampling, seeds)

    monkeypatch.setattr(HFBackend, "generate", counted)
    _labelers.WAITS.clear()
    _labelers.GENERATIONS[0] = _labelers.PASSES[0] = 0
    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:waits_for_next_generation"},
    }
    spec = _spec(True, labeler)
    spec["evaluation"]["every"] = 100  # an evaluation waits for the pass in flight: none between
    loaded = load_experiment(write_experiment(spec))
    summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    # One background pass per generated batch (4 trained + the last look-ahead), and in each
    # of the trained ones the next generation began while it was still labeling.
    assert _labelers.PASSES[0] == 5 and len(_labelers.WAITS) == 4
    assert all(_labelers.WAITS), _labelers.WAITS
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["rollout/staleness"] == 1.0 and "timing/label_wait" in r for r in rows)


def test_overlap_trains_on_the_same_prompts_one_step_old(write_experiment, tmp_path):
    runs = {}
    for overlap in (False, True):
        loaded = load_experiment(write_experiment(_spec(overlap), name=f"{overlap}.yaml"))
        out = tmp_path / str(overlap)
        assert run_one(loaded, "grpo", 0, out).status == "finished"
        runs[overlap] = out
    plain, ahead = (read_jsonl(runs[o] / "samples.jsonl") for o in (False, True))
    assert [(r["step"], r["prompt"]) for r in plain] == [(r["step"], r["prompt"]) for r in ahead]
    # Step 1 trains on the same samples from the same weights either way.
    first_plain, first_ahead = (read_jsonl(runs[o] / "metrics.jsonl")[0] for o in (False, True))
    assert [r["response"] for r in plain if r["step"] == 1] == [
        r["response"] for r in ahead if r["step"] == 1
    ]
    for key in ("reward/mean", "kl/ref", "entropy", "loss"):
        assert first_ahead[key] == pytest.approx(first_plain[key], rel=1e-5, abs=1e-7), key
    assert "rollout/staleness" not in first_plain


def test_overlap_resumes_exactly_and_records_the_slowest_calls(write_experiment, tmp_path):
    loaded = load_experiment(write_experiment(_spec(True, steps=6)))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    reference = _stable(read_jsonl(out / "metrics.jsonl"))
    slowest = read_jsonl(out / "labels_slowest.jsonl")
    assert [r["step"] for r in slowest] == list(range(1, 7))  # one call a step: 4 x 4 at once
    assert all(r["labeler"] == "arithmetic" and r["seconds"] >= 0 for r in slowest)
    assert all(1 <= r["requests"] <= 16 and r["prompt"] for r in slowest)  # identical sent once

    back_to_checkpoint(out, 4)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    resumed = read_jsonl(out / "metrics.jsonl")
    assert _stable(resumed) == reference
    # The batches of steps 5 and 6 were labeled before the stop (6's in the background during
    # step 5): after the resume they come from the label store, with no labeler call.
    assert [r["labeler/arithmetic/stored"] for r in resumed[4:]] == [16.0, 16.0]
    assert [r["step"] for r in read_jsonl(out / "labels_slowest.jsonl")] == [1, 2, 3, 4]


def test_a_look_ahead_batch_sampled_with_top_k_and_top_p_resumes_exactly(
    write_experiment, tmp_path
):
    """The checkpointed look-ahead batch keeps the distribution it was drawn from
    (``batch.sampling``): resumed from the checkpoint of step 3 (every 3 of 5 steps), the
    run trains on its warped log-probs as the uninterrupted one did."""
    spec = _spec(True, steps=5)
    spec["training"].update(
        checkpoint_every=3,
        sampling={"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 4},
    )
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, out).status == "finished"
    reference = _stable(read_jsonl(out / "metrics.jsonl"))
    assert all("rollout/outside_support" in row for row in reference)
    back_to_checkpoint(out, 3)
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    assert _stable(read_jsonl(out / "metrics.jsonl")) == reference


def test_overlap_on_an_offline_arm_is_refused(write_experiment, tmp_path, engine_cache):
    spec = tiny_experiment(
        data={"online": False},
        arms={"dpo": {"algorithm": "dpo", "labeling": {"overlap": True}}},
    )
    spec["arms"].pop("grpo")
    loaded = load_experiment(write_experiment(spec))
    summary = run_one(loaded, "dpo", 0, tmp_path / "run")
    assert summary.status == "failed"
    assert "labeling.overlap" in summary.error and "offline" in summary.error
