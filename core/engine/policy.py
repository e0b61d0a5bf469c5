"""Where the policy's weights come from: the user's folder, or the embedded warm start, built
on the embedded task or (``model.embedded.sft_on: train``) on the experiment's own rows.

Its own module because it reads data (:mod:`alignzoo.engine.datasets`) as well as models:
:mod:`alignzoo.engine.models` stays below the data layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alignzoo.config.schema import DataConfig, ModelConfig
from alignzoo.engine.datasets import load_split
from alignzoo.errors import UserError


def warm_start_examples(data: DataConfig) -> dict[str, list[dict[str, str]]]:
    """The experiment's own train and eval rows as the embedded warm start's examples
    (``model.embedded.sft_on: train``): ``prompt`` and ``answer`` of each row."""
    out: dict[str, list[dict[str, str]]] = {}
    for split in ("train", "eval"):
        rows = load_split(data, split, "online")  # type: ignore[arg-type]
        if "answer" not in rows.column_names:
            raise UserError(
                f"model.embedded.sft_on: train warm-starts on each prompt's 'answer'; "
                f"data.{split} has no 'answer' column (columns: {', '.join(rows.column_names)})"
            )
        pairs = zip(rows["prompt"], rows["answer"], strict=True)
        out[split] = [{"prompt": str(p), "answer": str(a)} for p, a in pairs]
    return out


def policy_path(model_cfg: ModelConfig, data: DataConfig, log: Callable[[str], None]) -> str:
    """The folder the policy loads from: the cached embedded warm start (on the embedded task
    or, with ``sft_on: train``, on ``data``'s own rows), or the user's path."""
    if model_cfg.policy == "embedded":
        from alignzoo import distributed
        from alignzoo.world.warmstart import ensure_policy

        if not distributed.is_main():  # rank 0 builds the cached warm start, the others read it
            distributed.barrier()
        examples = warm_start_examples(data) if model_cfg.embedded.sft_on == "train" else None
        path = str(ensure_policy(model_cfg, data.task, log=log, examples=examples))
        if distributed.is_main():
            distributed.barrier()
        return path
    return model_cfg.policy


def teacher_path(model_cfg: ModelConfig, data: DataConfig, log: Callable[[str], None]) -> str:
    """The folder the arm's ``model.teacher`` loads from: its path, or the embedded world's
    teacher (the embedded policy's settings with the teacher's, built and cached like the
    warm start)."""
    teacher = model_cfg.teacher
    if teacher is None:
        raise UserError(
            "model.teacher: this arm's algorithm distills from a teacher; give one "
            "(model.teacher: {path: <checkpoint folder>} or {embedded: {...}})"
        )
    if teacher.path is not None:
        if not Path(teacher.path).expanduser().is_dir():
            raise UserError(
                f"model.teacher.path: {teacher.path!r} is not a folder (a local checkpoint "
                "written by save_pretrained)"
            )
        return str(Path(teacher.path).expanduser())
    # teacher.embedded: the policy's embedded settings with the teacher's (resolved by the schema)
    built = model_cfg.model_copy(update={"policy": "embedded", "embedded": teacher.embedded})
    log("model.teacher: the embedded world's teacher")
    return policy_path(built, data, log)
