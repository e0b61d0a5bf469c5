"""A queue of samples for human raters: SQLite (WAL) in a folder, shared by runs and raters.

The ``human`` labeler puts a run's requests here and waits for ratings; whoever rates (a web
app, a script, a simulated annotator) takes the next item with :meth:`HumanQueue.next_for` and
answers it with :meth:`HumanQueue.submit`. Each item wants ``raters`` judgements and is never
shown twice to the same rater. Ratings that arrive after a run stopped waiting stay here, for
the next run that asks for the same sample (and for training a reward model on them).

Two kinds of item: a *rating* (one response, a value on the item's scale) and a *pair* (two
responses to one prompt; the judgement is 1 when A is better, 0 when B is, 0.5 for a tie).
Either may be answered "cannot judge" (no value).

Layout of ``QUEUE_DIR/queue.sqlite``:

- ``items``: one row per distinct request (prompt, response, extra columns; keyed like the
  label store; a pair also has ``other``, response B), with how many raters it wants and its
  scale;
- ``judgements``: (item, rater) -> a value, or "cannot judge" (no value);
- ``annotators``: the people who may sign in to ``alignzoo annotate``, each with the SHA-256
  of the token :meth:`HumanQueue.add_annotator` issued (the token itself is never stored).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignzoo.labeling.store import request_key
from alignzoo.types import LabelRequest

QUEUE_FILE = "queue.sqlite"
SOURCE_FILE = "source.json"
"""Beside the queue: which experiment and arm sampled its items (``annotate pool`` writes it,
``annotate export`` carries it into its summary, ``train-rm --base embedded`` reads it)."""


def write_source(queue_dir: str | Path, experiment: str | Path, arm: str) -> None:
    """Record that ``experiment``'s arm ``arm`` (its starting policy) sampled the queue's
    items."""
    path = Path(queue_dir) / SOURCE_FILE
    row = {"experiment": str(Path(experiment).resolve()), "arm": arm}
    path.write_text(json.dumps(row, indent=2), encoding="utf-8")


def read_source(queue_dir: str | Path) -> dict[str, str]:
    """What :func:`write_source` recorded (empty when nothing was, or it cannot be read)."""
    try:
        row = json.loads((Path(queue_dir) / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(row, dict):
        return {}
    return {k: str(v) for k, v in row.items() if k in ("experiment", "arm") and v}


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
    """CREATE TABLE IF NOT EXISTS annotators (
        name TEXT PRIMARY KEY,
        token_sha256 TEXT NOT NULL UNIQUE,
        created REAL NOT NULL
    )""",
)
# Columns added after the first layout (a queue written by an earlier version gains them).
_ADDED_COLUMNS = {"kind": "TEXT NOT NULL DEFAULT 'rating'", "other": "TEXT"}
PAIR_CHOICES = (0.0, 0.5, 1.0)  # B better, tie, A better


class QueueError(ValueError):
    """A judgement the queue refuses; the message says why."""


class UnknownItem(QueueError):
    """No queued item has that id."""


class AlreadyJudged(QueueError):
    """This rater judged the item already (a rater judges an item once)."""


class ItemComplete(QueueError):
    """The item has all the judgements it wants."""


class OffScale(QueueError):
    """A value outside the item's scale (or, for a pair, not 0, 0.5 or 1)."""


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Item:
    """One queued sample, as a rater sees it: a response to rate on [low, high], or (``kind``
    "pair") responses A (``response``) and B (``other``) to compare."""

    id: int
    prompt: str
    response: str
    extra: dict[str, object]
    low: float
    high: float
    kind: str = "rating"
    other: str | None = None
    raters: int = 1


_ITEM_COLUMNS = "id, prompt, response, extra, low, high, kind, other, raters"


def _item(row: Any) -> Item:
    return Item(
        int(row[0]),
        str(row[1]),
        str(row[2]),
        json.loads(str(row[3])),
        float(row[4]),
        float(row[5]),
        str(row[6]),
        None if row[7] is None else str(row[7]),
        int(row[8]),
    )


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
        with self.lock, self.db:
            for table in _SCHEMA:
                self.db.execute(table)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(items)")}
            for column, declaration in _ADDED_COLUMNS.items():
                if column not in have:
                    self.db.execute(f"ALTER TABLE items ADD COLUMN {column} {declaration}")

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def enqueue(
        self, requests: Sequence[LabelRequest], raters: int = 1, scale: tuple[float, float] = (0, 1)
    ) -> list[int]:
        """The item id of each request, queueing those not queued yet (a request asked for
        again keeps its item and its ratings; ``raters`` only ever grows). Raises
        :class:`QueueError`, queueing nothing, for a request queued before on another scale
        (its ratings would be read on the wrong one)."""
        now = time.time()
        low, high = float(scale[0]), float(scale[1])
        ids = []
        with self._transaction():
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
                        low,
                        high,
                        now,
                    ),
                )
                row = self.db.execute(
                    "SELECT id, low, high FROM items WHERE key = ?", (key,)
                ).fetchone()
                if (row[1], row[2]) != (low, high):
                    raise QueueError(
                        f"item {row[0]} is queued on the scale [{row[1]}, {row[2]}], not "
                        f"[{low}, {high}]; rate it on one scale (or use another queue folder)"
                    )
                ids.append(int(row[0]))
        return ids

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction, taken before the first read (BEGIN IMMEDIATE): checks and
        writes are atomic across threads and processes sharing the queue."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:  # SQLite may have rolled back already
                    self.db.execute("ROLLBACK")
                raise

    def enqueue_pairs(
        self,
        pairs: Sequence[tuple[str, str, str]],
        raters: int = 1,
        extras: Sequence[dict[str, object]] | None = None,
    ) -> list[int]:
        """Queue "which is better" items, one per ``(prompt, response_a, response_b)``; the
        item id of each (a pair queued again keeps its item and its judgements)."""
        now = time.time()
        ids = []
        with self._transaction():
            for n, (prompt, first, second) in enumerate(pairs):
                extra = json.dumps(extras[n] if extras else {}, sort_keys=True, default=str)
                key = (
                    "pair:"
                    + hashlib.sha256("\0".join((prompt, first, second, extra)).encode()).hexdigest()
                )
                self.db.execute(
                    "INSERT INTO items (key, prompt, response, extra, raters, low, high, created, "
                    "kind, other) VALUES (?,?,?,?,?,0,1,?,'pair',?) ON CONFLICT(key) DO UPDATE "
                    "SET raters = max(raters, excluded.raters)",
                    (key, prompt, first, extra, raters, now, second),
                )
                row = self.db.execute("SELECT id FROM items WHERE key = ?", (key,)).fetchone()
                ids.append(int(row[0]))
        return ids

    def next_for(self, rater: str) -> Item | None:
        """The oldest item that still wants raters and that ``rater`` has not judged."""
        with self.lock:
            row = self.db.execute(
                f"SELECT {_ITEM_COLUMNS} FROM items i WHERE "
                "(SELECT count(*) FROM judgements j WHERE j.item = i.id) < i.raters AND "
                "NOT EXISTS (SELECT 1 FROM judgements j WHERE j.item = i.id AND j.rater = ?) "
                "ORDER BY created, id LIMIT 1",
                (rater,),
            ).fetchone()
        return None if row is None else _item(row)

    def item(self, item: int) -> Item | None:
        """The queued item ``item`` (None when there is none)."""
        with self.lock:
            row = self.db.execute(
                f"SELECT {_ITEM_COLUMNS} FROM items WHERE id = ?", (item,)
            ).fetchone()
        return None if row is None else _item(row)

    def items(self) -> list[tuple[Item, list[tuple[str, float | None]]]]:
        """Every item with its judgements ((rater, value) pairs, oldest first), oldest first."""
        with self.lock:
            rows = self.db.execute(f"SELECT {_ITEM_COLUMNS} FROM items ORDER BY id").fetchall()
            given = self.db.execute(
                "SELECT item, rater, value FROM judgements ORDER BY created, rowid"
            ).fetchall()
        by_item: dict[int, list[tuple[str, float | None]]] = {}
        for item, rater, value in given:
            by_item.setdefault(int(item), []).append(
                (str(rater), None if value is None else float(value))
            )
        return [(_item(row), by_item.get(int(row[0]), [])) for row in rows]

    def submit(self, item: int, rater: str, value: float | None) -> None:
        """``rater``'s judgement of ``item``: a value on the item's scale (for a pair 1, 0 or
        0.5: A better, B better, a tie), or None for "cannot judge".

        Raises :class:`UnknownItem`, :class:`OffScale`, :class:`AlreadyJudged` (a rater
        judges an item once) or :class:`ItemComplete` (it has all the judgements it wants);
        a refused judgement changes nothing."""
        with self._transaction():
            row = self.db.execute(
                "SELECT low, high, kind, raters FROM items WHERE id = ?", (item,)
            ).fetchone()
            if row is None:
                raise UnknownItem(f"no queued item {item}")
            low, high, kind, wanted = row
            if value is not None:
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise OffScale(f"item {item}: {value!r} is not a number")
                if kind == "pair" and value not in PAIR_CHOICES:
                    raise OffScale(
                        f"item {item} is a pair: 1 (A better), 0 (B better) or 0.5 (a tie), "
                        f"not {value}"
                    )
                if not low <= value <= high:
                    raise OffScale(f"item {item}: {value} is off the scale [{low}, {high}]")
            given = self.db.execute(
                "SELECT rater FROM judgements WHERE item = ?", (item,)
            ).fetchall()
            if any(r[0] == rater for r in given):
                raise AlreadyJudged(f"item {item}: {rater} judged it already")
            if len(given) >= wanted:
                raise ItemComplete(f"item {item} has all the {wanted} judgements it wants")
            try:
                self.db.execute(
                    "INSERT INTO judgements VALUES (?,?,?,?)", (item, rater, value, time.time())
                )
            except sqlite3.IntegrityError:  # a concurrent writer got there first
                raise AlreadyJudged(f"item {item}: {rater} judged it already") from None

    # ------------------------------------------------------------------ annotators
    def add_annotator(self, name: str) -> str:
        """Let ``name`` sign in; returns the token they sign in with (shown once: only its
        SHA-256 is stored). Raises :class:`QueueError` for a name already added."""
        name = name.strip()
        if not name or len(name) > 64:
            raise QueueError("an annotator's name must have 1 to 64 characters")
        token = secrets.token_urlsafe(24)
        with self._transaction():
            known = self.db.execute("SELECT 1 FROM annotators WHERE name = ?", (name,)).fetchone()
            if known is not None:
                raise QueueError(f"annotator {name!r} exists already")
            self.db.execute(
                "INSERT INTO annotators VALUES (?,?,?)", (name, _token_hash(token), time.time())
            )
        return token

    def annotator(self, token: str) -> str | None:
        """The annotator whose token this is (None for a token nobody was issued)."""
        with self.lock:
            row = self.db.execute(
                "SELECT name FROM annotators WHERE token_sha256 = ?", (_token_hash(token),)
            ).fetchone()
        return None if row is None else str(row[0])

    def annotators(self) -> list[str]:
        """Every annotator's name, in the order they were added."""
        with self.lock:
            rows = self.db.execute("SELECT name FROM annotators ORDER BY created").fetchall()
        return [str(r[0]) for r in rows]

    def progress_of(self, rater: str) -> dict[str, int]:
        """``rater``'s judgements given, and the items still open to them."""
        with self.lock:
            done = self.db.execute(
                "SELECT count(*) FROM judgements WHERE rater = ?", (rater,)
            ).fetchone()[0]
            open_items = self.db.execute(
                "SELECT count(*) FROM items i WHERE "
                "(SELECT count(*) FROM judgements j WHERE j.item = i.id) < i.raters AND "
                "NOT EXISTS (SELECT 1 FROM judgements j WHERE j.item = i.id AND j.rater = ?)",
                (rater,),
            ).fetchone()[0]
        return {"judged": int(done), "open": int(open_items)}

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
