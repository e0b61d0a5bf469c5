"""The label store: every label a run's labelers give, persisted in SQLite (WAL).

A label is keyed by the labeler's identity (its class, its ``version`` and a hash of its
params) and the request (prompt, response and the dataset's extra columns). The labeling stage
looks every request up before calling a labeler and writes what the call gave right after it,
in one transaction: so a resumed run (which replays the steps after its checkpoint) and a
repeated pair (identical responses within a GRPO group) are never scored twice, and a SIGKILL
loses at most the call in flight. Only verdicts are stored (values, with their step scores
``Score.steps``, and abstains), never a timeout or an infrastructure error, nor an abstain
marked ``info["pending"]`` (a label that may still come, like a human rating not given yet).

``alignzoo relabel RUN_DIR LABELER.yaml`` reads the stored requests back and scores them with
another labeler (see :func:`stored_requests`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from alignzoo.runfolder import LABELS
from alignzoo.types import LabelRequest, Outcome, Score, StepScore

STORE_FILE = LABELS
"""The store's file in a run folder."""
_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels (
    labeler TEXT NOT NULL,
    key TEXT NOT NULL,
    prompt TEXT NOT NULL,
    response TEXT NOT NULL,
    extra TEXT NOT NULL,
    outcome TEXT NOT NULL,
    value REAL,
    valid INTEGER NOT NULL,
    info TEXT NOT NULL,
    seconds REAL NOT NULL,
    created REAL NOT NULL,
    steps TEXT,
    PRIMARY KEY (labeler, key)
)
"""
_COLUMNS = (
    "labeler, key, prompt, response, extra, outcome, value, valid, info, seconds, created, steps"
)
KEPT = (Outcome.VALUE, Outcome.ABSTAIN)


def labeler_identity(component: Any) -> str:
    """``module.Class@version#params-hash``: what must match for a stored label to be reused."""
    cls = type(component)
    params = getattr(component, "params", None)
    dump = getattr(params, "model_dump", None)
    dumped = dump(mode="json") if callable(dump) else {}
    digest = hashlib.sha256(json.dumps(dumped, sort_keys=True, default=str).encode()).hexdigest()
    return f"{cls.__module__}.{cls.__qualname__}@{getattr(cls, 'version', '1')}#{digest[:16]}"


def request_key(request: LabelRequest) -> str:
    """A hash of prompt, response and extra columns (the same request, the same key)."""
    extra = json.dumps(request.extra, sort_keys=True, default=str)
    payload = "\0".join((request.prompt, request.response, extra))
    return hashlib.sha256(payload.encode()).hexdigest()


class LabelStore:
    """One SQLite file; safe for several processes (WAL, a busy timeout) and threads (one
    connection behind a lock: a run with ``labeling.overlap`` labels off the main thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(
            self.path, timeout=30, isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(labels)")}
        if "steps" not in columns:  # a store written before step scores existed
            self.db.execute("ALTER TABLE labels ADD COLUMN steps TEXT")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def lookup(self, labeler: str, keys: Sequence[str]) -> dict[str, Score]:
        """The stored Scores of ``labeler`` for those keys (absent keys are left out)."""
        found: dict[str, Score] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), 500):
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            with self.lock:
                rows = self.db.execute(
                    f"SELECT key, outcome, value, valid, info, steps FROM labels "
                    f"WHERE labeler = ? AND key IN ({marks})",
                    [labeler, *chunk],
                ).fetchall()
            for key, outcome, value, valid, info, steps in rows:
                found[key] = Score(
                    math.nan if value is None else float(value),
                    bool(valid),
                    json.loads(info),
                    Outcome(outcome),
                    steps_from_json(steps),
                )
        return found

    def put(
        self,
        labeler: str,
        items: Iterable[tuple[str, LabelRequest, Score]],
        seconds: float,
    ) -> int:
        """Store the verdicts (values and abstains) of one call, in one transaction."""
        now = time.time()
        rows = [
            (
                labeler,
                key,
                req.prompt,
                req.response,
                json.dumps(req.extra, sort_keys=True, default=str),
                score.outcome.value,
                None if score.outcome != Outcome.VALUE else float(score.value),
                int(bool(score.valid)),
                json.dumps(score.info, default=str),
                seconds,
                now,
                steps_to_json(score.steps),
            )
            for key, req, score in items
            if score.outcome in KEPT and not score.info.get("pending")
        ]
        if rows:
            with self.lock:
                # The connection autocommits (isolation_level None): without an explicit
                # transaction every row would be a commit of its own, and a failure midway
                # would keep the rows before it.
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    self.db.executemany(
                        f"INSERT OR REPLACE INTO labels ({_COLUMNS}) VALUES "
                        "(?,?,?,?,?,?,?,?,?,?,?,?)",
                        rows,
                    )
                    self.db.execute("COMMIT")
                except BaseException:
                    if self.db.in_transaction:  # SQLite may have rolled back already
                        self.db.execute("ROLLBACK")
                    raise
        return len(rows)


def steps_to_json(steps: list[StepScore]) -> str | None:
    """A Score's steps as stored: ``[[start, end, score], ...]``, or None without steps."""
    if not steps:
        return None
    return json.dumps([[s.start, s.end, float(s.score)] for s in steps])


def steps_from_json(text: str | None) -> list[StepScore]:
    """The steps :func:`steps_to_json` stored (none for a NULL)."""
    if not text:
        return []
    return [StepScore(int(a), int(b), float(c)) for a, b, c in json.loads(text)]


def stored_requests(path: str | Path) -> list[tuple[str, LabelRequest, dict[str, Score]]]:
    """Every distinct request in a store, with the Scores each labeler gave it."""
    db = sqlite3.connect(Path(path), timeout=30)
    try:
        rows = db.execute(
            "SELECT key, prompt, response, extra, labeler, outcome, value, valid, info, steps "
            "FROM labels ORDER BY created, key"
        ).fetchall()
    finally:
        db.close()
    out: dict[str, tuple[LabelRequest, dict[str, Score]]] = {}
    for key, prompt, response, extra, labeler, outcome, value, valid, info, steps in rows:
        _, scores = out.setdefault(
            key, (LabelRequest(prompt=prompt, response=response, extra=json.loads(extra)), {})
        )
        scores[labeler] = Score(
            math.nan if value is None else float(value), bool(valid), json.loads(info),
            Outcome(outcome), steps_from_json(steps),
        )  # fmt: skip
    return [(key, request, scores) for key, (request, scores) in out.items()]
