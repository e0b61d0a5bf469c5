"""Where a run's numbers go: the console line, metrics.jsonl (always), TensorBoard and W&B.

The console line shows canonical metrics only (:mod:`alignzoo.metrics`), the same in every arm.

Files of a run folder: ``metrics.jsonl`` (one line per optimizer step), ``eval.jsonl`` (one line
per evaluation), ``samples.jsonl`` (a few prompt / response / score rows per step).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console

from alignzoo import metrics as canonical
from alignzoo.errors import UserError

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and flush it to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        f.flush()


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
        self.tb: Any = None
        self.wandb: Any = None
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
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
        append_jsonl(self.out_dir / METRICS_FILE, metrics)
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
        append_jsonl(self.out_dir / EVAL_FILE, row)
        step = int(row["step"])
        numeric = {k: float(v) for k, v in row.items() if k.startswith("eval/") and v is not None}
        self._track(numeric, step)
        if self.console is not None:
            shown = " │ ".join(f"{k} {v:.3f}" for k, v in numeric.items())
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
        """Append a few prompt / response / score rows."""
        for row in rows:
            append_jsonl(self.out_dir / SAMPLES_FILE, row)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
