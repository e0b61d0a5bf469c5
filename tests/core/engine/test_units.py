"""Unit tests of the engine's pieces that need no model: sampler, pairing, schedules, files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import ArmSpec, Budget, ComponentRef, TrainingConfig
from alignzoo.engine.assemble import total_optimizer_steps
from alignzoo.engine.checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    truncate_jsonl,
)
from alignzoo.engine.evaluate import evaluate
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import lr_factor
from alignzoo.engine.loop import budget_spent
from alignzoo.engine.modes import select_mode
from alignzoo.engine.modes.preference import OfflinePreference, pair_by_score
from alignzoo.engine.modes.samples import OnlineSamples
from alignzoo.engine.modes.unpaired import label_desirable, mismatch_partners
from alignzoo.engine.sampler import PromptSampler
from alignzoo.engine.update import split_units
from alignzoo.types import AlgorithmRequirements, SamplingParams, Score


def _dataset(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"prompt": [f"p{i}" for i in range(n)], "answer": list(range(n))}
    )


def test_sampler_order_depends_on_seed_only_and_covers_each_epoch() -> None:
    a, b, c = (
        PromptSampler(_dataset(10), 3),
        PromptSampler(_dataset(10), 3),
        PromptSampler(_dataset(10), 4),
    )
    first = [r["prompt"] for r in a.next(10)]
    assert first == [r["prompt"] for r in b.next(10)]
    assert sorted(first) == sorted(f"p{i}" for i in range(10))  # one epoch = a permutation
    assert first != [r["prompt"] for r in c.next(10)]
    second = [r["prompt"] for r in a.next(10)]
    assert second != first and sorted(second) == sorted(first)  # a new order each epoch
    assert a.next(1)[0]["answer"] is not None


def test_sampler_cursor_resumes_the_exact_sequence() -> None:
    ref = PromptSampler(_dataset(7), 11)
    ref.next(5)
    expected = [r["prompt"] for r in ref.next(9)]
    run = PromptSampler(_dataset(7), 11)
    run.next(5)
    state = run.state_dict()
    resumed = PromptSampler(_dataset(7), 11)
    resumed.load_state_dict(state)
    assert [r["prompt"] for r in resumed.next(9)] == expected


def _batch(scores: list[float], groups: list[int]) -> RolloutBatch:
    b = len(scores)
    return RolloutBatch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.arange(b).unsqueeze(1).repeat(1, 3),
        response_mask=torch.ones(b, 3),
        group_ids=torch.tensor(groups),
        prompts=[f"q{g}" for g in groups],
        responses=[f"r{i}" for i in range(b)],
        extras=[{} for _ in range(b)],
        scores=torch.tensor(scores),
    )


def test_online_dpo_pairs_best_and_worst_and_drops_ties() -> None:
    batch = _batch([0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.0, 0.9], [0, 0, 0, 1, 1, 1, 2, 2, 2])
    pairs = pair_by_score(batch)
    assert pairs is not None
    assert pairs.responses == ["r1", "r0", "r8", "r7"]  # group 1 is all ties: dropped
    assert pairs.group_ids.tolist() == [0, 0, 1, 1]
    assert pairs.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert pair_by_score(_batch([1.0, 1.0], [0, 0])) is None


def test_online_kto_desirable_above_group_mean_or_correct() -> None:
    batch = _batch([0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0, 0, 0, 1, 1, 1])
    labels = label_desirable(batch, [False, False, False, False, True, False]).labels
    assert labels.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_mismatched_partner_is_the_next_sample() -> None:
    assert mismatch_partners(4) == [1, 2, 3, 0]


def test_minibatches_keep_preference_pairs_together() -> None:
    units = OfflinePreference().units(6)
    assert units == [[0, 1], [2, 3], [4, 5]]
    assert split_units(units, 3) == [[0, 1], [2, 3], [4, 5]]  # 3 samples: a pair per micro-batch
    assert split_units(units, 4) == [[0, 1, 2, 3], [4, 5]]
    assert split_units(OnlineSamples().units(6), 4) == [[0, 1, 2, 3], [4, 5]]


def _steps(spec, arm, data: str = "online", online: bool = True) -> int | None:
    return total_optimizer_steps(spec, arm, select_mode(AlgorithmRequirements(data=data), online))


def _arm(**training) -> ArmSpec:
    base = {"prompts_per_step": 8, "samples_per_prompt": 4}
    return ArmSpec(
        algorithm=ComponentRef(name="x"), training=TrainingConfig(**{**base, **training})
    )


def _spec(budget: Budget) -> SimpleNamespace:
    return SimpleNamespace(budget=budget)


def test_scheduler_length_counts_the_optimizer_steps_each_data_mode_takes() -> None:
    steps = _spec(Budget(steps=10))
    # online: 8 x 4 = 32 samples; minibatches of 8 -> 4 optimizer steps per step, x 2 epochs
    assert _steps(steps, _arm(minibatch_size=8, epochs=2)) == 80
    # online pairs: at most 8 pairs = 16 samples; minibatches of 8 -> 2 per step
    assert _steps(steps, _arm(minibatch_size=8), "preference", True) == 20
    # offline preference: 8 rows = 16 samples -> 2 per step; offline unpaired: 8 samples -> 1
    assert _steps(steps, _arm(minibatch_size=8), "preference", False) == 20
    assert _steps(steps, _arm(minibatch_size=8), "unpaired", False) == 10
    # odd minibatch with pairs: 5 samples hold 2 pairs -> 8 pairs take 4 optimizer steps
    assert _steps(steps, _arm(minibatch_size=5), "preference", False) == 40
    # a sample budget counts what each mode counts: offline preference 16 per step
    samples = _spec(Budget(samples=160))
    assert _steps(samples, _arm(), "preference", False) == 10
    assert _steps(samples, _arm()) == 5  # online: 32 per step
    assert _steps(_spec(Budget(wall_clock_s=5)), _arm()) is None


def test_lr_schedules() -> None:
    assert lr_factor(0, 4, 20, "constant") == pytest.approx(0.25)
    assert lr_factor(3, 4, 20, "linear") == pytest.approx(1.0)
    assert lr_factor(12, 4, 20, "linear") == pytest.approx(0.5)
    assert lr_factor(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor(20, 4, 20, "cosine") == pytest.approx(0.0, abs=1e-9)
    assert lr_factor(8, 0, 16, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, 0, None, "cosine") == 1.0  # wall-clock budget: no known end


def test_budget_kinds() -> None:
    assert budget_spent(Budget(steps=3), TrainingState(step=3))
    assert not budget_spent(Budget(steps=3), TrainingState(step=2))
    assert budget_spent(Budget(samples=10), TrainingState(samples=12))
    assert not budget_spent(Budget(wall_clock_s=5), TrainingState(time_s=4.9))


@pytest.mark.parametrize(
    ("budget", "local_time", "rank0_says", "expected"),
    [
        (Budget(wall_clock_s=5), 6.0, False, False),  # rank 0 not yet out of time: go on
        (Budget(wall_clock_s=5), 4.0, True, True),  # rank 0 out of time: stop, here too
        (Budget(steps=3), 0.0, True, False),  # a steps budget is decided locally
    ],
)
def test_rank_0s_clock_decides_a_wall_clock_budget_for_every_rank(
    monkeypatch, budget, local_time, rank0_says, expected
) -> None:
    """Each rank's clock reads differently; if each decided on its own, one rank could stop
    a step before the others and leave them waiting in a collective."""
    from alignzoo import distributed
    from alignzoo.engine.loop import _Loop

    broadcasts: list[object] = []

    def from_rank_0(value: object) -> object:
        broadcasts.append(value)
        return rank0_says

    monkeypatch.setattr(distributed, "broadcast_object", from_rank_0)
    loop = _Loop.__new__(_Loop)
    loop.run = SimpleNamespace(spec=SimpleNamespace(budget=budget))
    loop.state = TrainingState(step=1, time_s=local_time)
    assert loop.spent() is expected
    assert broadcasts == ([local_time >= 5] if budget.wall_clock_s else [])


def test_truncate_jsonl_keeps_complete_rows_up_to_the_step(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in range(1, 6)]
    path.write_text("\n".join(rows) + '\n{"step": 6, "x"', encoding="utf-8")
    truncate_jsonl(path, 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_latest_checkpoint_ignores_unfinished_folders(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step-000002").mkdir()
    (tmp_path / "step-000002" / "state.json").write_text("{}")
    (tmp_path / ".tmp-step-000004").mkdir()  # a kill while writing step 4
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"
    (tmp_path / "latest").write_text("step-000002\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"


def _state(step: int) -> TrainingState:
    return TrainingState(step=step, samples=step * 4, sampler={"epoch": 0, "position": step})


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, monkeypatch
) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    save_checkpoint(tmp_path, _state(2), model, None, optimizer, scheduler, {})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)

    def dies(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, _state(4), model, None, optimizer, scheduler, {})
    monkeypatch.undo()
    folder = latest_checkpoint(tmp_path)
    assert folder is not None and folder.name == "step-000002"
    state = load_checkpoint(folder, model, None, optimizer, scheduler, {})
    assert state.step == 2 and state.sampler == {"epoch": 0, "position": 2}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    # The next complete save replaces the leftover and keeps two.
    for step in (4, 6):
        save_checkpoint(tmp_path, _state(step), model, None, optimizer, scheduler, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000006"]


def test_evaluation_is_greedy_and_pass_at_k_samples(monkeypatch) -> None:
    calls: list[tuple[int, float, int]] = []

    def generate(prompts, extras, n, sampling, seeds=None):
        calls.append((n, sampling.temperature, sampling.max_new_tokens))
        b = len(prompts) * n
        return RolloutBatch(
            prompt_ids=torch.ones(b, 1, dtype=torch.long),
            prompt_mask=torch.ones(b, 1, dtype=torch.long),
            response_ids=torch.ones(b, 2, dtype=torch.long),
            response_mask=torch.ones(b, 2),
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            prompts=[p for p in prompts for _ in range(n)],
            # greedy answers the first prompt right; sampling gets the second right once
            responses=["2", "0"] if n == 1 else ["0", "0", "0", "4"],
            extras=[dict(e) for e in extras for _ in range(n)],
        )

    def score_batch(requests):
        right = [r.response == r.extra["answer"] for r in requests]
        return [Score(float(c), info={"correct": c}) for c in right]

    pm = SimpleNamespace(hook=SimpleNamespace(generate=generate, score_batch=score_batch))
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    out = evaluate(Hooks(pm), rows, 5, pass_at_k=2, sampling=SamplingParams(temperature=0.0))
    assert calls == [(1, 0.0, 5), (2, 1.0, 5)]  # greedy first; pass@k never samples greedily
    assert out["eval/exact_match"] == 0.5 and out["eval/score"] == 0.5
    assert out["eval/pass@2"] == 0.5

    # exact match is the labeler's word: a labeler that does not say what is correct gets none,
    # whatever the data's answer column holds (the engine never checks answers itself)
    def no_verdict(requests):
        return [Score(float(r.response == r.extra["answer"])) for r in requests]

    pm = SimpleNamespace(hook=SimpleNamespace(generate=generate, score_batch=no_verdict))
    out = evaluate(Hooks(pm), rows, 5, pass_at_k=2)
    assert "eval/exact_match" not in out and out["eval/score"] == 0.5
    assert out["eval/pass@2"] == 0.5  # without a verdict a prompt passes on a score above 0


def one_token_answers(prompts: list[str]) -> RolloutBatch:
    """A batch answering each of ``prompts`` with the one-token response "a", a group each."""
    b = len(prompts)
    return RolloutBatch(
        prompt_ids=torch.ones(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, 1, dtype=torch.long),
        response_mask=torch.ones(b, 1),
        group_ids=torch.arange(b),
        prompts=prompts,
        responses=["a"] * b,
        extras=[{} for _ in range(b)],
    )


def test_evaluation_reports_raw_scores_of_a_normalising_labeler() -> None:
    def generate(prompts, extras, n, sampling, seeds=None):
        return one_token_answers(list(prompts) * n)

    def score_batch(requests):  # standardised per call: mean 0 whatever the raw values
        raw = [1.0 + i for i in range(len(requests))]
        mean = sum(raw) / len(raw)
        return [Score(r - mean, info={"raw": r}) for r in raw]

    pm = SimpleNamespace(hook=SimpleNamespace(generate=generate, score_batch=score_batch))
    out = evaluate(Hooks(pm), [{"prompt": "x"}, {"prompt": "y"}, {"prompt": "z"}], 3)
    assert out["eval/score"] == pytest.approx(2.0)  # mean of the raw 1, 2, 3, not 0


def test_episode_metrics_of_an_evaluation_are_means_over_the_chunks_that_report_them(
    monkeypatch,
) -> None:
    """Several chunks of eval prompts: each env/* metric is a mean per episode over the chunks
    that reported it (a tool only one chunk called is not diluted by the others)."""
    from alignzoo.engine import evaluate as evaluation

    monkeypatch.setattr(evaluation, "EVAL_CHUNK", 2)
    reported = iter(
        [
            {"env/episodes": 2.0, "env/turns": 1.0, "env/tool/calc/calls": 1.0},
            {"env/episodes": 1.0, "env/turns": 4.0},
        ]
    )

    def rollout(prompts, extras, n, sampling, seeds=None, episodes=None):
        return one_token_answers(list(prompts)), next(reported)

    pm = SimpleNamespace(
        hook=SimpleNamespace(score_batch=lambda requests: [Score(1.0)] * len(requests))
    )
    hooks = Hooks(pm)
    monkeypatch.setattr(hooks, "rollout", rollout)
    out = evaluation.evaluate(hooks, [{"prompt": p} for p in "xyz"], 3)
    assert out["eval/env/turns"] == pytest.approx(2.0)  # (2 x 1 + 1 x 4) / 3 episodes
    assert out["eval/env/tool/calc/calls"] == 1.0  # not diluted by the chunk without it


def test_threads_set_to_gives_the_process_its_own_count_back(monkeypatch) -> None:
    from alignzoo.engine.threads import THREAD_VARIABLES, threads_set_to

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with threads_set_to(None):  # a run that starts: nothing changes
        assert torch.get_num_threads() == before and os.environ["OMP_NUM_THREADS"] == "5"
    with threads_set_to(before + 1):
        assert torch.get_num_threads() == before + 1
        assert all(os.environ[var] == str(before + 1) for var in THREAD_VARIABLES)
    assert torch.get_num_threads() == before
    assert os.environ["OMP_NUM_THREADS"] == "5" and "MKL_NUM_THREADS" not in os.environ


def test_a_checkpoint_records_the_thread_count(tmp_path: Path) -> None:
    from alignzoo.engine.checkpoint import recorded_threads

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    folder = save_checkpoint(tmp_path, _state(2), model, None, optimizer, scheduler, {})
    assert recorded_threads(folder) == torch.get_num_threads()
    state = json.loads((folder / "state.json").read_text())
    del state["threads"]  # a checkpoint written before the count was kept
    (folder / "state.json").write_text(json.dumps(state))
    assert recorded_threads(folder) is None
