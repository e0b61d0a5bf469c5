"""Iterated RLHF: the reward model learns from the live policy's own responses, round by round.

With ``labeling.iterate`` (:class:`~alignzoo.config.schema.IterateConfig`) on an arm whose
labeler is ``reward_model``, a round runs before step ``k * every + 1`` (k = 1, 2, ...):

1. **sample**: two fresh responses of the current policy to each of ``prompts`` training
   prompts (drawn for round k, apart from the run's own prompt order), queued as "which is
   better" pairs in ``RUN/rlhf/queue`` (the human queue, :mod:`alignzoo.human.queue`);
2. **judge**: simulated annotators (``annotators``) judge them at once; without them people
   judge in the queue (``alignzoo annotate RUN/rlhf/queue``), and the round trains on what has
   been judged by then;
3. **retrain**: a reward model trained on every agreed pair so far (``data``, the first reward
   model's preferences, plus the queue's), warm-started from the reward model in use, into
   ``RUN/rlhf/rm-<k>``;
4. **check**: its held-out pairwise accuracy must reach ``min_heldout_accuracy``;
5. **swap**: the new reward model is requested through the hot-swap machinery
   (:mod:`alignzoo.labeling.swap`), applied before the step and recorded in ``swaps.jsonl``.

Each round is one line of ``rlhf_rounds.jsonl`` (pairs, judgements, training pairs, the held-out
accuracy and top-1 probe, swapped or why not); the report lists them.

Every part of a round leaves a file and is skipped when its file exists, so a run killed in
the middle of a round and resumed does it again without asking anyone twice: the round's pairs
are recorded in ``rlhf/round-<k>.json`` once queued (a resumed round judges those, never new
ones; the queue keeps every judgement given), the reward model is written to a temporary
folder and renamed into place when complete, and the swap request has the round's id and is
due before the round's step, which the run applies once, at that step (a resume from an earlier
checkpoint applies it again at that step, from the ledger: :mod:`alignzoo.labeling.swap`). The
round's reward model is named relative to the run folder, so the run resumes wherever its folder
lies. The round runs outside the run's random streams (its draws have seeds of their
own and torch's generator is restored after it), so a run with rounds resumes exactly as it
would have gone on.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignzoo.errors import UserError
from alignzoo.runfolder import RunFolder, write_atomic

if TYPE_CHECKING:
    from alignzoo.config.schema import IterateConfig

STREAM = "rlhf_rounds"
"""The run folder's ``rlhf_rounds.jsonl``: one line per round."""


def due(cfg: IterateConfig, step: int, last_step: int | None = None) -> int | None:
    """The round that runs before training step ``step`` (None when none does): round k
    before step ``k * every + 1``, but not after the last step of a step budget."""
    done = step - 1
    if done <= 0 or done % cfg.every:
        return None
    if last_step is not None and done >= last_step:
        return None
    return done // cfg.every


class Rounds:
    """The rounds of one run (built by the training loop when ``labeling.iterate`` is set:
    the engine's ``run_one`` is handed this class as its ``rounds``)."""

    def __init__(self, cfg: IterateConfig, run: Any, log: Any = print) -> None:
        from alignzoo import distributed

        if distributed.world_size() > 1:
            raise UserError(
                f"arms.{run.context.arm}.labeling.iterate: not supported with "
                f"{distributed.world_size()} processes yet; run the arm in one process"
            )
        self.cfg, self.run, self.log = cfg, run, log
        # queue/, round-<k>.json, prefs-<k>/, rm-<k>/
        self.folder = RunFolder(Path(run.context.out_dir)).rlhf
        self.queue_dir = self.folder / "queue"
        self.simulation = None
        if cfg.annotators is not None:
            from alignzoo.human.simulate import read_simulation

            self.simulation = read_simulation(cfg.annotators, "labeling.iterate.annotators")

    # ------------------------------------------------------------------ the round
    def before_step(self, step: int) -> None:
        """Run the round due before ``step``, if one is (called before each step)."""
        budget = self.run.spec.budget
        k = due(self.cfg, step, budget.steps)
        if k is None:
            return
        import torch

        with torch.random.fork_rng(devices=[]):  # the run's own draws stay as they were
            self.round(k, step - 1)

    def round(self, k: int, step: int) -> dict[str, Any]:
        """Round ``k`` after training step ``step``; returns its ``rlhf_rounds.jsonl`` row."""
        from alignzoo.labeling import swap

        self.folder.mkdir(parents=True, exist_ok=True)
        row: dict[str, Any] = {"round": k, "after_step": step}
        items = self._queued(k, step)
        row["pairs_queued"] = len(items)
        if self.simulation is not None:
            self._simulate(items)  # those judged before a kill are not asked again
            row["judgements_stored"] = self._judgements(items)
        current = self.current_reward_model()
        row["warm_start"] = self._shown(current)
        out = self.folder / f"rm-{k}"
        if not out.is_dir():
            pairs = self._training_data(k)
            row["training_pairs"] = pairs
            if pairs < 2:
                row["swapped"] = False
                row["why"] = f"{pairs} agreed pair(s) so far: nothing to retrain on yet"
                return self._record(row)
            self._retrain(k, current, out)
        report = json.loads((out / "train_rm.json").read_text(encoding="utf-8"))
        row["training_pairs"] = report["train_pairs"]
        row["heldout_accuracy"] = report["heldout_accuracy"]
        row["heldout_pairs"] = report["heldout_pairs"]
        row["top1_accuracy"] = report.get("probes", {}).get("top1_accuracy")
        if report["heldout_accuracy"] < self.cfg.min_heldout_accuracy:
            row["swapped"] = False
            row["why"] = (
                f"held-out accuracy {report['heldout_accuracy']:.3f} below "
                f"min_heldout_accuracy {self.cfg.min_heldout_accuracy}; {current} stays"
            )
            return self._record(row)
        ref = self.run.context.arm_spec.labeler
        relative = out.relative_to(self.run.context.out_dir).as_posix()
        request = {
            "id": f"rlhf-round-{k}",
            "action": "swap",
            "not_before": step + 1,  # this step, also when a resume replays the round
            "labeler": {
                "name": ref.name,
                "params": {**ref.params, "path": relative},
                swap.RUN_RELATIVE: ["path"],  # the run folder may move
            },
        }
        swap.write_request(Path(self.run.context.out_dir), request)
        row["swapped"] = True
        row["reward_model"] = relative
        return self._record(row)

    def _shown(self, path: str) -> str:
        """A reward model's folder as the round's record names it: relative to the run folder
        when it lies inside it, so the record stays true when the folder moves."""
        root = Path(self.run.context.out_dir).resolve()
        found = Path(path).resolve()
        return found.relative_to(root).as_posix() if found.is_relative_to(root) else path

    def _record(self, row: dict[str, Any]) -> dict[str, Any]:
        self.run.context.record(STREAM, row)
        what = (
            f"swapped in {row['reward_model']}"
            if row.get("swapped")
            else f"no swap ({row.get('why')})"
        )
        self.log(f"RLHF round {row['round']} after step {row['after_step']}: {what}")
        return row

    # ------------------------------------------------------------------ parts
    def _queued(self, k: int, step: int) -> list[int]:
        """The round's pair items: queued now, or read back from ``round-<k>.json``."""
        from alignzoo.human.queue import HumanQueue

        marker = self.folder / f"round-{k}.json"
        if marker.is_file():
            return [int(i) for i in json.loads(marker.read_text(encoding="utf-8"))["items"]]
        pairs, extras = self._sample(k)
        queue = HumanQueue(self.queue_dir)
        try:
            ids = queue.enqueue_pairs(pairs, raters=self.cfg.raters, extras=extras)
        finally:
            queue.close()
        write_atomic(marker, json.dumps({"round": k, "after_step": step, "items": ids}))
        return ids

    def _sample(self, k: int) -> tuple[list[tuple[str, str, str]], list[dict[str, Any]]]:
        """Two responses of the current policy to each of the round's prompts (pairs of two
        equal responses left out), with the rows' plain columns and the round."""
        from alignzoo.engine.modes import split_rows
        from alignzoo.engine.sampler import PromptSampler

        seed = f"{self.run.context.seed}/{k}"
        draw = random.Random(f"rlhf-round/{seed}")
        sampler = PromptSampler(self.run.sampler.dataset, draw.randrange(2**31))
        rows, seeds = sampler.next_seeded(self.cfg.prompts)
        texts, extras = split_rows(rows)
        sampling = self.run.context.arm_spec.training.sampling
        batch = self.run.hooks.generate(texts, extras, 2, sampling, seeds)
        pairs, kept = [], []
        for i, (prompt, extra) in enumerate(zip(texts, extras, strict=True)):
            first, second = batch.responses[2 * i], batch.responses[2 * i + 1]
            if first != second:
                pairs.append((prompt, first, second))
                plain = {c: v for c, v in extra.items() if isinstance(v, (str, int, float, bool))}
                kept.append({**plain, "rlhf_round": k})
        return pairs, kept

    def _judgements(self, items: list[int]) -> int:
        """How many judgements the queue holds for ``items`` (given in this attempt or an
        earlier one: the round's count is the same whatever was killed)."""
        from alignzoo.human.queue import HumanQueue

        wanted = set(items)
        queue = HumanQueue(self.queue_dir)
        try:
            return sum(len(given) for item, given in queue.items() if item.id in wanted)
        finally:
            queue.close()

    def _simulate(self, items: list[int]) -> int:
        from alignzoo.human.queue import HumanQueue
        from alignzoo.human.simulate import rule_scorer, simulate

        assert self.simulation is not None
        queue = HumanQueue(self.queue_dir)
        try:
            return simulate(queue, self.simulation, rule_scorer(self.simulation.rule), only=items)
        finally:
            queue.close()

    def _training_data(self, k: int) -> int:
        """Write ``prefs-<k>.jsonl``: ``data``'s pairs and the queue's agreed ones; returns
        how many."""
        from alignzoo.human.export import export
        from alignzoo.human.reward_model import load_pairs

        agreed = self.folder / f"agreed-{k}"
        shutil.rmtree(agreed, ignore_errors=True)
        summary = export(self.queue_dir, agreed, "preference", min_agree=self.cfg.min_agree)
        pairs = load_pairs(agreed) if summary.rows else []
        if self.cfg.data is not None:
            pairs = load_pairs(self.cfg.data) + pairs
        path = self.folder / f"prefs-{k}.jsonl"
        path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in pairs), encoding="utf-8")
        return len(pairs)

    def _retrain(self, k: int, current: str, out: Path) -> None:
        from alignzoo.human.reward_model import train_reward_model
        from alignzoo.world.task import NEGATIVES

        negatives: Any = None
        if self.cfg.negatives is not None:
            if self.cfg.negatives in NEGATIVES:
                negatives = NEGATIVES[self.cfg.negatives]
            else:
                from alignzoo.config.callables import load_callable

                negatives = load_callable(self.cfg.negatives, "labeling.iterate.negatives")
        tmp = self.folder / f".tmp-rm-{k}"
        shutil.rmtree(tmp, ignore_errors=True)
        train_reward_model(
            self.folder / f"prefs-{k}.jsonl",
            current,
            tmp,
            epochs=self.cfg.epochs,
            lr=self.cfg.lr,
            batch_size=self.cfg.batch_size,
            seed=self.run.context.seed,
            negatives=negatives,
            max_negatives=self.cfg.max_negatives,
        )
        tmp.replace(out)  # complete, or absent: a killed retraining is done again

    def current_reward_model(self) -> str:
        """The folder of the reward model labeling now: the last swap's, else the arm's."""
        from alignzoo.labeling import swap

        head = (self.run.context.state.get(swap.STATE_KEY) or {}).get("head")
        if head:
            path = swap.resolve_ref(head, Path(self.run.context.out_dir)).params.get("path")
            if path:
                return str(path)
        return str(self.run.context.arm_spec.labeler.params["path"])
