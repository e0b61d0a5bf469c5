"""`alignzoo new plugin`: the package it writes installs with `pip install -e` in a fresh venv,
lists its components and passes its own tests as written; bad names and folders are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from alignzoo.cli import main


def test_bad_names_existing_folders_and_kinds_are_refused(tmp_path, capsys):
    assert main(["new", "plugin", "My-Plugin", "--out", str(tmp_path / "a")]) == 2
    assert "Python package name" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["new", "plugin", "ok_name", "--out", str(tmp_path / "full")]) == 2
    assert "nothing written" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]
    assert main(["new", "plugin", "ok_name", "--kind", "critic", "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b").exists()


def test_only_the_kinds_asked_for(tmp_path):
    out = tmp_path / "two"
    assert main(["new", "plugin", "two", "--kind", "labeler", "--kind", "modifier",
                 "--out", str(out)]) == 0  # fmt: skip
    assert sorted(p.name for p in (out / "two").glob("*.py")) == [
        "__init__.py",
        "labeler.py",
        "modifier.py",
    ]
    toml = (out / "pyproject.toml").read_text()
    assert '"labeler.two" = "two.labeler:TwoLabeler"' in toml and "algorithm." not in toml
    assert "algorithm: grpo" in (out / "README.md").read_text()


def _fresh_venv(where: Path) -> Path:
    """A new venv that sees this environment's packages (alignzoo, torch) through a .pth file,
    so nothing is downloaded; returns its python."""
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    # addsitedir also runs that folder's own .pth files (an editable alignzoo's finder)
    Path(purelib, "outer_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


@pytest.mark.slow
def test_the_scaffold_installs_in_a_fresh_venv_and_passes_its_tests(tmp_path):
    package = tmp_path / "my_rl"
    assert main(["new", "plugin", "my_rl", "--out", str(package)]) == 0
    python = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["ALIGNZOO_CACHE"] = str(tmp_path / "cache")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
         str(package)],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    listing = subprocess.run(
        [str(python), "-m", "alignzoo.cli", "plugins", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    rows = {(r["kind"], r["name"]): r for r in json.loads(listing.stdout)}
    for kind in ("algorithm", "labeler", "backend", "device_mapper", "modifier"):
        assert rows[(kind, "my_rl")]["provider"] == "my-rl", kind
        assert rows[(kind, "my_rl")]["status"] == "ok", rows[(kind, "my_rl")]
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, env=env, cwd=package, timeout=900,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "6 passed" in tests.stdout
    assert sys.prefix not in str(python)
