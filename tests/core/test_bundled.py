"""The bundled experiments: read through importlib.resources, reachable by name
(`alignzoo run smoke`, `alignzoo validate quickstart`) from any folder, written out by
`alignzoo init DIR`; a name that is neither a file nor a bundled experiment is exit 2."""

from __future__ import annotations

from pathlib import Path

import yaml

from alignzoo.config import bundled
from tests.core.test_cli import alignzoo, assert_user_error

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"


def tracked_experiment_files() -> set[str]:
    return {
        str(p.relative_to(EXPERIMENTS))
        for p in EXPERIMENTS.rglob("*.yaml")
        if "__pycache__" not in p.parts
    }


def test_every_experiment_file_of_the_checkout_is_bundled():
    assert set(bundled.bundled_files()) == tracked_experiment_files()
    assert {"quickstart", "smoke"} <= set(bundled.bundled_names())
    assert "annotators/rlhf_pipeline" not in bundled.bundled_names()


def test_every_annotator_file_an_experiment_names_is_bundled():
    """init writes the files the experiments point at (relative to the folder it writes to)."""
    files = bundled.bundled_files()
    named = []
    for name in bundled.bundled_names():
        text = files[f"{name}.yaml"].read_text()
        named += [
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.strip().startswith("annotators:")
        ]
    assert named, "no experiment names an annotator file any more: drop this test"
    for path in named:
        assert path.startswith("experiments/") and path.removeprefix("experiments/") in files


def test_a_bundled_name_resolves_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with bundled.experiment_file("smoke") as path:
        assert path.read_bytes() == (EXPERIMENTS / "smoke.yaml").read_bytes()
    with bundled.experiment_file("smoke.yaml") as path:
        assert path.read_bytes() == (EXPERIMENTS / "smoke.yaml").read_bytes()
    # a file of that name in the working folder is what the user means
    (tmp_path / "smoke").write_text("name: mine\n")
    with bundled.experiment_file("smoke") as path:
        assert path == Path("smoke")


def test_validate_takes_a_bundled_name(tmp_path):
    result = alignzoo("validate", "quickstart")
    assert result.returncode == 0, result.stderr
    assert "experiment 'quickstart'" in result.stdout and "baseline grpo" in result.stdout


def test_an_unknown_name_is_a_user_error_listing_the_bundled_ones(tmp_path):
    assert_user_error(
        alignzoo("run", "nosuchname", "--out", str(tmp_path / "out")),
        "'nosuchname' is neither a file nor a bundled experiment",
        "quickstart",
        "smoke",
        "alignzoo init DIR",
    )
    assert not (tmp_path / "out").exists()
    # a path keeps the loader's message
    assert_user_error(alignzoo("run", str(tmp_path / "nope.yaml")), "not found", "nope.yaml")


def test_init_writes_the_experiments_and_their_annotators_and_refuses_to_overwrite(tmp_path):
    folder = tmp_path / "project"
    result = alignzoo("init", str(folder))
    assert result.returncode == 0, result.stderr
    written = {str(p.relative_to(folder / "experiments")) for p in folder.rglob("*") if p.is_file()}
    assert written == tracked_experiment_files()
    for rel in written:
        assert (folder / "experiments" / rel).read_bytes() == (EXPERIMENTS / rel).read_bytes()
        assert isinstance(yaml.safe_load((folder / "experiments" / rel).read_text()), dict)
    assert "alignzoo run experiments/smoke.yaml" in result.stdout

    (folder / "experiments" / "smoke.yaml").write_text("edited\n")
    assert_user_error(alignzoo("init", str(folder)), "already exists", "--force")
    assert (folder / "experiments" / "smoke.yaml").read_text() == "edited\n"
    assert alignzoo("init", str(folder), "--force").returncode == 0
    assert (folder / "experiments" / "smoke.yaml").read_bytes() == (
        EXPERIMENTS / "smoke.yaml"
    ).read_bytes()


def test_init_into_a_file_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_user_error(alignzoo("init", str(tmp_path / "file")), "is a file", "folder")
