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
from pathlib import Path
from typing import Any

import yaml

from alignzoo.errors import UserError

CARD = "README.md"


def _config(run: Path) -> dict[str, Any]:
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run}: not a run folder (no config.yaml); give RUN_DIR/<arm>/seed-<n>")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or "arm_spec" not in config:
        raise UserError(f"{path}: not the config of a run (no arm_spec)")
    return config


def _evaluations(run: Path) -> list[dict[str, Any]]:
    path = run / "eval.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


def _checkpoint(run: Path, step: str, metric: str, higher: bool) -> Path:
    """The checkpoint folder for ``step``: last, best (by the run's evaluation metric, among
    the checkpoints kept) or a step number."""
    from alignzoo.engine.checkpoint import complete_checkpoints, latest_checkpoint

    folder = run / "checkpoints"
    steps = complete_checkpoints(folder)
    if not steps:
        raise UserError(f"{run}: no checkpoint to export (checkpoints/ is empty)")
    if step == "last":
        latest = latest_checkpoint(folder)
        assert latest is not None
        return latest
    if step == "best":
        scored = [(r[metric], int(r["step"])) for r in _evaluations(run)
                  if int(r["step"]) in steps and isinstance(r.get(metric), (int, float))]  # fmt: skip
        if not scored:
            raise UserError(
                f"{run}: no evaluation of {metric} at a kept checkpoint (steps "
                f"{', '.join(map(str, steps))}); use --step last or a step number"
            )
        best = max(scored) if higher else min(scored)
        return steps[best[1]]
    if not step.isdigit() or int(step) not in steps:
        raise UserError(
            f"--step {step}: expected last, best or one of the kept checkpoints' steps "
            f"({', '.join(map(str, steps))})"
        )
    return steps[int(step)]


def export(run: Path, out: Path, step: str = "last", merge: bool = False) -> Path:
    """Write the run's policy at ``step`` into ``out`` (which must not exist or be empty)."""
    from alignzoo.config.schema import ArmSpec, DataConfig
    from alignzoo.engine import models as model_loading
    from alignzoo.engine.checkpoint import load_actor_weights
    from alignzoo.engine.policy import policy_path
    from alignzoo.experiment.runfiles import metric_key

    run = Path(run)
    config = _config(run)
    arm = ArmSpec.model_validate(config["arm_spec"])
    data = DataConfig.model_validate(config.get("data", {}))
    evaluation = config.get("evaluation", {})
    metric = metric_key(evaluation.get("metric") or "exact_match")
    higher = evaluation.get("higher_is_better")
    higher = True if higher is None else bool(higher)
    folder = _checkpoint(run, step, metric, higher)
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
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    at = [r for r in _evaluations(run) if int(r["step"]) == int(state["step"])]
    (out / CARD).write_text(
        _card(config, arm, int(state["step"]), at[-1] if at else None, metric, merge, base),
        encoding="utf-8",
    )
    return out


def _card(
    config: dict[str, Any],
    arm: Any,
    step: int,
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
        f"`{arm.labeler.name}`, {step} steps, seed {config.get('seed')}; {kind}, from "
        f"`{arm.model.policy}` ({base}).",
        "",
        f"- data: train `{config.get('data', {}).get('train')}`, eval "
        f"`{config.get('data', {}).get('eval')}`",
        f"- training: `{json.dumps(arm.training.model_dump(mode='json'), sort_keys=True)}`",
    ]
    if arm.modifiers:
        lines.append("- modifiers: " + ", ".join(f"`{m.name}`" for m in arm.modifiers))
    if evaluation is not None:
        shown = {k: v for k, v in evaluation.items() if k.startswith("eval/")}
        lines += ["", f"Evaluation at step {step} (the run's own, greedy):", ""]
        lines += [f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}"
                  for k, v in sorted(shown.items())]  # fmt: skip
        lines.append(f"\nThe experiment's report compares arms on `{metric}`.")
    return "\n".join(lines) + "\n"
