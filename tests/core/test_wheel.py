"""alignzoo as users and cluster workers install it: ``python -m build`` makes the sdist and the
wheel (the wheel from the sdist), ``twine check`` passes, the wheel holds every module and data
file of core/, plugins/ and experiments/ (and nothing else), and its metadata is what users
expect (one version, license, README, classifiers, every extra documented)."""

from __future__ import annotations

import email.parser
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import alignzoo

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11+")

ROOT = Path(__file__).resolve().parents[2]
# The import package each source folder installs as (pyproject.toml's package-dir).
FOLDERS = {"core": "alignzoo", "plugins": "alignzoo/plugins", "experiments": "alignzoo/experiments"}


def sh(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a command; its output in the assertion message when it fails."""
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def build(source: Path, out: Path, *what: str) -> None:
    """``python -m build`` in an isolated build environment (its requires come from pip)."""
    sh(sys.executable, "-m", "build", *what, "--outdir", out, source, cwd=out.parent)


def source_files() -> dict[str, str]:
    """Every file the package folders hold (bytecode and caches aside): its path in the wheel
    by its path in the source tree."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                relative = path.relative_to(ROOT / folder).as_posix()
                found[f"{folder}/{relative}"] = f"{package}/{relative}"
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_folders_are_those_setup_py_discovers():
    """setup.py discovers subpackages under the same folders pyproject.toml maps."""
    mapping = pyproject()["tool"]["setuptools"]["package-dir"]
    assert {folder: name.replace(".", "/") for name, folder in mapping.items()} == FOLDERS
    assert "packages" not in pyproject()["tool"]["setuptools"], "no hand-written package list"


def test_every_extra_is_in_the_readmes_dependency_table():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Dependencies, and why", 1)[1].split("\n## ", 1)[0]
    extras = pyproject()["project"]["optional-dependencies"]
    missing = [name for name in extras if f"`{name}`" not in table]
    assert not missing, f"extras without a row in the README's dependency table: {missing}"
    for package in ("build", "twine", "hypothesis"):
        assert package in table, package


@pytest.mark.slow
def test_sdist_and_wheel_hold_every_module_and_data_file(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    build(ROOT, dist)  # the sdist, then the wheel built from the unpacked sdist
    sdist = next(dist.glob("alignzoo-*.tar.gz"))
    wheel = next(dist.glob("alignzoo-*.whl"))
    sh(sys.executable, "-m", "twine", "check", "--strict", sdist, wheel)

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"alignzoo-{alignzoo.__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    packaged = {n for n in names if not n.startswith(f"{info}/")}
    expected = set(source_files().values())
    assert not expected - packaged, f"missing from the wheel: {sorted(expected - packaged)}"
    assert not packaged - expected, f"in the wheel, not in the tree: {sorted(packaged - expected)}"
    for needed in (
        "alignzoo/engine/modes/__init__.py",
        "alignzoo/py.typed",
        "alignzoo/experiments/quickstart.yaml",
        "alignzoo/experiments/smoke.yaml",
        "alignzoo/experiments/annotators/rlhf_pipeline.yaml",
    ):
        assert needed in packaged, needed

    with tarfile.open(sdist) as archive:
        top = f"alignzoo-{alignzoo.__version__}/"
        in_sdist = {m.name.removeprefix(top) for m in archive.getmembers() if m.isfile()}
    missing = set(source_files()) - in_sdist
    assert not missing, f"missing from the sdist: {sorted(missing)}"
    assert {"pyproject.toml", "setup.py", "README.md", "LICENSE"} <= in_sdist

    # One version: the package's, the wheel's and the file name's.
    assert metadata["Version"] == alignzoo.__version__ and wheel.name.startswith(
        f"alignzoo-{alignzoo.__version__}-"
    )
    assert metadata["Requires-Python"] == pyproject()["project"]["requires-python"]
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in metadata.get_all("License-File", [])
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    classifiers = metadata.get_all("Classifier", [])
    assert "Programming Language :: Python :: 3" in classifiers
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in classifiers)
    extras = set(metadata.get_all("Provides-Extra", []))
    assert extras == set(pyproject()["project"]["optional-dependencies"])
    for name, target in pyproject()["project"]["entry-points"]["alignzoo"].items():
        assert f"{name} = {target}" in entry_points, name
