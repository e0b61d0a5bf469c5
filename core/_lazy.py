"""Deferred imports, so that discovering plugins and `alignzoo --help` never pay for torch.

Built-in plugin modules write ``torch = lazy_import("torch")`` instead of ``import torch``;
the module object is created at once and executed on first attribute access. Outside plugins
may do the same, or simply ``import torch`` and accept the slower listing.

Not for ``transformers``: it replaces its own module object in ``sys.modules`` while loading,
which the standard library's LazyLoader refuses. Import transformers inside the functions that
use it (it is already lazy about its submodules).
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_import(name: str) -> ModuleType:
    """Return module ``name``, executing it only when an attribute is first used."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
