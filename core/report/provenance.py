"""The report's provenance section: which code, libraries, machine and threads produced the runs.

Reads ``provenance.json`` of the experiment folder (one session per ``alignzoo run``) and of
every run folder. Runs whose sessions agree on :data:`~alignzoo.provenance.COMPARED`
(versions, commit, CPU, GPU, threads) are grouped; more than one group means the arms' numbers
did not all come from the same setting, and the report says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignzoo.provenance import comparable_key, read_sessions
from alignzoo.report.document import Block
from alignzoo.runfolder.runfiles import RunData


def _git(entry: dict[str, Any]) -> str:
    git = entry.get("git") or {}
    if not git:
        return "not a git checkout"
    return (
        f"{str(git.get('commit', ''))[:12]}{' (uncommitted changes)' if git.get('dirty') else ''}"
    )


def _threads(entry: dict[str, Any]) -> str:
    threads = entry.get("threads")
    omp = entry.get("omp_num_threads")
    text = "?" if threads is None else str(threads)
    return text + (f" (OMP_NUM_THREADS={omp})" if omp is not None else "")


def _isa(entry: dict[str, Any]) -> str:
    """torch's CPU dispatch level, the CPU's vector flags and what restricted them."""
    isa = entry.get("cpu_isa")
    if not isinstance(isa, dict):
        return ""
    limits = ", ".join(f"{k}={v}" for k, v in (isa.get("limits") or {}).items())
    text = f"; kernels {isa.get('capability') or '?'} (CPU: {' '.join(isa.get('flags') or [])})"
    return text + (f", restricted by {limits}" if limits else "")


def _lock(entry: dict[str, Any]) -> str:
    if entry.get("lock"):
        return f"; lock {entry['lock']} (sha256 {str(entry.get('lock_sha256', ''))[:16]})"
    if "lock" in entry:
        return "; no lock matches the environment"
    return ""


def _describe(entry: dict[str, Any]) -> list[str]:
    gpus = entry.get("gpu") or []
    return [
        str(entry.get("alignzoo") or "?"),
        _git(entry),
        f"python {entry.get('python', '?')}, torch {entry.get('torch', '?')}, "
        f"transformers {entry.get('transformers', '?')}{_lock(entry)}",
        f"{entry.get('cpu', '?')} ({entry.get('cpu_count', '?')} cores){_isa(entry)}",
        ", ".join(gpus) if gpus else "none",
        _threads(entry),
    ]


def provenance_blocks(run_dir: Path, runs: list[RunData]) -> list[Block]:
    """The provenance section of the report (always present; says when nothing was recorded)."""
    blocks = [Block("h2", "Provenance")]
    sessions = read_sessions(run_dir)
    if sessions:
        last = sessions[-1]
        items = [
            f"command: `{last.get('command', '?')}` (started {last.get('started', '?')}; "
            f"{len(sessions)} invocation(s) of this folder)",
            f"experiment file sha256: {str(last.get('experiment_sha256', '?'))[:16]}",
        ]
        blocks.append(Block("ul", items=items))
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    members: dict[tuple[str, ...], list[str]] = {}
    policies: set[str] = set()
    for run in runs:
        for entry in read_sessions(run.path):
            key = comparable_key(entry)
            groups.setdefault(key, entry)
            members.setdefault(key, []).append(run.name)
            if entry.get("policy_sha256"):
                policies.add(f"{entry.get('policy')} (sha256 {str(entry['policy_sha256'])[:16]})")
    if not groups:
        blocks.append(Block("p", "No run folder records its provenance (provenance.json)."))
        return blocks
    headers = ["alignzoo", "commit", "libraries", "CPU", "GPU", "threads", "run sessions"]
    rows = [[*_describe(groups[key]), str(len(members[key]))] for key in groups]
    blocks.append(Block("table", headers=headers, rows=rows))
    if len(groups) > 1:
        blocks.append(
            Block(
                "p",
                f"The runs come from {len(groups)} different settings (rows above): numbers are "
                "reproducible to the last digit only within one setting (same versions, commit, "
                "CPU and its kernels, GPU and thread count), so small differences between arms may be rounding.",
            )
        )
    else:
        blocks.append(
            Block(
                "p",
                "Every run session shares one setting: a rerun with the same setting gives the "
                "same numbers; another CPU, thread count or library version may change the last "
                "digits and, through training, more.",
            )
        )
    if policies:
        blocks.append(Block("p", "Starting policy: " + "; ".join(sorted(policies)) + "."))
    outside = _outside_components(runs)
    if outside:
        blocks.append(
            Block(
                "p",
                "Components from outside alignzoo (each run's provenance.json lists every "
                "component): " + "; ".join(outside) + ".",
            )
        )
    return blocks


def _outside_components(runs: list[RunData]) -> list[str]:
    """One line per distinct component not provided by alignzoo itself (a part of a combine or
    a panel too), and per file of user code a component runs (a python labeler's function):
    arm, slot, name, distribution and version, and the commit of its source checkout (dirty
    said)."""
    seen: dict[str, None] = {}
    for run in runs:
        for entry in read_sessions(run.path)[-1:]:
            for slot, row in (entry.get("components") or {}).items():
                if not isinstance(row, dict):
                    continue
                if row.get("distribution") != "alignzoo":
                    seen[
                        f"{run.arm} {slot} `{row.get('name') or row.get('class')}` from "
                        f"{row.get('distribution') or 'no registered distribution'} "
                        f"{row.get('version') or ''}".rstrip()
                        + _commit(row)
                    ] = None
                for what, source in (row.get("sources") or {}).items():
                    if isinstance(source, dict):
                        name = Path(str(source.get("source", "?"))).name
                        seen[f"{run.arm} {slot} {what} from `{name}`{_commit(source)}"] = None
    return list(seen)


def _commit(row: dict[str, Any]) -> str:
    git = row.get("git") or {}
    commit = str(git.get("commit", ""))[:12]
    if not commit:
        return ""
    return f", commit {commit}{' with uncommitted changes' if git.get('dirty') else ''}"
