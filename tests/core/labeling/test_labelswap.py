"""Hot swap and shadow mode in a live run: requests arrive between steps, an invalid one is
refused (by the command, or by the run when the labeler fails to start), a shadow labeler is
compared then promoted, and a resumed run keeps the labeler it had."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from alignzoo import cli
from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.labeling.swap import CONTROL, request
from alignzoo.plugin import Modifier, hookimpl
from alignzoo.registry import ENTRY_POINT_GROUP, Registry

from ..engine.conftest import assert_same_run_files, back_to_checkpoint, read_jsonl, tiny_experiment

REGEX = {
    "name": "regex",
    "params": {"pattern": r"\s*0*{answer}\s*", "fullmatch": True, "answer_field": "answer"},
}


class Operator(Modifier):
    """Plays the researcher at the console: requests changes while the run goes on."""

    plan: ClassVar[dict[int, tuple[Any, ...]]] = {}  # step -> (action, labeler file[, at])

    @hookimpl
    def on_step_end(self, run, step, metrics):
        if step in self.plan:
            action, path, *at = self.plan[step]
            if at:
                request(Path(run.out_dir), action, path, at_step=at[0])
            elif action == "broken":  # a request the command could not have refused
                (Path(run.out_dir) / CONTROL).write_text(yaml.safe_dump(
                    {"action": "swap", "id": f"bad-{step}",
                     "labeler": {"name": "reward_model", "params": {"path": "/no/such/rm"}}}))  # fmt: skip
            else:
                request(Path(run.out_dir), action, path)


def test_shadow_then_promote_and_a_rejected_swap_during_a_live_run(
    write_experiment, tmp_path, capsys
):
    spec_file = tmp_path / "regex.yaml"
    spec_file.write_text(yaml.safe_dump(REGEX))
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(yaml.safe_dump({"name": "regex", "params": {"pattern": "(unclosed"}}))

    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Operator, "operator")
    Operator.plan = {2: ("shadow", spec_file), 5: ("promote", None), 7: ("broken", None)}
    spec = tiny_experiment(
        budget={"steps": 9},
        training={"checkpoint_every": 3},
        evaluation={"every": 3, "num_prompts": 8},
        arms={"grpo": {"algorithm": "grpo", "labeler": "arithmetic", "modifiers": ["operator"]}},
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    out = tmp_path / "run"

    # The command refuses an invalid labeler before the run is touched.
    out.mkdir()
    (out / "config.yaml").write_text("{}")
    assert cli.main(["labeler", "swap", str(out), str(bad_file)]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err
    assert not (out / CONTROL).exists()

    summary = run_one(loaded, "grpo", 0, out)
    assert summary.status == "finished", summary.error
    rows = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}
    # Steps 3-5: the regex scores alongside, not trained on; its agreement is logged.
    assert all("shadow/regex/n" in rows[s] for s in (3, 4, 5))
    assert "shadow/regex/n" not in rows[2] and "shadow/regex/n" not in rows[6]
    assert all(rows[s]["shadow/regex/disagree"] <= 0.2 for s in (3, 4, 5))
    # From step 6 the regex labels the run.
    assert "labeler/arithmetic/calls" in rows[5] and "labeler/regex/calls" in rows[6]
    assert "labeler/regex/calls" in rows[9]  # the broken swap at step 8 was rejected
    swaps = read_jsonl(out / "swaps.jsonl")
    assert [(r["action"], r["status"], r["step"]) for r in swaps] == [
        ("shadow", "applied", 3),
        ("promote", "applied", 6),
        ("swap", "rejected", 8),
    ]
    assert "does not exist" in swaps[2]["reason"]

    # The report lists the changes and says the comparison mixes labelers.
    from alignzoo.report.sections import _swaps
    from alignzoo.runfolder.runfiles import read_run

    blocks = _swaps([read_run("grpo", 0, out)])
    assert "were not labeled the same way" in blocks[1].text
    assert [row[2] for row in blocks[2].rows] == ["shadow", "promote", "swap"]

    # Resumed from the checkpoint of step 6, the run labels with the regex it had then.
    back_to_checkpoint(out, 6)
    Operator.plan = {}
    assert run_one(loaded, "grpo", 0, out, resume=True).status == "finished"
    again = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}
    assert "labeler/regex/calls" in again[7] and "labeler/arithmetic/calls" not in again[7]
    assert [(r["action"], r["status"]) for r in read_jsonl(out / "swaps.jsonl")] == [
        ("shadow", "applied"), ("promote", "applied"), ("swap", "rejected"),
    ]  # fmt: skip


def test_promote_without_a_run_is_a_user_error(tmp_path, capsys):
    assert cli.main(["labeler", "promote", str(tmp_path / "none")]) == 2
    assert "run folder not found" in capsys.readouterr().err
    assert cli.main(["labeler", "promote", str(tmp_path)]) == 2
    assert "no unfinished run" in capsys.readouterr().err


def test_promote_needs_a_running_shadow(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}")
    assert cli.main(["labeler", "promote", str(run)]) == 2  # nothing shadows this run
    err = " ".join(capsys.readouterr().err.split())
    assert "no shadow labeler is running" in err and "--shadow" in err
    assert not (run / CONTROL).exists()

    spec_file = tmp_path / "regex.yaml"
    spec_file.write_text(yaml.safe_dump(REGEX))
    assert cli.main(["labeler", "swap", str(run), str(spec_file), "--shadow"]) == 0
    assert cli.main(["labeler", "promote", str(run)]) == 2  # requested, not applied yet
    assert "not applied yet" in capsys.readouterr().err
    assert yaml.safe_load((run / CONTROL).read_text())["action"] == "shadow"  # kept

    applied = {"action": "shadow", "status": "applied", "step": 3}
    (run / "swaps.jsonl").write_text(json.dumps(applied) + "\n")
    assert cli.main(["labeler", "promote", str(run)]) == 0
    assert yaml.safe_load((run / CONTROL).read_text())["action"] == "promote"
    promoted = {"action": "promote", "status": "applied", "step": 6}
    with (run / "swaps.jsonl").open("a") as fh:
        fh.write(json.dumps(promoted) + "\n")
    assert cli.main(["labeler", "promote", str(run)]) == 2  # already promoted


PLANS = {  # each request made after step 3's checkpoint and taken before the kill
    "swap": ({4: ("swap", "regex")}, [("swap", "applied", 5)]),
    "shadow then promote": (
        {3: ("shadow", "regex"), 4: ("promote", None)},
        [("shadow", "applied", 4), ("promote", "applied", 5)],
    ),
    "swap at a chosen step": ({1: ("swap", "regex", 5)}, [("swap", "applied", 5)]),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_request_taken_after_the_checkpoint_is_taken_again_at_its_step_on_resume(
    write_experiment, tmp_path, plan
):
    """Killed after the request was taken and before the next checkpoint (every 3 steps): the
    resume from step 3 takes it again before the step it was taken at, not before step 4, and
    every file ends as the uninterrupted run's (a shadow is there to be promoted)."""
    spec_file = tmp_path / "regex.yaml"
    spec_file.write_text(yaml.safe_dump(REGEX))
    registry = Registry(metadata.entry_points(group=ENTRY_POINT_GROUP))
    registry.register(Operator, "operator")
    steps, expected = PLANS[plan]
    spec = tiny_experiment(
        budget={"steps": 5},  # checkpoints after steps 3 and 5, both kept
        training={"checkpoint_every": 3},
        evaluation={"every": 4, "num_prompts": 8},
        arms={"grpo": {"algorithm": "grpo", "labeler": "arithmetic", "modifiers": ["operator"]}},
    )
    loaded = load_experiment(write_experiment(spec), registry=registry)
    runs = {}
    for name in ("full", "killed"):
        Operator.plan = {
            step: (action, spec_file if path else None, *at)
            for step, (action, path, *at) in steps.items()
        }
        runs[name] = tmp_path / name
        assert run_one(loaded, "grpo", 0, runs[name]).status == "finished"
    swaps = [
        (r["action"], r["status"], r["step"]) for r in read_jsonl(runs["full"] / "swaps.jsonl")
    ]
    assert swaps == expected

    back_to_checkpoint(runs["killed"], 3)  # as after a kill before the step-5 checkpoint
    Operator.plan = {}  # the requests were made before the kill
    assert run_one(loaded, "grpo", 0, runs["killed"], resume=True).status == "finished"
    assert_same_run_files(runs["full"], runs["killed"], plan)


def test_at_step_must_name_a_step_not_trained_yet(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    spec_file = tmp_path / "regex.yaml"
    spec_file.write_text(yaml.safe_dump(REGEX))
    assert cli.main(["labeler", "swap", str(run), str(spec_file), "--at-step", "2"]) == 2
    assert "has trained step 2 already" in capsys.readouterr().err
    assert not (run / CONTROL).exists()
    assert cli.main(["labeler", "swap", str(run), str(spec_file)]) == 0
    assert yaml.safe_load((run / CONTROL).read_text())["not_before"] == 3
    assert cli.main(["labeler", "swap", str(run), str(spec_file), "--at-step", "5"]) == 0
    assert yaml.safe_load((run / CONTROL).read_text())["not_before"] == 5


def test_a_requests_paths_are_kept_so_the_run_folder_can_move(tmp_path, monkeypatch):
    """A path param inside the run folder is kept relative to it (and resolved against where
    the folder is when the labeler is built), one outside it absolute; a param that only
    happens to name a file (a regex ``.``) is left as written."""
    from alignzoo.labeling.swap import RUN_RELATIVE, portable_ref, resolve_ref

    run = tmp_path / "run"
    (run / "rlhf" / "rm-1").mkdir(parents=True)
    (tmp_path / "rm0").mkdir()
    monkeypatch.chdir(tmp_path)
    inside = portable_ref({"name": "reward_model", "params": {"path": "run/rlhf/rm-1"}}, run)
    assert inside["params"]["path"] == "rlhf/rm-1" and inside[RUN_RELATIVE] == ["path"]
    outside = portable_ref({"name": "reward_model", "params": {"path": "rm0"}}, run)
    assert outside["params"]["path"] == str(tmp_path / "rm0") and RUN_RELATIVE not in outside
    regex = {"name": "regex", "params": {"pattern": ".", "answer_field": "run"}}
    assert portable_ref(regex, run) == regex
    moved = tmp_path / "moved"
    run.rename(moved)
    assert resolve_ref(inside, moved).params["path"] == str(moved / "rlhf" / "rm-1")
