"""`alignzoo annotate *`: the human queue (serve the app, annotators, instructions, status, pool,
simulate, export)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from alignzoo.cli.common import console, err_console
from alignzoo.errors import UserError


class _ServeByDefault(TyperGroup):
    """`alignzoo annotate QUEUE_DIR ...` means `alignzoo annotate serve QUEUE_DIR ...`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["serve", *args]
        return super().parse_args(ctx, args)


annotate_app = typer.Typer(
    cls=_ServeByDefault,
    help="Human feedback: `alignzoo annotate QUEUE_DIR` serves the annotation app; "
    "add-annotator issues sign-in tokens (revoke, reissue), instructions sets the question, "
    "status shows progress and agreement, export writes the agreed judgements as a data set.",
    no_args_is_help=True,
)


QueueDir = Annotated[Path, typer.Argument(help="The queue's folder (queue.sqlite).")]


def _existing_queue(queue_dir: Path) -> Path:
    if not (queue_dir / "queue.sqlite").is_file():
        raise UserError(
            f"{queue_dir}: no queue here (queue.sqlite); a run with the human labeler creates "
            "one, as does add-annotator"
        )
    return queue_dir


@contextlib.contextmanager
def _open_queue(queue_dir: Path, existing: bool = True) -> Iterator[Any]:
    """The human queue in ``queue_dir`` (which must already hold one unless ``existing`` is
    False), closed afterwards; its refusals (QueueError) become errors naming the folder."""
    from alignzoo.human.queue import HumanQueue, QueueError

    queue = HumanQueue(_existing_queue(queue_dir) if existing else queue_dir)
    try:
        yield queue
    except QueueError as exc:
        raise UserError(f"{queue_dir}: {exc}") from None
    finally:
        queue.close()


@annotate_app.command("serve")
def annotate_serve(
    queue_dir: QueueDir,
    host: Annotated[
        str, typer.Option(help="Interface to bind (0.0.0.0 only if you mean it).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8766,
) -> None:
    """Serve the annotation app for the queue in QUEUE_DIR (the default command)."""
    from alignzoo.human.app import serve
    from alignzoo.labeling.service import is_loopback

    _existing_queue(queue_dir)
    console.print(f"annotation app for {queue_dir} on http://{host}:{port}/", highlight=False)
    if not is_loopback(host):
        err_console.print(
            f"warning: serving on {host} over plain HTTP: annotators' tokens and judgements "
            "cross the network unencrypted; put a TLS proxy in front, or bind 127.0.0.1 and "
            "reach it through an SSH tunnel",
            highlight=False,
        )
    serve(queue_dir, host=host, port=port)


@annotate_app.command("add-annotator")
def annotate_add(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator's name (1 to 64 characters).")],
) -> None:
    """Let NAME sign in to the app; prints their token (shown once, stored hashed)."""
    with _open_queue(queue_dir, existing=False) as queue:
        token = queue.add_annotator(name)
    console.print(f"annotator {name!r} added; their sign-in token (shown once):", markup=False)
    print(token)


@annotate_app.command("revoke")
def annotate_revoke(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator whose token stops working.")],
) -> None:
    """NAME's token stops working at once (their judgements stay); reissue gives a new one."""
    with _open_queue(queue_dir) as queue:
        queue.revoke(name)
    console.print(f"annotator {name!r}: token revoked", markup=False)


@annotate_app.command("reissue")
def annotate_reissue(
    queue_dir: QueueDir,
    name: Annotated[str, typer.Argument(help="The annotator who gets a new token.")],
) -> None:
    """A new token for NAME (shown once); their old one stops working at once."""
    with _open_queue(queue_dir) as queue:
        token = queue.reissue(name)
    console.print(f"annotator {name!r}: new sign-in token (shown once):", markup=False)
    print(token)


def _scale_labels(labels: list[str] | None) -> dict[float, str] | None:
    """``--scale-label VALUE=MEANING`` options as {value: meaning}."""
    if not labels:
        return None
    out = {}
    for label in labels:
        value, sep, text = label.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not text.strip() or number != number:
            raise UserError(f"--scale-label {label!r}: expected VALUE=MEANING, e.g. 1='wrong'")
        out[number] = text.strip()
    return out


QuestionOption = Annotated[
    str | None, typer.Option(help="What annotators are asked (shown above each item).")
]
ScaleLabelOption = Annotated[
    list[str] | None,
    typer.Option(
        "--scale-label", help="VALUE=MEANING: what a point of the rating scale means (repeat)."
    ),
]


class ItemKind(str, Enum):
    """The kind of item instructions are for."""

    rating = "rating"
    pair = "pair"


@annotate_app.command("instructions")
def annotate_instructions(
    queue_dir: QueueDir,
    kind: Annotated[ItemKind, typer.Option(help="The items they are for.")] = ItemKind.rating,
    question: QuestionOption = None,
    scale_label: ScaleLabelOption = None,
) -> None:
    """Set (or, without options, show) what annotators are asked and what scale points mean."""
    with _open_queue(queue_dir) as queue:
        if question is None and not scale_label:
            said = queue.instructions(kind.value)
        else:
            said = queue.set_instructions(kind.value, question, _scale_labels(scale_label))
    labels = [[v, t] for v, t in said.scale_labels]
    print(json.dumps({"kind": kind.value, "question": said.question, "scale_labels": labels}))


@annotate_app.command("status")
def annotate_status(queue_dir: QueueDir) -> None:
    """Progress per annotator, and the queue's agreement, as JSON."""
    from alignzoo.human.export import agreement

    with _open_queue(queue_dir) as queue:
        out = {
            "queue": queue.progress(),
            "annotators": {name: queue.progress_of(name) for name in queue.annotators()},
            "revoked": [name for name in queue.annotators() if queue.revoked(name)],
            "agreement": agreement(queue),
        }
    print(json.dumps(out, indent=2))


@annotate_app.command("pool")
def annotate_pool(
    experiment: Annotated[Path, typer.Argument(help="The experiment whose policy samples.")],
    queue_dir: QueueDir,
    arm: Annotated[str | None, typer.Option(help="The arm (default: the first).")] = None,
    prompts: Annotated[int, typer.Option(min=1, help="Training prompts to sample for.")] = 64,
    raters: Annotated[int, typer.Option(min=1, help="Judgements wanted per item.")] = 3,
    ratings: Annotated[
        bool, typer.Option(help="Queue each response to be rated instead of pairs to compare.")
    ] = False,
    question: QuestionOption = None,
    scale_label: ScaleLabelOption = None,
) -> None:
    """Sample two responses per prompt from the arm's starting policy and queue them."""
    from alignzoo.config.bundled import experiment_file
    from alignzoo.config.loader import load_experiment
    from alignzoo.human.queue import HumanQueue, write_source
    from alignzoo.human.simulate import sample_pool
    from alignzoo.types import LabelRequest

    with experiment_file(experiment) as path:
        loaded = load_experiment(path)
    name = arm or next(iter(loaded.spec.arms))
    if name not in loaded.spec.arms:
        raise UserError(f"--arm {name}: {experiment} has arms {', '.join(loaded.spec.arms)}")
    labels = _scale_labels(scale_label)
    if labels and not ratings:
        raise UserError("--scale-label is for --ratings (a pair's choices are A, B and a tie)")
    pool = sample_pool(loaded, name, prompts, 2, log=lambda m: console.print(m, highlight=False))
    queue = HumanQueue(queue_dir)
    try:
        if question is not None or labels:
            queue.set_instructions("rating" if ratings else "pair", question, labels)
        if ratings:
            requests = [
                LabelRequest(prompt=p, response=r, extra=extra)
                for p, responses, extra in pool
                for r in responses
            ]
            ids = queue.enqueue(requests, raters=raters, scale=(1, 5))
        else:
            pairs = [(p, rs[0], rs[1]) for p, rs, _ in pool if rs[0] != rs[1]]
            extras = [extra for _, rs, extra in pool if rs[0] != rs[1]]
            ids = queue.enqueue_pairs(pairs, raters=raters, extras=extras)
    finally:
        queue.close()
    write_source(queue_dir, experiment, name)
    kind = "rating" if ratings else "pair"
    skipped = "" if ratings else f" ({len(pool) - len(ids)} prompts gave two equal responses)"
    console.print(f"{len(ids)} {kind} items queued in {queue_dir}{skipped}", highlight=False)


@annotate_app.command("simulate")
def annotate_simulate(
    queue_dir: QueueDir,
    config: Annotated[Path, typer.Argument(help="YAML: rule, annotators, seed, tie_margin.")],
) -> None:
    """Judge the open items as simulated annotators (a rule labeler plus noise and bias)."""
    from alignzoo.human.queue import HumanQueue
    from alignzoo.human.simulate import read_simulation, rule_scorer, simulate

    simulation = read_simulation(config)
    queue = HumanQueue(_existing_queue(queue_dir))
    try:
        stored = simulate(queue, simulation, rule_scorer(simulation.rule))
        progress = queue.progress()
    finally:
        queue.close()
    console.print(
        f"{stored} judgements by {len(simulation.annotators)} simulated annotators; "
        f"{progress['complete']} of {progress['items']} items complete",
        highlight=False,
    )


class ExportKind(str, Enum):
    """What `alignzoo annotate export` writes."""

    preference = "preference"
    unpaired = "unpaired"


@annotate_app.command("export")
def annotate_export(
    queue_dir: QueueDir,
    out: Annotated[Path, typer.Argument(help="Folder for the data set (must not exist).")],
    kind: Annotated[
        ExportKind,
        typer.Option("--as", help="preference (prompt/chosen/rejected) or unpaired (label)."),
    ] = ExportKind.preference,
    min_agree: Annotated[
        int, typer.Option(min=1, help="Annotators who must agree for an item to be kept.")
    ] = 2,
    tolerance: Annotated[
        float, typer.Option(help="Agreeing: closer than this on the scale mapped to [0, 1].")
    ] = 0.3,
    threshold: Annotated[
        float, typer.Option(help="unpaired: a normalised rating at least this is desirable.")
    ] = 0.5,
) -> None:
    """Write the agreed judgements as a `datasets` folder DPO, KTO and train-rm read."""
    from alignzoo.human.export import export

    _existing_queue(queue_dir)
    if not tolerance > 0:
        raise UserError(f"--tolerance {tolerance}: must be above 0 (values agree when closer)")
    if out.exists():
        raise UserError(f"{out} exists; choose a new folder for the export")
    summary = export(queue_dir, out, kind.value, min_agree, tolerance, threshold)
    console.print(
        f"{summary.rows} {kind.value} rows in {out}: ratings kept {summary.ratings.kept}, "
        f"{summary.ratings.disagreed} disagreed, {summary.ratings.too_few} too few judgements; "
        f"pairs kept {summary.pairs.kept} ({summary.ties} ties left out), "
        f"{summary.pairs.disagreed} disagreed, {summary.pairs.too_few} too few judgements",
        highlight=False,
    )
