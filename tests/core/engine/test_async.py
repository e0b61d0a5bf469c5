"""training.async: rollout producers in processes of their own (alignzoo.engine.producers).

K = 0 is the synchronous run, digit for digit (GRPO and PPO); K > 0 trains each step on its own
prompts with samples at most K steps old, and says so in its metrics; a producer that dies is
started again and no step is trained twice or skipped; a producer that fails fails the run with
its error; a checkpoint keeps the steps handed out, so a resume skips no prompt."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from alignzoo.config.loader import load_experiment
from alignzoo.engine.assemble import assemble
from alignzoo.engine.behaviour import Behaviour
from alignzoo.engine.loop import run_one
from alignzoo.engine.producers import Produced, Task, Weights, _ProducerSide, staleness_metrics
from alignzoo.runfolder import RunStatus

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

VOLATILE = ("time_s", "timing/", "throughput/", "async/")
ASYNC_ONLY = ("rollout/staleness", "rollout/kl_behaviour")  # staleness: _max and _hist/<k> too


def _stable(rows, drop=()):
    """Each row without its timings (and the keys starting with a prefix in ``drop``)."""
    skip = VOLATILE + tuple(drop)
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


def _spec(algorithm="grpo", steps=4, async_=None, labeler="arithmetic", **training):
    arm = {"algorithm": algorithm, "labeler": labeler}
    if async_ is not None:
        arm["training"] = {"async": async_}
    return tiny_experiment(
        budget={"steps": steps},
        training={"checkpoint_every": 2, **training},
        arms={"arm": arm},
    )


def _run(write_experiment, tmp_path, name, spec):
    loaded = load_experiment(write_experiment(spec, name=f"{name}.yaml"))
    out = tmp_path / name
    summary = run_one(loaded, "arm", 0, out)
    assert summary.status == "finished", summary.error
    return out


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_max_staleness_zero_is_the_synchronous_run(write_experiment, tmp_path, algorithm):
    sync = _run(write_experiment, tmp_path, "sync", _spec(algorithm))
    lock = _run(write_experiment, tmp_path, "k0", _spec(algorithm, async_={"max_staleness": 0}))
    plain, produced = (read_jsonl(out / "metrics.jsonl") for out in (sync, lock))
    assert len(plain) == len(produced) == 4
    # Every metric of the synchronous run, to the last digit (timings aside), the labeler's own
    # labeler/* figures too (its drift follows the training passes alone in both).
    assert _stable(produced, drop=ASYNC_ONLY) == _stable(plain)
    assert all(
        r["rollout/staleness"] == 0.0 and r["rollout/staleness_max"] == 0.0 for r in produced
    )
    assert all(r["async/restarts"] == 0.0 for r in produced)
    for name in ("eval.jsonl", "samples.jsonl"):
        assert _stable(read_jsonl(lock / name)) == _stable(read_jsonl(sync / name)), name


@pytest.mark.parametrize("partial_rollouts", [False, True])
def test_staleness_one_trains_each_step_on_its_own_prompts(
    write_experiment, tmp_path, monkeypatch, partial_rollouts
):
    """K = 1 with weights sent every 2 steps (after steps 0, 2, 4): by construction, step 2's
    batch can only come from the starting weights (those of step 2 need its batch first), step
    3's needs weights of step 1 or later so waits for step 2's, and so on: staleness 0, 1, 0,
    1, 0, whichever of the two producers takes which step and however fast it is. No weights
    are sent while a batch is sampled, so partial rollouts change nothing here."""
    sync = _run(write_experiment, tmp_path, "sync", _spec(steps=5))
    versions = []  # per trained batch: its policy version and each response token's

    def recorded(self, batch):
        versions.append((batch.policy_version, batch.token_versions, batch.response_mask))
        return {}

    monkeypatch.setattr(Behaviour, "at_collection", recorded)
    settings = {"max_staleness": 1, "producers": 2, "weights_every": 2, "producer_threads": 1}
    settings["partial_rollouts"] = partial_rollouts
    ahead = _run(write_experiment, tmp_path, "k1", _spec(steps=5, async_=settings))
    plain, produced = (read_jsonl(out / "samples.jsonl") for out in (sync, ahead))
    assert [(r["step"], r["prompt"]) for r in produced] == [(r["step"], r["prompt"]) for r in plain]
    rows = read_jsonl(ahead / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["rollout/staleness_hist/1"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(r["rollout/staleness_hist/0"] + r["rollout/staleness_hist/1"] == 1 for r in rows)
    for row in rows:  # the ledger balances at every step; nothing lost or trained twice
        assert row["async/samples_delivered"] == (
            row["async/samples_trained"]
            + row["async/samples_queued"]
            + row["async/samples_discarded"]
        )
        assert row["async/samples_lost"] == 0.0
    assert [r["async/samples_trained"] for r in rows] == [16.0 * k for k in range(1, 6)]
    # Paced by construction: steps 3 and 5 wait for the weights of steps 2 and 4, which need
    # the batches of steps 2 and 4 produced and trained first (the others may wait a moment
    # for weights already sent: not asserted).
    paced = [0.0] + [r["async/samples_paced"] for r in rows]
    assert [paced[s] - paced[s - 1] for s in (3, 5)] == [16.0, 16.0]
    assert all(rows[s - 1]["async/producer_paced_s"] > 0.01 for s in (3, 5))
    # One optimizer step per step: the weights of step s are version s.
    assert [v for v, _, _ in versions] == [0, 0, 2, 2, 4]
    for version, tokens, mask in versions:
        on = mask.bool()
        assert tokens[on].eq(version).all() and tokens[~on].eq(-1).all()
    # The first step trains on the starting weights' samples, as the synchronous run does.
    first = read_jsonl(sync / "metrics.jsonl")[0]
    assert _stable([rows[0]], drop=ASYNC_ONLY) == _stable([first])


def test_staleness_is_counted_per_token():
    """A partial rollout's tokens from three weights: the weights of step 5 train step 6, so
    tokens of versions 3, 4 and 6 (the weights of steps 3, 4 and 5) are 2, 1 and 0 steps old."""
    batch = SimpleNamespace(
        token_versions=torch.tensor([[3, 3, 4, 6, -1], [6, 6, -1, -1, -1]]),
        response_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]),
    )
    produced = Produced(0, 6, weights_step=3, version_steps={3: 3, 4: 4, 6: 5})
    m = staleness_metrics(batch, produced, step=6, max_staleness=2)
    assert m["rollout/staleness"] == pytest.approx(5 / 6)  # (2 + 2 + 1 + 0 + 0 + 0) / 6
    assert m["rollout/staleness_max"] == 2.0
    hist = [m[f"rollout/staleness_hist/{k}"] for k in range(3)]
    assert hist == pytest.approx([3 / 6, 1 / 6, 2 / 6])
    # Without recorded versions: the weights the batch started with, for every token.
    batch.token_versions = None
    m = staleness_metrics(batch, produced, step=6, max_staleness=2)
    assert (m["rollout/staleness"], m["rollout/staleness_hist/2"]) == (2.0, 1.0)


class Arrivals:
    """A producer's weights queue whose ``at``-th look finds ``weights`` (none before or after)."""

    def __init__(self, at: int, weights: Weights) -> None:
        self.at, self.weights, self.looks = at, weights, 0

    def get_nowait(self) -> Weights:
        self.looks += 1
        if self.looks == self.at:
            return self.weights
        raise queue.Empty


@pytest.mark.parametrize("partial_rollouts", [False, True])
def test_a_producer_takes_weights_that_arrive_while_it_samples(
    write_experiment, tmp_path, partial_rollouts
):
    """A producer's side of the arm, in this process, sampling step 2's prompts with the
    weights of step 0 while the trainer's weights of step 1 arrive at its third look (before
    the second decode step): with partial rollouts the first two tokens of every response are
    version 0 and the rest version 1, and the producer records which step each version ended;
    without, the batch is the starting weights' and the arrival waits for the next batch."""
    settings = {"max_staleness": 1, "partial_rollouts": partial_rollouts}
    loaded = load_experiment(write_experiment(_spec(async_=settings)))
    run = assemble(loaded, "arm", 0, tmp_path / "run")
    try:
        job = run.collector.job
        actor = run.models.actor
        tensors = {n: t.detach().clone() for n, t in actor.named_parameters()}
        rows, seeds = run.sampler.next_seeded(4)
    finally:
        run.close(RunStatus.FINISHED)
    side = _ProducerSide(job)
    try:
        side.load(Weights(0, 0, tensors))
        arrivals = Arrivals(3, Weights(1, 1, tensors))
        collected = side.produce(Task(2, rows, seeds, min_weights=0), arrivals)
    finally:
        side.close()
    batch = collected.batch
    on = batch.response_mask.bool()
    assert on[:, 2:].any(), "premise: responses of more than two tokens"
    versions = batch.token_versions
    if partial_rollouts:
        assert versions[:, :2][on[:, :2]].eq(0).all() and versions[:, 2:][on[:, 2:]].eq(1).all()
        assert side.version_steps == {0: 0, 1: 1} and side.weights.version == 1
    else:
        assert versions[on].eq(0).all() and arrivals.looks == 0
        assert side.version_steps == {0: 0}
    assert versions[~on].eq(-1).all()


def test_a_killed_producer_is_started_again_and_no_step_is_lost(
    write_experiment, tmp_path, monkeypatch
):
    mark = tmp_path / "kill-mark"
    monkeypatch.setenv("ALIGNZOO_TEST_KILL_MARK", str(mark))
    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:kills_its_producer_once"},
    }
    spec = _spec(async_={"max_staleness": 0}, labeler=labeler)
    spec["evaluation"]["labeler"] = "arithmetic"  # the trainer's own labeling never kills
    out = _run(write_experiment, tmp_path, "killed", spec)
    assert mark.exists()  # a producer was killed by SIGKILL in its first batch
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/restarts"] for r in rows] == [1.0] * 4, (mark.read_text(), rows)
    # The ledger: the killed producer's batch (4 prompts x 4 samples) was lost in flight and
    # sampled again; every delivered sample was trained, once.
    last = rows[-1]
    assert last["async/samples_lost"] == 16.0 and last["async/samples_discarded"] == 0.0
    assert last["async/samples_delivered"] == last["async/samples_trained"] == 4 * 16.0
    # Lock-step: the batch sampled anew by the restarted producer is the one the killed
    # producer was labeling, so the run is still the synchronous one.
    spec_sync = _spec(labeler=labeler)
    spec_sync["evaluation"]["labeler"] = "arithmetic"
    sync = _run(write_experiment, tmp_path, "sync", spec_sync)
    assert _stable(rows, drop=ASYNC_ONLY) == _stable(read_jsonl(sync / "metrics.jsonl"))


def test_the_trainer_trains_what_is_queued_while_a_labeler_takes_its_time(
    write_experiment, tmp_path, monkeypatch
):
    """K = 2, one producer: it samples steps 1, 2 and 3 in turn, and labeling step 3's batch
    takes until the trainer has trained step 2 (up to 30 s). The trainer does, from the queue,
    while that call is in flight: a trainer that waited on the labeling, as a synchronous
    step does, never would. Evaluations after every step keep the trainer the slower party,
    so that the call begins before step 2 is trained (checked)."""
    out = tmp_path / "slow"
    mark = tmp_path / "wait-mark"
    monkeypatch.setenv("ALIGNZOO_TEST_METRICS", str(out / "metrics.jsonl"))
    monkeypatch.setenv("ALIGNZOO_TEST_WAIT_MARK", str(mark))
    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:waits_in_a_producer_for_the_trainer"},
    }
    spec = _spec(async_={"max_staleness": 2}, labeler=labeler)
    spec["evaluation"] = {"every": 1, "num_prompts": 32, "labeler": "arithmetic"}
    loaded = load_experiment(write_experiment(spec))
    assert run_one(loaded, "arm", 0, out).status == "finished"
    seen = json.loads(mark.read_text())
    assert not seen["before"], "premise: step 3's labeling began after step 2 was trained"
    assert seen["meanwhile"], "the trainer did not train step 2 while step 3 was labeled"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["label/valued"] == 16.0  # the slow call's labels, as without async


def test_a_failing_producer_fails_the_run_with_its_error(write_experiment, tmp_path):
    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:fails_in_a_producer"},
    }
    spec = _spec(async_={"max_staleness": 1}, labeler=labeler)
    spec["arms"]["arm"]["labeling"] = {"retries": 0, "on": {"error": "fail"}}
    loaded = load_experiment(write_experiment(spec))
    summary = run_one(loaded, "arm", 0, tmp_path / "run")
    assert summary.status == "failed"
    assert "producer 0" in summary.error and "fails in producers" in summary.error


def test_a_resumed_run_hands_out_the_steps_it_had_handed_out(write_experiment, tmp_path):
    # Weights every 3 steps, checkpoints every 2: cadences that do not divide each other.
    spec = _spec(steps=6, async_={"max_staleness": 2, "weights_every": 3})
    loaded = load_experiment(write_experiment(spec))
    out = tmp_path / "run"
    assert run_one(loaded, "arm", 0, out).status == "finished"
    prompts = [(r["step"], r["prompt"]) for r in read_jsonl(out / "samples.jsonl")]
    back_to_checkpoint(out, 4)
    assert run_one(loaded, "arm", 0, out, resume=True).status == "finished"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # Steps 5 and 6 were handed out before the stop (K = 2): after the resume the same
    # prompts train at the same steps, none skipped, none twice.
    assert [(r["step"], r["prompt"]) for r in read_jsonl(out / "samples.jsonl")] == prompts
    # The ledger came back with the checkpoint: what was delivered and waiting then counts as
    # lost (sampled again after the resume), and it still balances.
    last = rows[-1]
    assert last["async/samples_trained"] == 6 * 16.0
    # Step 4's batch waits, by construction, for the weights of step 3 (the first sent after
    # step 0): paced before the stop, and the count comes back with the checkpoint.
    assert rows[3]["async/samples_paced"] >= 16.0
    assert rows[4]["async/samples_paced"] >= rows[3]["async/samples_paced"]
    assert last["async/samples_delivered"] == (
        last["async/samples_trained"]
        + last["async/samples_queued"]
        + last["async/samples_discarded"]
        + last["async/samples_lost"]
    )


@pytest.mark.slow
def test_multi_turn_episodes_from_producers_are_the_synchronous_ones(write_experiment, tmp_path):
    """experiments/tool_use.yaml's calculator arm at a tiny size: the producer plays the
    episodes (the environment and its tools in the producer's process) and, at K = 0, the
    trainer trains on what the synchronous run trains on: the same rewards, the same trained
    tokens (env/trained_token_frac), the same losses."""
    from ..experiment.test_tool_use import tiny_tool_use

    runs = {}
    for name, settings in (("sync", None), ("k0", {"max_staleness": 0})):
        spec = tiny_tool_use([0], 3)
        arm = spec["arms"]["tool"]
        if settings is not None:
            arm.setdefault("training", {})["async"] = settings
        spec["arms"] = {"arm": arm}
        spec.pop("baseline", None)
        spec["evaluation"]["num_prompts"] = 4
        spec["logging"] = {"sinks": ["jsonl"]}
        runs[name] = _run(write_experiment, tmp_path, name, spec)
    plain, produced = (read_jsonl(runs[n] / "metrics.jsonl") for n in ("sync", "k0"))
    assert all("env/turns" in r and 0 < r["env/trained_token_frac"] < 1 for r in produced)
    assert _stable(produced, drop=ASYNC_ONLY) == _stable(plain)
    assert _stable(read_jsonl(runs["k0"] / "samples.jsonl")) == _stable(
        read_jsonl(runs["sync"] / "samples.jsonl")
    )


def test_a_killed_trainer_takes_its_producers_with_it_and_resumes_exactly(
    write_experiment, tmp_path
):
    """The trainer, killed by SIGKILL while a producer labels step 3 (after the checkpoint of
    step 2): its producer exits on its own (no orphan keeps sampling), and ``--resume`` at
    K = 0 ends with the uninterrupted run's metrics."""
    import os
    import subprocess
    import sys
    import time

    labeler = {
        "name": "python",
        "params": {"function": "tests.core.engine._labelers:kills_the_trainer_once"},
    }
    spec = _spec(async_={"max_staleness": 0}, labeler=labeler)
    spec["evaluation"]["labeler"] = "arithmetic"
    exp = write_experiment(spec)
    whole = _run(write_experiment, tmp_path, "whole", spec)  # no kill: the variables unset

    out, mark = tmp_path / "killed", tmp_path / "kill-mark"
    env = {
        **os.environ,
        "ALIGNZOO_TEST_KILL_MARK": str(mark),
        "ALIGNZOO_TEST_KILL_STEP": "3",
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
    }
    code = (
        "import sys\n"
        "from alignzoo.config.loader import load_experiment\n"
        "from alignzoo.engine.loop import run_one\n"
        "if __name__ == '__main__':\n"
        "    run_one(load_experiment(sys.argv[1]), 'arm', 0, sys.argv[2])\n"
    )
    trainer = subprocess.run(
        [sys.executable, "-c", code, str(exp), str(out)], env=env, capture_output=True, text=True
    )
    assert trainer.returncode == -9, trainer.stderr[-2000:]  # SIGKILL, by the producer
    producer = int(mark.read_text())
    deadline = time.monotonic() + 30
    while _alive(producer) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(producer), "the producer outlived its trainer"

    loaded = load_experiment(exp)
    summary = run_one(loaded, "arm", 0, out, resume=True)
    assert summary.status == "finished", summary.error
    resumed = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # labeler/*: a resumed run finds its labels stored (calls 0, stored 16), so left out.
    resumed_only = ("labeler/",)
    assert _stable(resumed, resumed_only) == _stable(
        read_jsonl(whole / "metrics.jsonl"), resumed_only
    )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
