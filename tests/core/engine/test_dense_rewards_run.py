"""Dense rewards through a real run: a PPO arm labeled by a process reward model (a tiny one,
built here) trains and reports the dense metrics; `alignzoo validate` refuses a bad PRM
param and a PRM whose steps the algorithm would ignore, naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from alignzoo import cli
from alignzoo import metrics as canonical
from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from tests.plugins.labelers.test_reward_model import save_reward_model

from .conftest import read_jsonl, tiny_experiment


@pytest.fixture(scope="module")
def prm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("prm") / "prm")


def write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


@pytest.mark.parametrize("algorithm", ["ppo", "reinforce_pp"])
def test_an_arm_with_the_prm_labeler_trains_and_reports_the_dense_metrics(
    algorithm: str, prm: Path, tmp_path: Path, engine_cache: Path
) -> None:
    labeler = {"name": "process_reward_model", "params": {"path": str(prm)}}
    spec = tiny_experiment(
        name="dense",
        budget={"steps": 2},
        training={"checkpoint_every": 2},
        evaluation={"every": 2, "num_prompts": 4},
        arms={"dense": {"algorithm": algorithm, "labeler": labeler}},
    )
    spec["arms"].pop("grpo")
    loaded = load_experiment(write(tmp_path / "exp.yaml", spec))
    summary = run_one(loaded, "dense", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        # each non-empty response is one step (no newline in an arithmetic answer), its
        # score a probability
        assert 0.0 < row[canonical.REWARD_DENSE_STEPS] <= 1.0, row
        assert 0.0 < row[canonical.REWARD_DENSE_MEAN] < 1.0, row
        assert row[canonical.REWARD_DENSE_UNPLACED] == 0.0, row
        assert 0.0 < row[canonical.REWARD_MEAN] < 1.0  # the sequence value: the min step


def validate(tmp_path: Path, spec: dict, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    code = cli.main(["validate", str(write(tmp_path / "exp.yaml", spec))])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text
    return code, " ".join(text.split())


def prm_arms(**arms: dict) -> dict:
    spec = tiny_experiment(name="dense")
    spec["arms"] = arms
    return spec


def test_validate_refuses_a_bad_prm_param_naming_the_field(
    prm: Path, tmp_path: Path, capsys, monkeypatch, engine_cache: Path
) -> None:
    for field, value, says in (
        ("separator", "", "at least 1 character"),
        ("aggregate", "max", "'min', 'last', 'mean' or 'prod'"),
        ("batch_size", 0, "greater than or equal to 1"),
    ):
        params = {"path": str(prm), field: value}
        labeler = {"name": "process_reward_model", "params": params}
        code, text = validate(tmp_path, prm_arms(a={"algorithm": "ppo", "labeler": labeler}),
                              capsys, monkeypatch)  # fmt: skip
        assert code == 2, text
        assert "exp.yaml:" in text and f"arms.a.labeler.params.{field}" in text, text
        assert says in text, text


def test_validate_refuses_step_scores_the_algorithm_ignores_and_accepts_dense_false(
    prm: Path, tmp_path: Path, capsys, monkeypatch, engine_cache: Path
) -> None:
    dense = {"name": "process_reward_model", "params": {"path": str(prm)}}
    plain = {"name": "process_reward_model", "params": {"path": str(prm), "dense": False}}
    code, text = validate(tmp_path, prm_arms(g={"algorithm": "grpo", "labeler": dense}),
                          capsys, monkeypatch)  # fmt: skip
    assert code == 2, text
    assert "arms.g.labeler" in text and "gives step scores" in text and "'grpo'" in text
    assert "dense: false" in text
    ok = prm_arms(
        g={"algorithm": "grpo", "labeler": plain},
        p={"algorithm": "ppo", "labeler": dense},
        r={"algorithm": "reinforce_pp", "labeler": dense},
    )
    code, text = validate(tmp_path, ok, capsys, monkeypatch)
    assert code == 0, text
    off = prm_arms(p={"algorithm": {"name": "ppo", "params": {"dense_reward_coef": 0}},
                      "labeler": dense})  # fmt: skip
    code, text = validate(tmp_path, off, capsys, monkeypatch)
    assert code == 2 and "arms.p.labeler" in text, text
