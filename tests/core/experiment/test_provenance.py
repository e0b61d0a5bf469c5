"""Provenance: every session of a run folder says which code, libraries, machine and threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from alignzoo import provenance
from alignzoo.report.document import render_markdown
from alignzoo.report.provenance import provenance_blocks
from alignzoo.runfolder.runfiles import RunData

ROOT = Path(__file__).resolve().parents[3]


def test_a_session_names_versions_machine_command_and_hashes(tmp_path: Path) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: x\n")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    entry = provenance.collect(exp, policy)
    for key in ("alignzoo", "python", "torch", "transformers", "cpu", "cpu_count", "command"):
        assert entry[key], key
    assert entry["experiment_sha256"] == provenance.file_sha256(exp)
    assert entry["policy"] == str(policy)
    before = entry["policy_sha256"]
    (policy / "config.json").write_text('{"changed": true}')
    assert provenance.folder_sha256(policy) != before  # the hash follows the files


def test_git_state_reports_commit_and_uncommitted_changes(tmp_path: Path) -> None:
    assert provenance.git_state(tmp_path) == {}  # not a checkout

    def run(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    state = provenance.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    # A results file rewritten by an earlier figure target is an output: still clean, from
    # the checkout's root or a folder inside it.
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "x.json").write_text("{}")
    run("add", "docs")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "y")
    (results / "x.json").write_text('{"rerun": true}')
    assert provenance.git_state(tmp_path)["dirty"] is False
    assert provenance.git_state(tmp_path / "docs")["dirty"] is False
    (tmp_path / "f.txt").write_text("b")
    assert provenance.git_state(tmp_path)["dirty"] is True
    assert provenance.git_state(tmp_path / "docs")["dirty"] is True


def test_a_large_file_is_hashed_by_its_size_and_edges(tmp_path: Path) -> None:
    big = tmp_path / "weights.bin"
    size = provenance.BIG_FILE + 10
    big.write_bytes(b"\0" * size)
    first = provenance.file_sha256(big)
    with open(big, "r+b") as f:  # a change in the middle goes unseen: by design, for speed
        f.seek(size // 2)
        f.write(b"x")
    assert provenance.file_sha256(big) == first
    with open(big, "r+b") as f:  # a change at the end is seen
        f.seek(size - 1)
        f.write(b"x")
    assert provenance.file_sha256(big) != first


def test_resuming_appends_a_session_and_a_fresh_start_replaces_them(tmp_path: Path) -> None:
    provenance.record(tmp_path, {"started": "1"}, resume=False)
    provenance.record(tmp_path, {"started": "2"}, resume=True)
    assert [s["started"] for s in provenance.read_sessions(tmp_path)] == ["1", "2"]
    provenance.record(tmp_path, {"started": "3"}, resume=False)
    assert [s["started"] for s in provenance.read_sessions(tmp_path)] == ["3"]
    (tmp_path / provenance.PROVENANCE_FILE).write_bytes(b"\xff\x00")  # unreadable: no sessions
    assert provenance.read_sessions(tmp_path) == []


def _run(root: Path, arm: str, seed: int, **fields) -> RunData:
    folder = root / arm / f"seed-{seed}"
    folder.mkdir(parents=True)
    entry = {**provenance.collect(), **fields}
    (folder / provenance.PROVENANCE_FILE).write_text(json.dumps({"sessions": [entry]}))
    return RunData(arm=arm, seed=seed, path=folder, status="finished")


def test_the_report_groups_runs_by_setting_and_says_when_they_differ(tmp_path: Path) -> None:
    provenance.record(tmp_path, provenance.collect(), resume=False)
    same = [_run(tmp_path, "a", 0, threads=2), _run(tmp_path, "b", 0, threads=2)]
    text = render_markdown(provenance_blocks(tmp_path, same))
    assert "## Provenance" in text and "command:" in text
    assert "Every run session shares one setting" in text
    mixed = [*same, _run(tmp_path, "c", 0, threads=1)]
    text = render_markdown(provenance_blocks(tmp_path, mixed))
    assert "2 different settings" in text
    assert "| 2 |" in text and "| 1 |" in text  # two sessions in one setting, one in the other


def test_a_report_without_provenance_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "seed-0"
    folder.mkdir(parents=True)
    run = RunData(arm="a", seed=0, path=folder, status="finished")
    assert "No run folder records its provenance" in render_markdown(
        provenance_blocks(tmp_path, [run])
    )


def test_each_component_records_its_distribution_version_and_source_commit(
    tmp_path: Path, monkeypatch
) -> None:
    import importlib.util

    from alignzoo import registry as registry_module
    from alignzoo.plugins.algorithms.grpo import GRPO
    from alignzoo.registry import Registry

    repo = tmp_path / "outside"
    repo.mkdir()
    (repo / "my_labeler.py").write_text(
        "from alignzoo import Labeler, Score\n\n"
        "class Mine(Labeler):\n"
        "    def score(self, request):\n"
        "        return Score(1.0)\n"
    )

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", "my_labeler.py")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    spec = importlib.util.spec_from_file_location("my_labeler", repo / "my_labeler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_labeler", module)  # imported as a plugin would be
    spec.loader.exec_module(module)
    registry = Registry(entry_points=[])
    registry.register(GRPO, "grpo", provider="alignzoo")
    registry.register(module.Mine, "mine", provider="my-plugins")
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)

    fields = provenance.component_fields({"algorithm": GRPO(), "labeler": module.Mine()})
    rows = fields["components"]
    assert rows["algorithm"]["name"] == "grpo" and rows["algorithm"]["kind"] == "algorithm"
    assert rows["algorithm"]["distribution"] == "alignzoo"
    mine = rows["labeler"]
    assert (mine["name"], mine["distribution"], mine["kind"]) == ("mine", "my-plugins", "labeler")
    assert mine["source"] == str((repo / "my_labeler.py").resolve())
    assert len(mine["git"]["commit"]) == 40 and mine["git"]["dirty"] is False
    (repo / "my_labeler.py").write_text("# the sign bug, uncommitted\n")
    assert provenance.component_fields({"labeler": module.Mine()})["components"]["labeler"]["git"][
        "dirty"
    ]

    # the report names components from outside alignzoo, with their commit
    run = _run(tmp_path, "a", 0, **fields)
    text = render_markdown(provenance_blocks(tmp_path, [run]))
    assert "Components from outside alignzoo" in text
    assert "a labeler `mine` from my-plugins, commit " in text
    assert "grpo" not in text.split("Components from outside alignzoo")[1]


def test_parts_of_a_combine_and_a_python_function_file_are_recorded(tmp_path, monkeypatch):
    """What a combine is built from is recorded like an arm's own components, and a python
    labeler's function file with the state of its checkout (a new, unadded file is a change)."""
    from alignzoo.plugins.labelers.combine import CombineLabeler

    repo = tmp_path / "rewards"
    repo.mkdir()
    (repo / "trl_rewards.py").write_text(
        "def reward_len(completions, **kwargs):\n    return [0.0 for _ in completions]\n"
    )
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a",
                                                "commit", "-qm", "x"]):  # fmt: skip
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    function = f"{repo / 'trl_rewards.py'}:reward_len"
    combine = CombineLabeler(
        {"labelers": [{"name": "python", "params": {"function": function}}, {"name": "format"}]}
    )
    rows = provenance.component_fields({"labeler": combine})["components"]
    assert set(rows) == {"labeler", "labeler.parts.reward_len", "labeler.parts.format"}
    part = rows["labeler.parts.reward_len"]
    assert part["name"] == "python" and part["kind"] == "labeler"
    source = part["sources"]["function"]
    assert source["source"] == str((repo / "trl_rewards.py").resolve())
    assert len(source["git"]["commit"]) == 40 and source["git"]["dirty"] is False
    (repo / "helper.py").write_text("# not added yet\n")
    rows = provenance.component_fields({"labeler": combine})["components"]
    assert rows["labeler.parts.reward_len"]["sources"]["function"]["git"]["dirty"] is True

    run = _run(tmp_path, "a", 0, components=rows)
    text = render_markdown(provenance_blocks(tmp_path, [run]))
    assert "a labeler.parts.reward_len function from `trl_rewards.py`, commit " in text


def test_an_installed_wheel_is_not_given_the_enclosing_checkouts_commit(tmp_path):
    """A package installed into a virtual environment inside a checkout (site-packages) is not
    that checkout's code: no git state is recorded for it."""
    wheel = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "pkg" / "mod.py"
    wheel.parent.mkdir(parents=True)
    wheel.write_text("")
    subprocess.run(["git", "-C", str(tmp_path), "init", "-q"], check=True)
    assert "git" not in provenance.source_fields(wheel)
    here = tmp_path / "plugin.py"
    here.write_text("")
    assert "git" in provenance.source_fields(here)


def test_the_lock_an_environment_matches_is_named_with_its_hash(tmp_path: Path) -> None:
    from importlib import metadata

    torch_version = metadata.version("torch")
    pydantic_version = metadata.version("pydantic")
    checkout = tmp_path / "checkout"
    (checkout / "requirements").mkdir(parents=True)
    assert provenance.lock_fields(tmp_path) == {"lock": None}  # no locks: an installed wheel

    other = checkout / "requirements" / "a-other.txt"
    other.write_text(f"torch=={torch_version} \\\n    --hash=sha256:00\npydantic==0.0.1\n")
    ours = checkout / "requirements" / "b-ours.txt"
    ours.write_text(
        "# a comment\n"
        f"torch=={torch_version} \\\n    --hash=sha256:00\n"
        f"Pydantic=={pydantic_version} ; python_version >= '3.8'\n"
    )
    fields = provenance.lock_fields(checkout)
    assert fields == {
        "lock": "requirements/b-ours.txt",
        "lock_sha256": provenance.file_sha256(ours),
    }

    ours.write_text(f"torch=={torch_version}\npydantic==0.0.2\n")
    fields = provenance.lock_fields(checkout)
    assert fields["lock"] is None
    assert fields["lock_differs"] == [f"pydantic==0.0.1 (installed: {pydantic_version})"]


def test_a_package_seen_twice_matches_its_pin_by_either_copy(tmp_path: Path, monkeypatch) -> None:
    """setuptools' vendored packages join the distributions when setuptools/_vendor is on
    sys.path (vLLM's imports put it there): an older vendored ``packaging`` beside the pinned
    one must not make the environment differ from its lock."""
    from importlib import metadata
    from types import SimpleNamespace

    def dist(name: str, version: str) -> SimpleNamespace:
        return SimpleNamespace(metadata={"Name": name}, version=version)

    pinned, vendored = dist("packaging", "26.4"), dist("packaging", "24.2")
    checkout = tmp_path / "checkout"
    (checkout / "requirements").mkdir(parents=True)
    (checkout / "requirements" / "env.txt").write_text("packaging==26.4\n")
    for order in ([pinned, vendored], [vendored, pinned]):
        monkeypatch.setattr(metadata, "distributions", lambda order=order: iter(order))
        assert provenance.lock_fields(checkout)["lock"] == "requirements/env.txt"
    monkeypatch.setattr(metadata, "distributions", lambda: iter([vendored]))
    assert provenance.lock_fields(checkout)["lock_differs"] == ["packaging==26.4 (installed: 24.2)"]


def test_the_kernels_torch_may_use_and_their_limits_are_recorded(monkeypatch) -> None:
    import torch

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    isa = provenance.cpu_isa()
    assert isa["capability"] == torch.backends.cpu.get_cpu_capability()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert provenance.cpu_isa()["limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert set(isa["flags"]) <= set(provenance.ISA_FLAGS)
    assert provenance.collect()["cpu_isa"]["limits"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_a_process_limited_to_avx2_says_so_in_its_kernels() -> None:
    script = "import json; from alignzoo import provenance; print(json.dumps(provenance.cpu_isa()))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    isa = json.loads(out.stdout)
    flags = set(isa["flags"])
    if "avx2" in flags:  # an AVX2-capable CPU runs torch's AVX2 kernels when told to
        assert isa["capability"] == "AVX2"
    assert isa["limits"]["ATEN_CPU_CAPABILITY"] == "avx2"


def test_a_benchmarks_results_file_carries_the_provenance_the_figures_check_reads(
    tmp_path: Path,
) -> None:
    import torch

    from alignzoo.report.results import write_measurement
    from tests.core.test_figures import provenance_problems

    path = write_measurement(tmp_path / "bench.json", {"figures": {"s_per_step": 1.25}})
    document = json.loads(path.read_text())
    assert document["figures"] == {"s_per_step": 1.25}
    (setting,) = document["provenance"]["settings"]
    assert setting["threads"] == torch.get_num_threads()
    assert setting["cpu_isa"]["capability"] == torch.backends.cpu.get_cpu_capability()
    # What the check asks of a results file, but for a clean commit (this tree may be dirty).
    clean = {k: v for k, v in setting.items() if k != "git"} | {
        "git": {"commit": "a", "dirty": False}
    }
    assert provenance_problems({"provenance": {"settings": [clean]}}) == []
