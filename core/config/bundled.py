"""The experiments that ship with alignzoo (package data of ``alignzoo.experiments``).

In a checkout they are the files under experiments/; in an installed wheel they are
``alignzoo/experiments/*.yaml``. Either way they are read through :mod:`importlib.resources`, so
``alignzoo run smoke`` works after ``pip install alignzoo`` from any folder, and
``alignzoo init DIR`` copies them (with the annotator files they name) where a user can edit them.
"""

from __future__ import annotations

import contextlib
import importlib.resources
from collections.abc import Iterator
from importlib.resources.abc import Traversable
from pathlib import Path

from alignzoo.errors import UserError

PACKAGE = "alignzoo.experiments"
SUFFIX = ".yaml"


def _root() -> Traversable:
    return importlib.resources.files(PACKAGE)


def bundled_names() -> list[str]:
    """The bundled experiments' names (``quickstart``, ``smoke``, ...), sorted."""
    return sorted(
        entry.name.removesuffix(SUFFIX)
        for entry in _root().iterdir()
        if entry.is_file() and entry.name.endswith(SUFFIX)
    )


def bundled_files() -> dict[str, Traversable]:
    """Every bundled data file by its path relative to the experiments folder (``smoke.yaml``,
    ``annotators/rlhf_pipeline.yaml``); the package's own ``__init__.py`` is not one."""
    found: dict[str, Traversable] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                if entry.name != "__pycache__":
                    walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(SUFFIX):
                found[prefix + entry.name] = entry

    walk(_root(), "")
    return dict(sorted(found.items()))


def _listing() -> str:
    return ", ".join(bundled_names())


@contextlib.contextmanager
def experiment_file(value: str | Path) -> Iterator[Path]:
    """The experiment file ``value`` names: the file itself when it exists, else the bundled
    experiment of that name (``smoke`` or ``smoke.yaml``). Neither: a :class:`UserError` that
    lists the bundled names."""
    text = str(value)
    given = Path(text).expanduser()
    name = text.removesuffix(SUFFIX)
    bare = bool(name) and not any(sep in name for sep in ("/", "\\", "."))
    if given.exists() or not (bare and name in bundled_names()):
        if not given.exists() and bare and text == name:
            raise UserError(
                f"experiment not found: {text!r} is neither a file nor a bundled experiment; "
                f"expected a path to an experiment YAML or one of: {_listing()} "
                "(`alignzoo init DIR` writes them to DIR/experiments/)"
            )
        yield given  # a missing path is reported by the loader ("experiment file not found")
        return
    with importlib.resources.as_file(_root() / f"{name}{SUFFIX}") as path:
        yield Path(path)


def write_bundled(folder: Path, force: bool = False) -> list[Path]:
    """Copy every bundled experiment and annotator file into ``folder/experiments/``; returns
    the files written. An existing file is left alone and refused unless ``force``."""
    target = folder / "experiments"
    files = bundled_files()
    if not force:
        existing = [target / rel for rel in files if (target / rel).exists()]
        if existing:
            raise UserError(
                f"{existing[0]} already exists ({len(existing)} of the {len(files)} files "
                "init writes do); pass --force to overwrite them, or give another folder"
            )
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; expected a folder to write the experiments into")
    written = []
    for rel, source in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(source.read_bytes())
        written.append(path)
    return written
