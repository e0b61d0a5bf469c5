"""A Python reward function from a file (sync), and one that is async inside a combine, in an
experiment run with --jobs 2: each worker imports the functions itself, and the combined
reward's parts are logged as reward/<part>."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from .test_cli_kill_resume import TINY


@pytest.mark.slow
def test_python_labelers_from_files_with_two_jobs(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def exact(prompts, completions, answer):
                return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]

            async def short(prompts, completions, **columns):
                await asyncio.sleep(0)
                return [1.0 if len(c.strip()) <= 2 else 0.0 for c in completions]
            """
        )
    )
    spec = {**TINY, "name": "pyfn", "seeds": [0], "budget": {"steps": 3}}
    spec["evaluation"] = {"every": 3, "metric": "score"}
    spec["arms"] = {
        "exact": {
            "algorithm": "grpo",
            "labeler": {"name": "python", "params": {"function": "rewards.py:exact"}},
        },
        "mixed": {
            "algorithm": "grpo",
            "labeler": {
                "name": "combine",
                "params": {
                    "labelers": [
                        {"name": "python", "params": {"function": "rewards.py:exact"}},
                        {"name": "python", "params": {"function": "rewards.py:short"}},
                    ],
                    "weights": [1.0, 0.1],
                },
            },
        },
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "ALIGNZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "alignzoo.cli", "run", "exp.yaml", "--out", "out", "--jobs", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for arm in ("exact", "mixed"):
        rows = [
            json.loads(x)
            for x in (tmp_path / "out" / arm / "seed-0" / "metrics.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 3 and all(r["label/valued"] == r["label/generated"] for r in rows)
    mixed = [
        json.loads(x)
        for x in (tmp_path / "out" / "mixed" / "seed-0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("reward/exact" in r and "reward/short" in r for r in mixed)  # function names
    for r in mixed:  # the combined reward is the weighted sum of the parts' means
        assert abs(r["reward/mean"] - (r["reward/exact"] + 0.1 * r["reward/short"])) < 1e-5
