"""Checkpoints mirrored to object storage, against a real S3-compatible server on 127.0.0.1
(moto's server mode, reached through s3fs with credentials and endpoint from the environment):
each complete checkpoint is copied with its manifest last and pruned like the run folder's; a
run folder that lost its checkpoints resumes from the mirror's newest complete one, exactly,
while a copy cut short (no manifest) is passed over; a damaged copy is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.engine.mirror import MANIFEST, mirror_for, open_mirror, restore, upload
from alignzoo.errors import UserError
from alignzoo.experiment.runner import run_experiment

from .conftest import back_to_checkpoint, read_jsonl, tiny_experiment

pytest.importorskip("moto.server", reason="moto[server] is not installed")
pytest.importorskip("s3fs", reason="s3fs (the s3 extra) is not installed")


def test_a_url_that_is_not_one_is_refused_naming_the_field() -> None:
    with pytest.raises(
        UserError, match=r"training.checkpoint_mirror: 'bucket/prefix' is not a URL"
    ):
        open_mirror("bucket/prefix")
    with pytest.raises(UserError, match=r"nosuch://x"):
        open_mirror("nosuch://x")


def fake_checkpoint(folder: Path, step: int) -> Path:
    checkpoint = folder / f"step-{step:06d}"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"step": step}))
    (checkpoint / "sub" / "weights.bin").write_bytes(bytes(range(256)) * (step + 1))
    return checkpoint


def test_a_copy_without_its_manifest_is_passed_over_and_a_damaged_one_refused(
    s3: str, tmp_path: Path
) -> None:
    mirror = mirror_for(f"{s3}/unit", "exp", "arm", 0)
    assert mirror is not None
    local = tmp_path / "checkpoints"
    for step in (2, 4):
        upload(mirror, fake_checkpoint(local, step), keep={"step-000002", "step-000004"})
    assert mirror.complete() == {2: "step-000002", 4: "step-000004"}
    manifest = json.loads(mirror.fs.cat_file(f"{mirror.root}/step-000004/{MANIFEST}"))
    assert sorted(manifest["files"]) == ["state.json", "sub/weights.bin"]
    upload(mirror, fake_checkpoint(local, 6), keep={"step-000004", "step-000006"})
    assert mirror.complete() == {4: "step-000004", 6: "step-000006"}  # pruned like the folder

    mirror.fs.rm(f"{mirror.root}/step-000006/{MANIFEST}")  # a copy cut short by a kill
    fresh = tmp_path / "elsewhere" / "checkpoints"
    restored = restore(mirror, fresh, lambda *_: None)
    assert restored == fresh / "step-000004"
    assert (restored / "sub" / "weights.bin").read_bytes() == bytes(range(256)) * 5
    assert (fresh / "latest").read_text().strip() == "step-000004"
    assert restore(mirror, fresh, lambda *_: None) is None  # it has a checkpoint now

    mirror.fs.pipe_file(f"{mirror.root}/step-000004/sub/weights.bin", b"damaged")
    with pytest.raises(UserError, match=r"step-000004/sub/weights.bin does not match"):
        restore(mirror, tmp_path / "third" / "checkpoints", lambda *_: None)
    assert not list((tmp_path / "third" / "checkpoints").iterdir())  # nothing half-restored


@pytest.mark.slow
def test_a_run_that_lost_its_checkpoints_resumes_exactly_from_the_mirror(
    s3: str, tmp_path: Path, engine_cache: Path
) -> None:
    spec = tiny_experiment(
        budget={"steps": 4},
        training={"checkpoint_every": 2, "checkpoint_mirror": f"{s3}/runs"},
        evaluation={"every": 2, "num_prompts": 4},
    )
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    first = run_experiment(load_experiment(path), out_dir=tmp_path / "out")
    assert not first.failed, [r.error for r in first.runs]
    run_dir = tmp_path / "out" / "grpo" / "seed-0"
    straight = read_jsonl(run_dir / "metrics.jsonl")
    assert all(row["checkpoint/mirror_failures"] == 0.0 for row in straight)
    mirror = mirror_for(f"{s3}/runs", "tiny", "grpo", 0)
    assert mirror is not None and mirror.complete() == {2: "step-000002", 4: "step-000004"}
    local = json.loads(mirror.fs.cat_file(f"{mirror.root}/step-000004/{MANIFEST}"))
    assert set(local["files"]) == {
        str(p.relative_to(run_dir / "checkpoints" / "step-000004"))
        for p in (run_dir / "checkpoints" / "step-000004").rglob("*")
        if p.is_file()
    }

    # Another machine: the run was killed while step 4's copy was going up (no manifest), and
    # this run folder has the lines up to step 2 but no checkpoint at all.
    back_to_checkpoint(run_dir, 2)
    shutil.rmtree(run_dir / "checkpoints")
    mirror.fs.rm(f"{mirror.root}/step-000004/{MANIFEST}")
    resumed = run_experiment(load_experiment(path), out_dir=tmp_path / "out", resume=True)
    assert not resumed.failed, [r.error for r in resumed.runs]
    restarted = [
        json.loads(p.read_text())
        for p in (run_dir / "attempts").glob("*/attempt.json")
        if json.loads(p.read_text()).get("kind") == "restarted"
    ]
    assert not restarted, f"premise: the run resumed from the mirror, not from scratch: {restarted}"
    again = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(straight, again, strict=True):
        for key in ("loss", "reward/mean", "kl/ref", "entropy", "actor/grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)
    assert mirror.complete() == {2: "step-000002", 4: "step-000004"}  # step 4 copied again


UPLOAD = """
import sys
from pathlib import Path
from alignzoo.engine.mirror import mirror_for, upload

mirror = mirror_for(sys.argv[1], "exp", "arm", 0)
upload(mirror, Path(sys.argv[2]), keep={"step-000002", "step-000004"})
"""


def test_a_copy_killed_mid_upload_leaves_the_previous_checkpoint_the_resume_point(
    s3: str, tmp_path: Path
) -> None:
    """A process SIGKILLed while it copies a checkpoint (some files up, the manifest not):
    the mirror's complete checkpoints are still the earlier ones, and a restore takes those."""
    import signal
    import subprocess
    import sys
    import time

    url = f"{s3}/killed"
    mirror = mirror_for(url, "exp", "arm", 0)
    assert mirror is not None
    local = tmp_path / "checkpoints"
    upload(mirror, fake_checkpoint(local, 2), keep={"step-000002"})
    big = fake_checkpoint(local, 4)
    for i in range(40):  # many files, so the kill lands between two of them
        (big / "sub" / f"shard-{i:02d}.bin").write_bytes(os.urandom(1 << 20))
    child = subprocess.Popen([sys.executable, "-c", UPLOAD, url, str(big)])
    target = f"{mirror.root}/step-000004"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mirror.fs.invalidate_cache()
        if mirror.fs.exists(target) and len(mirror.fs.find(target)) >= 3:
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    mirror.fs.invalidate_cache()
    copied = len(mirror.fs.find(target))
    assert 3 <= copied < 42, f"premise: the kill came mid-upload ({copied} files up)"
    assert mirror.complete() == {2: "step-000002"}
    restored = restore(mirror, tmp_path / "fresh" / "checkpoints", lambda *_: None)
    assert restored is not None and restored.name == "step-000002"
