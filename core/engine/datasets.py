"""Loading prompt sets, preference pairs and unpaired feedback as ``datasets.Dataset``.

``data.train`` / ``data.eval`` name either ``"embedded"`` (the arithmetic task of
:mod:`alignzoo.world.task`), a generator (``{reasoning_gym: {...}}``:
:mod:`alignzoo.integrations.reasoning_gym`, online prompts with their answers and scorer's
entry; ``{verifiers: {...}}``: :mod:`alignzoo.integrations.verifiers`, a taskset's tasks) or
a file: ``.jsonl`` / ``.json`` (JSON lines or one JSON array), ``.parquet``, or a
folder written by ``Dataset.save_to_disk`` (a ``DatasetDict`` folder too: the split of the
same name is used, or its only split).

The columns are TRL's standard names, by kind of data (each data mode of
:mod:`alignzoo.engine.modes` declares the columns it reads):

========== ===============================
online     ``prompt``
preference ``prompt``, ``chosen``, ``rejected``
unpaired   ``prompt``, ``completion``, ``label`` (bool; 0/1 accepted)
demonstr.  ``prompt``, ``completion`` (or ``messages``: the last assistant turn is the
           completion)
========== ===============================

**Conversational data** (TRL's conversational formats): ``prompt``, ``chosen``, ``rejected`` and
``completion`` may each be a list of ``{"role", "content"}`` messages, and an online file may
give a ``messages`` column instead of ``prompt`` (a trailing assistant turn is dropped). They
are rendered with the policy tokenizer's chat template (:func:`render`): the prompt with the
generation prompt, a completion as what the template adds after it; the messages stay in the
row as ``prompt_messages`` (and ``completion_messages``), so the labeler gets both the text and
the messages. Preference rows without a ``prompt`` column have an implicit one, split off the
way TRL does: the longest common prefix of ``chosen`` and ``rejected`` (whole messages, or
characters for text). A tokenizer without a chat template given messages is an error.

Extra columns are kept: the engine passes them to the labeler as ``LabelRequest.extra`` (the
embedded task adds ``answer``). Text columns must hold strings and prompts must not be blank;
otherwise a :class:`~alignzoo.errors.UserError` names the file, the row and the column.
``data.sample_ratio`` keeps a seeded random subset of the *train* split (rows stay in order);
the eval split is always complete (``evaluation.num_prompts`` shortens it).

Embedded data per mode: online -> ``prompt``, ``answer``; preference -> ``chosen`` is the
correct answer and ``rejected`` a nearby wrong number; unpaired -> two rows per prompt, the
correct answer (``label`` true) then the wrong one (false); demonstrations -> the correct
answer as the completion. Completions carry no EOS; the engine appends it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import datasets
from datasets.table import InMemoryTable

from alignzoo.config.schema import DataConfig, ReasoningGymData, VerifiersData
from alignzoo.engine.modes import required_columns
from alignzoo.errors import UserError
from alignzoo.types import DataMode

Split = Literal["train", "eval"]

KINDS = ("online", "preference", "unpaired", "demonstrations")
SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "eval": ("eval", "validation", "test"),
}
"""The DatasetDict splits read for data.train and data.eval, in order of preference."""
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion")
"""Columns that hold text or, in conversational data, a list of messages."""


def load_split(
    data: DataConfig, split: Split, mode: DataMode, tokenizer: Any = None
) -> datasets.Dataset:
    """The ``split`` data of the experiment in the columns ``mode`` needs (plus any extras);
    with the policy's ``tokenizer``, conversational rows rendered to text (:func:`render`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if mode not in KINDS:
        raise ValueError(f"mode must be one of {', '.join(KINDS)}, got {mode!r}")
    source = data.train if split == "train" else data.eval
    field = f"data.{split}"
    if isinstance(source, ReasoningGymData):
        dataset = _generated(source, mode, field)
        if split == "train" and isinstance(data.eval, ReasoningGymData):
            # Generated splits can repeat each other's prompts (a small task has few): the
            # training rows drop every eval prompt, so the evaluation is held out.
            # Compared by question, so prompts templated differently are caught too.
            held_out = set(_generated(data.eval, "online", "data.eval")["question"])
            dataset = dataset.select(
                [i for i, question in enumerate(dataset["question"]) if question not in held_out]
            )
            if len(dataset) == 0:
                raise UserError(
                    f"{field}: every generated training prompt is also an eval prompt; draw more "
                    "(size), another seed, or a task with more distinct prompts"
                )
    elif isinstance(source, VerifiersData):
        dataset = _generated(source, mode, field)
    elif source == "embedded":
        dataset = _embedded(data, split, mode)
    else:
        dataset = _read(Path(source).expanduser(), split, mode, field)
    if split == "train" and data.sample_ratio < 1.0:
        dataset = _sample(dataset, data.sample_ratio, seed=data.task.seed)
    if tokenizer is not None:
        named = source if isinstance(source, str) and source != "embedded" else "data"
        dataset = render(dataset, tokenizer, mode, named)
    return dataset


def _generated(
    source: ReasoningGymData | VerifiersData, mode: DataMode, field: str
) -> datasets.Dataset:
    """The rows a generator gives (reasoning-gym's tasks, a verifiers taskset's): prompts that
    its labeler scores, so only for arms that sample."""
    if mode != "online":
        library = "reasoning-gym" if isinstance(source, ReasoningGymData) else "a verifiers taskset"
        raise UserError(
            f"{field}: {library} gives prompts with their scorers, for arms that sample "
            f"(online); this arm reads {mode} data from it (set data.online: true)"
        )
    if isinstance(source, ReasoningGymData):
        from alignzoo.integrations import reasoning_gym

        return datasets.Dataset.from_list(reasoning_gym.generate(source.reasoning_gym, field))
    from alignzoo.integrations import verifiers

    return datasets.Dataset.from_list(verifiers.generate(source.verifiers, field))


# --------------------------------------------------------------------------- embedded


def _embedded(data: DataConfig, split: Split, mode: DataMode) -> datasets.Dataset:
    from alignzoo.world.task import make_examples, wrong_answer

    examples = make_examples(data.task, split)
    if mode == "online":
        rows: list[dict[str, Any]] = examples
    elif mode == "preference":
        rows = [
            {
                "prompt": ex["prompt"],
                "chosen": ex["answer"],
                "rejected": wrong_answer(ex["prompt"], ex["answer"]),
                "answer": ex["answer"],
            }
            for ex in examples
        ]
    elif mode == "demonstrations":
        rows = [
            {"prompt": ex["prompt"], "completion": ex["answer"], "answer": ex["answer"]}
            for ex in examples
        ]
    else:
        rows = []
        for ex in examples:
            wrong = wrong_answer(ex["prompt"], ex["answer"])
            for completion, label in ((ex["answer"], True), (wrong, False)):
                rows.append(
                    {
                        "prompt": ex["prompt"],
                        "completion": completion,
                        "label": label,
                        "answer": ex["answer"],
                    }
                )
    return datasets.Dataset.from_list(rows)


# --------------------------------------------------------------------------- files


def _read(path: Path, split: Split, mode: DataMode, field: str) -> datasets.Dataset:
    if not path.exists():
        text = str(path)
        if text.count("/") == 1 and not text.startswith((".", "/", "~")):
            raise UserError(
                f"{field}: {text!r} is not a local file or folder; it looks like a Hugging Face "
                "Hub dataset id, which alignzoo does not download: save it once with "
                f"datasets.load_dataset({text!r}).save_to_disk(DIR) and give DIR"
            )
        raise UserError(f"{field}: {path} does not exist (give 'embedded' or a data file)")
    if path.is_dir():
        return _checked(_read_folder(path, split), mode, str(path))
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            return _read_json(path, mode)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = datasets.Dataset(InMemoryTable(pq.read_table(path)))
            return _checked(table, mode, str(path))
    except UserError:
        raise
    except Exception as exc:  # pyarrow / datasets errors: say which file
        raise UserError(f"{path}: could not read ({type(exc).__name__}: {exc})") from exc
    raise UserError(
        f"{field}: {path} has an unsupported extension {suffix!r} "
        "(expected .jsonl, .json, .parquet or a save_to_disk folder)"
    )


def _read_folder(path: Path, split: Split) -> datasets.Dataset:
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise UserError(f"{path}: not a dataset folder (written by Dataset.save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"{path}: could not load ({type(exc).__name__}: {exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        names = SPLIT_NAMES[split]
        for name in names:
            if name in loaded:
                return loaded[name]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise UserError(
            f"{path}: a DatasetDict with splits {', '.join(loaded)}; expected a split named "
            f"{' or '.join(repr(n) for n in names)}, or a single split"
        )
    return loaded


def _read_json(path: Path, mode: DataMode) -> datasets.Dataset:
    text = path.read_text(encoding="utf-8")
    rows: list[Any]
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON ({exc})") from exc
        where = [f"row {i + 1}" for i in range(len(rows))]
    else:
        rows, where = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}: line {number}: invalid JSON ({exc.msg})") from exc
            where.append(f"row {len(rows)} (line {number})")
    for row, loc in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise UserError(f"{path}: {loc}: expected a JSON object, got {type(row).__name__}")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    # Check the rows before arrow sees them, so a bad value is reported by row, not by arrow.
    _check(columns, lambda c: [row.get(c) for row in rows], len(rows), mode, str(path), where)
    try:
        dataset = datasets.Dataset.from_list([{c: row.get(c) for c in columns} for row in rows])
    except Exception as exc:  # a column whose type changes from row to row
        raise UserError(
            f"{path}: columns must keep one type in every row ({type(exc).__name__}: {exc})"
        ) from exc
    return _bool_labels(dataset, mode)


# --------------------------------------------------------------------------- checks


def _checked(dataset: datasets.Dataset, mode: DataMode, source: str) -> datasets.Dataset:
    where = [f"row {i + 1}" for i in range(len(dataset))]
    _check(list(dataset.column_names), lambda c: dataset[c], len(dataset), mode, source, where)
    return _bool_labels(dataset, mode)


def _check(
    found: list[str],
    values_of: Callable[[str], list[Any]],
    size: int,
    mode: DataMode,
    source: str,
    where: list[str],
) -> None:
    """Raise a UserError naming the file and row of the first problem in the required columns."""
    if size == 0:
        raise UserError(f"{source}: no rows")
    required = list(required_columns(mode))  # each data mode owns its columns
    if "prompt" not in found and mode == "preference":
        required.remove("prompt")  # implicit: the common prefix of chosen and rejected
    if "prompt" not in found and mode == "online" and "messages" in found:
        required[required.index("prompt")] = "messages"
    if "prompt" not in found and mode == "demonstrations" and "messages" in found:
        required = ["messages"]  # a conversation: its last assistant turn is the completion
    missing = [c for c in required if c not in found]
    if missing:
        raise UserError(
            f"{source}: missing column(s) {', '.join(missing)} for {mode} data; expected "
            f"{', '.join(required)}, found {', '.join(found) or 'no columns'}"
        )
    for column in required:
        for loc, value in zip(where, values_of(column), strict=True):
            at = f"{source}: {loc}: column {column!r}"
            if column == "label":
                if not isinstance(value, (bool, int)) or value not in (0, 1):
                    raise UserError(f"{at}: expected true/false, got {_short(value)}")
            elif isinstance(value, list):
                problem = _messages_problem(value)
                if problem:
                    raise UserError(f"{at}: {problem}")
            elif not isinstance(value, str):
                raise UserError(
                    f"{at}: expected text or a list of {{role, content}} messages, got "
                    f"{type(value).__name__} {_short(value)}"
                )
            elif column == "prompt" and not value.strip():
                raise UserError(f"{at}: empty prompt")


def _bool_labels(dataset: datasets.Dataset, mode: DataMode) -> datasets.Dataset:
    if mode == "unpaired" and dataset.features["label"].dtype != "bool":
        return dataset.cast_column("label", datasets.Value("bool"))
    return dataset


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sample(dataset: datasets.Dataset, ratio: float, seed: int) -> datasets.Dataset:
    keep = max(1, round(len(dataset) * ratio))
    indices = sorted(random.Random(f"sample_ratio/{seed}").sample(range(len(dataset)), keep))
    return dataset.select(indices)


# --------------------------------------------------------------------------- conversations


def _messages_problem(value: list[Any]) -> str:
    """Why ``value`` is not a list of {role, content} messages ('' when it is)."""
    if not value:
        return "an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"message {i} is not a {{role, content}} object: {_short(message)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} has no text content: {_short(message)}"
    return ""


def is_conversational(dataset: datasets.Dataset) -> bool:
    """Whether any text column holds messages (checked on the first row)."""
    if len(dataset) == 0:
        return False
    first = dataset[0]
    return any(isinstance(first.get(c), list) for c in (*TEXT_COLUMNS, "messages"))


def _common_prefix(a: Any, b: Any) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def split_implicit_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """A preference row without a prompt: the longest common prefix of chosen and rejected
    (whole messages for conversations, characters for text) becomes the prompt."""
    chosen, rejected = row["chosen"], row["rejected"]
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, list) and isinstance(rejected, list):
        while n and chosen[n - 1].get("role") == "assistant":  # the prompt ends with a user turn
            n -= 1
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def render(
    dataset: datasets.Dataset, tokenizer: Any, mode: DataMode, source: str
) -> datasets.Dataset:
    """Conversational rows as text through the tokenizer's chat template (see the module
    docstring); text rows unchanged, an implicit preference prompt split off either way."""
    columns = dataset.column_names
    implicit = mode == "preference" and "prompt" not in columns
    if not implicit and not is_conversational(dataset):
        return dataset
    rows = [dict(row) for row in dataset]
    if implicit:
        rows = [split_implicit_prompt(row) for row in rows]
    if "prompt" not in rows[0] and "messages" in rows[0] and mode == "demonstrations":
        for i, row in enumerate(rows):
            messages = list(row.pop("messages"))
            if len(messages) < 2 or messages[-1].get("role") != "assistant":
                raise UserError(
                    f"{source}: row {i + 1}: column 'messages': a demonstration ends with the "
                    "assistant turn to imitate, after at least one message"
                )
            row["prompt"], row["completion"] = messages[:-1], messages[-1:]
    elif "prompt" not in rows[0] and "messages" in rows[0]:
        for row in rows:
            messages = list(row.pop("messages"))
            while len(messages) > 1 and messages[-1].get("role") == "assistant":
                messages.pop()
            row["prompt"] = messages
    if any(isinstance(row.get(c), list) for row in rows[:1] for c in TEXT_COLUMNS):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"{source}: the data holds messages ({{role, content}} lists) but the policy's "
                "tokenizer has no chat template; use a model whose tokenizer has one (its "
                "tokenizer_config.json 'chat_template'), or give the columns as text"
            )
        rows = [_render_row(row, tokenizer, source, i) for i, row in enumerate(rows)]
    for i, row in enumerate(rows):
        if not str(row["prompt"]).strip():
            raise UserError(f"{source}: row {i + 1}: column 'prompt': empty prompt")
    return datasets.Dataset.from_list(rows)


def _render_row(row: dict[str, Any], tokenizer: Any, source: str, i: int) -> dict[str, Any]:
    prompt = row["prompt"]
    out = dict(row)
    if isinstance(prompt, list):
        out["prompt_messages"] = prompt
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        out["prompt"] = text
    else:
        text = prompt
    for column in ("chosen", "rejected", "completion"):
        value = row.get(column)
        if not isinstance(value, list):
            continue
        if not isinstance(prompt, list):
            raise UserError(
                f"{source}: row {i + 1}: column {column!r} holds messages but 'prompt' is text; "
                "give both as messages or both as text"
            )
        whole = tokenizer.apply_chat_template(prompt + value, tokenize=False)
        if not whole.startswith(text):
            raise UserError(
                f"{source}: row {i + 1}: the chat template does not render the prompt as the "
                f"start of the conversation with its {column}, so the {column} cannot be cut "
                "from it"
            )
        out[column] = whole[len(text) :]
        if column == "completion":
            out["completion_messages"] = value
    return out
