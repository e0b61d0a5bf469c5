"""alignzoo relabel: a finished run's stored rollouts scored again by another labeler."""

from __future__ import annotations

import json

import yaml

from alignzoo import cli
from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.labeling.store import stored_requests
from tests.core.engine.conftest import engine_cache, tiny_experiment, write_experiment  # noqa: F401 - fixtures


def test_relabel_scores_stored_rollouts_and_reports_agreement(
    write_experiment,  # noqa: F811 - the engine tests' fixture
    tmp_path,
    capsys,
) -> None:
    loaded = load_experiment(write_experiment(tiny_experiment(budget={"steps": 3})))
    run = tmp_path / "run"
    assert run_one(loaded, "grpo", 0, run).status == "finished"
    before = stored_requests(run / "labels.sqlite")
    assert len(before) > 10

    spec = tmp_path / "regex.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "regex",
                "params": {
                    "pattern": r"\s*0*{answer}\s*",
                    "fullmatch": True,
                    "answer_field": "answer",
                },
            }
        )
    )
    assert cli.main(["relabel", str(run), str(spec)]) == 0
    out = capsys.readouterr().out
    result = json.loads((run / "relabel.json").read_text())
    assert result["requests"] == len(before) and result["valued"] == len(before)
    [row] = result["agreement"]
    assert "ArithmeticLabeler" in row["labeler"] and row["pairs"] == len(before)
    # The same verdict on nearly every response (the rule and the regex differ only on
    # answers written with a sign or spaces inside).
    assert row["disagree"] <= 0.1, row
    assert "Pearson" in out and "disagree" in out
    after = stored_requests(run / "labels.sqlite")
    assert all(len(scores) == 2 for _, _, scores in after)  # both labelers' verdicts stored


def test_relabel_errors_are_user_errors(tmp_path, capsys) -> None:
    spec = tmp_path / "l.yaml"
    spec.write_text("name: regex\nparams: {pattern: x}\n")
    assert cli.main(["relabel", str(tmp_path), str(spec)]) == 2
    assert "no label store" in capsys.readouterr().err
    assert cli.main(["relabel", str(tmp_path / "nope"), str(spec)]) == 2
    assert "run folder not found" in capsys.readouterr().err
