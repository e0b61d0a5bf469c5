"""A queue of samples for human raters: SQLite (WAL) in a folder, shared by runs and raters.

The ``human`` labeler puts a run's requests here and waits for ratings; whoever rates (a web
app, a script, a simulated annotator) takes the next item with :meth:`HumanQueue.next_for` and
answers it with :meth:`HumanQueue.submit`. Each item wants ``raters`` judgements and is never
shown twice to the same rater. Ratings that arrive after a run stopped waiting stay here, for
the next run that asks for the same sample (and for training a reward model on them).

Layout of ``QUEUE_DIR/queue.sqlite``:

- ``items``: one row per distinct request (prompt, response, extra columns; keyed like the
  label store), with how many raters it wants and its rating scale;
- ``judgements``: (item, rater) -> a value on the item's scale, or "cannot judge" (no value).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from alignzoo.engine.labelstore import request_key
from alignzoo.types import LabelRequest

QUEUE_FILE = "queue.sqlite"
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS items (
        id INTEGER PRIMARY KEY,
        key TEXT NOT NULL UNIQUE,
        prompt TEXT NOT NULL,
        response TEXT NOT NULL,
        extra TEXT NOT NULL,
        raters INTEGER NOT NULL,
        low REAL NOT NULL,
        high REAL NOT NULL,
        created REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS judgements (
        item INTEGER NOT NULL REFERENCES items(id),
        rater TEXT NOT NULL,
        value REAL,
        created REAL NOT NULL,
        PRIMARY KEY (item, rater)
    )""",
)


@dataclass(frozen=True)
class Item:
    """One queued sample, as a rater sees it."""

    id: int
    prompt: str
    response: str
    extra: dict[str, object]
    low: float
    high: float


class HumanQueue:
    """The queue in ``folder`` (created if missing); safe for several processes and threads."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder).expanduser() / QUEUE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(
            self.path, timeout=30, isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        for table in _SCHEMA:
            self.db.execute(table)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def enqueue(
        self, requests: Sequence[LabelRequest], raters: int = 1, scale: tuple[float, float] = (0, 1)
    ) -> list[int]:
        """The item id of each request, queueing those not queued yet (a request asked for
        again keeps its item and its ratings; ``raters`` only ever grows)."""
        now = time.time()
        ids = []
        with self.lock, self.db:
            for request in requests:
                key = request_key(request)
                self.db.execute(
                    "INSERT INTO items (key, prompt, response, extra, raters, low, high, created) "
                    "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET "
                    "raters = max(raters, excluded.raters)",
                    (
                        key,
                        request.prompt,
                        request.response,
                        json.dumps(request.extra, sort_keys=True, default=str),
                        raters,
                        float(scale[0]),
                        float(scale[1]),
                        now,
                    ),
                )
                row = self.db.execute("SELECT id FROM items WHERE key = ?", (key,)).fetchone()
                ids.append(int(row[0]))
        return ids

    def next_for(self, rater: str) -> Item | None:
        """The oldest item that still wants raters and that ``rater`` has not judged."""
        with self.lock:
            row = self.db.execute(
                "SELECT id, prompt, response, extra, low, high FROM items i WHERE "
                "(SELECT count(*) FROM judgements j WHERE j.item = i.id) < i.raters AND "
                "NOT EXISTS (SELECT 1 FROM judgements j WHERE j.item = i.id AND j.rater = ?) "
                "ORDER BY created, id LIMIT 1",
                (rater,),
            ).fetchone()
        if row is None:
            return None
        return Item(int(row[0]), row[1], row[2], json.loads(row[3]), row[4], row[5])

    def submit(self, item: int, rater: str, value: float | None) -> None:
        """``rater``'s judgement of ``item``: a value on the item's scale, or None for "cannot
        judge". A rater judges an item once; a value off the scale is refused."""
        with self.lock, self.db:
            row = self.db.execute("SELECT low, high FROM items WHERE id = ?", (item,)).fetchone()
            if row is None:
                raise KeyError(f"no queued item {item}")
            if value is not None and not row[0] <= value <= row[1]:
                raise ValueError(f"item {item}: {value} is off the scale [{row[0]}, {row[1]}]")
            self.db.execute(
                "INSERT INTO judgements VALUES (?,?,?,?)", (item, rater, value, time.time())
            )

    def judgements(self, ids: Sequence[int]) -> dict[int, list[float | None]]:
        """Per item id, the judgements given so far (None: "cannot judge"), oldest first."""
        out: dict[int, list[float | None]] = {i: [] for i in ids}
        unique = list(dict.fromkeys(ids))
        with self.lock:
            for start in range(0, len(unique), 500):
                chunk = unique[start : start + 500]
                rows = self.db.execute(
                    f"SELECT item, value FROM judgements WHERE item IN ({','.join('?' * len(chunk))}) "
                    "ORDER BY created",
                    chunk,
                ).fetchall()
                for item, value in rows:
                    out[int(item)].append(None if value is None else float(value))
        return out

    def progress(self) -> dict[str, int]:
        """Items queued, items with all the raters they want, and judgements given."""
        with self.lock:
            items = self.db.execute("SELECT count(*) FROM items").fetchone()[0]
            done = self.db.execute(
                "SELECT count(*) FROM items i WHERE "
                "(SELECT count(*) FROM judgements j WHERE j.item = i.id) >= i.raters"
            ).fetchone()[0]
            given = self.db.execute("SELECT count(*) FROM judgements").fetchone()[0]
        return {"items": int(items), "complete": int(done), "judgements": int(given)}
