"""alignzoo against TRL on the same work: GRPO, RLOO, DPO and KTO, side by side.

Both frameworks train the same model folder on the same data files with the same settings
(fp32, no reference for GRPO/RLOO (beta 0), one update per generation, AdamW, lr 1e-5, grad-norm
clip 1.0, 8 prompts x 8 samples of at most 6 new tokens (``--max-new-tokens``) at temperature 1;
DPO and KTO offline, 32 pairs / 32 rows a step, beta 0.1, a reference forward every step). Every run is a fresh
process, and the frameworks alternate (alignzoo, TRL, alignzoo, TRL, ...) so that drift of the
machine hits both. Reported per work item: median seconds per step (intervals between step ends
from step 3 on), samples per second, peak RSS, and TRL / alignzoo; on the ~25M model also the
share of the machine's matmul limit (a plain torch matmul in the run's dtype, measured in the
same run) that the step's useful arithmetic reaches.

    .venv/bin/python benchmarks/vs_trl.py [--steps 25] [--repeats 2]
        [--models embedded,25m] [--algorithms grpo,rloo,dpo,kto] [--json results.json]
        [--dtype float32|bfloat16] [--gradient-checkpointing] [--frameworks alignzoo,trl]
        [--max-new-tokens 6] [--phases] [--no-reuse-cpu-memory] [--no-decode-trace]
        [--no-huge-pages] [--trl-huge-pages]

``--dtype bfloat16`` runs both under bf16 autocast (alignzoo's ``model.dtype``, TRL's ``bf16``):
fast only on a CPU with AVX512-BF16 or AMX. Gradient checkpointing is set equal in both: off
unless ``--gradient-checkpointing`` (alignzoo's ``model.gradient_checkpointing``, TRL's
``gradient_checkpointing``, which TRL's configs turn on by default: left to its default, TRL
recomputes every layer's activations in the backward pass, slower and with less memory).

Needs the bench extra (TRL 1.16.0). Takes about 20 minutes on 2 CPU cores with the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ONLINE = ("grpo", "rloo")
NEW_TOKENS_ENV = "VS_TRL_MAX_NEW_TOKENS"  # --max-new-tokens, passed on to the worker processes
REUSE_ENV = "VS_TRL_REUSE_CPU_MEMORY"  # --no-reuse-cpu-memory, passed on to the worker processes
TRACE_ENV = "VS_TRL_DECODE_TRACE"  # --no-decode-trace, likewise
HUGE_PAGES_ENV = "ALIGNZOO_HUGE_PAGES"  # --no-huge-pages: alignzoo.engine.malloc reads it
TRL_HUGE_PAGES_ENV = "VS_TRL_TRL_HUGE_PAGES"  # --trl-huge-pages
PROMPTS, SAMPLES, PAIRS = 8, 8, 32
NEW_TOKENS = int(os.environ.get(NEW_TOKENS_ENV, "6"))
LR = 1e-5
MODEL_25M = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1408}


# --------------------------------------------------------------------------- setup (parent)


def prepare_models(root: Path, names: list[str]) -> dict[str, Path]:
    """The model folders: the embedded warm start, and a ~25M-parameter Qwen2 (random init,
    the same tokenizer) saved with save_pretrained."""
    from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig, TaskConfig
    from alignzoo.world.model import build_model, save_policy
    from alignzoo.world.tokenizer import build_tokenizer
    from alignzoo.world.warmstart import ensure_policy

    folders: dict[str, Path] = {}
    if "embedded" in names:
        folders["embedded"] = ensure_policy(ModelConfig(), TaskConfig(), log=lambda _: None)
    if "25m" in names:
        tokenizer = build_tokenizer()
        model = build_model(EmbeddedModelConfig(**MODEL_25M, seed=0), tokenizer)
        # Room for 512 new tokens after a prompt (RoPE's default frequencies do not depend on it).
        model.config.max_position_embeddings = 1024
        folders["25m"] = save_policy(model, tokenizer, root / "model-25m")
    return folders


def prepare_data(root: Path) -> dict[str, Path]:
    """The embedded task's train rows as jsonl files, one per kind of data, read by both."""
    from alignzoo.config.schema import DataConfig
    from alignzoo.engine.datasets import load_split

    files = {}
    for kind in ("online", "preference", "unpaired"):
        path = root / f"{kind}.jsonl"
        rows = load_split(DataConfig(), "train", kind)
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        files[kind] = path
    return files


def matmul_limit_gflops(size: int = 2048, repeats: int = 20, dtype: str = "float32") -> float:
    """GFLOP/s of a plain square torch matmul in ``dtype`` on this machine's default threads."""
    import torch

    kind = getattr(torch, dtype)
    a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def parameter_count(folder: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())


# --------------------------------------------------------------------------- phases (child)

PHASES_ENV = "VS_TRL_PHASES"  # --phases, passed on to the worker processes


def current_rss_mb() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PhaseMeter:
    """Where a step's time and memory go: each call of a wrapped function (a phase) recorded
    with its start, its duration and the highest resident memory seen while it ran (a thread
    reads /proc/self/statm every 5 ms). A call inside another call of the same phase counts
    once (the outer one)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._open: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss = current_rss_mb()
            with self._lock:
                for call in self._open.values():
                    call["peak_rss_mb"] = max(call["peak_rss_mb"], rss)
            time.sleep(0.005)

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        with self._lock:
            outer = name in self._open
            if not outer:
                rss = current_rss_mb()
                self._open[name] = {
                    "phase": name,
                    "start": time.perf_counter(),
                    "start_rss_mb": rss,
                    "peak_rss_mb": rss,
                }
        try:
            yield
        finally:
            if not outer:
                with self._lock:
                    call = self._open.pop(name)
                    call["seconds"] = time.perf_counter() - call["start"]
                    call["peak_rss_mb"] = max(call["peak_rss_mb"], current_rss_mb())
                    self.calls.append(call)

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Record every call of ``owner.attribute`` as phase ``name``."""
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, recorded)

    def install(self, framework: str) -> None:
        """The phases of an online step: generation, the log-prob forward with gradients, the
        backward pass and the optimizer step, at the same points of both frameworks."""
        import torch
        import torch.optim.optimizer as optimizer

        self.wrap(torch.Tensor, "backward", "backward")
        opened: list[Any] = []

        def before(*_: Any) -> None:
            opened.append(self.phase("optimizer step"))
            opened[-1].__enter__()

        optimizer.register_optimizer_step_pre_hook(before)
        optimizer.register_optimizer_step_post_hook(
            lambda *_: opened.pop().__exit__(None, None, None)
        )
        if framework == "alignzoo":
            from alignzoo.engine import loop, update
            from alignzoo.plugins.backends.hf import HFBackend

            self.wrap(loop, "train_step", "step")  # the step's window (not evaluation's)
            self.wrap(HFBackend, "generate", "generation")
            self.wrap(update, "policy_outputs", "log-prob forward")
        else:
            import trl

            self.wrap(trl.GRPOTrainer, "_generate", "generation")
            self.wrap(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", "log-prob forward")

    def summary(self, windows: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
        """Per phase: the median seconds it took per step, and the highest memory seen in it,
        over the timed steps (``windows``: each step's start and end, from step 3 on as the
        step times; alignzoo's are its ``train_step`` calls, TRL's between its step ends)."""
        steps = windows[2:]
        out: dict[str, dict[str, float]] = {}
        for name in dict.fromkeys(c["phase"] for c in self.calls if c["phase"] != "step"):
            per_step, peaks = [], []
            for begin, end in steps:
                inside = [c for c in self.calls if c["phase"] == name and begin <= c["start"] < end]
                per_step.append(sum(c["seconds"] for c in inside))
                peaks += [c["peak_rss_mb"] for c in inside]
            if peaks:
                out[name] = {"seconds": statistics.median(per_step), "peak_rss_mb": max(peaks)}
        return out


# --------------------------------------------------------------------------- workers (child)


def reward_correct(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """TRL's reward-function signature over the embedded task: 1 for the right answer."""
    from alignzoo.world.task import is_correct

    return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def run_alignzoo(
    algorithm: str,
    model: Path,
    data: dict[str, Path],
    steps: int,
    out: Path,
    dtype: str,
    checkpointing: bool,
):
    import yaml

    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one

    online = algorithm in ONLINE
    params = {
        "grpo": {"beta": 0.0},
        "rloo": {"kl_coef": 0.0},
        "dpo": {"beta": 0.1, "loss_type": "sigmoid"},
        "kto": {"beta": 0.1},
    }[algorithm]
    arm: dict[str, Any] = {"algorithm": {"name": algorithm, "params": params}}
    if not online:
        arm["online"] = False
    kind = "online" if online else {"dpo": "preference", "kto": "unpaired"}[algorithm]
    spec = {
        "name": "vs_trl",
        "seeds": [0],
        "budget": {"steps": steps},
        "model": {
            "policy": str(model),
            "dtype": dtype,
            "gradient_checkpointing": checkpointing,
        },
        "data": {"train": str(data[kind]), "eval": str(data["online"])},
        "training": {
            "lr": LR,
            "prompts_per_step": PROMPTS if online else PAIRS,
            "samples_per_prompt": SAMPLES if online else 1,
            "micro_batch_size": 128,
            "checkpoint_every": steps,
            "sampling": {"temperature": 1.0, "max_new_tokens": NEW_TOKENS},
        },
        "evaluation": {"every": 10 * steps, "num_prompts": 1},
        "logging": {"sinks": ["jsonl"]},
        "arms": {"a": arm},
    }
    if os.environ.get(REUSE_ENV, "1") == "0":  # only then: an older alignzoo has no such field
        spec["training"]["reuse_cpu_memory"] = False
    if os.environ.get(TRACE_ENV, "1") == "0":
        spec["training"]["decode_trace"] = False
    path = out / "experiment.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    summary = run_one(load_experiment(path), "a", 0, out / "run")
    if summary.status != "finished":
        raise SystemExit(f"alignzoo {algorithm} failed: {summary.error}")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    lengths = [r.get("response_length/mean", 0.0) for r in rows]
    return [r["time_s"] for r in rows], statistics.mean(lengths)


TRL_TRAIN_START = [0.0]  # perf_counter() when trainer.train() began (its step ends count from it)


def run_trl(
    algorithm: str,
    model_dir: Path,
    data: dict[str, Path],
    steps: int,
    out: Path,
    dtype: str,
    checkpointing: bool,
):
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ends: list[float] = []

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    common = dict(
        output_dir=str(out / "trl"),
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_accumulation_steps=1,
        logging_steps=10 * steps,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=dtype == "bfloat16",
        gradient_checkpointing=checkpointing,  # TRL's configs default to True
        fp16=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    online = algorithm in ONLINE
    kind = "online" if online else {"dpo": "preference", "kto": "unpaired"}[algorithm]
    dataset = datasets.load_dataset("json", data_files=str(data[kind]), split="train")
    sampling = dict(
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
    )
    if online:  # GRPO (TRL's loss_type "grpo" is alignzoo's default aggregation) or RLOO
        config_cls, trainer_cls = {
            "grpo": (trl.GRPOConfig, trl.GRPOTrainer),
            "rloo": (trl.RLOOConfig, trl.RLOOTrainer),
        }[algorithm]
        extra: dict[str, Any] = {"loss_type": "grpo"} if algorithm == "grpo" else {}
        trainer: Any = trainer_cls(
            model=model,
            reward_funcs=[reward_correct],
            args=config_cls(**common, **sampling, **extra),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    else:  # DPO (sigmoid) or KTO, offline, PAIRS rows a step
        config_cls, trainer_cls = {
            "dpo": (trl.DPOConfig, trl.DPOTrainer),
            "kto": (trl.KTOConfig, trl.KTOTrainer),
        }[algorithm]
        extra = {"loss_type": ["sigmoid"]} if algorithm == "dpo" else {}
        args = config_cls(**common, per_device_train_batch_size=PAIRS, beta=0.1, **extra)
        trainer = trainer_cls(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer
        )
    trainer.add_callback(StepEnds())
    start = TRL_TRAIN_START[0] = time.perf_counter()
    trainer.train()
    return [t - start for t in ends], float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the
    parent that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(argv: list[str]) -> None:
    framework, algorithm, model, data_json, steps, out, dtype, checkpointing = argv
    if framework == "alignzoo" and os.environ.get(REUSE_ENV, "1") != "0":
        # What `alignzoo run` does for a run that keeps its freed memory: restart with glibc's
        # huge-page tunable where that helps (ALIGNZOO_HUGE_PAGES=0, --no-huge-pages, keeps it
        # from doing so).
        from alignzoo.engine.malloc import restart_with_huge_pages

        restart_with_huge_pages()
    data = {k: Path(v) for k, v in json.loads(data_json).items()}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = run_alignzoo if framework == "alignzoo" else run_trl
    meter = None
    if os.environ.get(PHASES_ENV) == "1" and algorithm in ONLINE:
        meter = PhaseMeter()
        meter.install(framework)
    ends, response_length = runner(
        algorithm, Path(model), data, int(steps), out_dir, dtype, checkpointing == "on"
    )
    peak = peak_rss_mb()
    result: dict[str, Any] = {
        "ends": ends,
        "peak_rss_mb": peak,
        "response_length": response_length,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }
    if meter is not None:
        if framework == "alignzoo":
            windows = [
                (c["start"], c["start"] + c["seconds"]) for c in meter.calls if c["phase"] == "step"
            ]
        else:  # between TRL's step ends (measured from the start of train())
            begin = TRL_TRAIN_START[0]
            windows = list(itertools.pairwise([begin, *(begin + t for t in ends)]))
        result["phases"] = meter.summary(windows)
    (out_dir / "result.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def step_seconds(ends: list[float]) -> float:
    """Median interval between step ends from step 3 on (the first steps pay one-off costs)."""
    intervals = [b - a for a, b in itertools.pairwise(ends)][1:]
    if not intervals:
        raise SystemExit("too few steps to time: use --steps 5 or more")
    return statistics.median(intervals)


def measure(
    framework: str,
    algorithm: str,
    model: Path,
    data: dict[str, Path],
    steps: int,
    tmp: Path,
    dtype: str = "float32",
    checkpointing: bool = False,
) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{framework}-{algorithm}-"))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    env["ALIGNZOO_CACHE"] = os.environ.get("ALIGNZOO_CACHE", str(tmp / "cache"))
    if framework == "trl" and env.get(TRL_HUGE_PAGES_ENV) == "1":
        from alignzoo.engine.malloc import huge_pages_environment

        env = huge_pages_environment({**env, HUGE_PAGES_ENV: "1"}) or env
    data_json = json.dumps({k: str(v) for k, v in data.items()})
    cmd = [sys.executable, str(HERE), "_worker", framework, algorithm, str(model), data_json]
    proc = subprocess.run(
        [*cmd, str(steps), str(out), dtype, "on" if checkpointing else "off"],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{framework} {algorithm} failed:\n{proc.stderr[-4000:]}")
    result = json.loads((out / "result.json").read_text())
    result["seconds"] = step_seconds(result["ends"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="embedded,25m")
    parser.add_argument("--algorithms", default="grpo,rloo,dpo,kto")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass, in both frameworks (default: off in both)",
    )
    parser.add_argument("--frameworks", default="alignzoo,trl")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=6,
        help="new tokens per sample in GRPO and RLOO (default 6: update-bound; 128 or 512: "
        "decode-bound, where generation dominates); the 25m model is random, so none stops early",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also measure where a GRPO/RLOO step's time and memory go in both frameworks "
        "(generation, the log-prob forward, backward, optimizer step: median seconds per step "
        "and the highest memory seen in each)",
    )
    parser.add_argument(
        "--no-reuse-cpu-memory",
        action="store_true",
        help="alignzoo with training.reuse_cpu_memory false (malloc as it is, as TRL runs): "
        "large activations page-faulted in again at every step, and freed memory handed back",
    )
    parser.add_argument(
        "--no-decode-trace",
        action="store_true",
        help="alignzoo with training.decode_trace false: the update runs its forward pass "
        "instead of a backward pass against the decode loop's recorded activations",
    )
    parser.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="alignzoo without the restart with glibc's huge-page tunable that `alignzoo run` "
        "makes (ALIGNZOO_HUGE_PAGES=0): 4 KB pages, as TRL runs",
    )
    parser.add_argument(
        "--trl-huge-pages",
        action="store_true",
        help="start TRL's processes with the same huge-page tunable as alignzoo's (where it "
        "helps: glibc 2.35 or later, the kernel's mode madvise): the frameworks on equal pages",
    )
    args = parser.parse_args()
    if args.no_huge_pages:  # else as the environment says (ALIGNZOO_HUGE_PAGES=0: off)
        os.environ[HUGE_PAGES_ENV] = "0"
    os.environ[TRL_HUGE_PAGES_ENV] = "1" if args.trl_huge_pages else "0"
    os.environ[REUSE_ENV] = "0" if args.no_reuse_cpu_memory else "1"
    os.environ[TRACE_ENV] = "0" if args.no_decode_trace else "1"
    os.environ[NEW_TOKENS_ENV] = str(args.max_new_tokens)  # the workers read it
    os.environ[PHASES_ENV] = "1" if args.phases else "0"
    models, algorithms = args.models.split(","), args.algorithms.split(",")
    import torch

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ.setdefault("ALIGNZOO_CACHE", str(tmp / "cache"))
        folders = prepare_models(tmp, models)
        data = prepare_data(tmp)
        limit = matmul_limit_gflops(dtype=args.dtype)
        from alignzoo import provenance
        from alignzoo.engine.models import cpu_has_native_bf16

        machine = {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "native_bf16": cpu_has_native_bf16(),
            "torch": torch.__version__,
        }
        print(
            f"{machine['cpu']}, torch {torch.__version__}, {machine['threads']} threads, native "
            f"bf16: {'yes' if machine['native_bf16'] else 'no'}; {args.dtype} matmul limit "
            f"{limit:.0f} GFLOP/s (2048^2, median of 20)"
        )
        results = []
        for name in models:
            params = parameter_count(folders[name])
            for algorithm in algorithms:
                before = matmul_limit_gflops(dtype=args.dtype)
                runs: dict[str, list[dict]] = {f: [] for f in args.frameworks.split(",")}
                for _ in range(args.repeats):
                    for framework in runs:
                        runs[framework].append(
                            measure(
                                framework,
                                algorithm,
                                folders[name],
                                data,
                                args.steps,
                                tmp,
                                args.dtype,
                                args.gradient_checkpointing,
                            )
                        )
                # The limit this work item's share is taken of: the higher of the measurements
                # just before and just after it (a slow moment of the machine makes it lower).
                item_limit = max(before, matmul_limit_gflops(dtype=args.dtype))
                row = summarise(name, params, algorithm, runs, item_limit, folders[name], data)
                row["limit_gflops"] = item_limit
                results.append(row)
                print_row(row)
        limit_after = matmul_limit_gflops(dtype=args.dtype)
        print(f"{args.dtype} matmul limit at the end: {limit_after:.0f} GFLOP/s")
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    {
                        "machine": machine,
                        # Where the numbers came from (commit, lock, CPU and its kernels,
                        # threads, versions): what docs' figures are checked against.
                        "provenance": {"settings": [provenance.collect()]},
                        "settings": {
                            "dtype": args.dtype,
                            "gradient_checkpointing": args.gradient_checkpointing,
                            "steps": args.steps,
                            "repeats": args.repeats,
                            "max_new_tokens": args.max_new_tokens,
                            "phases": args.phases,
                            "reuse_cpu_memory": not args.no_reuse_cpu_memory,
                            "decode_trace": not args.no_decode_trace,
                            # whether alignzoo's workers were allowed to restart on huge
                            # pages; each row's glibc_tunables says what its processes had
                            "huge_pages": os.environ.get(HUGE_PAGES_ENV, "1") != "0",
                            "trl_huge_pages": args.trl_huge_pages,
                        },
                        "limit_gflops": [limit, limit_after],
                        "rows": results,
                    },
                    indent=1,
                )
            )


def useful_gflop(
    params: int, algorithm: str, folder: Path, data: dict[str, Path], response: float
) -> float:
    """The arithmetic a step cannot avoid, 2 FLOP per parameter per token per forward pass
    (backward twice that): online, one forward over prompt + response in generation and a
    forward and backward in the update (8 N T); offline, the policy's forward and backward
    and the reference's forward over both sequences (8 N T as well)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    kind = "online" if algorithm in ONLINE else {"dpo": "preference", "kto": "unpaired"}[algorithm]
    rows = [json.loads(line) for line in data[kind].open()][:256]
    prompt = statistics.mean(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    if algorithm in ONLINE:
        tokens = PROMPTS * SAMPLES * (prompt + response)
    else:
        key = "chosen" if algorithm == "dpo" else "completion"
        completion = statistics.mean(len(tokenizer(r[key])["input_ids"]) + 1 for r in rows)
        sequences = 2 * PAIRS if algorithm == "dpo" else PAIRS
        tokens = sequences * (prompt + completion)
    return 8 * params * tokens / 1e9


def summarise(name, params, algorithm, runs, limit, folder, data) -> dict[str, Any]:
    samples = PROMPTS * SAMPLES if algorithm in ONLINE else PAIRS
    row: dict[str, Any] = {"model": name, "params": params, "algorithm": algorithm}
    for framework, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        row[framework] = {
            "s_per_step": seconds,
            "samples_per_s": samples / seconds,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "each_run_s": [r["seconds"] for r in results],
            # GLIBC_TUNABLES as each run's process had it (huge pages: glibc.malloc.hugetlb=1)
            "glibc_tunables": sorted({str(r.get("glibc_tunables")) for r in results}),
        }
        if all("phases" in r for r in results):  # per phase: the medians over the runs
            names = dict.fromkeys(n for r in results for n in r["phases"])
            row[framework]["phases"] = {
                n: {
                    "seconds": statistics.median(
                        r["phases"][n]["seconds"] for r in results if n in r["phases"]
                    ),
                    "peak_rss_mb": max(
                        r["phases"][n]["peak_rss_mb"] for r in results if n in r["phases"]
                    ),
                }
                for n in names
            }
    if "trl" in runs and "alignzoo" in runs:
        row["trl_over_alignzoo"] = row["trl"]["s_per_step"] / row["alignzoo"]["s_per_step"]
    if name != "embedded" and "alignzoo" in runs:
        response = statistics.mean(r["response_length"] for r in runs["alignzoo"])
        gflop = useful_gflop(params, algorithm, folder, data, response)
        row["useful_gflop"] = gflop
        for framework in runs:
            row[framework]["share_of_limit"] = gflop / row[framework]["s_per_step"] / limit
    return row


def print_row(row: dict[str, Any]) -> None:
    cells = [f"{row['model']:9s} {row['algorithm']:5s}"]
    for framework in ("alignzoo", "trl"):
        if framework in row:
            r = row[framework]
            share = f", {r['share_of_limit']:.0%} of the limit" if "share_of_limit" in r else ""
            cells.append(
                f"{framework} {r['s_per_step'] * 1000:7.1f} ms ({r['samples_per_s']:6.0f}/s, "
                f"{r['peak_rss_mb']:5.0f} MB{share})"
            )
    if "trl_over_alignzoo" in row:
        cells.append(f"TRL/alignzoo {row['trl_over_alignzoo']:.2f}")
    if "limit_gflops" in row and "useful_gflop" in row:
        cells.append(f"limit {row['limit_gflops']:.0f} GFLOP/s")
    print("  ".join(cells), flush=True)
    for framework in ("alignzoo", "trl"):
        for name, phase in row.get(framework, {}).get("phases", {}).items():
            print(
                f"    {framework:8s} {name:17s} {phase['seconds']:7.2f} s/step, "
                f"peak {phase['peak_rss_mb']:5.0f} MB",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2:])
    else:
        main()
