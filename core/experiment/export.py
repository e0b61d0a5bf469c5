"""``alignzoo export RUN_DIR [--step last|best|N] --out DIR [--merge]``: a trained policy as a
folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load.

The run's checkpoint (``actor.safetensors``) is loaded into the policy it started from (the
cached embedded warm start or ``model.policy``), then written with ``save_pretrained``:
config, safetensors weights, the tokenizer and a generation config. A LoRA arm is written as
its adapter (peft format: ``adapter_config.json``, ``adapter_model.safetensors``, loaded with
``peft.AutoPeftModelForCausalLM``), or, with ``--merge``, merged into the base weights (loaded
with transformers alone). ``README.md`` is a model card: the experiment, arm, algorithm and
its params, data, seed, step, and the run's evaluation at that step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alignzoo.errors import UserError
from alignzoo.runfolder import RunFolder, RunStatus

CARD = "README.md"


def _config(run: Path) -> dict[str, Any]:
    path = RunFolder(run).config
    if not path.is_file():
        raise UserError(f"{run}: not a run folder (no config.yaml); give RUN_DIR/<arm>/seed-<n>")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "arm_spec" not in config:
        raise UserError(f"{path}: not the config of a run (no arm_spec)")
    return config


def _evaluations(run: Path) -> list[dict[str, Any]]:
    path = RunFolder(run).eval
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


@dataclass
class Chosen:
    """The checkpoint an export takes: its folder, its step, and why that one (said in the
    command's output)."""

    folder: Path
    step: int
    why: str


def _status(run: Path) -> dict[str, Any] | None:
    try:
        status = json.loads(RunFolder(run).status.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def _last(run: Path, steps: dict[int, Path]) -> Chosen:
    """``--step last``: a finished run's final step (the step its status.json reports, whatever
    ``checkpoints/latest`` says), else the newest usable checkpoint (what a resume takes)."""
    from alignzoo.engine.checkpoint import (
        CheckpointError,
        check_checkpoint,
        find_resume_point,
        pointed_name,
    )

    folder = RunFolder(run).checkpoints
    pointer = pointed_name(folder)
    status = _status(run)
    if status is not None and status.get("status") == RunStatus.FINISHED:
        final = status.get("step")
        if not isinstance(final, int) or final not in steps:
            raise UserError(
                f"{run}: status.json says the run finished at step {final}, but checkpoints/ "
                f"has no complete checkpoint of that step (kept: "
                f"{', '.join(map(str, steps))}); nothing written. Run it again with --resume "
                "to write its final checkpoint, or give --step with one of the kept steps"
            )
        try:
            check_checkpoint(steps[final], critic=False)
        except CheckpointError as exc:
            raise UserError(
                f"{run}: the checkpoint of the final step {final} is unusable ({exc}); "
                "nothing written. Give --step with one of the other kept steps"
            ) from None
        why = f"the run's final step ({final})"
        if pointer != steps[final].name:
            why += (
                f"; checkpoints/latest names {pointer or 'nothing'}, not the final step: "
                "a resume would set it right"
            )
        return Chosen(steps[final], final, why)
    point = find_resume_point(folder, critic=False)
    if point.folder is None:
        reasons = "; ".join(f"{f.name}: {why}" for f, why in point.unusable)
        raise UserError(f"{run}: no usable checkpoint to export ({reasons}); nothing written")
    step = int(point.folder.name.split("-", 1)[1])
    state = "without a status.json" if status is None else f"{status.get('status')}"
    why = f"the newest usable checkpoint ({step}): the run is {state}, not finished"
    if point.unusable:
        why += "; passed over " + ", ".join(f.name for f, _ in point.unusable)
    return Chosen(point.folder, step, why)


def choose_checkpoint(run: Path, step: str, metric: str, higher: bool) -> Chosen:
    """The checkpoint for ``--step``: last (see :func:`_last`), best (by the run's evaluation
    metric, among the checkpoints kept) or a step number."""
    from alignzoo.engine.checkpoint import complete_checkpoints

    steps = complete_checkpoints(RunFolder(run).checkpoints)
    if not steps:
        raise UserError(f"{run}: no checkpoint to export (checkpoints/ is empty)")
    if step == "last":
        return _last(run, steps)
    if step == "best":
        scored = [(r[metric], int(r["step"])) for r in _evaluations(run)
                  if int(r["step"]) in steps and isinstance(r.get(metric), (int, float))]  # fmt: skip
        if not scored:
            raise UserError(
                f"{run}: no evaluation of {metric} at a kept checkpoint (steps "
                f"{', '.join(map(str, steps))}); use --step last or a step number"
            )
        value, best = max(scored) if higher else min(scored)
        return Chosen(steps[best], best, f"the best {metric} at a kept checkpoint ({value:.4g})")
    if not step.isdigit() or int(step) not in steps:
        raise UserError(
            f"--step {step}: expected last, best or one of the kept checkpoints' steps "
            f"({', '.join(map(str, steps))})"
        )
    return Chosen(steps[int(step)], int(step), "asked for by --step")


def base_name(policy: str, base: str) -> str:
    """The starting policy as a model card names it, with no path of the machine that trained
    it: the embedded warm start by its cache entry's name, a local folder by its own name, a
    hub id as written."""
    if policy == "embedded":
        return f"the embedded warm start {Path(base).name}"
    if Path(policy).is_absolute() or Path(policy).exists() or policy.startswith((".", "~")):
        return f"a local model folder named {Path(policy).expanduser().name}"
    return policy


def export(run: Path, out: Path, step: str = "last", merge: bool = False) -> Chosen:
    """Write the run's policy at ``step`` into ``out`` (which must not exist or be empty);
    returns the checkpoint it took and why. Refuses (:class:`UserError`, nothing written) when
    that checkpoint cannot be told: a finished run with no checkpoint of its final step."""
    from alignzoo.config.schema import ArmSpec, DataConfig
    from alignzoo.engine import models as model_loading
    from alignzoo.engine.checkpoint import load_actor_weights
    from alignzoo.engine.policy import policy_path
    from alignzoo.runfolder.runfiles import metric_key

    run = Path(run)
    config = _config(run)
    arm = ArmSpec.model_validate(config["arm_spec"])
    data = DataConfig.model_validate(config.get("data", {}))
    evaluation = config.get("evaluation", {})
    metric = metric_key(evaluation.get("metric") or "exact_match")
    higher = evaluation.get("higher_is_better")
    higher = True if higher is None else bool(higher)
    chosen = choose_checkpoint(run, step, metric, higher)
    folder = chosen.folder
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; nothing written")
    if merge and arm.model.lora is None:
        raise UserError("--merge: the arm trains every weight (no LoRA), nothing to merge")

    base = policy_path(arm.model, data, log=lambda _: None)
    tokenizer = model_loading.load_tokenizer(base)
    actor = model_loading.load_actor(base, arm.model, "cpu")
    load_actor_weights(actor, folder / "actor.safetensors")
    actor.eval()
    out.mkdir(parents=True, exist_ok=True)
    model = actor.merge_and_unload() if merge else actor
    model.save_pretrained(out)  # peft: the adapter; otherwise config + weights
    tokenizer.save_pretrained(out)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    generation = getattr(inner, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
    at = [r for r in _evaluations(run) if int(r["step"]) == chosen.step]
    card = _card(config, arm, chosen, at[-1] if at else None, metric, merge, base)
    (out / CARD).write_text(card, encoding="utf-8")
    return chosen


def _card(
    config: dict[str, Any],
    arm: Any,
    chosen: Chosen,
    evaluation: dict[str, Any] | None,
    metric: str,
    merged: bool,
    base: str,
) -> str:
    kind = (
        "full weights" if arm.model.lora is None else ("LoRA merged" if merged else "LoRA adapter")
    )
    params = json.dumps(arm.algorithm.params, sort_keys=True) if arm.algorithm.params else "{}"
    lines = [
        "---",
        "library_name: "
        + ("peft" if arm.model.lora is not None and not merged else "transformers"),
        "tags: [alignzoo, " + arm.algorithm.name + "]",
        "---",
        "",
        f"# {config.get('experiment')} / {config.get('arm')} / seed {config.get('seed')}",
        "",
        f"Trained with alignzoo: algorithm `{arm.algorithm.name}` `{params}`, labeler "
        f"`{arm.labeler.name}`, {chosen.step} steps, seed {config.get('seed')}; {kind}, from "
        f"{base_name(arm.model.policy, base)}.",
        "",
        f"Exported checkpoint: step {chosen.step}, {chosen.why}.",
        "",
        f"- data: train `{config.get('data', {}).get('train')}`, eval "
        f"`{config.get('data', {}).get('eval')}`",
        f"- training: `{json.dumps(arm.training.model_dump(mode='json'), sort_keys=True)}`",
    ]
    if arm.modifiers:
        lines.append("- modifiers: " + ", ".join(f"`{m.name}`" for m in arm.modifiers))
    if evaluation is not None:
        shown = {k: v for k, v in evaluation.items() if k.startswith("eval/")}
        lines += ["", f"Evaluation at step {chosen.step} (the run's own, greedy):", ""]
        lines += [f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}"
                  for k, v in sorted(shown.items())]  # fmt: skip
        lines.append(f"\nThe experiment's report compares arms on `{metric}`.")
    return "\n".join(lines) + "\n"
