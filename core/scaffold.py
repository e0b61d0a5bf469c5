"""``alignzoo new plugin NAME``: a ready plugin package.

It writes ``pyproject.toml`` with the entry points, one module per component kind (each a
working component with its ``Params``), ``tests/test_contracts.py`` running the contract suite
of each kind, and a README. ``pip install -e .`` installs it; its tests pass as written; the
components are starting points to edit.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from alignzoo.errors import UserError

KINDS = ("algorithm", "labeler", "backend", "device_mapper", "modifier", "environment")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,49}")

_MODULES: dict[str, tuple[str, str]] = {
    # kind: (class-name suffix, module source)
    "algorithm": (
        "Algorithm",
        '''"""$title: an algorithm. Start here: compute_advantages and compute_loss."""

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Algorithm, AlgorithmRequirements, LossOutput, hookimpl
from alignzoo.ops import aggregate_loss, group_mean_std, weight_samples


class ${cls}Algorithm(Algorithm):
    """REINFORCE with each prompt's group mean as baseline (edit me)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        scale: float = Field(1.0, gt=0, description="Multiplies the advantages.")
        smoothing: float = Field(
            0.9, ge=0, lt=1, description="Of the running mean reward it logs (its state)."
        )

    # weights=True: compute_loss multiplies batch.weights in (the reweight modifier needs it).
    requirements = AlgorithmRequirements(reference=False, critic=False, data="online", weights=True)

    def __init__(self, params=None):
        super().__init__(params)
        self.running_reward = None  # state across steps: saved by state_dict, resumed exactly

    @hookimpl
    def compute_advantages(self, batch):
        # A_i = scale * (r_i - mean of r over the samples of its prompt), on every response token
        group_mean, _, _ = group_mean_std(batch.scores, batch.group_ids)
        advantage = self.params.scale * (batch.scores - group_mean)
        batch.advantages = advantage[:, None] * batch.response_mask
        reward = float(batch.scores.mean())
        if self.running_reward is None:
            self.running_reward = reward
        else:
            w = self.params.smoothing
            self.running_reward = w * self.running_reward + (1 - w) * reward
        return batch

    @hookimpl
    def compute_loss(self, batch, outputs, context):
        # L = - sum_i w_i sum_t A_i log pi(y_t) / tokens of the optimizer step
        per_token = weight_samples(-batch.advantages * outputs.logprobs, batch.weights)
        loss = aggregate_loss(per_token, batch.response_mask, "token-mean", context=context)
        metrics = {"$name/advantage_abs": float(batch.advantages.abs().mean())}
        if self.running_reward is not None:
            metrics["$name/running_reward"] = self.running_reward
        return LossOutput(loss, metrics)

    def state_dict(self):
        return {"running_reward": self.running_reward}

    def load_state_dict(self, state):
        self.running_reward = state["running_reward"]
''',
    ),
    "labeler": (
        "Labeler",
        '''"""$title: a labeler. Start here: score_batch (whole calls) or score (one request)."""

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Labeler, LabelRequest, Score, hookimpl


class ${cls}Labeler(Labeler):
    """1.0 when the response contains the answer column's value, else 0.0 (edit me)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        answer_field: str = Field("answer", description="Dataset column with the answer.")

    marks_correct = True  # every Score says info["correct"]

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        # One call gets a whole step's requests (or a labeling.batch_size chunk): batch costly
        # work here (one model forward, one HTTP request). One Score per request, in order.
        return [self.score(request) for request in requests]

    def score(self, request: LabelRequest) -> Score:
        answer = request.extra.get(self.params.answer_field)
        if answer is None:
            return Score.abstain(f"no {self.params.answer_field!r} column")
        correct = str(answer) in request.response.split()
        return Score(float(correct), info={"correct": correct})
''',
    ),
    "backend": (
        "Backend",
        '''"""$title: a rollout backend. Start here: generate and sync_weights."""

from pydantic import Field

from alignzoo import hookimpl
from alignzoo.plugins.backends.hf import HFBackend


class ${cls}Backend(HFBackend):
    """Hugging Face generate with a cap on prompts per call (edit me: override generate)."""

    class Params(HFBackend.Params):  # every hf setting (decoder, use_cache, ...), and:
        max_batch_size: int = Field(16, ge=1, description="Prompts per generate call.")

    @hookimpl
    def generate(self, prompts, extras, n, sampling, seeds=None):
        return HFBackend.generate(self, prompts, extras, n, sampling, seeds)
''',
    ),
    "device_mapper": (
        "Devices",
        '''"""$title: a device mapper. Start here: place_roles."""

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import DeviceMapper, UserError, hookimpl


class ${cls}Devices(DeviceMapper):
    """Every role on one device, ``device`` if available, else the CPU (edit me)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        device: str = Field("cuda:0", description="Preferred device for every role.")

    @hookimpl
    def place_roles(self, roles, available):
        if self.params.device in available:
            return {role: self.params.device for role in roles}
        if "cpu" in available:
            return {role: "cpu" for role in roles}
        raise UserError(f"devices: neither {self.params.device} nor cpu in {list(available)}")
''',
    ),
    "modifier": (
        "Modifier",
        '''"""$title: a modifier. Start here: wrap a hook of another component."""

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Modifier, hookimpl


class ${cls}Modifier(Modifier):
    """Scales any algorithm's loss by ``factor`` (edit me)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        factor: float = Field(1.0, gt=0, description="Multiplies the loss.")

    @hookimpl(wrapper=True)
    def compute_loss(self, batch, outputs, context):
        result = yield
        result.loss = result.loss * self.params.factor
        return result
''',
    ),
    "environment": (
        "Environment",
        '''"""$title: an environment. Start here: env_reset and env_step."""

import random

from pydantic import BaseModel, ConfigDict, Field

from alignzoo import Environment, hookimpl
from alignzoo.rollout.episode import EpisodeStart, StepResult


class ${cls}Environment(Environment):
    """Guess a number: the model guesses, the environment says higher or lower (edit me)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        high: int = Field(20, ge=2, description="The number is drawn from 1..high.")

    @hookimpl
    def env_reset(self, row, seed):
        # Everything an episode keeps lives in its state, never on self: episodes run side
        # by side. Draw randomness from the episode's seed.
        secret = random.Random(seed).randint(1, self.params.high)
        task = f"Guess my number between 1 and {self.params.high}. Answer with a number."
        return EpisodeStart(state={"secret": secret}, messages=[{"role": "user", "content": task}])

    @hookimpl
    def env_step(self, state, turn):
        # Any text may arrive: answer it, never raise.
        digits = "".join(c for c in turn.text if c in "0123456789")[:6]
        if not digits:
            return StepResult([{"role": "user", "content": "Answer with a number."}], reward=0.0)
        guess = int(digits)
        if guess == state["secret"]:
            return StepResult(reward=1.0, done=True)
        hint = "higher" if guess < state["secret"] else "lower"
        return StepResult([{"role": "user", "content": f"No: {hint}."}], reward=0.0)

    @hookimpl
    def env_close(self, state):
        state.clear()  # release what an episode holds (a subprocess, a connection)
''',
    ),
}

_TESTS = {
    "algorithm": """

def test_algorithm_contract():
    assert_algorithm_contract(${cls}Algorithm, max_examples=20)
""",
    "labeler": """

def test_labeler_contract():
    assert_contract("labeler", ${cls}Labeler, max_examples=20)
""",
    "backend": """

def test_backend_contract():
    assert_contract("backend", ${cls}Backend, max_examples=3)
""",
    "device_mapper": """

def test_device_mapper_contract():
    assert_contract("device_mapper", ${cls}Devices)
""",
    "modifier": """

def test_modifier_contract():
    assert_contract("modifier", ${cls}Modifier, max_examples=5)
""",
    "environment": """

def test_environment_contract():
    assert_contract("environment", ${cls}Environment, max_examples=10)
""",
}

_MODULE_FILE = {
    "algorithm": "algorithm",
    "labeler": "labeler",
    "backend": "backend",
    "device_mapper": "devices",
    "modifier": "modifier",
    "environment": "environment",
}

_README = """# $project

alignzoo plugins: $components.

    pip install -e .
    alignzoo plugins --kind KIND          # listed, with $project as provider
$checks
    pytest tests                         # the same contract suites

In an experiment (see `alignzoo schema` for every field):

    arms:
      mine:
$arm
Each module is a working starting point: edit it, then run the checks again. The plugin
guide is docs/plugins.md in alignzoo's source tree.
"""

_ARM_FIELD = {
    "algorithm": "algorithm",
    "labeler": "labeler",
    "backend": "backend",
    "device_mapper": "devices",
    "environment": "environment",
}


def new_plugin(name: str, out: Path, kinds: list[str] | None = None) -> list[Path]:
    """Write the package for ``name`` into ``out`` (which must not exist or be empty); return
    the files written."""
    if not _NAME.fullmatch(name):
        raise UserError(
            f"new plugin: NAME must be a Python package name (lower-case letters, digits, '_', "
            f"starting with a letter, at most 50 characters), got {name!r}"
        )
    chosen = list(dict.fromkeys(kinds or KINDS))
    unknown = [k for k in chosen if k not in KINDS]
    if unknown:
        raise UserError(f"new plugin: --kind {unknown[0]!r} is not one of {', '.join(KINDS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"new plugin: {out} exists and is not an empty folder; nothing written")
    cls = "".join(part.capitalize() for part in name.split("_") if part)
    values = {"name": name, "cls": cls, "title": name, "project": name.replace("_", "-")}
    files: dict[str, str] = {f"{name}/__init__.py": f'"""{name}: alignzoo plugins."""\n'}
    entry_points, imports, tests = [], [], []
    for kind in chosen:
        suffix, source = _MODULES[kind]
        module = _MODULE_FILE[kind]
        files[f"{name}/{module}.py"] = Template(source).substitute(values)
        entry_points.append(f'"{kind}.{name}" = "{name}.{module}:{cls}{suffix}"')
        imports.append(f"from {name}.{module} import {cls}{suffix}")
        tests.append(Template(_TESTS[kind]).substitute(values))
    uses_algorithm = "algorithm" in chosen
    needed = ["assert_algorithm_contract"] * uses_algorithm
    needed += ["assert_contract"] * any(k != "algorithm" for k in chosen)
    header = "from alignzoo.testing import " + ", ".join(needed)
    files["tests/test_contracts.py"] = (
        f'"""The contract suites of {name}\'s components (as `alignzoo check` runs them)."""\n\n'
        + header
        + "\n\n"
        + "\n".join(sorted(imports))
        + "\n"
        + "".join(tests)
    )
    files["pyproject.toml"] = (
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{values["project"]}"\nversion = "0.1.0"\n'
        f'description = "alignzoo plugins: {", ".join(chosen)}"\n'
        'requires-python = ">=3.10"\ndependencies = ["alignzoo"]\n\n'
        f'[project.optional-dependencies]\ntest = ["pytest"]\n\n'
        f'[tool.setuptools.packages.find]\ninclude = ["{name}", "{name}.*"]\n\n'
        "[project.entry-points.alignzoo]\n" + "\n".join(entry_points) + "\n"
    )
    arm = ["        algorithm: " + (name if uses_algorithm else "grpo")]
    arm += [
        f"        {_ARM_FIELD[k]}: {name}" for k in chosen if k in _ARM_FIELD and k != "algorithm"
    ]
    if "modifier" in chosen:
        arm.append(f"        modifiers: [{name}]")
    checks = "\n".join(f"    alignzoo check {k} {name}" for k in chosen)
    files["README.md"] = Template(_README).substitute(
        values,
        components=", ".join(chosen),
        checks=checks,
        arm="\n".join(arm) + "\n",
    )
    written = []
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
