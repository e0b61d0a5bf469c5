"""Hot swap and shadow mode: change a live run's labeler between steps.

``alignzoo labeler swap RUN_DIR NEW.yaml`` validates the new labeler (``{name: ..., params:
{...}}``: it is built, as a run would build it) and only then writes the request into each
unfinished run folder (``control/labeler.yaml``, atomically); with ``--shadow`` the new labeler
first scores alongside the current one without being trained on, and the step's metrics carry
the agreement (``shadow/<name>/pearson``, ``spearman``, ``disagree``, ``n``) until
``alignzoo labeler promote RUN_DIR`` makes it the labeler (``alignzoo labeler swap`` without
``--shadow`` swaps at once).

The run reads the request before each step (:func:`poll`). A labeler that fails to build or
start there is rejected and the old one keeps running. Every request is recorded in the run's
``swaps.jsonl`` (applied or rejected, at which step; the report lists them and says when the
arms were labeled differently), and the labeler in use is kept in ``run.state``, so a resumed
run labels with the labeler it had at its checkpoint and then applies any newer request.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from alignzoo.config.schema import ComponentRef
from alignzoo.errors import UserError

CONTROL = Path("control") / "labeler.yaml"
STATE_KEY = "labeling"


def build_labeler(ref: ComponentRef) -> Any:
    """The labeler ``ref`` names, built from its params (UserError saying what is wrong)."""
    from alignzoo.registry import get_registry

    cls = get_registry().get("labeler", ref.name)
    try:
        return cls(cls.Params.model_validate(ref.params))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise UserError(f"labeler {ref.name!r}: params.{where}: {err['msg']}") from None


def read_ref(path: Path) -> ComponentRef:
    """A labeler spec file: ``{name: <labeler>, params: {...}}``."""
    from alignzoo.config.loader import load_yaml_model

    ref: ComponentRef = load_yaml_model(path, ComponentRef, "labeler spec")
    return ref


def run_folders(folder: Path) -> list[Path]:
    """The unfinished run folders at or under ``folder`` (a run folder or an experiment's)."""
    from alignzoo.experiment.runfiles import read_status

    candidates = (
        [folder]
        if (folder / "config.yaml").is_file()
        else sorted(p.parent for p in folder.glob("*/seed-*/config.yaml"))
    )
    return [p for p in candidates if read_status(p).get("status") != "finished"]


def request(folder: Path, action: str, labeler_file: Path | None = None) -> list[Path]:
    """Validate and write a swap / shadow / promote request into every unfinished run folder."""
    if not folder.is_dir():
        raise UserError(f"run folder not found: {folder}")
    payload: dict[str, Any] = {"action": action, "id": f"{time.time():.6f}-{uuid.uuid4().hex[:8]}"}
    if labeler_file is not None:
        ref = read_ref(labeler_file)
        component = build_labeler(ref)  # validated before anything is written
        close = getattr(component, "close", None)
        if callable(close):
            close()
        payload["labeler"] = ref.model_dump(mode="json")
    runs = run_folders(folder)
    if not runs:
        raise UserError(f"{folder}: no unfinished run to change the labeler of")
    if action == "promote":
        runs = _with_a_shadow(folder, runs)
    for run in runs:
        path = run / CONTROL
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(yaml.safe_dump(payload), encoding="utf-8")
        tmp.replace(path)
    return runs


def shadow_of(run: Path) -> str | None:
    """Whether ``run`` has a shadow labeler: "running" (the last applied shadow request has not
    been promoted), "pending" (requested, not yet applied before a step), else None."""
    running = False
    swaps = run / "swaps.jsonl"
    if swaps.is_file():
        for line in swaps.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and row.get("status") == "applied":
                if row.get("action") == "shadow":
                    running = True
                elif row.get("action") == "promote":
                    running = False
    if running:
        return "running"
    try:
        pending = yaml.safe_load((run / CONTROL).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        pending = {}
    return "pending" if isinstance(pending, dict) and pending.get("action") == "shadow" else None


def _with_a_shadow(folder: Path, runs: list[Path]) -> list[Path]:
    """The runs a promotion applies to: those whose shadow labeler is running; a UserError
    when none is (or when a shadow is only requested: promoting now would replace that
    request)."""
    states = {run: shadow_of(run) for run in runs}
    pending = [run for run, state in states.items() if state == "pending"]
    if pending:
        raise UserError(
            f"{pending[0]}: its shadow labeler is requested but not applied yet (it is applied "
            "before the run's next step); promote after that step, or the promotion would "
            "replace the shadow request"
        )
    running = [run for run, state in states.items() if state == "running"]
    if not running:
        raise UserError(
            f"{folder}: no shadow labeler is running in its {len(runs)} unfinished run(s), so "
            "there is nothing to promote; start one with `alignzoo labeler swap RUN_DIR NEW.yaml "
            "--shadow`, or swap at once without --shadow"
        )
    return running


def _slot(ref: ComponentRef, stage: Any, context: Any) -> Any:
    from alignzoo.engine.hooks import Hooks
    from alignzoo.labeling.callers import Breaker, InlineCaller, ProcessCaller, Slot
    from alignzoo.labeling.store import labeler_identity
    from alignzoo.registry import build_plugin_manager

    component = build_labeler(ref)
    hooks = Hooks(build_plugin_manager([component]), ref.name)
    hooks.on_run_start(context)
    process = stage.cfg.isolation == "process" or stage.cfg.timeout_s is not None
    call = ProcessCaller(component) if process else InlineCaller(hooks, component)
    return Slot(ref.name, call, Breaker(stage.cfg.breaker), identity=labeler_identity(component))


def restore(stage: Any, context: Any) -> None:
    """After a resume: label with the labeler (and shadow) recorded in ``run.state``."""
    state = context.state.get(STATE_KEY) or {}
    if state.get("head"):
        stage.replace_head(_slot(ComponentRef.model_validate(state["head"]), stage, context))
    if state.get("shadow"):
        stage.set_shadow(_slot(ComponentRef.model_validate(state["shadow"]), stage, context))


def poll(stage: Any, context: Any, log: Any = print) -> None:
    """Apply a new request in the run folder, if there is one (called before each step)."""
    path = Path(context.out_dir) / CONTROL
    if not path.is_file():
        return
    state = context.state.setdefault(STATE_KEY, {})
    try:
        payload = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # being written: the next step reads it
    if not isinstance(payload, dict) or payload.get("id") == state.get("applied"):
        return
    state["applied"] = payload.get("id")
    action = str(payload.get("action"))
    row: dict[str, Any] = {"action": action, "request": payload.get("id")}
    try:
        if action == "promote":
            if stage.shadow is None:
                raise UserError("there is no shadow labeler to promote")
            shadow = stage.shadow
            stage.shadow = None
            stage.replace_head(shadow)
            state["head"], state["shadow"] = state.get("shadow"), None
            row["labeler"] = state["head"]
        else:
            ref = ComponentRef.model_validate(payload.get("labeler"))
            row["labeler"] = ref.model_dump(mode="json")
            slot = _slot(ref, stage, context)
            if action == "shadow":
                stage.set_shadow(slot)
                state["shadow"] = row["labeler"]
            elif action == "swap":
                stage.replace_head(slot)
                state["head"] = row["labeler"]
            else:
                raise UserError(f"unknown action {action!r}")
        row["status"] = "applied"
        log(f"labeler {action} applied before step {context.step}: {json.dumps(row['labeler'])}")
    except Exception as exc:  # the old labeler keeps running
        row["status"], row["reason"] = "rejected", f"{type(exc).__name__}: {exc}"
        log(f"labeler {action} rejected before step {context.step}: {row['reason']}")
    context.record("swaps", row)
