"""Tasks and environments from other libraries, each behind an optional extra.

Nothing here imports its library at import time: a module imports it when first used, and says
which extra to install (exit 2) when it is missing, so the core runs without any of them.

- :mod:`alignzoo.integrations.reasoning_gym`: reasoning-gym's procedural tasks as a data source
  (``data.train: {reasoning_gym: {...}}``) and their scorers (the ``reasoning_gym`` labeler).
- :mod:`alignzoo.integrations.verifiers`: a verifiers taskset's tasks as a data source
  (``data.train: {verifiers: {...}}``) and their in-process rewards (the ``verifiers`` labeler).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from alignzoo.errors import UserError


def require(module: str, extra: str, owner: str) -> ModuleType:
    """``module`` imported, or a UserError from ``owner`` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{owner}: {module.split('.')[0]} is not installed; pip install 'alignzoo[{extra}]'"
        ) from None
