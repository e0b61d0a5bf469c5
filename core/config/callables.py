"""User code named in a YAML or on the command line: ``"path/to/file.py:name"`` (a file,
relative to the working directory) or ``"package.module:name"`` (an importable module).
Used by the ``python`` labeler and by ``alignzoo train-rm --negatives``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from alignzoo.errors import UserError


def load_callable(spec: str, owner: str) -> Any:
    """The callable named by ``"file.py:name"`` or ``"package.module:name"``; ``owner`` (what
    asked for it, e.g. ``"python labeler"``) starts every error message."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise UserError(
            f"{owner}: function {spec!r} must be 'path/to/file.py:name' or 'module:name'"
        )
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"{owner}: file {target!r} does not exist ({path})")
        module_name = f"alignzoo_user_{abs(hash(str(path)))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise UserError(
                f"{owner}: importing {target} raised {type(exc).__name__}: {exc}"
            ) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UserError(f"{owner}: cannot import {target!r} ({exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{owner}: {target} has no function {name!r}")
    return fn
