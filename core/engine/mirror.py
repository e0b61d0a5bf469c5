"""Checkpoints mirrored to object storage: ``training.checkpoint_mirror`` is any fsspec URL
(``s3://bucket/prefix``: the ``s3`` extra; ``gs://``, ``az://``, ``file://``, ... with their
fsspec packages), for runs whose nodes share no filesystem or whose disks do not outlive them.

After each local checkpoint is complete, rank 0 copies it to
``URL/<experiment>/<arm>/seed-<n>/checkpoints/step-<n>/``: every file, then ``MANIFEST.json``
last (each file's size and SHA-256), so a copy cut short (a kill mid-upload) has no manifest
and is never resumed from; the previous one stays the resume point. The mirror keeps the
checkpoints the run folder keeps (the last two and the best evaluated). A copy that fails (the
store unreachable) is logged and counted, and training goes on from the local checkpoint.

On ``--resume``, a run folder that holds no complete checkpoint (another machine's disk, a lost
node) first gets the newest complete one of the mirror, each file checked against the
manifest. Credentials come from the environment only (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ... as the storage's own library reads them), never from the YAML.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignzoo.engine.checkpoint import (
    checkpoint_manifest,
    complete_checkpoints,
    full_sha256,
    point_latest_at,
)
from alignzoo.errors import UserError

MANIFEST = "MANIFEST.json"
"""Written last into each mirrored checkpoint: without it a checkpoint is incomplete."""


@dataclass
class Mirror:
    """Where one run's checkpoints are mirrored: a filesystem and a folder path on it."""

    fs: Any
    root: str
    url: str

    def complete(self) -> dict[int, str]:
        """Step -> name of every mirrored checkpoint that has its manifest."""
        self.fs.invalidate_cache()
        try:
            names = [Path(p).name for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return {}
        found = {}
        for name in names:
            tail = name.split("-", 1)[-1]
            complete = self.fs.exists(f"{self.root}/{name}/{MANIFEST}")
            if name.startswith("step-") and tail.isdigit() and complete:
                found[int(tail)] = name
        return dict(sorted(found.items()))


def open_mirror(url: str, field: str = "training.checkpoint_mirror") -> tuple[Any, str]:
    """The fsspec filesystem and path of ``url``; a UserError naming ``field`` when the URL is
    not one fsspec reads or its protocol's package is missing."""
    import fsspec

    if "://" not in url:
        raise UserError(
            f"{field}: {url!r} is not a URL; give one such as s3://bucket/prefix or file:///path"
        )
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        extra = " (pip install 'alignzoo[s3]')" if url.startswith("s3://") else ""
        raise UserError(f"{field}: {url!r}: {exc}{extra}") from None
    except ValueError as exc:
        raise UserError(f"{field}: {url!r}: {exc}") from None
    return fs, str(path).rstrip("/")


def mirror_for(url: str | None, experiment: str, arm: str, seed: int) -> Mirror | None:
    """The mirror of one run (None without ``training.checkpoint_mirror``)."""
    if not url:
        return None
    fs, path = open_mirror(url)
    return Mirror(fs, f"{path}/{experiment}/{arm}/seed-{seed}/checkpoints", url)


def upload(mirror: Mirror, folder: Path, keep: set[str]) -> None:
    """Copy the complete local checkpoint ``folder`` (its manifest last), then remove mirrored
    checkpoints whose names are not in ``keep`` (what the run folder keeps)."""
    manifest = checkpoint_manifest(folder)
    target = f"{mirror.root}/{folder.name}"
    if mirror.fs.exists(f"{target}/{MANIFEST}"):  # the same step saved again: incomplete first
        mirror.fs.rm(f"{target}/{MANIFEST}")
    for relative in manifest["files"]:
        mirror.fs.put_file(str(folder / relative), f"{target}/{relative}")
    mirror.fs.pipe_file(f"{target}/{MANIFEST}", json.dumps(manifest).encode("utf-8"))
    for name in mirror.complete().values():
        if name not in keep:
            mirror.fs.rm(f"{mirror.root}/{name}", recursive=True)


def restore(mirror: Mirror, ckpt_dir: Path, log: Callable[..., None]) -> Path | None:
    """When ``ckpt_dir`` holds no complete checkpoint: the mirror's newest complete one,
    downloaded beside it and moved into place once every file matches the manifest (else a
    UserError naming the file). None when there is nothing to restore."""
    if complete_checkpoints(ckpt_dir):
        return None
    remote = mirror.complete()
    if not remote:
        return None
    name = remote[max(remote)]
    source = f"{mirror.root}/{name}"
    manifest = json.loads(mirror.fs.cat_file(f"{source}/{MANIFEST}"))
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    partial = ckpt_dir / f".fetch-{os.getpid()}-{name}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for relative, (size, sha256) in manifest["files"].items():
            local = partial / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            mirror.fs.get_file(f"{source}/{relative}", str(local))
            if local.stat().st_size != size or full_sha256(local) != sha256:
                raise UserError(
                    f"checkpoint mirror: {source}/{relative} does not match its manifest (size "
                    f"or SHA-256); the mirrored checkpoint is damaged, nothing was restored"
                )
        final = ckpt_dir / name
        if final.exists():  # another rank restored it meanwhile (a shared folder)
            return final
        os.replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    point_latest_at(final)
    log(f"restored checkpoint {name} from the mirror {mirror.url}")
    return final


def restore_from_mirror(
    loaded: Any, arm: str, seed: int, ckpt_dir: Path, log: Callable[..., None]
) -> Path | None:
    """:func:`restore` into the checkpoints folder ``ckpt_dir`` of the run ``arm`` x ``seed``
    from the arm's mirror, if it has one."""
    spec = loaded.spec
    mirror = mirror_for(spec.arms[arm].training.checkpoint_mirror, spec.name, arm, seed)
    return None if mirror is None else restore(mirror, ckpt_dir, log)
