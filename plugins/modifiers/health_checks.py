"""Health checks: warn when a run shows the signs researchers watch for a run going wrong.

On by default: the engine registers ``HealthChecks()`` in every arm's plugin manager
(``HealthChecks.default_on`` is True) unless the arm lists ``health_checks`` among its
modifiers, in which case the arm's params are used; ``enabled: false`` turns it off::

    modifiers:
      - name: health_checks
        params: {enabled: false}          # or change thresholds: {kl_max: 0.5}

Signals (each fires at most once per run; a threshold set to ``null`` disables its check):

- ``reward_collapse``: the reward rose by at least ``reward_min_rise`` and then fell by more
  than ``reward_drop`` from its running maximum (a classic sign of reward hacking, or of a
  policy that broke after exploiting the reward).
- ``length_drift``: the mean response length changed by more than ``length_drift`` (relative)
  over ``window`` steps.
- ``entropy_collapse``: entropy fell below ``entropy_floor`` (the policy became deterministic).
- ``entropy_explosion``: entropy rose above ``entropy_ceiling``, or grew by more than
  ``entropy_rise`` times over ``window`` steps.
- ``kl_runaway``: KL to the reference rose above ``kl_max``, or grew at every step over
  ``window`` steps, faster in the second half than in the first, from at least ``kl_min`` to
  more than ``kl_growth`` times its value at the window start (a KL that rises from 0 and
  levels off, as every healthy run's does, is not a runaway).
- ``reward_std_flat``: after ``std_after_steps`` steps the reward std (over the step's
  samples) has not narrowed by at least ``std_min_narrowing`` (relative) from its initial
  level while the mean reward has not risen by ``reward_min_rise`` either: the policy is neither becoming more
  consistent nor better. Skipped while every step's rewards are 0/1 (then the std is
  sqrt(mean (1 - mean)), a function of the mean, and says nothing the mean does not).

The checks read only the canonical metrics (:mod:`alignzoo.metrics`: ``reward/mean``,
``reward/std``, ``response_length/mean``, ``entropy``, ``kl/ref``), which the engine computes
the same way in every arm, so one threshold means the same thing for GRPO and for DPO. A
metric an arm does not report (``kl/ref`` without a reference model) is not checked.

Values are smoothed by an exponential moving average (``smoothing``) before checking. When a
signal fires, ``metrics["health/<signal>"] = 1.0`` is added to that step's metrics, a warning
naming the run, the signal and the step where it began is printed on ``run.console``, and a
line ``{"began_step", "detected_step", "signal", "message"}`` is recorded in the run's
``health.jsonl`` through ``run.record`` (stamped with the step, so a resumed run cuts it back
to its checkpoint like every other stream; the report lists them). The rolling state lives in
``run.state["health"]`` (JSON-serialisable), so it survives a resume.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import metrics as canonical
from alignzoo.plugin import Modifier, hookimpl

SIGNALS = (
    "reward_collapse",
    "length_drift",
    "entropy_collapse",
    "entropy_explosion",
    "kl_runaway",
    "reward_std_flat",
)


class HealthParams(BaseModel):
    """Thresholds of the health checks (``null`` disables one check)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Turn every health check off with false.")
    smoothing: float = Field(
        0.3, gt=0, le=1, description="EMA weight of the newest value (1 = no smoothing)."
    )
    warmup_steps: int = Field(5, ge=0, description="Steps observed before any signal may fire.")
    window: int = Field(20, ge=2, description="Steps over which drifts and trends are measured.")
    reward_min_rise: float | None = Field(
        0.1, ge=0, description="Rise of the reward above its start before a collapse counts."
    )
    reward_drop: float | None = Field(
        0.2, gt=0, description="Fall from the running maximum of the reward that fires."
    )
    length_drift: float | None = Field(
        1.0, gt=0, description="Relative change of mean response length over `window` steps."
    )
    entropy_floor: float | None = Field(0.01, ge=0, description="Entropy below this fires.")
    entropy_ceiling: float | None = Field(None, gt=0, description="Entropy above this fires.")
    entropy_rise: float | None = Field(
        3.0, gt=1, description="Entropy growing this many times over `window` steps fires."
    )
    kl_max: float | None = Field(1.0, gt=0, description="KL above this fires.")
    kl_growth: float | None = Field(
        2.0,
        gt=1,
        description="KL rising every step of `window`, speeding up, to this many times its start.",
    )
    kl_min: float = Field(
        0.01, ge=0, description="KL trends starting below this level are ignored (noise near 0)."
    )
    std_after_steps: int | None = Field(
        50, ge=1, description="Step count after which a reward std that has not narrowed fires."
    )
    std_min_narrowing: float = Field(
        0.1, ge=0, lt=1, description="Relative narrowing of the reward std expected by then."
    )


class HealthChecks(Modifier):
    """Warn when reward collapses, length drifts, entropy or KL run away, or reward std stays flat."""

    Params = HealthParams
    default_on: ClassVar[bool] = True
    """The engine adds an instance with default params to every arm that does not list it."""

    params: HealthParams

    # ------------------------------------------------------------------ state

    def _state(self, run: Any) -> dict[str, Any]:
        state = run.state.setdefault("health", {})
        state.setdefault("n", 0)
        state.setdefault("ema", {})
        state.setdefault("history", {})
        state.setdefault("fired", {})
        return state

    def _smooth(self, state: dict[str, Any], key: str, value: float) -> float:
        ema = state["ema"]
        a = self.params.smoothing
        ema[key] = value if key not in ema else a * value + (1 - a) * ema[key]
        return float(ema[key])

    def _remember(self, state: dict[str, Any], key: str, step: int, value: float) -> list[list]:
        hist = state["history"].setdefault(key, [])
        hist.append([step, value])
        del hist[: max(0, len(hist) - (self.params.window + 1))]
        return hist

    # ------------------------------------------------------------------ hook

    @hookimpl
    def on_step_end(self, run: Any, step: int, metrics: dict[str, float]) -> None:
        """Update the rolling state with this step's metrics and report newly fired signals."""
        if not self.params.enabled:
            return
        state = self._state(run)
        state["n"] += 1
        smoothed: dict[str, float] = {}
        mean, std = metrics.get(canonical.REWARD_MEAN), metrics.get(canonical.REWARD_STD)
        if mean is not None and std is not None and not _bernoulli(float(mean), float(std)):
            state["graded_rewards"] = True
        for key in (
            canonical.REWARD_MEAN,
            canonical.REWARD_STD,
            canonical.RESPONSE_LENGTH,
            canonical.ENTROPY,
            canonical.KL_REF,
        ):
            value = metrics.get(key)
            if value is None or not math.isfinite(float(value)):
                continue
            smoothed[key] = self._smooth(state, key, float(value))
            self._remember(state, key, step, smoothed[key])
        for signal, began, message in self._check(state, step, smoothed):
            if signal in state["fired"]:
                continue
            state["fired"][signal] = began
            metrics[f"health/{signal}"] = 1.0
            self._report(run, step, began, signal, message)

    def _report(self, run: Any, step: int, began: int, signal: str, message: str) -> None:
        name = getattr(run, "name", "run")
        console = getattr(run, "console", None)
        if console is not None:
            console.print(
                f"[yellow]health warning[/yellow] {name}: {signal} beginning at step {began}: "
                f"{message}",
                highlight=False,
            )
        line = {"began_step": began, "detected_step": step, "signal": signal, "message": message}
        if callable(getattr(run, "record", None)):
            run.record("health", line)  # stamped with the step: cut back on --resume

    # ------------------------------------------------------------------ checks

    def _check(
        self, state: dict[str, Any], step: int, smoothed: dict[str, float]
    ) -> list[tuple[str, int, str]]:
        """Every signal that holds at this step, as (signal, step it began, message)."""
        p = self.params
        found: list[tuple[str, int, str]] = []
        ready = state["n"] > p.warmup_steps

        if canonical.REWARD_MEAN in smoothed:
            r = smoothed[canonical.REWARD_MEAN]
            state.setdefault("reward_start", r)
            best = state.get("reward_max")
            if best is None or r > best[1]:
                state["reward_max"] = best = [step, r]
            rise = best[1] - state["reward_start"]
            if (
                ready
                and p.reward_drop is not None
                and rise >= (p.reward_min_rise or 0.0)
                and best[1] - r > p.reward_drop
            ):
                found.append(
                    (
                        "reward_collapse",
                        int(best[0]),
                        f"reward rose from {state['reward_start']:.3g} to {best[1]:.3g} by step "
                        f"{best[0]}, then fell to {r:.3g} at step {step} (possible reward hacking)",
                    )
                )

        if canonical.RESPONSE_LENGTH in smoothed and p.length_drift is not None and ready:
            hist = state["history"][canonical.RESPONSE_LENGTH]
            if len(hist) > p.window:
                (s0, l0), (_, l1) = hist[0], hist[-1]
                change = (l1 - l0) / max(abs(l0), 1e-8)
                if abs(change) > p.length_drift:
                    found.append(
                        (
                            "length_drift",
                            int(s0),
                            f"mean response length went from {l0:.3g} to {l1:.3g} "
                            f"({change:+.0%}) between steps {s0} and {step}",
                        )
                    )

        if canonical.ENTROPY in smoothed and ready:
            e = smoothed[canonical.ENTROPY]
            hist = state["history"][canonical.ENTROPY]
            if p.entropy_floor is not None:
                if e < p.entropy_floor:
                    below = state.setdefault("entropy_below_since", step)
                    found.append(
                        (
                            "entropy_collapse",
                            int(below),
                            f"entropy {e:.3g} is below the floor {p.entropy_floor:g}",
                        )
                    )
                else:
                    state.pop("entropy_below_since", None)
            if p.entropy_ceiling is not None and e > p.entropy_ceiling:
                found.append(
                    (
                        "entropy_explosion",
                        step,
                        f"entropy {e:.3g} is above the ceiling {p.entropy_ceiling:g}",
                    )
                )
            if p.entropy_rise is not None and len(hist) > p.window:
                s0, e0 = hist[0]
                if e0 > 0 and e > p.entropy_rise * e0:
                    found.append(
                        (
                            "entropy_explosion",
                            int(s0),
                            f"entropy grew from {e0:.3g} to {e:.3g} between steps {s0} and {step}",
                        )
                    )

        if canonical.KL_REF in smoothed and ready:
            k = smoothed[canonical.KL_REF]
            hist = state["history"][canonical.KL_REF]
            if p.kl_max is not None and k > p.kl_max:
                over = state.setdefault("kl_over_since", step)
                found.append(
                    ("kl_runaway", int(over), f"KL {k:.3g} is above the maximum {p.kl_max:g}")
                )
            elif p.kl_max is not None:
                state.pop("kl_over_since", None)
            if p.kl_growth is not None and len(hist) > p.window:
                values = [v for _, v in hist]
                rising = all(b > a for a, b in itertools.pairwise(values))
                # Runaway growth speeds up; a healthy KL leaving the reference rises from ~0 and
                # levels off. So the window must start above kl_min (a ratio from ~0 means
                # nothing) and rise more in its second half than in its first.
                mid = values[len(values) // 2]
                accelerating = values[-1] - mid > mid - values[0]
                s0, k0 = hist[0]
                if rising and accelerating and k0 >= p.kl_min and k > p.kl_growth * k0:
                    found.append(
                        (
                            "kl_runaway",
                            int(s0),
                            f"KL rose at every step from {k0:.3g} to {k:.3g} between steps "
                            f"{s0} and {step}",
                        )
                    )

        graded = state.get("graded_rewards", False)
        if canonical.REWARD_STD in smoothed and p.std_after_steps is not None and graded:
            s = smoothed[canonical.REWARD_STD]
            initial = state.get("std_initial")
            if initial is None:
                # The initial level: the smoothed std once the warm-up is over.
                if ready or p.warmup_steps == 0:
                    state["std_initial"] = [step, s]
            elif state["n"] >= p.std_after_steps and s > 0:
                s0_step, s0 = initial
                best, start = state.get("reward_max"), state.get("reward_start")
                learning = best is not None and best[1] - start >= (p.reward_min_rise or 0.0)
                if s > (1 - p.std_min_narrowing) * s0 and not learning:
                    found.append(
                        (
                            "reward_std_flat",
                            int(s0_step),
                            f"reward std is {s:.3g} at step {step}, not narrowed by "
                            f"{p.std_min_narrowing:.0%} from {s0:.3g} at step {s0_step}",
                        )
                    )
        return found


def _bernoulli(mean: float, std: float) -> bool:
    """Whether (mean, population std) are those of 0/1 rewards: std^2 == mean (1 - mean)."""
    return 0.0 <= mean <= 1.0 and abs(std * std - mean * (1.0 - mean)) < 1e-6
