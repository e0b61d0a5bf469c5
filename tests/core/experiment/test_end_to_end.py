"""The runner with the real engine: an A/A pair is "no detectable difference"; lr 0 is worse.

Floating-point results differ in the last digits between CPUs and thread counts, and a short
training run amplifies that, so nothing here relies on a run reaching a particular value.
The verdicts follow from premises that hold by construction or by a wide margin, and each
premise is checked on its own, failing with a message that names it:

* The policy starts weak on the evaluated prompts. They are the task's held-out split, which
  the supervised warm start never sees, and the warm start stops early (150 steps): it answers
  14-34% of its own training prompts and 5-15% of the held-out ones, for every init seed
  tried (0 to 7). (A 500-step warm start, as this test once had, already answers every prompt
  on some CPUs, and then lr 0 cannot come out worse.)
* GRPO trains on those 20 prompts (each step samples all of them, 8 responses each, lr 3e-3)
  and lifts greedy exact match by 6 to 12 of the 20 prompts within 60 steps on every seed
  (observed 0.05-0.15 -> 0.35-0.65 over 48 runs: eight warm-start inits x six seeds), far
  more than the one prompt a rounding difference might flip.
* lr 0 changes no weight, so an lr0 run's final greedy evaluation equals its start; every run
  starts from the same cached warm start, so the start is one number for all arms and seeds.
* Seven seeds, compared seed by seed: the report's sign-flip test decides (two arms are
  compared with the baseline, so Holm's strictest step is 0.05 / 2, and 7 pairs can reach
  p = 2/128 below it; with fewer seeds the paired t-test decides, and it depends on the spread
  of the differences). When every trained seed ends above the common start, every per-seed
  difference lr0 - grpo is negative and p is 2/128, whatever the sizes of the differences:
  "worse".
* The same seed and config give the same run, so grpo_again reproduces grpo seed by seed; every
  difference is 0 and p is 1: "no detectable difference".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import TaskConfig
from alignzoo.experiment.runner import run_experiment
from alignzoo.metrics import EVAL_EXACT_MATCH
from alignzoo.report import stats
from alignzoo.runfolder.runfiles import read_run
from alignzoo.world.task import make_examples

SEEDS = [0, 1, 2, 3, 4, 5, 6]
STEPS = 60
# The warm start's own task. Its eval split (20 prompts the warm start never trains on) is what
# GRPO trains and is evaluated on.
TASK = {"digits": 1, "operations": ["+"], "train_size": 80, "eval_size": 20}
# At most this fraction of the prompts right at step 0 (observed 0.05 to 0.15): room to improve.
MAX_START = 0.5
SPEC = {
    "name": "aa",
    "seeds": SEEDS,
    "baseline": "grpo",
    "budget": {"steps": STEPS},
    "model": {
        "embedded": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "intermediate_size": 64,
            "sft_steps": 150,
            "sft_batch_size": 64,
        }
    },
    "data": {"task": TASK},
    "training": {
        "lr": 3.0e-3,
        "warmup_steps": 3,
        "prompts_per_step": 20,
        "samples_per_prompt": 8,
        "micro_batch_size": 64,
        "checkpoint_every": STEPS,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
    },
    "evaluation": {"every": 30},
    "logging": {"sinks": ["jsonl"]},
    "arms": {
        "grpo": {"algorithm": "grpo"},
        "grpo_again": {"algorithm": "grpo"},
        "lr0": {"algorithm": "grpo", "training": {"lr": 0.0}},
    },
}


COMPARISONS = len(SPEC["arms"]) - 1  # every arm but the baseline: one Holm family


def held_out_prompts() -> list[dict[str, str]]:
    """The warm start's task's eval split: prompts (and answers) it is never trained on."""
    return make_examples(TaskConfig(**TASK), "eval")


def write_spec(root: Path) -> Path:
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in held_out_prompts()))
    spec = {**SPEC, "data": {**SPEC["data"], "train": str(data), "eval": str(data)}}
    path = root / "aa.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def verdicts(md: str) -> dict[str, str]:
    part = md[md.index("## Against the baseline") : md.index("## Health warnings")]
    out = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("arm", "---"):
            out[cells[0]] = cells[6]
    return out


@dataclass
class Experiment:
    report: str
    # arm -> seed -> (exact match at step 0, exact match at the last evaluation)
    start_final: dict[str, dict[int, tuple[float, float]]]

    def table(self) -> str:
        """Every run's start -> final, for the failure messages."""
        return "; ".join(
            f"{arm} " + ", ".join(f"s{s} {a:.2f}->{b:.2f}" for s, (a, b) in runs.items())
            for arm, runs in self.start_final.items()
        )


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Experiment:
    root = tmp_path_factory.mktemp("e2e")
    path = write_spec(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNZOO_CACHE", str(root / "cache"))
        result = run_experiment(load_experiment(path), out_dir=root / "out")
    assert not result.failed, [r.error for r in result.runs]
    start_final: dict[str, dict[int, tuple[float, float]]] = {}
    for arm in SPEC["arms"]:
        start_final[arm] = {}
        for seed in SEEDS:
            evals = read_run(arm, seed, root / "out" / arm / f"seed-{seed}").evals
            assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS, (arm, seed, evals)
            start_final[arm][seed] = (evals[0][EVAL_EXACT_MATCH], evals[-1][EVAL_EXACT_MATCH])
    return Experiment((root / "out" / "report.md").read_text(), start_final)


def check_common_weak_start(exp: Experiment) -> float:
    starts = {a for runs in exp.start_final.values() for a, _ in runs.values()}
    assert len(starts) == 1, (
        "premise broken: every run starts from the same cached warm start, so step 0 should "
        f"score the same in every arm and seed; got {exp.table()}"
    )
    (start,) = starts
    assert start <= MAX_START, (
        f"premise broken: the early-stopped warm start should answer at most {MAX_START} of the "
        f"held-out prompts it never trained on, leaving GRPO room to improve; got {start}"
    )
    return start


@pytest.mark.slow
def test_aa_pair_is_no_detectable_difference(experiment: Experiment) -> None:
    for seed in SEEDS:
        assert experiment.start_final["grpo_again"][seed] == experiment.start_final["grpo"][seed], (
            f"premise broken: the same seed and config should reproduce the same run, but "
            f"grpo_again differs from grpo on seed {seed}: {experiment.table()}"
        )
    assert verdicts(experiment.report)["grpo_again"] == "no detectable difference"


@pytest.mark.slow
def test_learning_rate_zero_is_worse(experiment: Experiment) -> None:
    start = check_common_weak_start(experiment)
    for seed, (_, final) in experiment.start_final["lr0"].items():
        assert final == start, (
            f"premise broken: lr 0 changes no weight, so lr0's final evaluation should equal its "
            f"start {start}; seed {seed} ended at {final}: {experiment.table()}"
        )
    for seed, (_, final) in experiment.start_final["grpo"].items():
        assert final > start, (
            f"premise broken: GRPO should lift every seed above the start {start}; seed {seed} "
            f"ended at {final}: {experiment.table()}"
        )
    assert verdicts(experiment.report)["lr0"] == "worse", experiment.table()


def test_spec_is_valid(tmp_path: Path) -> None:
    assert list(load_experiment(write_spec(tmp_path)).spec.arms) == ["grpo", "grpo_again", "lr0"]


def test_design_premises() -> None:
    """What the slow tests rely on by construction: the sign-flip test decides with these
    seeds (so the lr0 verdict depends only on the signs of the per-seed differences), and the
    evaluated prompts are ones the warm start never trains on."""
    test = stats.choose_test(len(SEEDS), len(SEEDS), paired=True, n_comparisons=COMPARISONS)
    assert test is not None and test.test == stats.SIGN_FLIP, (
        f"premise broken: with {len(SEEDS)} seeds and {COMPARISONS} comparisons the sign-flip "
        f"test cannot reach Holm's strictest level, so the paired t-test (which depends on the "
        f"spread of the differences) would decide: {test}"
    )
    train = {ex["prompt"] for ex in make_examples(TaskConfig(**TASK), "train")}
    held_out = held_out_prompts()
    assert len(held_out) == TASK["eval_size"]
    assert not train & {ex["prompt"] for ex in held_out}, (
        "premise broken: the evaluated prompts should be ones the warm start never trains on"
    )
