"""The bad-input corpus: malformed configs, files, plugins, run folders and CLI arguments.

Every case runs the real command line in-process (``alignzoo.cli.main``) and asserts:
- the exit code (2 for a problem the user can fix, unless the case says otherwise);
- no traceback is printed (and no exception escapes ``main``) without ``--debug``;
- the message names the place: the file, and the dotted path or the file inside a run folder;
- no file outside the output folder changed or appeared, and no file inside it was lost or
  shortened.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignzoo import cli
from alignzoo.registry import Registry, get_registry
from tests.core.helpers import entry_point

BASE: dict[str, Any] = {
    "name": "corpus",
    "seeds": [0, 1],
    "budget": {"steps": 3},
    "training": {"lr": 1.0e-4, "prompts_per_step": 2, "samples_per_prompt": 2},
    "evaluation": {"every": 3, "metric": "score"},
    "defaults": {
        "labeler": {"name": "keyword", "params": {"keyword": "4"}},
        "backend": "canned",
        "devices": "all_cpu",
    },
    "arms": {
        "a": {"algorithm": {"name": "vanilla_pg", "params": {"baseline": True}}},
        "b": {
            "algorithm": "vanilla_pg",
            "modifiers": [{"name": "loss_scale", "params": {"factor": 3}}],
        },
    },
}

DELETE = object()


def mutate(path: str, value: Any) -> dict[str, Any]:
    """BASE with the dotted ``path`` set to ``value`` (or removed for DELETE)."""
    data = copy.deepcopy(BASE)
    parts = path.split(".")
    node: Any = data
    for part in parts[:-1]:
        key: Any = int(part) if isinstance(node, list) else part
        if isinstance(node, dict) and key not in node:
            node[key] = {}
        node = node[key]
    last: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


@dataclass
class Case:
    id: str
    argv: list[str]
    files: dict[str, bytes | str | dict[str, Any]] = field(default_factory=dict)
    code: int = 2
    says: tuple[str, ...] = ()
    report_says: tuple[str, ...] = ()  # fragments report.md must contain (for report cases)
    plugins: dict[str, str] = field(default_factory=dict)  # entry point -> module source
    setup: Callable[[Path], None] | None = None


def config_case(id: str, path: str, value: Any, *says: str) -> Case:
    return Case(id, ["validate", "{tmp}/exp.yaml"], {"exp.yaml": mutate(path, value)}, 2,
                ("exp.yaml", *says))  # fmt: skip


def raw_case(id: str, content: bytes | str, *says: str, argv: list[str] | None = None) -> Case:
    return Case(id, argv or ["validate", "{tmp}/exp.yaml"], {"exp.yaml": content}, 2, says)


INF, NAN = float("inf"), float("nan")

CONFIG_CASES = [
    config_case("name-dotdot", "name", "..", "name", "plain folder name"),
    config_case("name-dot", "name", ".", "name", "plain folder name"),
    config_case("name-slash", "name", "a/b", "name"),
    config_case("name-backslash", "name", "a\\b", "name"),
    config_case("name-empty", "name", "", "name"),
    config_case("name-long", "name", "x" * 101, "name", "at most 100"),
    config_case("name-hidden", "name", ".hidden", "name"),
    config_case("name-int", "name", 5, "name"),
    config_case("name-missing", "name", DELETE, "name", "missing"),
    config_case("seeds-empty", "seeds", [], "seeds"),
    config_case("seeds-negative", "seeds", [-1], "seeds", "outside 0"),
    config_case("seeds-huge", "seeds", [2**64], "seeds"),
    config_case("seeds-int64", "seeds", [2**40], "seeds", "outside 0"),
    config_case("seeds-repeated", "seeds", [0, 0], "seeds", "distinct"),
    config_case("seeds-string", "seeds", ["a"], "seeds"),
    config_case("seeds-float", "seeds", [1.5], "seeds"),
    config_case("seeds-scalar", "seeds", 3, "seeds"),
    config_case("baseline-unknown", "baseline", "nope", "baseline", "not an arm"),
    config_case("budget-empty", "budget", {}, "budget"),
    config_case("budget-two", "budget", {"steps": 3, "samples": 4}, "budget"),
    config_case("budget-zero", "budget.steps", 0, "budget.steps"),
    config_case("budget-negative", "budget.steps", -1, "budget.steps"),
    config_case("budget-inf", "budget", {"wall_clock_s": INF}, "budget.wall_clock_s", "finite"),
    config_case("budget-string", "budget.steps", "many", "budget.steps"),
    config_case("budget-missing", "budget", DELETE, "budget", "missing"),
    config_case("budget-unknown", "budget.step", 3, "budget.step", "did you mean"),
    config_case("arms-empty", "arms", {}, "arms"),
    config_case("arms-list", "arms", ["a"], "arms"),
    config_case("arm-dotdot", "arms", {"..": {"algorithm": "vanilla_pg"}}, "arm name"),
    config_case("arm-space", "arms", {"a b": {"algorithm": "vanilla_pg"}}, "arm name"),
    config_case("arm-slash", "arms", {"a/b": {"algorithm": "vanilla_pg"}}, "arm name"),
    config_case("arm-scalar", "arms.a", "vanilla_pg", "arms.a"),
    config_case("arm-no-algorithm", "arms.a.algorithm", DELETE, "arms.a.algorithm", "missing"),
    config_case("algorithm-unknown", "arms.a.algorithm", {"name": "nope"}, "arms.a.algorithm"),
    config_case(
        "algorithm-typo", "arms.a.algorithm", "vanila_pg", "arms.a.algorithm", "vanilla_pg"
    ),
    config_case(
        "param-typo",
        "arms.a.algorithm",
        {"name": "vanilla_pg", "params": {"baselin": True}},
        "arms.a.algorithm.params.baselin",
        "did you mean",
    ),
    config_case("param-type", "arms.a.algorithm.params.baseline", "maybe", "params.baseline"),
    config_case("param-list", "arms.a.algorithm.params", [1], "arms.a.algorithm.params"),
    config_case("algorithm-int", "arms.a.algorithm", 5, "arms.a.algorithm"),
    config_case("labeler-unknown", "arms.a.labeler", "nope", "arms.a.labeler"),
    config_case("labeler-param-missing", "arms.a.labeler", "keyword", "arms.a.labeler", "keyword"),
    config_case("backend-unknown", "arms.a.backend", "nope", "arms.a.backend"),
    config_case("devices-unknown", "arms.a.devices", "nope", "arms.a.devices"),
    config_case("modifier-unknown", "arms.b.modifiers", ["nope"], "arms.b.modifiers.0"),
    config_case("modifiers-scalar", "arms.b.modifiers", "loss_scale", "arms.b.modifiers"),
    config_case("modifier-param", "arms.b.modifiers.0.params.factor", "x", "modifiers.0.params"),
    config_case("arm-unknown-field", "arms.a.algoritm", "vanilla_pg", "arms.a.algoritm"),
    config_case("arm-offline-online-algo", "arms.a.online", False, "arms.a.online"),
    config_case("top-unknown", "trainin", {"lr": 1}, "trainin", "did you mean 'training'"),
    config_case("lr-negative", "training.lr", -1, "training.lr"),
    config_case("lr-inf", "training.lr", INF, "training.lr", "finite"),
    config_case("lr-nan", "training.lr", NAN, "training.lr", "finite"),
    config_case("lr-string", "training.lr", "fast", "training.lr"),
    config_case("lr-list", "training.lr", [1e-4], "training.lr"),
    config_case("prompts-zero", "training.prompts_per_step", 0, "prompts_per_step"),
    config_case("samples-zero", "training.samples_per_prompt", 0, "samples_per_prompt"),
    config_case("micro-zero", "training.micro_batch_size", 0, "micro_batch_size"),
    config_case("warmup-negative", "training.warmup_steps", -1, "warmup_steps"),
    config_case("training-unknown", "training.lrr", 1, "training.lrr", "did you mean"),
    config_case("temperature-negative", "training.sampling.temperature", -1, "temperature"),
    config_case("max-new-zero", "training.sampling.max_new_tokens", 0, "max_new_tokens"),
    config_case("top-p-two", "training.sampling.top_p", 2, "top_p"),
    config_case("sampling-scalar", "training.sampling", 3, "training.sampling"),
    config_case("sampling-inf", "training.sampling.temperature", INF, "temperature", "finite"),
    config_case("checkpoint-zero", "training.checkpoint_every", 0, "checkpoint_every"),
    config_case(
        "async-negative", "training.async", {"max_staleness": -1}, "training.async.max_staleness"
    ),
    config_case(
        "async-weights-every",
        "training.async",
        {"max_staleness": 0, "weights_every": 3},
        "weights_every 3",
        "max_staleness >= 2",
    ),
    config_case(
        "async-offline",
        "arms.a",
        {"algorithm": "dpo", "online": False, "training": {"async": {"max_staleness": 1}}},
        "arms.a.training.async",
        "offline",
    ),
    config_case(
        "async-overlap",
        "arms.a",
        {"algorithm": "vanilla_pg", "labeling": {"overlap": True}, "training": {"async": {}}},
        "arms.a.training.async",
        "labeling.overlap",
    ),
    config_case("arm-lr-inf", "arms.a.training", {"lr": INF}, "arms.a.training.lr", "finite"),
    config_case(
        "policy-missing-abs", "model.policy", "/does/not/exist", "model.policy", "does not exist"
    ),
    config_case(
        "policy-missing-rel", "model.policy", "./missing-model", "model.policy", "does not exist"
    ),
    config_case(
        "policy-missing-home", "model.policy", "~/no/such/model", "model.policy", "does not exist"
    ),
    config_case("policy-is-file", "model.policy", "{tmp}/exp.yaml", "model.policy", "is a file"),
    config_case(
        "reward-model-missing",
        "model.reward_model",
        "/nope/rm",
        "model.reward_model",
        "does not exist",
    ),
    config_case("dtype-unknown", "model.dtype", "fp8", "model.dtype"),
    config_case("dtype-float16-on-cpu", "model.dtype", "float16", "model.dtype", "placed on cpu"),
    config_case("hidden-zero", "model.embedded.hidden_size", 0, "hidden_size"),
    config_case("slip-two", "model.embedded.sft_slip", 2, "sft_slip"),
    config_case("sft-lr-inf", "model.embedded.sft_lr", INF, "sft_lr", "finite"),
    config_case("model-unknown", "model.polcy", "embedded", "model.polcy", "did you mean"),
    config_case("lora-r-zero", "model.lora", {"r": 0}, "model.lora.r"),
    config_case("lora-dropout-one", "model.lora", {"dropout": 1.0}, "model.lora.dropout"),
    config_case("digits-zero", "data.task.digits", 0, "data.task.digits"),
    config_case("operations-empty", "data.task.operations", [], "operations"),
    config_case("operations-divide", "data.task.operations", ["/"], "operations"),
    config_case("train-size-zero", "data.task.train_size", 0, "train_size"),
    config_case("sample-ratio-zero", "data.sample_ratio", 0, "sample_ratio"),
    config_case("sample-ratio-big", "data.sample_ratio", 1.5, "sample_ratio"),
    config_case("data-unknown", "data.trian", "embedded", "data.trian", "did you mean"),
    config_case("eval-every-zero", "evaluation.every", 0, "evaluation.every"),
    config_case("metric-typo", "evaluation.metric", "scor", "evaluation.metric", "did you mean"),
    config_case(
        "metric-unknown", "evaluation.metric", "accuracy", "evaluation.metric", "produces no"
    ),
    config_case("metric-pass-without-k", "evaluation.metric", "pass@8", "evaluation.metric"),
    config_case("pass-at-k-zero", "evaluation.pass_at_k", 0, "pass_at_k"),
    config_case(
        "pass-at-k-samples-fewer",
        "evaluation",
        {"every": 3, "metric": "score", "pass_at_k": 4, "pass_at_k_samples": 2},
        "evaluation.pass_at_k_samples",
        "at least 4",
    ),
    config_case(
        "pass-at-k-samples-without-k",
        "evaluation.pass_at_k_samples",
        8,
        "evaluation.pass_at_k_samples",
        "set evaluation.pass_at_k",
    ),
    config_case("evaluation-unknown", "evaluation.evry", 3, "evaluation.evry", "did you mean"),
    config_case("sinks-unknown", "logging.sinks", ["nope"], "logging.sinks"),
    config_case("sinks-scalar", "logging.sinks", "console", "logging.sinks"),
    config_case("logging-unknown", "logging.sink", ["console"], "logging.sink", "did you mean"),
    config_case("defaults-labeler", "defaults.labeler", "nope", "labeler"),
    config_case("defaults-lr-inf", "defaults.training", {"lr": NAN}, "lr", "finite"),
    config_case("description-list", "description", [1, 2], "description"),
    config_case("output-dir-list", "output_dir", ["runs"], "output_dir"),
    config_case(
        "data-train-missing", "data.train", "/no/such/train.jsonl", "data.train", "does not exist"
    ),
    config_case(
        "data-eval-missing", "data.eval", "./missing-eval.jsonl", "data.eval", "does not exist"
    ),
    config_case(
        "data-train-relative", "data.train", "data/train.jsonl", "data.train", "does not exist"
    ),
    config_case("data-train-int", "data.train", 5, "data.train"),
]

ALIAS_BOMB = "\n".join(
    [
        'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]',
        *(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]"
            for i in range(7)
        ),
        "name: bomb",
    ]
)

RAW_CASES = [
    raw_case("empty-file", "", "exp.yaml", "empty file"),
    raw_case("only-comment", "# nothing here\n", "exp.yaml", "empty file"),
    raw_case("top-list", "- a\n- b\n", "exp.yaml", "expected a mapping"),
    raw_case("top-scalar", "just text\n", "exp.yaml", "expected a mapping"),
    raw_case("unclosed-bracket", "name: x\nseeds: [0, 1\n", "exp.yaml", "YAML syntax error"),
    raw_case("bad-indent", "name: x\n  seeds: [0]\n", "exp.yaml", "YAML syntax error"),
    raw_case("tab-indent", "budget:\n\tsteps: 3\n", "exp.yaml", "YAML syntax error"),
    raw_case("unclosed-quote", 'name: "x\n', "exp.yaml", "YAML syntax error"),
    raw_case("duplicate-top", yaml.safe_dump(BASE) + "name: again\n", "exp.yaml", "duplicate key"),
    raw_case(
        "duplicate-nested",
        yaml.safe_dump(BASE).replace("  steps: 3\n", "  steps: 3\n  steps: 4\n"),
        "budget.steps",
        "duplicate key",
    ),
    raw_case(
        "python-apply-tag",
        "name: !!python/object/apply:os.system ['touch {tmp}/pwned']\n",
        "exp.yaml",
        "YAML syntax error",
    ),
    raw_case("python-name-tag", "name: !!python/name:os.system\n", "exp.yaml", "YAML"),
    raw_case("binary", bytes(range(256)) * 4, "exp.yaml", "not a UTF-8"),
    raw_case("latin-1", "name: caf\xe9\n".encode("latin-1"), "exp.yaml", "not a UTF-8"),
    raw_case("utf-16", "name: x\n".encode("utf-16"), "exp.yaml"),
    raw_case("alias-bomb", ALIAS_BOMB, "exp.yaml", "expands to more than"),
    raw_case("deep-nesting", "a: " + "[" * 100 + "]" * 100 + "\n", "exp.yaml", "nested more than"),
    raw_case("very-deep-nesting", "a: " + "[" * 20000 + "]" * 20000 + "\n", "exp.yaml", "nested"),
    raw_case("too-big", "# " + "x" * (2 << 20) + "\n", "exp.yaml", "at most"),
    raw_case(
        "inf-literal", yaml.safe_dump(BASE).replace("0.0001", ".inf"), "training.lr", "finite"
    ),
    raw_case(
        "overflow-float",
        yaml.safe_dump(BASE).replace("0.0001", "1.0e+999"),
        "training.lr",
        "finite",
    ),
    raw_case(
        "inf-as-text", yaml.safe_dump(BASE).replace("0.0001", "'1e999'"), "training.lr", "finite"
    ),
    raw_case(
        "param-inf-as-text",
        yaml.safe_dump(mutate("arms.b.modifiers.0.params.factor", "1e999")),
        "modifiers.0.params.factor",
        "finite",
    ),
    raw_case(
        "nan-literal", yaml.safe_dump(BASE).replace("steps: 3", "steps: .nan"), "budget.steps"
    ),
    Case("directory", ["validate", "{tmp}/adir"], {"adir/x": "x"}, 2, ("adir", "directory")),
    Case("missing-file", ["validate", "{tmp}/missing.yaml"], {}, 2, ("missing.yaml", "not found")),
]


def cli_case(id: str, argv: list[str], *says: str, code: int = 2, **files: Any) -> Case:
    return Case(f"cli-{id}", argv, {"exp.yaml": BASE, **files}, code, says)


CLI_CASES = [
    cli_case(
        "arms-unknown",
        ["run", "{tmp}/exp.yaml", "--arms", "nope", "--out", "{out}"],
        "--arms",
        "nope",
    ),
    cli_case(
        "seeds-not-int", ["run", "{tmp}/exp.yaml", "--seeds", "x", "--out", "{out}"], "--seeds"
    ),
    cli_case("seeds-empty", ["run", "{tmp}/exp.yaml", "--seeds", ",", "--out", "{out}"], "--seeds"),
    cli_case(
        "seeds-repeated",
        ["run", "{tmp}/exp.yaml", "--seeds", "1,1", "--out", "{out}"],
        "--seeds repeats",
    ),
    cli_case(
        "seeds-negative",
        ["run", "{tmp}/exp.yaml", "--seeds", "-5", "--out", "{out}"],
        "--seeds",
        "outside 0",
    ),
    cli_case(
        "seeds-huge",
        ["run", "{tmp}/exp.yaml", "--seeds", str(2**70), "--out", "{out}"],
        "--seeds",
        "outside 0",
    ),
    cli_case("jobs-zero", ["run", "{tmp}/exp.yaml", "--jobs", "0", "--out", "{out}"], "--jobs"),
    cli_case("jobs-text", ["run", "{tmp}/exp.yaml", "--jobs", "many", "--out", "{out}"], "--jobs"),
    cli_case(
        "executor-unknown",
        ["run", "{tmp}/exp.yaml", "--executor", "slurm", "--out", "{out}"],
        "--executor",
    ),
    cli_case(
        "address-without-ray",
        ["run", "{tmp}/exp.yaml", "--address", "auto", "--out", "{out}"],
        "--address is for --executor ray",
    ),
    cli_case(
        "retries-negative",
        ["run", "{tmp}/exp.yaml", "--executor", "ray", "--retries", "-1", "--out", "{out}"],
        "--retries",
    ),
    cli_case(
        "out-below-file",
        ["run", "{tmp}/exp.yaml", "--out", "{tmp}/exp.yaml/sub"],
        "cannot create the output folder",
    ),
    cli_case("out-is-file", ["run", "{tmp}/exp.yaml", "--out", "{tmp}/exp.yaml"], "not a folder"),
    cli_case(
        "out-not-empty",
        ["run", "{tmp}/exp.yaml", "--out", "{out}"],
        "already holds",
        **{"out/keep.txt": "mine"},
    ),
    cli_case("report-missing", ["report", "{tmp}/nothing"], "run folder not found", "nothing"),
    cli_case("report-on-file", ["report", "{tmp}/exp.yaml"], "run folder not found"),
    cli_case(
        "report-empty-folder", ["report", "{out}"], "experiment.yaml", **{"out/keep.txt": "x"}
    ),
    cli_case("plugins-bad-kind", ["plugins", "--kind", "algo"], "unknown kind 'algo'"),
    cli_case("check-unknown", ["check", "algorithm", "nope"], "nope"),
    cli_case("unknown-command", ["trian"], "trian"),
    cli_case("unknown-option", ["validate", "{tmp}/exp.yaml", "--fast"], "--fast"),
    cli_case("validate-no-arg", ["validate"], "Missing argument"),
    cli_case("schema-missing-dir", ["schema", "--out", "{tmp}/no/such/s.json"], "cannot write"),
    cli_case(
        "run-missing-file", ["run", "{tmp}/nope.yaml", "--out", "{out}"], "nope.yaml", "not found"
    ),
]


# ------------------------------------------------------------------ run folders


def resolved_experiment() -> dict[str, Any]:
    from alignzoo.config.loader import load_experiment

    return load_experiment_dump(load_experiment)


def load_experiment_dump(load: Callable[..., Any]) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exp.yaml"
        path.write_text(yaml.safe_dump(BASE))
        return load(path).spec.model_dump(mode="json")


def _checkpoint(folder: Path, **override: bytes | None) -> None:
    """A checkpoint folder whose files are all valid-looking unless overridden (None: absent)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": 3, "samples": 12, "time_s": 1.0, "sampler": {}, "run_state": {}, "rng": {}}
    files: dict[str, bytes | None] = {"state.json": json.dumps(state).encode()}
    weights = folder / "actor.safetensors"
    save_file({"w": torch.zeros(64)}, str(weights))
    files["actor.safetensors"] = weights.read_bytes()
    trainer = folder / "trainer.pt"
    torch.save({"optimizer": {}, "scheduler": {}, "torch_rng": torch.get_rng_state(),
                "components": {}}, trainer)  # fmt: skip
    files["trainer.pt"] = trainer.read_bytes()
    files.update(override)
    for name, content in files.items():
        path = folder / name
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content)


def run_folder(**checkpoint: bytes | None) -> Callable[[Path], None]:
    """Setup: an experiment folder {tmp}/out with one unfinished run a/seed-0 whose only
    checkpoint has the given files replaced."""

    def setup(tmp: Path) -> None:
        out = tmp / "out"
        out.mkdir(exist_ok=True)
        (out / "experiment.yaml").write_text(yaml.safe_dump(resolved_experiment()))
        run = out / "a" / "seed-0"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
        (run / "status.json").write_text('{"status": "running", "step": 3}')
        _checkpoint(run / "checkpoints" / "step-000003", **checkpoint)
        (run / "checkpoints" / "latest").write_text("step-000003\n")

    return setup


def truncated(name: str) -> Callable[[], bytes]:
    return lambda: b""


RESUME = ["run", "{tmp}/exp.yaml", "--out", "{out}", "--resume"]


def resume_case(id: str, *says: str, **checkpoint: bytes | None) -> Case:
    return Case(id, RESUME, {"exp.yaml": BASE}, 2, ("cannot resume", *says),
                setup=run_folder(**checkpoint))  # fmt: skip


def _weights_prefix(n: int) -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.zeros(64)})[:n]


TINY_WORLD = {
    "embedded": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                 "sft_steps": 20, "sft_batch_size": 16},
}  # fmt: skip


def _symlinked_arm(tmp: Path) -> None:
    (tmp / "elsewhere").mkdir()
    (tmp / "out").mkdir()
    (tmp / "out" / "a").symlink_to(tmp / "elsewhere", target_is_directory=True)


def _run_with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["model"] = TINY_WORLD
    data["data"] = {"task": {"digits": 1, "train_size": 40, "eval_size": 8}}
    data["seeds"] = [0]
    data["arms"] = {"a": {"algorithm": "vanilla_pg"}}
    for path, value in changes.items():
        node = data
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


RUN_FOLDER_CASES = [
    Case(
        "run-symlink-escape",
        ["run", "{tmp}/exp.yaml", "--out", "{out}", "--resume"],
        {"exp.yaml": _run_with()},
        2,
        ("outside the output folder",),
        setup=_symlinked_arm,
    ),
    Case(
        "run-cuda-on-cpu",
        ["run", "{tmp}/exp.yaml", "--out", "{out}"],
        {
            "exp.yaml": _run_with(
                **{"defaults.devices": {"name": "single", "params": {"device": "cuda"}}}
            )
        },
        1,
        ("a/seed-0", "does not exist on this machine"),
    ),
    Case(
        "run-float16-on-cpu",
        ["run", "{tmp}/exp.yaml", "--out", "{out}", "--set", "model.dtype=float16"],
        {"exp.yaml": _run_with()},
        2,
        ("--set model.dtype=float16", "model.dtype", "placed on cpu", "bfloat16 ", "float32"),
    ),
    resume_case(
        "state-binary", "state.json", "not readable JSON", **{"state.json": b"\x00\xff" * 50}
    ),
    resume_case("state-truncated", "state.json", **{"state.json": b'{"step": 3, "sam'}),
    resume_case("state-not-object", "state.json", "lacks", **{"state.json": b"[1, 2]"}),
    resume_case("state-missing-keys", "state.json", "lacks", **{"state.json": b'{"step": 3}'}),
    resume_case(
        "state-bad-step",
        "state.json",
        "step must be",
        **{
            "state.json": json.dumps(
                {
                    "step": "three",
                    "samples": 0,
                    "time_s": 0,
                    "sampler": {},
                    "run_state": {},
                    "rng": {},
                }
            ).encode()
        },
    ),
    resume_case("state-absent", "state.json", "missing", **{"state.json": None}),
    resume_case("weights-empty", "actor.safetensors", **{"actor.safetensors": b""}),
    resume_case("weights-header-only", "actor.safetensors", **{"actor.safetensors": b"\xff" * 8}),
    resume_case("weights-truncated", "actor.safetensors", **{"actor.safetensors": b"TRUNC"}),
    resume_case("weights-absent", "actor.safetensors", "missing", **{"actor.safetensors": None}),
    resume_case("trainer-garbage", "trainer.pt", **{"trainer.pt": b"not a torch file"}),
    resume_case("trainer-absent", "trainer.pt", "missing", **{"trainer.pt": None}),
    resume_case("trainer-pickle", "trainer.pt", **{"trainer.pt": b"\x80\x04\x95"}),
    Case(
        "experiment-yaml-binary",
        RESUME,
        {"exp.yaml": BASE, "out/experiment.yaml": b"\x00\x01\x02\xff"},
        2,
        ("experiment.yaml", "cannot read the experiment being resumed"),
    ),
    Case(
        "experiment-differs",
        RESUME,
        {"exp.yaml": mutate("training.lr", 3e-4), "out/experiment.yaml": BASE},
        2,
        ("cannot resume", "training"),
    ),
    Case(
        "report-binary-metrics",
        ["report", "{out}"],
        {
            "out/experiment.yaml": BASE,
            "out/a/seed-0/metrics.jsonl": b"\x00\xff\xfe\n" * 20,
            "out/a/seed-0/status.json": '{"status": "finished", "step": 3}',
        },
        0,
        (),
        ("metrics.jsonl", "not JSON objects"),
    ),
    Case(
        "report-binary-status",
        ["report", "{out}"],
        {
            "out/experiment.yaml": BASE,
            "out/a/seed-0/status.json": b"\x00\xff" * 30,
            "out/a/seed-0/metrics.jsonl": '{"step": 1}\n',
        },
        0,
        (),
        ("status.json", "not a JSON status file"),
    ),
    Case(
        "report-binary-eval",
        ["report", "{out}"],
        {
            "out/experiment.yaml": BASE,
            "out/a/seed-0/eval.jsonl": b"\xff\n\xfe\n{}\n",
            "out/a/seed-0/status.json": '{"status": "finished", "step": 3}',
        },
        0,
        (),
        ("eval.jsonl",),
    ),
    Case(
        "report-experiment-yaml-invalid",
        ["report", "{out}"],
        {"out/experiment.yaml": "name: [unclosed\n"},
        2,
        ("experiment.yaml",),
    ),
    Case(
        "report-experiment-yaml-binary",
        ["report", "{out}"],
        {"out/experiment.yaml": b"\x00\xff\x00"},
        2,
        ("experiment.yaml",),
    ),
]


# ------------------------------------------------------------------ plugins

GOOD_PLUGINS = ("labeler.keyword", "backend.canned", "device_mapper.all_cpu")


def plugin_case(id: str, source: str, *says: str, target: str = "badplug:Algo") -> Case:
    data = mutate("arms.a.algorithm", "bad")
    data["arms"]["b"] = {"algorithm": "vanilla_pg"}
    return Case(id, ["validate", "{tmp}/exp.yaml"], {"exp.yaml": data}, 2,
                ("arms.a.algorithm", *says), plugins={f"algorithm.bad={target}": source})  # fmt: skip


PLUGIN_HEADER = "from alignzoo import Algorithm, Labeler, AlgorithmRequirements, hookimpl\n"
PLUGIN_CASES = [
    plugin_case(
        "import-raises", "raise ImportError('needs libfoo')\n", "badplug:Algo", "needs libfoo"
    ),
    plugin_case("import-sys-exit-0", "import sys\nsys.exit(0)\n", "badplug:Algo", "sys.exit"),
    plugin_case("import-sys-exit-3", "import sys\nsys.exit(3)\n", "badplug:Algo", "sys.exit"),
    plugin_case("import-syntax-error", "def (:\n", "badplug:Algo", "SyntaxError"),
    plugin_case("missing-attribute", PLUGIN_HEADER, "badplug:Algo", "AttributeError"),
    plugin_case("not-a-component", "def Algo():\n    pass\n", "not an alignzoo Component"),
    plugin_case(
        "wrong-kind",
        PLUGIN_HEADER + "class Algo(Labeler):\n    pass\n",
        "is a labeler",
    ),
    plugin_case(
        "params-not-pydantic",
        PLUGIN_HEADER + "class Algo(Algorithm):\n    Params = dict\n",
        "Params must be a pydantic",
    ),
    plugin_case(
        "constructor-raises",
        PLUGIN_HEADER
        + "class Algo(Algorithm):\n    def __init__(self, params=None):\n"
        + "        raise RuntimeError('no GPU here')\n",
        "constructing",
        "no GPU here",
    ),
    plugin_case(
        "constructor-sys-exit",
        PLUGIN_HEADER
        + "import sys\nclass Algo(Algorithm):\n    def __init__(self, params=None):\n"
        + "        sys.exit(1)\n",
        "constructing",
        "SystemExit",
    ),
    plugin_case(
        "hook-misspelled",
        PLUGIN_HEADER + "class Algo(Algorithm):\n    @hookimpl\n    def compute_los(self, batch):\n"
        "        return None\n",
        "compute_los",
    ),
    plugin_case(
        "hook-wrong-args",
        PLUGIN_HEADER
        + "class Algo(Algorithm):\n    @hookimpl\n    def compute_loss(self, batch, output):\n"
        + "        return None\n",
        "compute_loss",
    ),
    plugin_case("bad-target", PLUGIN_HEADER, "no_such_module", target="no_such_module:Algo"),
    Case(
        "run-loss-is-a-float",
        ["run", "{tmp}/exp.yaml", "--out", "{out}"],
        {"exp.yaml": _run_with(**{"arms.a.algorithm": "bad"})},
        1,
        ("a/seed-0", "compute_loss", "LossOutput"),
        plugins={
            "algorithm.bad=floatloss:Algo": PLUGIN_HEADER
            + "class Algo(Algorithm):\n"
            + "    requirements = AlgorithmRequirements(reference=False, data='online')\n"
            + "    @hookimpl\n    def compute_advantages(self, batch):\n"
            + "        batch.advantages = batch.response_mask.float()\n        return batch\n"
            + "    @hookimpl\n    def compute_loss(self, batch, outputs, context):\n"
            + "        return 1.0\n"
        },
    ),
]

ALL_CASES = CONFIG_CASES + RAW_CASES + CLI_CASES + RUN_FOLDER_CASES + PLUGIN_CASES


def test_the_corpus_has_150_distinct_cases() -> None:
    ids = [case.id for case in ALL_CASES]
    assert len(ids) == len(set(ids)), "case ids must be distinct"
    assert len(ids) >= 150, len(ids)


# ------------------------------------------------------------------ the runner


def _write(path: Path, content: bytes | str | dict[str, Any], tmp: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, dict):
        content = yaml.safe_dump(content, sort_keys=False)
    if isinstance(content, str):
        path.write_text(content.replace("{tmp}", str(tmp)), encoding="utf-8")
    else:
        path.write_bytes(content)


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            data = path.read_bytes()
            found[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return found


def _registry(tmp: Path, plugins: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    if not plugins:
        return
    monkeypatch.syspath_prepend(str(tmp / "pkgs"))
    eps = []
    for spec, source in plugins.items():
        name, target = spec.split("=", 1)
        module = target.split(":", 1)[0]
        _write(tmp / "pkgs" / f"{module}.py", source, tmp)
        sys.modules.pop(module, None)
        eps.append(entry_point(name, target))
    registry = Registry(entry_points=eps)
    installed = get_registry()
    for ep in ("algorithm.vanilla_pg", *GOOD_PLUGINS):
        kind, name = ep.split(".")
        registry.register(installed.get(kind, name), name)
    monkeypatch.setattr("alignzoo.config.loader.get_registry", lambda: registry)


@pytest.fixture(scope="module")
def world_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the few cases that run build their tiny embedded world (outside each case's tmp)."""
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_bad_input(case: Case, tmp_path: Path, capsys, monkeypatch, world_cache) -> None:
    monkeypatch.setenv("ALIGNZOO_CACHE", str(world_cache))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.chdir(tmp_path)  # a run without --out would write under ./runs: inside tmp
    out = tmp_path / "out"
    for rel, content in case.files.items():
        _write(tmp_path / rel, content, tmp_path)
    if case.setup is not None:
        case.setup(tmp_path)
    _registry(tmp_path, case.plugins, monkeypatch)
    before = _snapshot(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{out}", str(out)) for a in case.argv]

    code = cli.main(argv)  # an exception escaping here is a traceback the user would see

    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == case.code, f"exit {code}, expected {case.code}:\n{text}"
    assert "Traceback" not in text, text
    flat = " ".join(text.split())  # rich may wrap long messages
    for fragment in case.says:
        fragment = fragment.replace("{tmp}", str(tmp_path))
        assert fragment in text or fragment in flat, f"{fragment!r} not in:\n{text}"
    if case.report_says:
        report = (out / "report.md").read_text(encoding="utf-8")
        for fragment in case.report_says:
            assert fragment in report, f"{fragment!r} not in report.md:\n{report}"

    after = _snapshot(tmp_path)
    inside = "out" + "/"
    for rel, (size, digest) in before.items():
        assert rel in after, f"{rel} was deleted"
        if rel.startswith(inside):
            assert after[rel][0] >= size, f"{rel} lost data ({size} -> {after[rel][0]} bytes)"
            if code == 2:  # a refused command leaves the output folder as it was
                assert after[rel] == (size, digest), f"{rel} changed though it was refused"
        else:
            assert after[rel] == (size, digest), f"{rel} outside the output folder changed"
    for rel in set(after) - set(before):
        assert rel.startswith(inside), f"{rel} was written outside the output folder"
        assert code != 2, f"{rel} was written although the command was refused"
