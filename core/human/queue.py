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
  of the token :meth:`HumanQueue.add_annotator` issued (the token itself is never stored;
  :meth:`HumanQueue.revoke` makes it useless, :meth:`HumanQueue.reissue` replaces it);
- ``changes``: every judgement stored or undone, in order (``seq``), so that a reader keeps
  running figures such as the agreement up to date from what changed since it last looked;
- ``served``: the item the app showed each annotator last, the only one it lets them judge
  (held for them a while: :meth:`HumanQueue.serve`);
- ``meta``: the queue's instructions to annotators (the question, what scale points mean).

The files are created readable by their owner only (0600): judgements and token hashes are
nobody else's business.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
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
    """CREATE TABLE IF NOT EXISTS served (
        rater TEXT PRIMARY KEY,
        item INTEGER NOT NULL,
        at REAL NOT NULL
    )""",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS judgements_by_rater ON judgements (rater, created)",
    "CREATE INDEX IF NOT EXISTS served_by_item ON served (item)",
)
_CHANGES = """CREATE TABLE changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    item INTEGER NOT NULL,
    rater TEXT NOT NULL,
    value REAL,
    added INTEGER NOT NULL
)"""  # added: 1 a judgement stored, 0 one undone
# Columns added after the first layout (a queue written by an earlier version gains them).
# ``given`` counts an item's judgements (kept by submit and undo), so that open items are found
# through the partial index below instead of counting every item's judgements.
_ADDED_COLUMNS = {
    "kind": "TEXT NOT NULL DEFAULT 'rating'",
    "other": "TEXT",
    "given": "INTEGER NOT NULL DEFAULT 0",
}
_OPEN_INDEX = "CREATE INDEX IF NOT EXISTS items_open ON items (created, id) WHERE given < raters"
QUEUE_FILES = (QUEUE_FILE, QUEUE_FILE + "-wal", QUEUE_FILE + "-shm")
DEFAULT_QUESTIONS = {
    "rating": "How good is the response as an answer to the prompt?",
    "pair": "Which response answers the prompt better?",
}
PAIR_LABELS = (
    (1.0, "A is better"),
    (0.0, "B is better"),
    (0.5, "Tie: equally good, or equally bad"),
)
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


class NotServed(QueueError):
    """The app did not show this item to this rater (it lets them judge only that one)."""


class NothingToUndo(QueueError):
    """The rater has no judgement young enough to take back (or not the one named)."""


class UnknownAnnotator(QueueError):
    """No annotator has that name."""


@dataclass(frozen=True)
class Instructions:
    """What annotators are asked (``question``) and what points of the scale mean
    (``scale_labels``: (value, meaning) pairs, on the rating scale; for a pair, A, B and a
    tie, fixed)."""

    question: str
    scale_labels: tuple[tuple[float, str], ...] = ()


def default_scale_labels(low: float, high: float) -> tuple[tuple[float, str], ...]:
    """What the ends (and the middle) of a rating scale mean when the queue does not say."""
    middle = (low + high) / 2
    return (
        (low, "very poor: wrong, unhelpful or off the point"),
        (middle, "acceptable: partly right, or right but unclear"),
        (high, "excellent: right, complete and clear"),
    )


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
# The oldest item still open (through the partial index items_open) that the rater has not
# judged.
_NEXT = (
    f"SELECT {_ITEM_COLUMNS} FROM items i WHERE given < raters AND NOT EXISTS "
    "(SELECT 1 FROM judgements j WHERE j.item = i.id AND j.rater = ?) ORDER BY created, id LIMIT 1"
)
# The same, leaving out items whose judgements given and held for other raters (served to
# them since the time given) leave no room.
_NEXT_FREE = (
    f"SELECT {_ITEM_COLUMNS} FROM items i WHERE given < raters AND NOT EXISTS "
    "(SELECT 1 FROM judgements j WHERE j.item = i.id AND j.rater = ?) AND given + "
    "(SELECT count(*) FROM served s WHERE s.item = i.id AND s.rater != ? AND s.at > ?) < raters "
    "ORDER BY created, id LIMIT 1"
)
HOLD_SECONDS = 15 * 60.0
"""How long an item served to one annotator is kept from others who would complete it."""


def _private(path: Path) -> None:
    """Create ``path`` (or tighten an existing one we own) readable by its owner only."""
    with contextlib.suppress(OSError):
        if path.exists():
            if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
                path.chmod(0o600)
        else:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


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
        for name in QUEUE_FILES:  # SQLite gives -wal and -shm the database file's mode
            if name == QUEUE_FILE or (self.path.parent / name).exists():
                _private(self.path.parent / name)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(
            self.path, timeout=30, isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        with self._transaction():
            for table in _SCHEMA:
                self.db.execute(table)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(items)")}
            for column, declaration in _ADDED_COLUMNS.items():
                if column not in have:
                    self.db.execute(f"ALTER TABLE items ADD COLUMN {column} {declaration}")
            if "given" not in have:  # an earlier layout: count what each item has
                self.db.execute(
                    "UPDATE items SET given = "
                    "(SELECT count(*) FROM judgements j WHERE j.item = items.id)"
                )
            self.db.execute(_OPEN_INDEX)
            known = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'changes'"
            ).fetchone()
            if known is None:  # the log starts with the judgements given so far
                self.db.execute(_CHANGES)
                self.db.execute(
                    "INSERT INTO changes (item, rater, value, added) "
                    "SELECT item, rater, value, 1 FROM judgements ORDER BY created, rowid"
                )

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
            row = self.db.execute(_NEXT, (rater,)).fetchone()
        return None if row is None else _item(row)

    def serve(self, rater: str, hold: float = HOLD_SECONDS) -> Item | None:
        """The item to show ``rater`` now, remembered as the one they may judge
        (:meth:`submit` with ``served_only``): the one served before while it is still open
        to them (a reload shows the same item), else the oldest open item they have not
        judged whose judgements given and held for others leave room for theirs. A served
        item is held for its annotator for ``hold`` seconds from the last time it was served
        to them, so two people working at once are not shown the one judgement an item
        still wants."""
        now = time.time()
        with self._transaction():
            row = self.db.execute(
                f"SELECT {_ITEM_COLUMNS}, s.at FROM items, served s WHERE s.rater = ? AND "
                "items.id = s.item AND given < raters AND NOT EXISTS "
                "(SELECT 1 FROM judgements j WHERE j.item = items.id AND j.rater = ?)",
                (rater, rater),
            ).fetchone()
            if row is not None and now - float(row[-1]) < min(60.0, hold / 2):
                return _item(row)  # served a moment ago: still held, nothing to write
            if row is None:
                row = self.db.execute(_NEXT_FREE, (rater, rater, now - hold)).fetchone()
            if row is None:
                self.db.execute("DELETE FROM served WHERE rater = ?", (rater,))
                return None
            self.db.execute(
                "INSERT INTO served VALUES (?,?,?) ON CONFLICT(rater) DO UPDATE SET "
                "item = excluded.item, at = excluded.at",
                (rater, int(row[0]), now),
            )
        return _item(row)

    def served(self, rater: str) -> int | None:
        """The item last served to ``rater`` and not judged yet (None when none)."""
        with self.lock:
            row = self.db.execute("SELECT item FROM served WHERE rater = ?", (rater,)).fetchone()
        return None if row is None else int(row[0])

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

    def submit(self, item: int, rater: str, value: float | None, served_only: bool = False) -> None:
        """``rater``'s judgement of ``item``: a value on the item's scale (for a pair 1, 0 or
        0.5: A better, B better, a tie), or None for "cannot judge".

        Raises :class:`UnknownItem`, :class:`OffScale`, :class:`AlreadyJudged` (a rater
        judges an item once), :class:`ItemComplete` (it has all the judgements it wants) or,
        with ``served_only`` (the app), :class:`NotServed` for an item :meth:`serve` did not
        give ``rater``; a refused judgement changes nothing."""
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
            if served_only:
                row = self.db.execute(
                    "SELECT item FROM served WHERE rater = ?", (rater,)
                ).fetchone()
                if row is None or int(row[0]) != item:
                    now = "none" if row is None else f"item {row[0]}"
                    raise NotServed(
                        f"item {item} is not the item served to you ({now} is); judge the item "
                        "GET /api/next gives you"
                    )
                self.db.execute("DELETE FROM served WHERE rater = ?", (rater,))
            try:
                self.db.execute(
                    "INSERT INTO judgements VALUES (?,?,?,?)", (item, rater, value, time.time())
                )
            except sqlite3.IntegrityError:  # a concurrent writer got there first
                raise AlreadyJudged(f"item {item}: {rater} judged it already") from None
            self.db.execute("UPDATE items SET given = given + 1 WHERE id = ?", (item,))
            self.db.execute(
                "INSERT INTO changes (item, rater, value, added) VALUES (?,?,?,1)",
                (item, rater, value),
            )

    def undo(self, rater: str, within: float, item: int | None = None) -> Item:
        """Take back ``rater``'s latest judgement when it is at most ``within`` seconds old
        (and, when ``item`` is given, is of that item); the item is served to them again and
        returned. Raises :class:`NothingToUndo` otherwise. A judgement read meanwhile (a run
        waiting on the queue, an export) keeps what it read."""
        with self._transaction():
            row = self.db.execute(
                "SELECT item, value, created FROM judgements WHERE rater = ? "
                "ORDER BY created DESC, rowid DESC LIMIT 1",
                (rater,),
            ).fetchone()
            if row is None:
                raise NothingToUndo("nothing to undo: you have not judged anything")
            last, value, created = int(row[0]), row[1], float(row[2])
            if item is not None and item != last:
                raise NothingToUndo(
                    f"nothing to undo: your last judgement is of item {last}, not {item}"
                )
            if time.time() - created > within:
                raise NothingToUndo(
                    f"nothing to undo: your last judgement (item {last}) is over {within:g} s old"
                )
            self.db.execute("DELETE FROM judgements WHERE item = ? AND rater = ?", (last, rater))
            self.db.execute("UPDATE items SET given = given - 1 WHERE id = ?", (last,))
            self.db.execute(
                "INSERT INTO changes (item, rater, value, added) VALUES (?,?,?,0)",
                (last, rater, value),
            )
            self.db.execute(
                "INSERT INTO served VALUES (?,?,?) ON CONFLICT(rater) DO UPDATE SET "
                "item = excluded.item, at = excluded.at",
                (rater, last, time.time()),
            )
            got = self.db.execute(
                f"SELECT {_ITEM_COLUMNS} FROM items WHERE id = ?", (last,)
            ).fetchone()
        return _item(got)

    def changes(
        self, after: int = 0
    ) -> tuple[list[tuple[int, str, float | None, bool, str, float, float]], int]:
        """Judgements stored or undone since change ``after``, in order: (item, rater, value,
        stored (False: undone), the item's kind, low, high) each; and the last change's
        number, to pass next time."""
        with self.lock:
            rows = self.db.execute(
                "SELECT c.seq, c.item, c.rater, c.value, c.added, i.kind, i.low, i.high "
                "FROM changes c JOIN items i ON i.id = c.item WHERE c.seq > ? ORDER BY c.seq",
                (after,),
            ).fetchall()
        last = int(rows[-1][0]) if rows else after
        return [
            (
                int(r[1]),
                str(r[2]),
                None if r[3] is None else float(r[3]),
                bool(r[4]),
                str(r[5]),
                float(r[6]),
                float(r[7]),
            )
            for r in rows
        ], last

    # ------------------------------------------------------------------ instructions
    def set_instructions(
        self,
        kind: str = "rating",
        question: str | None = None,
        scale_labels: Mapping[float, str] | None = None,
    ) -> Instructions:
        """Say what annotators of ``kind`` items ("rating" or "pair") are asked, and (for
        ratings) what points of the scale mean; what is not given stays as it was (the
        defaults at first). Returns the instructions now in force."""
        if kind not in DEFAULT_QUESTIONS:
            raise QueueError(f"kind must be 'rating' or 'pair', not {kind!r}")
        if question is not None and not question.strip():
            raise QueueError("the question must not be empty")
        if scale_labels and kind == "pair":
            raise QueueError(
                "a pair's choices are fixed (A, B, a tie); scale labels are for ratings"
            )
        labels = []
        for value, text in (scale_labels or {}).items():
            if not math.isfinite(float(value)) or not str(text).strip():
                raise QueueError(f"a scale label needs a finite value and a text: {value}={text!r}")
            labels.append([float(value), str(text).strip()])
        with self._transaction():
            row = self.db.execute("SELECT value FROM meta WHERE key = 'instructions'").fetchone()
            stored = json.loads(row[0]) if row else {}
            mine = stored.get(kind, {})
            if question is not None:
                mine["question"] = question.strip()
            if scale_labels is not None:
                mine["scale_labels"] = sorted(labels)
            stored[kind] = mine
            self.db.execute(
                "INSERT INTO meta VALUES ('instructions', ?) ON CONFLICT(key) DO UPDATE SET "
                "value = excluded.value",
                (json.dumps(stored, sort_keys=True),),
            )
        return self._instructions(stored, kind)

    def instructions(self, kind: str = "rating") -> Instructions:
        """What annotators of ``kind`` items are asked (:meth:`set_instructions`; the
        defaults where nothing was set). A rating's labels here are those set; for an item,
        :meth:`labels_for` adds the defaults."""
        with self.lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = 'instructions'").fetchone()
        return self._instructions(json.loads(row[0]) if row else {}, kind)

    @staticmethod
    def _instructions(stored: dict[str, Any], kind: str) -> Instructions:
        mine = stored.get(kind, {})
        labels = tuple((float(v), str(t)) for v, t in mine.get("scale_labels", []))
        if kind == "pair":
            labels = PAIR_LABELS
        return Instructions(str(mine.get("question") or DEFAULT_QUESTIONS[kind]), labels)

    def labels_for(
        self, item: Item, instructions: Instructions | None = None
    ) -> list[tuple[float, str]]:
        """What the points of ``item``'s scale mean: the queue's labels on its scale, else the
        defaults (:func:`default_scale_labels`); a pair's three choices."""
        given = instructions or self.instructions(item.kind)
        if item.kind == "pair":
            return list(PAIR_LABELS)
        labels = [(v, t) for v, t in given.scale_labels if item.low <= v <= item.high]
        return labels or list(default_scale_labels(item.low, item.high))

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

    def revoke(self, name: str) -> None:
        """``name``'s token stops working at once (their judgements stay); :meth:`reissue`
        gives them a new one. Raises :class:`UnknownAnnotator`."""
        with self._transaction():
            done = self.db.execute(
                "UPDATE annotators SET token_sha256 = ? WHERE name = ?", (f"revoked:{name}", name)
            ).rowcount
            if not done:
                raise UnknownAnnotator(f"no annotator named {name!r}")
            self.db.execute("DELETE FROM served WHERE rater = ?", (name,))

    def reissue(self, name: str) -> str:
        """A new token for ``name`` (shown once); their old one stops working at once.
        Raises :class:`UnknownAnnotator`."""
        token = secrets.token_urlsafe(24)
        with self._transaction():
            done = self.db.execute(
                "UPDATE annotators SET token_sha256 = ? WHERE name = ?", (_token_hash(token), name)
            ).rowcount
            if not done:
                raise UnknownAnnotator(f"no annotator named {name!r}")
        return token

    def revoked(self, name: str) -> bool:
        """Whether ``name``'s token was revoked (and not reissued since)."""
        with self.lock:
            row = self.db.execute(
                "SELECT token_sha256 FROM annotators WHERE name = ?", (name,)
            ).fetchone()
        return row is not None and str(row[0]).startswith("revoked:")

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
                "SELECT count(*) FROM items WHERE given < raters"
            ).fetchone()[0]
            theirs = self.db.execute(
                "SELECT count(*) FROM judgements j JOIN items i ON i.id = j.item "
                "WHERE j.rater = ? AND i.given < i.raters",
                (rater,),
            ).fetchone()[0]
        return {"judged": int(done), "open": int(open_items) - int(theirs)}

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
            open_items = self.db.execute(
                "SELECT count(*) FROM items WHERE given < raters"
            ).fetchone()[0]
            given = self.db.execute("SELECT count(*) FROM judgements").fetchone()[0]
        return {
            "items": int(items),
            "complete": int(items) - int(open_items),
            "judgements": int(given),
        }
