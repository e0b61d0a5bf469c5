"""`alignzoo train-rm`: a Bradley-Terry reward model trained on preference pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from alignzoo.cli.common import console
from alignzoo.errors import UserError


def train_rm(
    data: Annotated[
        Path, typer.Argument(help="Preference pairs: prompt/chosen/rejected (file or folder).")
    ],
    base: Annotated[
        str,
        typer.Option(
            help="Model folder or an experiment YAML (its arm's policy); 'embedded' only when "
            "the data records the experiment that produced it (else refused)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Folder for the reward model (must not exist).")],
    arm: Annotated[str | None, typer.Option(help="With an experiment --base: the arm.")] = None,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1, help="Pairs per optimizer step.")] = 16,
    heldout: Annotated[
        float, typer.Option(min=0.0, max=0.9, help="Share of prompts held out for evaluation.")
    ] = 0.2,
    max_length: Annotated[int, typer.Option(min=1, help="Tokens per prompt + response.")] = 256,
    seed: int = 0,
    negatives: Annotated[
        str | None,
        typer.Option(
            help="Synthetic negatives, each a perturbation of a chosen response taken as a "
            "second rejected one: 'arithmetic' (one near miss of the answer), "
            "'arithmetic-shifts' (the answer moved by ±1, ±2, ±10, ±20, ±50, ±100), or "
            "'file.py:fn' / 'module:fn' (fn(prompt, response) -> str | list[str] | None)."
        ),
    ] = None,
    max_negatives: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="At most this many of --negatives' perturbations per training pair (a seeded "
            "draw; default: all). The top-1 probe still uses all of them.",
        ),
    ] = None,
    perturbations: Annotated[
        str | None,
        typer.Option(
            help="Perturbations for the top-1 probe (the right response against them), as "
            "--negatives names them, without training on them; default: --negatives."
        ),
    ] = None,
    ensemble: Annotated[
        int,
        typer.Option(
            min=1,
            help="K > 1: an ensemble of K reward models (OUT/member-i, seed + i, each on a "
            "bootstrap of the training pairs; OUT/ensemble.json lists them).",
        ),
    ] = 1,
) -> None:
    """Train a Bradley-Terry reward model the reward_model labeler loads."""
    from alignzoo.human.reward_model import (
        RewardModelReport,
        base_model,
        negatives_function,
        train_ensemble,
        train_reward_model,
    )

    if out.exists():
        raise UserError(f"--out {out} exists; choose a new folder for the reward model")

    say = lambda m: console.print(m, highlight=False)  # noqa: E731
    perturb = negatives_function(negatives, "--negatives")
    probe_with = negatives_function(perturbations, "--perturbations")
    settings: dict[str, Any] = {
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "heldout": heldout,
        "max_length": max_length,
        "negatives": perturb,
        "max_negatives": max_negatives,
        "perturbations": probe_with,
    }
    model = base_model(base, arm, data, say)
    if ensemble > 1:
        result = train_ensemble(data, model, out, ensemble, seed=seed, log=say, **settings)
        reports: list[RewardModelReport] = result.members
    else:
        reports = [train_reward_model(data, model, out, seed=seed, log=say, **settings)]
    for i, report in enumerate(reports):
        where = out / f"member-{i}" if ensemble > 1 else out
        lo, hi = report.heldout_interval
        console.print(
            f"reward model in {where}: held-out accuracy {report.heldout_accuracy:.3f} "
            f"(95% interval [{lo:.3f}, {hi:.3f}]) on "
            f"{report.heldout_pairs} pairs (ECE {report.heldout_ece:.3f}, Brier "
            f"{report.heldout_brier:.3f}); {report.train_pairs} training pairs, "
            f"{report.synthetic_negatives} of them synthetic negatives",
            highlight=False,
        )
        probes = report.probes
        if "top1_accuracy" in probes:
            console.print(
                f"  top-1 accuracy {probes['top1_accuracy']:.3f} over {probes['top1_sets']} "
                f"candidate sets ({probes['top1_candidates']:.1f} candidates each: the chosen "
                "response and its perturbations)",
                highlight=False,
            )
        for name, row in probes.get("ood", {}).items():
            console.print(
                f"  out-of-distribution '{name}': score {row['mean_score_minus_chosen']:+.3f} "
                f"against the chosen response, above it for "
                f"{row['share_above_chosen']:.0%} of prompts",
                highlight=False,
            )
        for warning in report.warnings:
            console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if ensemble > 1:
        console.print(
            f"ensemble of {ensemble} in {out} ({out / 'ensemble.json'}): held-out accuracy "
            f"{result.heldout_accuracy_mean:.3f} +- {result.heldout_accuracy_std:.3f} "
            "across members",
            highlight=False,
        )
