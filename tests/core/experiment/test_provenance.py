"""Provenance: every session of a run folder says which code, libraries, machine and threads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from alignzoo import provenance
from alignzoo.experiment.runfiles import RunData
from alignzoo.report.document import render_markdown
from alignzoo.report.provenance import provenance_blocks


def test_a_session_names_versions_machine_command_and_hashes(tmp_path: Path) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: x\n")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    entry = provenance.collect(exp, policy)
    for key in ("alignzoo", "python", "torch", "transformers", "cpu", "cpu_count", "command"):
        assert entry[key], key
    assert entry["experiment_sha256"] == provenance.file_sha256(exp)
    assert entry["policy"] == str(policy)
    before = entry["policy_sha256"]
    (policy / "config.json").write_text('{"changed": true}')
    assert provenance.folder_sha256(policy) != before  # the hash follows the files


def test_git_state_reports_commit_and_uncommitted_changes(tmp_path: Path) -> None:
    assert provenance.git_state(tmp_path) == {}  # not a checkout

    def run(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    state = provenance.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "f.txt").write_text("b")
    assert provenance.git_state(tmp_path)["dirty"] is True


def test_a_large_file_is_hashed_by_its_size_and_edges(tmp_path: Path) -> None:
    big = tmp_path / "weights.bin"
    size = provenance.BIG_FILE + 10
    big.write_bytes(b"\0" * size)
    first = provenance.file_sha256(big)
    with open(big, "r+b") as f:  # a change in the middle goes unseen: by design, for speed
        f.seek(size // 2)
        f.write(b"x")
    assert provenance.file_sha256(big) == first
    with open(big, "r+b") as f:  # a change at the end is seen
        f.seek(size - 1)
        f.write(b"x")
    assert provenance.file_sha256(big) != first


def test_resuming_appends_a_session_and_a_fresh_start_replaces_them(tmp_path: Path) -> None:
    provenance.record(tmp_path, {"started": "1"}, resume=False)
    provenance.record(tmp_path, {"started": "2"}, resume=True)
    assert [s["started"] for s in provenance.read_sessions(tmp_path)] == ["1", "2"]
    provenance.record(tmp_path, {"started": "3"}, resume=False)
    assert [s["started"] for s in provenance.read_sessions(tmp_path)] == ["3"]
    (tmp_path / provenance.PROVENANCE_FILE).write_bytes(b"\xff\x00")  # unreadable: no sessions
    assert provenance.read_sessions(tmp_path) == []


def _run(root: Path, arm: str, seed: int, **fields) -> RunData:
    folder = root / arm / f"seed-{seed}"
    folder.mkdir(parents=True)
    entry = {**provenance.collect(), **fields}
    (folder / provenance.PROVENANCE_FILE).write_text(json.dumps({"sessions": [entry]}))
    return RunData(arm=arm, seed=seed, path=folder, status="finished")


def test_the_report_groups_runs_by_setting_and_says_when_they_differ(tmp_path: Path) -> None:
    provenance.record(tmp_path, provenance.collect(), resume=False)
    same = [_run(tmp_path, "a", 0, threads=2), _run(tmp_path, "b", 0, threads=2)]
    text = render_markdown(provenance_blocks(tmp_path, same))
    assert "## Provenance" in text and "command:" in text
    assert "Every run session shares one setting" in text
    mixed = [*same, _run(tmp_path, "c", 0, threads=1)]
    text = render_markdown(provenance_blocks(tmp_path, mixed))
    assert "2 different settings" in text
    assert "| 2 |" in text and "| 1 |" in text  # two sessions in one setting, one in the other


def test_a_report_without_provenance_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "seed-0"
    folder.mkdir(parents=True)
    run = RunData(arm="a", seed=0, path=folder, status="finished")
    assert "No run folder records its provenance" in render_markdown(
        provenance_blocks(tmp_path, [run])
    )
