"""alignzoo as users and cluster workers install it: ``python -m build`` makes the sdist and the
wheel (the wheel from the sdist), ``twine check`` passes, the wheel holds every module and data
file of core/, plugins/ and experiments/ (and nothing else), and the wheel installed
non-editable into a fresh virtual environment (torch 2.13.0 first, the rest from pip) runs a
bundled experiment by name, locally and with ``--executor ray`` (whose workers import the
installed alignzoo, not the checkout), lists every built-in as loaded and passes ``alignzoo
check``. A package written by ``alignzoo new plugin`` is built and installed the same way."""

from __future__ import annotations

import email.parser
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import alignzoo
from tests.core.engine.conftest import assert_same_run_files

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11+")

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU build on local disk: a plain `torch` would pull CUDA's
# The import package each source folder installs as (pyproject.toml's package-dir).
FOLDERS = {"core": "alignzoo", "plugins": "alignzoo/plugins", "experiments": "alignzoo/experiments"}
# The bundled smoke experiment shrunk to a tiny model and task: trains 2 steps in seconds.
TINY = [
    "--set", "budget.steps=2",
    "--set", "model.embedded={hidden_size: 32, num_layers: 1, num_heads: 2, "
    "intermediate_size: 64, sft_steps: 60, sft_batch_size: 64}",
    "--set", 'data.task={digits: 1, operations: ["+"], train_size: 80, eval_size: 20}',
    "--set", "training.prompts_per_step=4",
    "--set", "training.samples_per_prompt=4",
    "--set", "training.micro_batch_size=8",
    "--set", "training.checkpoint_every=2",
    "--set", "evaluation.every=2",
    "--set", "evaluation.num_prompts=8",
]  # fmt: skip


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


REWARD = """\
import json, sys

import alignzoo


def reward(prompts, completions, **columns):
    with open({calls!r}, "a") as out:
        out.write(json.dumps({{"alignzoo": alignzoo.__file__, "argv0": sys.argv[0]}}) + "\\n")
    return [0.0] * len(completions)
"""


def clean_env(tmp_path: Path) -> dict[str, str]:
    """The environment of the commands run in the fresh venv: nothing of this checkout or of
    the dev venv (no PYTHONPATH, no test plugins), its own warm-start cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(ALIGNZOO_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    return env


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_trains_lists_and_checks(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    build(ROOT, dist, "--wheel")
    wheel = next(dist.glob("alignzoo-*.whl"))

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    env = clean_env(tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    sh(*pip, TORCH, env=env)  # first: the wheel's `torch>=2.4` is then satisfied
    sh(*pip, f"{wheel}[ray]", env=env)  # non-editable, its dependencies from pip
    work = tmp_path / "work"  # not the checkout: nothing there can be imported by accident
    work.mkdir()
    python = venv / "bin" / "python"
    cli = venv / "bin" / "alignzoo"

    where = sh(python, "-c", "import alignzoo; print(alignzoo.__file__)", env=env, cwd=work)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    assert sh(cli, "--version", env=env, cwd=work).stdout.strip() == (
        f"alignzoo {alignzoo.__version__}"
    )

    # The bundled smoke experiment by name, shrunk to 2 steps: it trains and writes its report.
    sh(cli, "run", "smoke", *TINY, env=env, cwd=work)
    report = work / "runs" / "smoke" / "report.md"
    assert report.is_file() and "grpo" in report.read_text()
    metrics = (work / "runs" / "smoke" / "grpo" / "seed-0" / "metrics.jsonl").read_text()
    assert max(json.loads(line).get("step", 0) for line in metrics.splitlines()) == 2

    # Same machine, same numbers: this checkout's environment (built from the lock), with a
    # warm-start cache of its own, trains the same run to the last digit as the wheel's (its
    # dependencies resolved by pip) when both hold the same torch and transformers.
    versions = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    ours = sh(sys.executable, "-c", versions).stdout.strip()
    theirs = sh(python, "-c", versions, env=env, cwd=work).stdout.strip()
    dev_env = {**env, "ALIGNZOO_CACHE": str(tmp_path / "dev-cache")}
    # The experiment file the wheel ran (config.yaml records its path): the one it installed.
    where_bundled = (
        "import alignzoo.experiments as e, pathlib; print(pathlib.Path(e.__file__).parent)"
    )
    bundled = sh(python, "-c", where_bundled, env=env, cwd=work).stdout.strip() + "/smoke.yaml"
    sh(sys.executable, "-m", "alignzoo.cli", "run", bundled, *TINY, "--out", tmp_path / "dev",
       env=dev_env, cwd=work)  # fmt: skip
    if ours == theirs:
        assert_same_run_files(
            work / "runs" / "smoke" / "grpo" / "seed-0",
            tmp_path / "dev" / "grpo" / "seed-0",
            "the checkout's environment against the wheel's",
        )

    # --executor ray: a local Ray's workers import alignzoo from the installed wheel too. The
    # reward function runs inside the worker and says where alignzoo came from.
    calls = work / "calls.jsonl"
    (work / "reward.py").write_text(REWARD.format(calls=str(calls)))
    labeler = (
        f"{{name: python, params: {{function: {work / 'reward.py'}:reward, validate_call: false}}}}"
    )
    sh(cli, "run", "smoke", *TINY, "--executor", "ray", "--out", work / "runs" / "ray",
       "--set", f"arms.grpo.labeler={labeler}", env=env, cwd=work)  # fmt: skip
    assert (work / "runs" / "ray" / "report.md").is_file()
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert seen and all(c["argv0"].endswith("default_worker.py") for c in seen), seen[:2]
    assert {c["alignzoo"] for c in seen} == {where.stdout.strip()}

    # Every built-in component loads from the installed wheel.
    rows = json.loads(sh(cli, "plugins", "--json", env=env, cwd=work).stdout)
    builtins = {f"{r['kind']}.{r['name']}": r for r in rows if r["provider"] == "alignzoo"}
    assert set(builtins) == set(pyproject()["project"]["entry-points"]["alignzoo"])
    broken = {k: r for k, r in builtins.items() if r["status"] != "ok"}
    assert not broken, broken
    checks = sh(cli, "check", "algorithm", "grpo", env=env, cwd=work).stdout.splitlines()
    assert len(checks) > 5 and all(line.startswith("pass ") for line in checks), checks

    # init writes the bundled experiments with the annotator file rlhf_pipeline names.
    sh(cli, "init", "project", env=env, cwd=work)
    assert (work / "project" / "experiments" / "quickstart.yaml").is_file()
    assert (work / "project" / "experiments" / "annotators" / "rlhf_pipeline.yaml").is_file()

    # A package from `alignzoo new plugin`, built and installed non-editable the same way.
    sh(cli, "new", "plugin", "my_rl", "--out", work / "my_rl", env=env, cwd=work)
    build(work / "my_rl", dist, "--wheel")
    sh(*pip, next(dist.glob("my_rl-*.whl")), env=env)
    rows = json.loads(sh(cli, "plugins", "--json", env=env, cwd=work).stdout)
    ours = {r["kind"]: r for r in rows if r["name"] == "my_rl"}
    assert set(ours) >= {"algorithm", "labeler", "backend", "device_mapper", "modifier"}, ours
    assert all(r["status"] == "ok" and r["provider"] == "my-rl" for r in ours.values()), ours
    assert (
        sh(python, "-c", "import my_rl; print(my_rl.__file__)", env=env, cwd=work)
        .stdout.strip()
        .startswith(str(venv))
    )
