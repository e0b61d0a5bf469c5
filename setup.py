"""Package discovery for the package-dir mapping in pyproject.toml (everything else lives there).

The import package ``alignzoo`` is the folder core/, ``alignzoo.plugins`` is plugins/ and
``alignzoo.experiments`` (the bundled experiment files, data only) is experiments/. setuptools'
own discovery cannot prefix a folder's subpackages with the name it installs as, so this file
finds every folder below each root and names it: a new subpackage, with or without an
``__init__.py``, is in the wheel without anyone listing it. Every file in those folders ships as
package data (``"*": ["*"]`` in pyproject.toml); tests/core/test_wheel.py compares the wheel's
file list with the tracked files.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
# Keep in step with [tool.setuptools] package-dir in pyproject.toml (a test checks they agree).
ROOTS = {"alignzoo": "core", "alignzoo.plugins": "plugins", "alignzoo.experiments": "experiments"}


def discover() -> list[str]:
    packages = []
    for name, folder in ROOTS.items():
        found = find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*"])
        packages += [name, *(f"{name}.{sub}" for sub in found if "__pycache__" not in sub)]
    return sorted(packages)


setup(packages=discover())
