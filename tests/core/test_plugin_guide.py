"""docs/plugins.md is executable: its files make a package that installs, lists every
component with its provider, passes `alignzoo check` for each kind, passes its own tests, and
trains an arm made of all of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugins.md"


def guide_files() -> dict[str, str]:
    """Every fenced block whose first line is ``# <path>``: path -> contents."""
    files = {}
    for body in re.findall(r"```(?:python|toml|yaml)\n(.*?)```", GUIDE.read_text(), flags=re.S):
        first, _, rest = body.partition("\n")
        match = re.fullmatch(r"# ([\w./-]+\.(?:py|toml|yaml))", first.strip())
        if match:
            files[match.group(1)] = rest if first.strip().endswith((".toml", ".yaml")) else body
    return files


def test_the_guide_names_a_file_for_every_kind():
    files = guide_files()
    for path in (
        "algorithm",
        "labeler",
        "backend",
        "devices",
        "modifier",
        "lifecycle",
        "environment",
    ):
        assert f"guide_plugin/{path}.py" in files
    assert {"pyproject.toml", "experiment.yaml", "tests/test_contracts.py"} <= set(files)
    toml = files["pyproject.toml"]
    for prefix in (
        "algorithm.",
        "labeler.",
        "backend.",
        "device_mapper.",
        "modifier.",
        "environment.",
    ):
        assert f'"{prefix}' in toml


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


@pytest.mark.slow
def test_the_guide_package_installs_checks_and_trains(tmp_path):
    package = tmp_path / "guide"
    for path, text in guide_files().items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    (package / "guide_plugin" / "__init__.py").write_text("")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "ALIGNZOO_CACHE": str(tmp_path / "cache")}

    listing = _cli("plugins", "--json", env=env, cwd=tmp_path)
    rows = {(r["kind"], r["name"]): r for r in json.loads(listing.stdout)}
    mine = {
        ("algorithm", "moving_baseline"),
        ("labeler", "terse_exact"),
        ("backend", "one_by_one"),
        ("device_mapper", "first_gpu"),
        ("modifier", "clip_advantages"),
        ("modifier", "journal"),
        ("environment", "guess_number"),
    }
    for key in mine:
        assert rows[key]["provider"] == "guide-plugin" and rows[key]["status"] == "ok", key

    for kind, name in sorted(mine - {("modifier", "journal")}):
        check = _cli("check", kind, name, "--max-examples", "5", env=env, cwd=tmp_path)
        assert check.returncode == 0, f"{kind} {name}:\n{check.stdout}\n{check.stderr}"
        assert "FAIL" not in check.stdout

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, env={**env, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"},
        cwd=package, timeout=600,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr

    experiment = package / "experiment.yaml"
    assert _cli("validate", str(experiment), env=env, cwd=tmp_path).returncode == 0
    run = _cli("run", str(experiment), "--out", str(tmp_path / "runs"), env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    folder = next((tmp_path / "runs").rglob("metrics.jsonl")).parent
    metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["journal/steps"] for m in metrics] == [1.0, 2.0]
    assert all("moving_baseline/baseline" in m and "clip_advantages/clipped_frac" in m
               for m in metrics)  # fmt: skip
    events = [json.loads(x)["event"] for x in (folder / "journal.jsonl").read_text().splitlines()]
    assert events == ["start", "step", "step", "end"]
