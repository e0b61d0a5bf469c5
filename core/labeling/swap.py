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
run labels with the labeler it had at its checkpoint.

Resume: a request is taken no earlier than its ``not_before`` step (``--at-step``, else the step
after the last one the run had finished when it was made), and when the run takes it, it
appends the request and the step to ``control/applied.jsonl`` first: a ledger that is never
cut back. A run resumed from an earlier checkpoint applies each ledger entry again before the
step it was applied at (not at once, and never twice), so it changes labelers exactly where the
uninterrupted run did; a run that starts over from step 0 has ``control/`` moved aside with the
killed attempt. Paths a request names inside the run folder are kept relative to it
(``run_relative``), so a run folder resumes from any working directory, moved or restored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from alignzoo import runfolder
from alignzoo.config.schema import ComponentRef
from alignzoo.errors import UserError
from alignzoo.runfolder.runfiles import append_jsonl, read_jsonl, read_status

HooksFor = Callable[[Any, str], Any]  # (labeler component, its name) -> the hooks of it alone

CONTROL = Path(runfolder.CONTROL) / "labeler.yaml"
"""The pending request: the last one written (atomically) by the command or by a round."""
LEDGER = Path(runfolder.CONTROL) / "applied.jsonl"
"""Every request the run took, in order, with the step it was taken before (append-only)."""
STATE_KEY = "labeling"
RUN_RELATIVE = "run_relative"
"""A request's labeler may list params (``run_relative: [path]``) that are paths relative to
the run folder: resolved against the folder the run is in whenever the labeler is built."""


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
    from alignzoo.config.yamlfile import load_yaml_model

    ref: ComponentRef = load_yaml_model(path, ComponentRef, "labeler spec")
    return ref


def run_folders(folder: Path) -> list[Path]:
    """The unfinished run folders at or under ``folder`` (a run folder or an experiment's)."""
    candidates = (
        [folder]
        if (folder / "config.yaml").is_file()
        else sorted(p.parent for p in folder.glob("*/seed-*/config.yaml"))
    )
    return [p for p in candidates if read_status(p).get("status") != "finished"]


def request(
    folder: Path, action: str, labeler_file: Path | None = None, at_step: int | None = None
) -> list[Path]:
    """Validate and write a swap / shadow / promote request into every unfinished run folder.

    ``at_step``: take it before that training step (a step not trained yet), which makes the
    step a swap happens at reproducible; else before the first step after the last one each
    run has finished (or the next one, if that one has begun)."""
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
        done = finished_step(run)
        if at_step is not None and at_step <= done:
            raise UserError(
                f"--at-step {at_step}: {run} has trained step {done} already; give a later step"
            )
        row = {**payload, "not_before": at_step if at_step is not None else done + 1}
        if "labeler" in payload:
            row["labeler"] = portable_ref(payload["labeler"], run)
        write_request(run, row)
    return runs


def write_request(run: Path, payload: dict[str, Any]) -> None:
    """``payload`` as the pending request of the run folder ``run`` (atomically)."""
    path = run / CONTROL
    path.parent.mkdir(exist_ok=True)
    runfolder.write_atomic(path, yaml.safe_dump(payload))


def finished_step(run: Path) -> int:
    """The last step the run in ``run`` has finished (its last metrics line; 0 before any)."""
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if isinstance(r.get("step"), int)]
    return max(steps, default=0)


PATH_KEYS = ("path", "_path", "_dir", "_file", "folder")
"""Param names (or their endings) that hold a path, such as the reward_model labeler's
``path``; other params are taken for paths only when written as one (with a ``/``)."""


def _names_a_path(key: str, value: Any) -> bool:
    """Whether a labeler param is a path to keep portable: a non-empty string under a path
    key, or one written with a folder separator or ``~`` (a regex ``.`` is not a path)."""
    if not isinstance(value, str) or not value or "\n" in value:
        return False
    return key.endswith(PATH_KEYS) or "/" in value or value.startswith("~")


def portable_ref(labeler: dict[str, Any], run: Path) -> dict[str, Any]:
    """A labeler spec as a run folder keeps it: each param that names an existing path
    (:func:`_names_a_path`, relative to the working directory) made absolute, or relative to
    ``run`` and listed in ``run_relative`` when it lies inside the run folder, so the request
    means the same file from any working directory and after the folder is moved."""
    params = dict(labeler.get("params") or {})
    relative = list(labeler.get(RUN_RELATIVE) or [])
    root = run.resolve()
    for key, value in params.items():
        if key in relative or not _names_a_path(key, value):
            continue
        try:
            found = Path(value).expanduser()
            if not found.exists():
                continue
            found = found.resolve()
        except (OSError, ValueError):
            continue
        if found.is_relative_to(root):
            params[key] = found.relative_to(root).as_posix()
            relative.append(key)
        else:
            params[key] = str(found)
    out = {**labeler, "params": params}
    if relative:
        out[RUN_RELATIVE] = relative
    return out


def resolve_ref(labeler: dict[str, Any], run: Path) -> ComponentRef:
    """The labeler a request or ``run.state`` names, its ``run_relative`` params resolved
    against the run folder ``run`` (where the run is now)."""
    spec = dict(labeler)
    relative = spec.pop(RUN_RELATIVE, None) or []
    params = dict(spec.get("params") or {})
    for key in relative:
        if isinstance(params.get(key), str):
            params[key] = str(Path(run) / params[key])
    return ComponentRef.model_validate({**spec, "params": params})


def read_ledger(run: Path) -> list[dict[str, Any]]:
    """The requests the run took, in order: ``{"step": n, "request": {...}}`` rows (a line cut
    by a kill is left out)."""
    return [
        row
        for row in read_jsonl(run / LEDGER)
        if isinstance(row.get("step"), int) and isinstance(row.get("request"), dict)
    ]


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


def _slot(ref: ComponentRef, stage: Any, context: Any, hooks_for: HooksFor) -> Any:
    from alignzoo.labeling.callers import Breaker, InlineCaller, ProcessCaller, Slot
    from alignzoo.labeling.store import labeler_identity

    component = build_labeler(ref)
    hooks = hooks_for(component, ref.name)
    hooks.on_run_start(context)
    process = stage.cfg.isolation == "process" or stage.cfg.timeout_s is not None
    call = ProcessCaller(component) if process else InlineCaller(hooks, component)
    return Slot(ref.name, call, Breaker(stage.cfg.breaker), identity=labeler_identity(component))


def restore(stage: Any, context: Any, hooks_for: HooksFor) -> None:
    """After a resume: label with the labeler (and shadow) recorded in ``run.state``.

    ``hooks_for(component, name)`` is the engine's checked hook facade over a plugin manager
    holding that labeler alone (the caller passes it: labeling imports nothing of the engine)."""
    state = context.state.get(STATE_KEY) or {}
    run = Path(context.out_dir)
    if state.get("head"):
        stage.replace_head(_slot(resolve_ref(state["head"], run), stage, context, hooks_for))
    if state.get("shadow"):
        stage.set_shadow(_slot(resolve_ref(state["shadow"], run), stage, context, hooks_for))


def poll(stage: Any, context: Any, hooks_for: HooksFor, log: Any = print) -> None:
    """Before each step: take again what the ledger says was taken before this step (a resumed
    run), then the pending request if it is new and due (see the module docstring);
    ``hooks_for`` as in :func:`restore`."""
    run, step = Path(context.out_dir), context.step
    state = context.state.setdefault(STATE_KEY, {})
    ledger = read_ledger(run)
    for entry in ledger:
        if entry["step"] == step:
            _apply(entry["request"], stage, context, state, log, hooks_for)
    path = run / CONTROL
    if not path.is_file():
        return
    try:
        payload = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # being written: the next step reads it
    if not isinstance(payload, dict):
        return
    taken = {entry["request"].get("id") for entry in ledger}
    if payload.get("id") in taken or payload.get("id") == state.get("applied"):
        return
    not_before = payload.get("not_before")
    if isinstance(not_before, int) and step < not_before:
        return
    append_jsonl(run / LEDGER, {"step": step, "request": payload})  # before it takes effect
    _apply(payload, stage, context, state, log, hooks_for)


def _apply(
    payload: dict[str, Any],
    stage: Any,
    context: Any,
    state: dict[str, Any],
    log: Any,
    hooks_for: HooksFor,
) -> None:
    """Take one request (swap, shadow or promote) and record it in ``swaps.jsonl``."""
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
            labeler = payload.get("labeler")
            if not isinstance(labeler, dict):
                raise UserError("the request names no labeler ({name: ..., params: {...}})")
            ref = resolve_ref(labeler, Path(context.out_dir))  # validated before it is kept
            row["labeler"] = dict(labeler)
            slot = _slot(ref, stage, context, hooks_for)
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
