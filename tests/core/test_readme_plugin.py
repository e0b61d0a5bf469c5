"""The README's "write your own plugin" example works when copied into a package, and the
experiment file of docs/experiments.md validates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Write your own plugin", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.slow
def test_readme_plugin_installs_lists_and_passes_the_contract_suite(tmp_path):
    (python_code,) = readme_blocks("python")
    (toml,) = readme_blocks("toml")
    package = tmp_path / "src"
    (package / "my_plugin").mkdir(parents=True)
    (package / "my_plugin" / "__init__.py").write_text("")
    (package / "my_plugin" / "algo.py").write_text(python_code)
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "my-plugin"\nversion = "1.2.3"\n\n'
        '[tool.setuptools]\npackages = ["my_plugin"]\n\n' + toml
    )
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(package),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    listing = subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    rows = {(r["kind"], r["name"]): r for r in json.loads(listing.stdout)}
    assert rows[("algorithm", "sign_pg")]["provider"] == "my-plugin"
    assert rows[("algorithm", "sign_pg")]["version"] == "1.2.3"
    assert rows[("modifier", "loss_clip")]["status"] == "ok"
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "alignzoo.cli",
            "check",
            "algorithm",
            "sign_pg",
            "--max-examples",
            "10",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "FAIL" not in check.stdout and "pass" in check.stdout


def test_docs_experiment_example_validates(tmp_path):
    """The experiment file of docs/experiments.md (its first YAML block) loads as written."""
    from alignzoo import load_experiment

    text = (ROOT / "docs" / "experiments.md").read_text()
    example = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)[0]
    path = tmp_path / "experiment.yaml"
    path.write_text(example)
    loaded = load_experiment(path)
    assert loaded.components["dr_grpo"]["algorithm"].params.scale_rewards == "none"
