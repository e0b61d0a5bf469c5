"""The run folder's one owner: every file a run writes is one RunFolder names, status.json
holds RunStatus's strings, and write_atomic leaves the old file whole when it fails before the
rename."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one
from alignzoo.runfolder import SEED_FOLDER, RunFolder, RunStatus, write_atomic
from tests.core.engine.conftest import engine_cache, tiny_experiment, write_experiment  # noqa: F401 - fixtures


def test_every_file_a_run_writes_is_one_run_folder_names(
    write_experiment,  # noqa: F811 - the engine tests' fixture
    tmp_path: Path,
) -> None:
    loaded = load_experiment(write_experiment(tiny_experiment(budget={"steps": 2})))
    folder = RunFolder.of(tmp_path / "out", "grpo", 0)
    assert SEED_FOLDER.match(folder.path.name).group(1) == "0"
    summary = run_one(loaded, "grpo", 0, folder.path)
    assert summary.status is RunStatus.FINISHED
    named = {
        folder.status,
        folder.config,
        folder.provenance,
        folder.metrics,
        folder.eval,
        folder.samples,
        folder.labels,
        *folder.streams(),
    }
    for path in folder.streams():
        assert path == folder.stream(path.stem)
    written = set(folder.path.iterdir())
    assert written - named - {folder.checkpoints} == set()
    assert {folder.status, folder.config, folder.metrics, folder.eval} <= written
    assert folder.checkpoints.is_dir()
    assert not list(folder.path.glob(".*.tmp")), "a temporary file was left behind"
    status = json.loads(folder.status.read_text(encoding="utf-8"))
    assert status["status"] == "finished" == RunStatus.FINISHED


def test_run_status_is_its_string_on_disk_and_in_text() -> None:
    assert json.dumps({"status": RunStatus.FAILED}) == '{"status": "failed"}'
    assert f"{RunStatus.RUNNING}" == str(RunStatus.RUNNING) == "running"
    assert RunStatus("finished") is RunStatus.FINISHED
    assert {"finished": 1}.get(RunStatus.FINISHED) == 1


@pytest.mark.parametrize("new", ["new text\n", b"new \x00bytes"])
def test_write_atomic_replaces_the_file_whole(tmp_path: Path, new: str | bytes) -> None:
    path = tmp_path / "status.json"
    path.write_text("old\n", encoding="utf-8")
    write_atomic(path, new)
    got = path.read_bytes()
    assert got == (new.encode("utf-8") if isinstance(new, str) else new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_crash_before_the_rename_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "status.json"
    path.write_text('{"status": "running"}', encoding="utf-8")
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])

    def crash(src: object, dst: object) -> None:
        raise OSError("killed between the write and the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        write_atomic(path, '{"status": "finished"}')
    assert path.read_text(encoding="utf-8") == '{"status": "running"}'
    assert synced, "the new text is fsynced before the rename"
    assert (tmp_path / ".status.json.tmp").read_text(encoding="utf-8") == '{"status": "finished"}'
