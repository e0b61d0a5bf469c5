"""A built wheel (not just the editable install) carries the plugins and their entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_lists_builtin_plugins(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    wheel = next(dist.glob("alignzoo-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # Install the wheel itself with this interpreter's pip; dependencies come from the dev venv
    # through a .pth file (its site dir is not processed, so the editable install stays out).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(purelib),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import json, alignzoo, alignzoo.plugins\n"
        "from alignzoo.registry import get_registry\n"
        "rows = [(e.kind, e.name, e.distribution, e.error) for e in get_registry().load_all()]\n"
        "print(json.dumps({'file': alignzoo.plugins.__file__, 'rows': rows}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, env=env)
    data = json.loads(out.stdout)
    assert data["file"].startswith(str(purelib)), data["file"]
    builtins = {(k, n): err for k, n, d, err in data["rows"] if d == "alignzoo"}
    for key in [
        ("algorithm", "grpo"),
        ("algorithm", "dpo"),
        ("backend", "hf"),
        ("labeler", "arithmetic"),
    ]:
        assert key in builtins and builtins[key] is None, (key, builtins.get(key))
    cli = subprocess.run(
        [venv / "bin" / "python", "-m", "alignzoo.cli", "plugins", "--kind", "algorithm"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert cli.returncode == 0 and "grpo" in cli.stdout
