"""Every figure the documentation quotes from a run appears in that run's results file.

A passage of README.md, docs/*.md or benchmarks/README.md that quotes a run sits between
``<!-- figures: docs/results/NAME.json -->`` and ``<!-- /figures -->``. Each decimal number in
it (``0.8456``, ``-0.012``, ``1.32x``, ``47.5%``; not versions such as ``5.25.0``, and not
inside `code`; not a model size such as ``25.8M``) must equal, at the precision it is printed
with, a number of that results file (a figure in ``ms`` may be recorded in seconds)
(written by ``alignzoo report --results`` or a benchmark's ``--results``; ``make figures``
reruns them); a commit the passage names must be the commit the results file's runs came from.
Each results file records where it came from: commit (no uncommitted changes), the lock the
environment matched, the CPU and its kernels, the thread count.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

PASSAGE = re.compile(r"<!-- figures: (?P<file>\S+) -->(?P<body>.*?)<!-- /figures -->", re.S)
# A decimal number; a sign only where it starts a word ("0.83-0.86" is a range of two).
FIGURE = re.compile(
    r"(?<![\w.])(?P<value>[-+−]?\d+\.(?P<decimals>\d+))(?P<exponent>e[-+−]?\d+)?"
    r"(?![\d.]|M\b)(?P<percent>%)?(?P<ms>\s?ms\b)?"
)
ANY_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
CODE = re.compile(r"`[^`]*`")
COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b")


def documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks/README.md",
    ]


def numbers_of(document: Any) -> list[float]:
    """Every number in a JSON document: its numeric values and the numbers inside its strings
    (a report's table cells print ``0.8456 ± 0.0177``, ``-0.012 (-0.065 to +0.025)``)."""
    out: list[float] = []
    if isinstance(document, bool) or document is None:
        return out
    if isinstance(document, (int, float)):
        if math.isfinite(document):
            out.append(float(document))
    elif isinstance(document, str):
        out.extend(float(m.group()) for m in ANY_NUMBER.finditer(document))
    elif isinstance(document, dict):
        for value in document.values():
            out.extend(numbers_of(value))
    elif isinstance(document, list):
        for value in document:
            out.extend(numbers_of(value))
    return out


def commits_of(document: dict[str, Any]) -> set[str]:
    settings = document.get("provenance", {}).get("settings", [])
    return {str((s.get("git") or {}).get("commit", "")) for s in settings} - {""}


def unmatched(body: str, document: dict[str, Any]) -> list[str]:
    """The figures of a passage that its results file does not hold, and the commits it names
    that the file's runs did not come from."""
    values = numbers_of(document)
    text = CODE.sub("", body)
    problems = []
    for match in FIGURE.finditer(text):
        printed = float(match.group("value").replace("−", "-"))
        decimals = len(match.group("decimals"))
        scale = 1.0  # "2.5e-7": 2.5 at one decimal, times 10^-7
        if match.group("exponent"):
            scale = 10.0 ** int(match.group("exponent")[1:].replace("−", "-"))
            printed *= scale
        if match.group("percent"):
            printed, decimals = printed / 100, decimals + 2
        tolerance = scale * 0.5 * 10**-decimals + 1e-12 * scale
        candidates = [(printed, tolerance)]
        if match.group("ms"):  # milliseconds: recorded as such, or in seconds
            candidates.append((printed / 1000, tolerance / 1000))
        signed = match.group("value")[0] in "+-−"
        if not any(
            abs(value - want) <= tol or (not signed and abs(-value - want) <= tol)
            for value in values
            for want, tol in candidates
        ):
            problems.append(match.group())
    commits = commits_of(document)
    for named in COMMIT.findall(text):
        if not any(commit.startswith(named) for commit in commits):
            problems.append(f"commit {named} (the runs came from {sorted(commits) or 'none'})")
    return problems


def passages() -> list[tuple[str, str, str]]:
    """(where, results file, body) of every marked passage."""
    out = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        for match in PASSAGE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append(
                (f"{path.relative_to(ROOT)}:{line}", match.group("file"), match.group("body"))
            )
    return out


def provenance_problems(document: dict[str, Any]) -> list[str]:
    """What a results file fails to record about where its numbers came from."""
    settings = document.get("provenance", {}).get("settings") or []
    if not settings:
        return ["no provenance settings"]
    problems = []
    for setting in settings:
        git = setting.get("git") or {}
        isa = setting.get("cpu_isa") or {}
        if not git.get("commit") or git.get("dirty") is not False:
            problems.append(f"commit {git or 'missing'} (a committed, clean checkout expected)")
        if not setting.get("lock") or not setting.get("lock_sha256"):
            problems.append(f"lock {setting.get('lock')!r}: no lock matched the environment")
        if not setting.get("cpu") or not isa.get("capability") or "flags" not in isa:
            problems.append(f"CPU {setting.get('cpu')!r} / kernels {isa or 'missing'}")
        if not setting.get("threads"):
            problems.append("thread count missing")
    return problems


MARKED = passages()


def test_the_documentation_marks_its_figures() -> None:
    assert MARKED, "no <!-- figures: ... --> passage found in the documentation"
    referenced = {RESULTS.parent.parent / file for _, file, _ in MARKED}
    orphans = [p.name for p in RESULTS.glob("*.json") if p not in referenced]
    assert not orphans, f"results files no passage quotes (remove them or quote them): {orphans}"


@pytest.mark.parametrize(("where", "file", "body"), MARKED, ids=[m[0] for m in MARKED])
def test_every_quoted_figure_is_in_its_results_file(where: str, file: str, body: str) -> None:
    path = ROOT / file
    assert path.is_file(), f"{where}: names {file}, which does not exist"
    document = json.loads(path.read_text(encoding="utf-8"))
    assert not provenance_problems(document), f"{file}: {provenance_problems(document)}"
    missing = unmatched(body, document)
    assert not missing, (
        f"{where}: figures not in {file} (stale, or mistyped; `make figures` reruns the "
        f"runs): {missing}"
    )


def test_the_check_finds_a_figure_its_file_lacks_and_a_wrong_commit() -> None:
    document = {
        "tables": [{"rows": [["grpo", "0.505", "0.8456 ± 0.0177", "-0.012 (-0.065 to +0.025)"]]}],
        "runs": {"grpo/seed-0": {"tokens_per_s": 6402.57}},
        "provenance": {"settings": [{"git": {"commit": "28a113a9b0f0", "dirty": False}}]},
    }
    good = (
        "from 0.505 to 0.85 (0.8456 ± 0.0177), -0.012 (-0.065 to +0.025), 0.01 apart, "
        "6402.6 tokens/s, 84.6% right, transformers 5.25.0, `--lr 0.3`, commit 28a113a"
    )
    assert unmatched(good, document) == []
    assert unmatched("0.84 and 0.8457", document) == ["0.84", "0.8457"]
    # A sign is part of a figure where it starts a word, a range's dash is not.
    assert unmatched("+0.012", document) == ["+0.012"]
    assert unmatched("0.505-0.85", document) == []
    assert unmatched("commit 41c7005", document) == [
        "commit 41c7005 (the runs came from ['28a113a9b0f0'])"
    ]
    assert provenance_problems(document)  # no lock, no CPU, no threads


def test_units_exponents_and_model_sizes() -> None:
    """A figure in ms matches seconds in the file (or ms); ``2.5e-7`` is checked with its
    exponent; a model size such as ``25.8M`` is a name, not a figure."""
    document = {"s_per_step": 0.0475, "ms": 56.28, "diff": 2.4644e-07}
    assert unmatched("47.5 ms, 56.3 ms and 2.5e-7 on the 25.8M model", document) == []
    assert unmatched("47.6 ms", document) == ["47.6 ms"]
    assert unmatched("2.4e-7", document) == ["2.4e-7"]
    assert unmatched("3.5e-7", document) == ["3.5e-7"]
