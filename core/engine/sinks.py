"""Where a run's numbers go: the console line, metrics.jsonl (always), TensorBoard and W&B.

The console line shows canonical metrics only (:mod:`alignzoo.metrics`), the same in every arm.

Files of a run folder: ``metrics.jsonl`` (one line per optimizer step), ``eval.jsonl`` (one line
per evaluation), ``samples.jsonl`` (a few prompt / response / score rows per step).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console

from alignzoo import metrics as canonical
from alignzoo.errors import UserError
from alignzoo.runfolder import RunFolder
from alignzoo.runfolder.runfiles import append_jsonl as append_jsonl


def _cell(value: Any, width: int = 80) -> str:
    """Text for one markdown table cell: no pipes or newlines, at most ``width`` characters."""
    text = str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(metrics: dict[str, Any], key: str, spec: str = ".3f") -> str:
    value = metrics.get(key)
    return "-" if value is None else format(value, spec)


def console_line(m: dict[str, Any], watched: tuple[str, ...] = ()) -> str:
    """One step on one line: the canonical metrics, then the algorithm's ``watched`` ones.

    The canonical part (:mod:`alignzoo.metrics`) means the same in every arm; a metric a run
    does not have (the reward of an offline arm, ``kl/ref`` without a reference) is left out.
    """
    parts = [
        f"{_fmt(m, canonical.BATCH_PROMPTS, '.0f')} prompts → "
        f"{_fmt(m, canonical.BATCH_RESPONSES, '.0f')} responses "
        f"(mean len {_fmt(m, canonical.RESPONSE_LENGTH, '.1f')})"
    ]
    if m.get(canonical.REWARD_MEAN) is not None:
        parts.append(f"reward {_fmt(m, canonical.REWARD_MEAN)} ± {_fmt(m, canonical.REWARD_STD)}")
    parts.append(f"loss {_fmt(m, canonical.LOSS, '.4f')}")
    for key, label, spec in (
        (canonical.KL_REF, "kl/ref", ".4f"),
        (canonical.ENTROPY, "entropy", ".3f"),
    ):
        if m.get(key) is not None:
            parts.append(f"{label} {_fmt(m, key, spec)}")
    parts += [f"{key} {_fmt(m, key, '.3g')}" for key in watched if m.get(key) is not None]
    parts.append(f"grad {_fmt(m, 'actor/grad_norm', '.3g')} lr {_fmt(m, canonical.LR, '.2e')}")
    parts.append(f"{_fmt(m, canonical.STEP_SECONDS, '.2f')}s")
    return " │ ".join(parts)


CONSOLE_EVAL_ENV = ("eval/env/turns", "eval/env/tool_calls")
"""The evaluation's episode metrics the console prints (all are in eval.jsonl)."""


class Sinks:
    """Fan-out of step metrics, evaluations and samples to every configured sink."""

    def __init__(
        self,
        out_dir: Path,
        sinks: list[str],
        console: Console | None,
        run_name: str,
        wandb_cfg: Any = None,
        experiment: str = "",
        config: dict[str, Any] | None = None,
        watched: tuple[str, ...] = (),
    ) -> None:
        self.out_dir = out_dir
        self.watched = watched  # the algorithm's own metrics its users watch (console only)
        self.console = console if "console" in sinks else None
        self.run_name = run_name
        self.config = config or {}
        self.last_eval: dict[str, float] = {}
        self.sample_rows: list[dict[str, Any]] = []  # for the W&B samples table
        self.tb: Any = None
        self.wandb: Any = None
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
                if config:  # the resolved config as text, readable in TensorBoard's Text tab
                    text = json.dumps(config, indent=2, sort_keys=True, default=str)
                    self.tb.add_text("config", "```\n" + text + "\n```", 0)
            except ImportError:
                warnings.warn(
                    "logging.sinks asks for tensorboard but it is not installed "
                    "(pip install alignzoo[tensorboard]); skipping it",
                    stacklevel=2,
                )
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError:
                raise UserError(
                    "logging.sinks asks for wandb, which is not installed: pip install alignzoo[wandb]"
                ) from None
            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                mode=wandb_cfg.mode,
                group=experiment,
                name=run_name.split("/", 1)[-1].replace("/seed-", "-"),
                config=config or {},
                dir=str(out_dir),
                reinit=True,
            )

    def step(self, metrics: dict[str, Any], step: int) -> None:
        """Write one step's metrics (``step``, ``time_s``, ``samples`` included)."""
        append_jsonl(RunFolder(self.out_dir).metrics, metrics)
        numeric = {
            k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"
        }
        self._track(numeric, step)
        if self.console is not None:
            self.console.print(
                f"[bold]{self.run_name}[/bold] step {step}: {console_line(metrics, self.watched)}",
                highlight=False,
            )

    def evaluation(self, row: dict[str, Any]) -> None:
        """Write one evaluation's results."""
        append_jsonl(RunFolder(self.out_dir).eval, row)
        step = int(row["step"])
        numeric = {k: float(v) for k, v in row.items() if k.startswith("eval/") and v is not None}
        self.last_eval = numeric
        self._track(numeric, step)
        if self.console is not None:
            # An episode's many env/* numbers stay in eval.jsonl; the console shows two of them.
            shown = " │ ".join(
                f"{k} {v:.3f}"
                for k, v in numeric.items()
                if not k.startswith("eval/env/") or k in CONSOLE_EVAL_ENV
            )
            self.console.print(
                f"[bold]{self.run_name}[/bold] eval @ step {step}: {shown}", highlight=False
            )

    def _track(self, numeric: dict[str, float], step: int) -> None:
        """Send numbers to the experiment trackers that are on (TensorBoard, W&B)."""
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def samples(self, rows: list[dict[str, Any]]) -> None:
        """Append a few prompt / response / score rows (also TensorBoard text and, at the end,
        a W&B table)."""
        for row in rows:
            append_jsonl(RunFolder(self.out_dir).samples, row)
        if self.tb is not None and rows:
            lines = ["| prompt | response | score |", "|---|---|---|"]
            lines += [
                f"| {_cell(r.get('prompt'))} | {_cell(r.get('response'))} | {r.get('score', '')} |"
                for r in rows
            ]
            self.tb.add_text("samples", "\n".join(lines), int(rows[0].get("step", 0)))
        if self.wandb is not None:
            self.sample_rows += rows

    def hparams(self) -> dict[str, Any]:
        """The run's settings as flat TensorBoard hparams (numbers, strings, booleans)."""
        arm = self.config.get("arm_spec", {})
        flat: dict[str, Any] = {
            "arm": self.config.get("arm", ""),
            "seed": self.config.get("seed", 0),
        }
        flat["algorithm"] = (arm.get("algorithm") or {}).get("name", "")
        flat["labeler"] = (arm.get("labeler") or {}).get("name", "")
        for key, value in (arm.get("training") or {}).items():
            if isinstance(value, (int, float, str, bool)):
                flat[f"training.{key}"] = value
        for key, value in ((arm.get("algorithm") or {}).get("params") or {}).items():
            if isinstance(value, (int, float, str, bool)):
                flat[f"params.{key}"] = value
        return flat

    def close(self) -> None:
        if self.tb is not None:
            if self.config:  # the HParams tab: settings against the final evaluation
                self.tb.add_hparams(self.hparams(), self.last_eval or {"eval/none": 0.0},
                                    run_name="hparams")  # fmt: skip
            self.tb.close()
        if self.wandb is not None:
            if self.sample_rows:
                import wandb

                columns = ["step", "prompt", "response", "score"]
                data = [[r.get(c) for c in columns] for r in self.sample_rows]
                self.wandb.log({"samples": wandb.Table(columns=columns, data=data)})
            self.wandb.finish()
