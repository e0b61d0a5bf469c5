"""Provenance: what produced a run folder, so that a difference between two machines' results
can be explained from the files alone.

``provenance.json`` (in the experiment folder and in every run folder) holds a list of
*sessions*, one appended per invocation (a resumed run may continue on another machine), each:

- ``alignzoo``: the installed version; ``git``: the commit of the source tree alignzoo was
  imported from and whether it had uncommitted changes (``{}`` outside a git checkout);
- ``python``, ``torch``, ``transformers``: versions (read from the installed metadata);
- ``cpu``: the CPU model, ``cpu_count``, ``gpu``: the CUDA device names (empty without CUDA);
- ``cpu_isa``: what the CPU's kernels were allowed to use: torch's dispatch level
  (``capability``: AVX2, AVX512, ...), the vector-instruction flags the CPU reports (AVX2,
  AVX-512, AMX) and the environment variables that restrict them (``ATEN_CPU_CAPABILITY``,
  ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``): the same model can give other numbers
  on an AVX2 CPU than on an AVX-512 or AMX one;
- ``lock``: the lock file of the checkout (``requirements/<env>.txt``) whose every pin the
  running environment has installed, with its sha256; ``null`` where none matches (a wheel
  install, or an environment changed by hand), and then the first packages that differ;
- ``threads``: torch's intra-op thread count (``OMP_NUM_THREADS`` as set, too); in a run
  folder the run's own count, the same in every session since a resume keeps it
  (:mod:`alignzoo.engine.threads`);
- ``transparent_hugepage``: the kernel's huge-page mode (``always``, ``madvise``, ``never``)
  and ``glibc_tunables``: ``GLIBC_TUNABLES`` as the process had it, ``glibc.malloc.hugetlb=1``
  where ``alignzoo run`` restarted itself with huge pages (:mod:`alignzoo.engine.malloc`):
  where memory pages come from changes a run's speed, not its numbers;
- ``command``: the command line; ``experiment_sha256``: a hash of the experiment file;
- ``policy``: the policy folder a run loaded (the embedded warm start's cache entry or the
  user's checkpoint) and ``policy_sha256``, a hash of its files (files over 16 MiB are hashed
  by size and their first and last MiB, so a multi-GB checkpoint costs no minute);
- ``started``: when the session started (UTC, ISO 8601).

Floating-point results are reproducible on the same machine type with the same thread count
and the same versions; these are the fields that say whether two folders share them.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from alignzoo.runfolder import PROVENANCE, write_atomic

PROVENANCE_FILE = PROVENANCE
"""The file of an experiment folder and of each run folder."""
BIG_FILE = 16 * 2**20
EDGE = 2**20
COMPARED = (
    "alignzoo",
    "git",
    "python",
    "torch",
    "transformers",
    "cpu",
    "cpu_isa",
    "gpu",
    "threads",
)
"""The fields that decide whether two sessions' numbers are comparable to the last digit."""


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


RESULTS_FOLDER = "docs/results"
"""Where the documented figures' results files live in a checkout (outputs, not inputs)."""


def git_state(folder: Path, scope: Path | None = None) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding ``folder``; {} if none.

    ``dirty``: uncommitted changes to tracked files, but for those under ``docs/results/`` (the
    figures' own results files, which ``make figures`` and ``make figures-bench`` rewrite one
    target after another: an earlier target's output does not change what produces the next);
    with ``scope`` (a file or folder of the checkout), changes under it only, new files not
    yet added included."""
    untracked = ["--untracked-files=no"] if scope is None else ["--untracked-files=normal"]
    limit = (
        ["--", ":(top)", f":(top,exclude){RESULTS_FOLDER}"] if scope is None else ["--", str(scope)]
    )
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", *untracked, *limit],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(status.strip())}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _gpus() -> list[str]:
    torch = sys.modules.get("torch")  # only ask CUDA when torch is already loaded
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


# The CPU flags that decide which vector kernels torch, oneDNN and MKL may run.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_isa() -> dict[str, Any]:
    """``{"capability", "flags", "limits"}``: torch's CPU dispatch level (None without torch), the :data:`ISA_FLAGS` the CPU reports (/proc/cpuinfo) and the :data:`ISA_LIMITS`
    environment variables that are set."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    try:
        import torch

        capability: str | None = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # no torch, or an old or unusual build without the query
        capability = None
    return {
        "capability": capability,
        "flags": [flag for flag in ISA_FLAGS if flag in flags],
        "limits": {name: os.environ[name] for name in ISA_LIMITS if name in os.environ},
    }


def _pins(lock: Path) -> dict[str, str]:
    """``{normalised name: version}`` of a pip-compile lock's ``name==version`` lines, less the
    packages its environment uninstalls after installing it (``<lock>.uninstall`` beside it,
    one name per line: what ``make`` removes, e.g. torchvision from the vLLM environment)."""
    pins = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[_normalise(match.group(1))] = match.group(2)
    removed = lock.with_suffix(".uninstall")
    if removed.is_file():
        for name in removed.read_text(encoding="utf-8").split():
            pins.pop(_normalise(name), None)
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_fields(checkout: Path) -> dict[str, Any]:
    """``{"lock": "requirements/<env>.txt", "lock_sha256": ...}`` for the checkout's lock whose
    every pin is installed in this environment; ``{"lock": None, "lock_differs": [...]}`` (the
    closest lock's first differing packages) where none is, or ``{"lock": None}`` without
    locks (an installed wheel)."""
    locks = sorted((checkout / "requirements").glob("*.txt"))
    if not locks:
        return {"lock": None}
    # A package may be seen twice: setuptools' vendored copies (packaging, more-itertools, ...)
    # join the distributions once something puts setuptools/_vendor on sys.path (vLLM's
    # imports do). The environment matches a pin when one of them has the pinned version.
    installed: dict[str, list[str]] = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"]:
            installed.setdefault(_normalise(dist.metadata["Name"]), []).append(dist.version)
    closest: list[str] | None = None
    for lock in locks:
        differs = [
            f"{name}=={version} (installed: {', '.join(installed.get(name, ['none']))})"
            for name, version in sorted(_pins(lock).items())
            if version not in installed.get(name, [])
        ]
        if not differs:
            return {
                "lock": str(lock.relative_to(checkout)),
                "lock_sha256": file_sha256(lock),
            }
        if closest is None or len(differs) < len(closest):
            closest = differs
    return {"lock": None, "lock_differs": (closest or [])[:5]}


THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_hugepage_mode(path: Path = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``; None
    where the kernel does not say, as off Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else None


def _threads() -> int | None:
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes; a file over 16 MiB by its size, first and last MiB."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= BIG_FILE:
            for block in iter(lambda: f.read(EDGE), b""):
                digest.update(block)
        else:
            digest.update(f"size={size}".encode())
            digest.update(f.read(EDGE))
            f.seek(size - EDGE)
            digest.update(f.read(EDGE))
    return digest.hexdigest()


def folder_sha256(folder: Path) -> str:
    """A hash of every file below ``folder`` (relative names and :func:`file_sha256`)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def collect(
    experiment_file: str | Path | None = None, policy: str | Path | None = None
) -> dict[str, Any]:
    """This session's provenance (see the module docstring)."""
    source = Path(__file__).resolve().parent  # the package folder (core/ in a checkout)
    entry: dict[str, Any] = {
        "alignzoo": _version("alignzoo"),
        "git": git_state(source),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_isa": cpu_isa(),
        "gpu": _gpus(),
        "threads": _threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "transparent_hugepage": transparent_hugepage_mode(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "command": shlex.join(sys.argv),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    entry.update(lock_fields(source.parent))
    if experiment_file is not None and Path(experiment_file).is_file():
        entry["experiment_sha256"] = file_sha256(Path(experiment_file))
    if policy is not None:
        entry.update(policy_fields(policy))
    return entry


def component_fields(components: dict[str, Any]) -> dict[str, Any]:
    """``components``: per slot of the arm (``algorithm``, ``labeler``, ``modifiers.0``, ...)
    the component's kind, registered name, class, the distribution and version that provide
    it, and, for one imported from a git checkout (an editable or local install, or a plugin
    file beside the experiment; not an installed wheel in site-packages), that checkout's
    commit and whether its source had uncommitted changes (new files included): what tells
    two runs of an outside plugin apart.

    A component built from others (a ``combine``'s parts, a ``panel``'s raters) lists them in
    ``provenance_parts()`` (``{name: component}``), recorded as slots of their own
    (``labeler.parts.NAME``); one that runs code from a file of its own (the ``python``
    labeler's function) names it in ``provenance_sources()`` (``{what: path}``), recorded
    with its git state under ``sources``."""
    import contextlib
    import inspect

    from alignzoo.registry import get_registry

    entries: dict[type, Any] = {}
    try:
        for entry in get_registry().entries():
            if entry.component is not None:
                entries.setdefault(entry.component, entry)
    except Exception:  # a broken registry must not stop a run from recording the rest
        entries = {}
    out: dict[str, Any] = {}
    todo = sorted(components.items())
    while todo:
        slot, component = todo.pop(0)
        cls = type(component)
        entry = next((entries[c] for c in cls.__mro__ if c in entries), None)
        row: dict[str, Any] = {
            "kind": getattr(component, "kind", None),
            "name": entry.name if entry is not None else None,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "distribution": entry.distribution if entry is not None else None,
            "version": (entry.version or None) if entry is not None else None,
        }
        with contextlib.suppress(TypeError, OSError):  # a class without a file (built-in)
            row.update(source_fields(Path(inspect.getfile(cls))))
        sources = getattr(component, "provenance_sources", None)
        if callable(sources):
            row["sources"] = {what: source_fields(Path(path)) for what, path in sources().items()}
        parts = getattr(component, "provenance_parts", None)
        if callable(parts):
            todo.extend((f"{slot}.parts.{name}", part) for name, part in parts().items())
        out[slot] = row
    return {"components": dict(sorted(out.items()))}


def source_fields(path: Path) -> dict[str, Any]:
    """``{"source": path}`` and, outside an installed wheel (site-packages), ``"git"``: the
    state of the checkout holding it, its changes counted under its folder."""
    source = path.resolve()
    row: dict[str, Any] = {"source": str(source)}
    if not {"site-packages", "dist-packages"} & set(source.parts):
        row["git"] = git_state(source.parent, scope=source.parent)
    return row


def policy_fields(policy: str | Path) -> dict[str, Any]:
    """``policy`` (the folder a run loaded its starting weights from) and its ``policy_sha256``."""
    folder = Path(policy)
    return {
        "policy": str(policy),
        "policy_sha256": folder_sha256(folder) if folder.is_dir() else None,
    }


def read_sessions(folder: Path) -> list[dict[str, Any]]:
    """The sessions recorded in ``folder/provenance.json`` ([] when absent or unreadable)."""
    try:
        data = json.loads((Path(folder) / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    sessions = data.get("sessions") if isinstance(data, dict) else None
    return [s for s in sessions if isinstance(s, dict)] if isinstance(sessions, list) else []


def record(folder: Path, entry: dict[str, Any], resume: bool) -> None:
    """Write ``entry`` as ``folder/provenance.json``'s newest session (after the earlier ones
    when ``resume``), atomically."""
    sessions = read_sessions(folder) if resume else []
    text = json.dumps({"sessions": [*sessions, entry]}, indent=2)
    write_atomic(Path(folder) / PROVENANCE_FILE, text)


PER_SESSION = ("command", "started", "components", "policy", "policy_sha256")
"""Session fields that describe one invocation rather than the setting its numbers depend on."""


def distinct_settings(runs: dict[str, Path]) -> list[dict[str, Any]]:
    """The distinct settings (:func:`comparable_key`) the sessions of ``runs`` (``{name:
    folder}``) ran under, in the order first seen: each the first such session without its
    :data:`PER_SESSION` fields, and ``runs``, the names of the runs that ran under it."""
    settings: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, folder in runs.items():
        for entry in read_sessions(folder):
            setting = settings.setdefault(
                comparable_key(entry),
                {k: v for k, v in entry.items() if k not in PER_SESSION} | {"runs": []},
            )
            if name not in setting["runs"]:
                setting["runs"].append(name)
    return list(settings.values())


def comparable_key(entry: dict[str, Any]) -> tuple[str, ...]:
    """The fields of :data:`COMPARED` as strings: equal keys, same numbers to the last digit."""
    return tuple(json.dumps(entry.get(name), sort_keys=True) for name in COMPARED)
