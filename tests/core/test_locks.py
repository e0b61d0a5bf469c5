"""The locks (requirements/<env>.txt, what `make setup`, `make vllm-env` and `make verifiers-env`
install) agree with pyproject.toml: every requirement of the environment's extras (and of its
requirements/<env>.in) is locked at a version inside its range, and every locked package is
pinned to one version with its hashes. `make lock` regenerates them when this fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11+")

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENTS = ["dev", "vllm", "verifiers"]  # requirements/<env>.txt, the Makefile's <ENV>_EXTRAS


def makefile_extras(env: str) -> list[str]:
    """The extras the Makefile compiles ``env``'s lock for."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{env.upper()}_EXTRAS\s*:?=(.*)$", text, re.MULTILINE)
    assert match, f"the Makefile names no {env.upper()}_EXTRAS"
    return match.group(1).split()


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a pip requirements file: comments dropped, continuations joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def parse_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """Each locked package's normalised name -> (its pinned version, its hashes)."""
    locked: dict[str, tuple[Version, list[str]]] = {}
    for line in requirement_lines(path):
        spec, *options = re.split(r"\s+(?=--)", line)
        hashes = [option.split("=", 1)[1] for option in options if option.startswith("--hash=")]
        assert len(hashes) == len(options), f"{path.name}: an option other than --hash in {line!r}"
        req = Requirement(spec)
        pins = list(req.specifier)
        assert len(pins) == 1 and pins[0].operator == "==", f"{path.name}: {spec!r} is not a pin"
        name = canonicalize_name(req.name)
        assert name not in locked, f"{path.name}: {req.name} is locked twice"
        locked[name] = (Version(pins[0].version), hashes)
    return locked


def expected_requirements(env: str) -> list[Requirement]:
    """What ``env`` must hold: pyproject's dependencies and its extras', and requirements/<env>.in's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = makefile_extras(env)
    optional = project["optional-dependencies"]
    unknown = sorted(set(extras) - set(optional))
    assert not unknown, (
        f"the Makefile's {env.upper()}_EXTRAS names extras pyproject lacks: {unknown}"
    )
    found = [(line, None) for line in project["dependencies"]]
    found += [(line, extra) for extra in extras for line in optional[extra]]
    found += [(line, None) for line in requirement_lines(ROOT / "requirements" / f"{env}.in")]
    requirements = []
    for line, extra in found:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra or ""}):
            requirements.append(req)
    return requirements


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_locked_package_is_pinned_with_hashes(env: str) -> None:
    locked = parse_lock(ROOT / "requirements" / f"{env}.txt")
    assert locked
    for name, (_, hashes) in locked.items():
        assert hashes, f"requirements/{env}.txt: {name} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name
    assert "alignzoo" not in locked  # installed afterwards, editable, without dependencies


def disagreements(
    requirements: list[Requirement], locked: dict[str, tuple[Version, list[str]]]
) -> list[str]:
    """The requirements the lock leaves out or pins outside their range."""
    problems = []
    for req in requirements:
        name = canonicalize_name(req.name)
        if name not in locked:
            problems.append(f"{req} is not locked")
        elif not req.specifier.contains(locked[name][0], prereleases=True):
            problems.append(f"{req} is locked at {locked[name][0]}")
    return problems


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_the_lock_holds_every_requirement_inside_its_range(env: str) -> None:
    locked = parse_lock(ROOT / "requirements" / f"{env}.txt")
    problems = disagreements(expected_requirements(env), locked)
    assert not problems, (
        f"requirements/{env}.txt disagrees with pyproject.toml (run make lock): "
        + ("; ".join(problems))
    )


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_the_lock_was_compiled_for_the_makefiles_extras(env: str) -> None:
    header = (ROOT / "requirements" / f"{env}.txt").read_text().split("\n\n", 1)[0]
    compiled_for = re.findall(r"--extra=(\S+)", header)
    assert sorted(compiled_for) == sorted(makefile_extras(env)), header
    assert f"requirements/{env}.in" in header


def test_every_lock_pins_torch_to_the_local_cpu_build() -> None:
    for env in ENVIRONMENTS:
        version, _ = parse_lock(ROOT / "requirements" / f"{env}.txt")["torch"]
        assert version == Version("2.13.0+cpu"), (env, version)


def test_a_lock_that_drifts_from_pyproject_is_caught(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    digest = " \\\n    --hash=sha256:" + "0" * 64 + "\n"
    lock.write_text("transformers==4.40.0" + digest + "typing-extensions==4.12.2" + digest)
    locked = parse_lock(lock)
    requirements = [
        Requirement(r) for r in ["transformers>=4.46", "peft>=0.13", "Typing_Extensions>=4"]
    ]
    assert disagreements(requirements, locked) == [
        "transformers>=4.46 is locked at 4.40.0",
        "peft>=0.13 is not locked",
    ]
    lock.write_text("transformers==5.25.0\n")
    assert parse_lock(lock)["transformers"][1] == []  # no hash: the hash test fails on it
    lock.write_text("Transformers>=5" + digest)
    with pytest.raises(AssertionError, match="not a pin"):
        parse_lock(lock)
