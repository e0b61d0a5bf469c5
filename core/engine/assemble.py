"""Assembling one run: fresh components in a per-run PluginManager, roles placed on devices
before any model loads, then exactly the models the algorithm asks for, data and optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from alignzoo import distributed
from alignzoo.config.loader import EVAL_LABELER, LoadedExperiment, at_override
from alignzoo.config.schema import ArmSpec, ExperimentSpec
from alignzoo.engine import models as model_loading
from alignzoo.engine.behaviour import Behaviour, choose_behaviour, traces_decode
from alignzoo.engine.collect import Collector, LabelAhead, build_collector
from alignzoo.engine.context import RunContext
from alignzoo.engine.evaluate import eval_rows
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.learner import Learner, build_learner, shard_units
from alignzoo.engine.mirror import Mirror, mirror_for
from alignzoo.engine.models import Models
from alignzoo.engine.modes import DataMode, select_mode
from alignzoo.engine.modes.demonstrations import OfflineDemonstrations, TeacherWriter
from alignzoo.engine.parts import (
    fresh_components,
    labeler_hooks,
    labeling_stage,
    run_hooks,
    seed_everything,
    start_fallbacks,
)
from alignzoo.engine.policy import policy_path, teacher_path
from alignzoo.engine.sampler import PromptSampler
from alignzoo.engine.scoring import Scorer, packing_of
from alignzoo.engine.served import ServedTeacher
from alignzoo.engine.sinks import Sinks
from alignzoo.errors import ConfigError, ConfigIssue, UserError
from alignzoo.labeling import LabelingStage
from alignzoo.plugin import Component
from alignzoo.registry import build_plugin_manager
from alignzoo.runfolder import RunStatus
from alignzoo.types import AlgorithmRequirements, Placement
from alignzoo.weights import PolicyWeights

if TYPE_CHECKING:
    from alignzoo.rollout.multiturn import Episodes

AHEAD_SLOT = "labeling.overlap"
ASYNC_SLOT = "training.async"


@dataclass
class Run:
    """Everything an assembled run holds and owns: its context (models included), the hooks of
    its components (the backend among them), its data mode, learner, prompt sampler,
    evaluation rows, behaviour policy, the collector of its batches, its training and
    evaluation labeling stages, its episode runner, checkpoint mirror and sinks.
    :meth:`close` releases them, in order."""

    context: RunContext
    hooks: Hooks
    components: dict[str, Component]
    requirements: AlgorithmRequirements
    mode: DataMode
    learner: Learner
    sampler: PromptSampler
    eval_rows: list[dict[str, Any]]
    scorer: Scorer  # no-grad passes of the run's models
    behaviour: Behaviour  # fills each batch's behaviour snapshot
    collector: Collector  # generate and label (or read) each step's batch
    labeling: LabelingStage  # the arm's labeler chain
    episodes: Episodes | None = None  # an arm with an environment samples episodes
    eval_labeling: LabelingStage | None = None  # evaluation.labeler (else the arm's labeling)
    mirror: Mirror | None = None  # training.checkpoint_mirror, on the rank that checkpoints
    sinks: Sinks | None = None  # opened once the run folder is at its resume point

    @property
    def evaluation_labeling(self) -> LabelingStage:
        """The stage that labels evaluations: ``evaluation.labeler``'s, else the arm's."""
        return self.eval_labeling if self.eval_labeling is not None else self.labeling

    def open_sinks(self, config: dict[str, Any]) -> Sinks:
        """The run's sinks (``config``: what config.yaml holds, for TensorBoard and W&B), opened
        once the run folder's streams are cut back to the resume point: rank 0 writes every
        configured sink, the other ranks a jsonl copy into their scratch folder."""
        main = distributed.is_main()
        spec, context = self.spec, self.context
        self.sinks = Sinks(
            context.out_dir,
            spec.logging.sinks if main else ["jsonl"],
            context.console if main else None,
            context.name,
            spec.logging.wandb,
            spec.name,
            config,
            watched=getattr(self.components.get("algorithm"), "watched_metrics", ()),
        )
        return self.sinks

    def close(self, status: RunStatus) -> None:
        """End the run, in this order: the sinks close (files flushed, W&B finished); the
        look-ahead labeling thread stops (a pass in flight finishes and its labels reach the
        store); the labeler worker processes of the training and evaluation stages end; then
        the components release what they hold (``on_run_end`` with ``status``: the backend
        among them). Every step runs even when an earlier one raises; the error is raised
        after the last."""
        with ExitStack() as stack:  # callbacks run last in, first out
            teacher = getattr(self.context.models, "teacher", None)
            if isinstance(teacher, ServedTeacher):
                stack.callback(teacher.close)
            stack.callback(self.hooks.on_run_end, self.context, status)
            if self.eval_labeling is not None:
                stack.callback(self.eval_labeling.close)
            stack.callback(self.labeling.close)
            stack.callback(self.collector.close)
            if self.sinks is not None:
                stack.callback(self.sinks.close)

    @property
    def ahead(self) -> LabelAhead | None:
        """The collector of an arm with ``labeling.overlap`` (its batch labeled in the
        background), else None."""
        return self.collector if isinstance(self.collector, LabelAhead) else None

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint saves besides models and optimizer: the components, the
        look-ahead batch of an overlapping arm, and the steps an asynchronous arm's producers
        were given and it has not trained on."""
        from alignzoo.engine.producers import AsyncCollector

        saved = dict(self.components)
        if self.ahead is not None:
            saved[AHEAD_SLOT] = self.ahead
        if isinstance(self.collector, AsyncCollector):
            saved[ASYNC_SLOT] = self.collector
        return saved

    @property
    def moving_reference(self) -> torch.nn.Module | None:
        """The reference when it moves toward the policy (``training.sync_ref_model``), so
        its checkpoints hold its weights; None otherwise."""
        return self.models.reference if self.arm.training.sync_ref_model else None

    def sync_weights(self) -> None:
        """Stream the actor's current weights to the backend, with their policy version."""
        self.hooks.sync_weights(PolicyWeights(self.models.actor, self.learner.version))

    @property
    def models(self) -> Models:
        """The run's models (set once assembled)."""
        assert self.context.models is not None
        return self.context.models

    @property
    def spec(self) -> ExperimentSpec:
        return self.context.spec

    @property
    def arm(self) -> ArmSpec:
        return self.context.arm_spec


def needed_roles(req: AlgorithmRequirements, arm: ArmSpec) -> list[str]:
    """The roles this run has: actor, rollout and labeler always; ref (the reference and the
    teacher), critic, reward on demand."""
    roles = ["actor", "rollout", "labeler"]
    local_teacher = req.teacher and not (arm.model.teacher and arm.model.teacher.served)
    if req.reference or local_teacher:  # a local teacher sits on the reference's device
        roles.append("ref")
    if req.critic:
        roles.append("critic")
    if arm.model.reward_model is not None:
        roles.append("reward")
    return roles


def arm_is_online(spec: ExperimentSpec, arm: ArmSpec) -> bool:
    """The arm's ``online`` setting, else the data section's."""
    return spec.data.online if arm.online is None else arm.online


def total_optimizer_steps(spec: ExperimentSpec, arm: ArmSpec, mode: DataMode) -> int | None:
    """Optimizer steps the budget allows (None for a wall-clock budget): for lr schedules."""
    cfg = arm.training
    counted, trained = mode.step_sizes(cfg)
    steps = spec.budget.steps
    if steps is None and spec.budget.samples is not None:
        steps = math.ceil(spec.budget.samples / counted)
    if steps is None:
        return None
    units = max(1, trained // mode.unit)  # units are never split between minibatches
    per_minibatch = max(1, (cfg.minibatch_size or trained) // mode.unit)
    return steps * cfg.epochs * max(1, math.ceil(units / per_minibatch))


class _EvaluationContext:
    """The run's context as ``evaluation.labeler`` sees it: ``labeling_role`` says that it
    only evaluates (a reward model then does not record itself as the arm's)."""

    labeling_role = "evaluation"

    def __init__(self, context: RunContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def evaluation_stage(spec: ExperimentSpec, component: Any, seed: int) -> LabelingStage:
    """The labeling stage of ``evaluation.labeler``: that labeler alone, default policies."""
    from alignzoo.config.schema import LabelingConfig

    ref = spec.evaluation.labeler
    name = ref.name if ref is not None else "evaluation"
    chain = [(name, component, labeler_hooks(component, name))]
    return LabelingStage.build(LabelingConfig(), chain, seed=seed)


def check_async(arm: str, arm_spec: ArmSpec, mode: DataMode) -> None:
    """``training.async`` needs an online arm without labeling overlap; under torchrun, one
    trained with DDP and without an environment."""
    at = f"arms.{arm}.training.async"
    if not mode.online:
        raise UserError(
            f"{at}: the arm reads its data offline ({mode.name}); producers sample and label "
            "online batches, so there is nothing for them to produce; leave async unset"
        )
    if arm_spec.labeling.overlap:
        raise UserError(
            f"{at}: labeling.overlap already labels a step ahead in one process; producers "
            "label in their own processes: use one or the other"
        )
    if distributed.active() and arm_spec.environment is not None:
        raise UserError(
            f"{at}: multi-turn episodes from producers are not supported with several torchrun "
            "processes yet (an episode dropped by on_failure would move the others' share); "
            "run the arm in one process"
        )
    if distributed.active() and arm_spec.training.parallel == "fsdp2":
        raise UserError(
            f"{at}: producers take whole weights, and an fsdp2 actor holds a shard per rank; "
            "use training.parallel: ddp (the default) with async"
        )


def placement_plan(loaded: LoadedExperiment, arm: str) -> dict[str, Placement]:
    """Where ``arm``'s device mapper would place each of its roles on this machine, before
    anything loads (what an executor asks a scheduler for)."""
    from alignzoo.devices import available_devices

    components = fresh_components(loaded, arm)
    parts = [components[s] for s in ("algorithm", "devices") if s in components]
    hooks = Hooks(build_plugin_manager(parts), loaded.spec.arms[arm].algorithm.name)
    roles = needed_roles(hooks.algorithm_requirements(), loaded.spec.arms[arm])
    return hooks.place_roles(roles, available_devices())


def check_precision(loaded: LoadedExperiment) -> None:
    """Before anything is written (``alignzoo validate``, ``alignzoo run``): every arm's
    ``model.dtype`` is one its actor's device can train in, where the arm's device mapper
    would place the actor on this machine; else a :class:`ConfigError` at ``model.dtype``
    (or the ``--set`` that gave it) saying what would work. An arm whose mapper cannot place
    it here is left to its run, which reports that."""
    issues: list[ConfigIssue] = []
    for arm, arm_spec in loaded.spec.arms.items():
        try:
            device = placement_plan(loaded, arm)["actor"].device
        except Exception:  # a device this machine lacks, a mapper's own failure: the run says
            continue
        problem = model_loading.dtype_problem(arm_spec.model.dtype, device)
        if problem is not None:
            issue = loaded.issue(("arms", arm, "model", "dtype"), problem)
            issues.append(at_override(issue, loaded.spec.overrides))
    if issues:  # a shared model.dtype is one issue, said once
        raise ConfigError(list(dict.fromkeys(issues)))


def assemble(
    loaded: LoadedExperiment,
    arm: str,
    seed: int,
    out_dir: Path,
    console: Any = None,
    log: Callable[[str], None] = print,
) -> Run:
    """Build the run: components, devices, models, data, optimizer. Calls ``on_run_start``."""
    from alignzoo.devices import available_devices
    from alignzoo.engine.datasets import load_split

    spec = loaded.spec
    components = fresh_components(loaded, arm)
    arm_spec = spec.arms[arm]
    hooks = run_hooks(components, arm_spec.algorithm.name)
    labeling = labeling_stage(arm_spec, components, hooks, seed, out_dir)
    req = hooks.algorithm_requirements()
    mode = select_mode(req, arm_is_online(spec, arm_spec))
    if mode.kind == "preference" and mode.online and arm_spec.training.samples_per_prompt < 2:
        raise UserError(
            f"arms.{arm}.training.samples_per_prompt: online preference pairs need at least 2 "
            "samples per prompt"
        )
    if distributed.active():
        world = distributed.world_size()
        if arm_spec.training.prompts_per_step % world:
            raise UserError(
                f"arms.{arm}.training.prompts_per_step: {arm_spec.training.prompts_per_step} "
                f"does not split evenly over {world} processes; use a multiple of {world}"
            )
        if arm_spec.labeling.overlap:
            raise UserError(
                f"arms.{arm}.labeling.overlap: not supported with {world} processes yet; "
                "leave overlap unset"
            )
    if arm_spec.training.async_ is not None:
        check_async(arm, arm_spec, mode)
    if arm_spec.labeling.overlap and not mode.online:
        raise UserError(
            f"arms.{arm}.labeling.overlap: the arm reads its data offline ({mode.name}), so "
            "there is no labeling to overlap with generation; leave overlap unset"
        )
    context = RunContext(
        experiment=spec.name,
        arm=arm,
        seed=seed,
        out_dir=out_dir,
        spec=spec,
        arm_spec=arm_spec,
        console=console,
    )
    placements = hooks.place_roles(needed_roles(req, arm_spec), available_devices())
    devices = {role: placement.device for role, placement in placements.items()}
    seed_everything(seed)

    mcfg = arm_spec.model
    path = policy_path(mcfg, spec.data, log)
    moving = arm_spec.training.sync_ref_model
    if moving and not req.reference:  # alignzoo validate says so first, with the field's line
        raise UserError(
            f"arms.{arm}.training.sync_ref_model: algorithm {arm_spec.algorithm.name!r} loads "
            "no reference model here, so there is none to sync; set sync_ref_model: false"
        )
    models = model_loading.load_models(
        path, mcfg, devices, req.reference, req.critic, seed, moving_reference=moving
    )
    models.placements = placements
    if req.teacher and mcfg.teacher is not None and mcfg.teacher.served is not None:
        served = ServedTeacher(mcfg.teacher.served)
        served.check(models.tokenizer)  # it answers, serves the model, tokenizes as the policy
        models.teacher = served
        log(f"model.teacher: served by {mcfg.teacher.served.base_url} ({served.cfg.model})")
    elif req.teacher:
        where = teacher_path(mcfg, spec.data, log)
        models.teacher = model_loading.load_teacher(where, mcfg, models.device("ref"), models)
    if (
        req.teacher_completions
        and models.teacher is not None
        and isinstance(mode, OfflineDemonstrations)
    ):  # sequence-level distillation: the teacher writes the demonstrations
        mode.teacher_writer = TeacherWriter(
            models.teacher, models.tokenizer, models.device("ref"), models.autocast
        )
    note = model_loading.precision_note(mcfg, models.device("actor"))
    if note is not None:
        log(note)
    context.models = models
    episodes = None
    if arm_spec.environment is not None:  # each prompt becomes a multi-turn episode
        from alignzoo.rollout.agents import episode_runner

        episodes = episode_runner(
            arm_spec.episodes,
            components.get("environment"),
            models.tokenizer,
            getattr(models.actor, "config", None),
        )

    kind = mode.kind if not mode.online else "online"
    train = mode.tokenize(load_split(spec.data, "train", kind, models.tokenizer), models.tokenizer)
    evaluation = load_split(spec.data, "eval", "online", models.tokenizer)
    learner = build_learner(
        models, arm_spec.training, total_optimizer_steps(spec, arm_spec, mode), seed
    )
    if learner.sharded:
        units = len(shard_units(models.actor))
        log(
            f"training.parallel fsdp2: the actor{' and the critic' if models.critic else ''} "
            f"sharded over {distributed.world_size()} processes ({units} blocks + the model)"
        )
    sampler = PromptSampler(train, seed)
    scorer = Scorer(models, arm_spec.training.micro_batch_size, packing_of(arm_spec.training))
    scorer.teacher_scores = req.teacher_logprobs
    overlap = arm_spec.labeling.overlap
    behaviour = choose_behaviour(
        scorer,
        arm_spec.training,
        req,
        mode,
        hooks,
        dropout_off=mcfg.disable_dropout,
        overlapping=overlap,
    )
    parts = (
        hooks,
        models.tokenizer,
        arm_spec.training,
        sampler,
        mode,
        behaviour,
        learner,
        labeling,
        episodes,
    )
    settings = arm_spec.training.async_
    collector: Collector
    if settings is None:
        collector = build_collector(*parts, overlap)
        collector.traces = traces_decode(
            arm_spec.training, mode, overlap, dropout_off=mcfg.disable_dropout
        )
    else:  # producers in processes of their own
        from alignzoo.engine.producers import AsyncCollector, ProducerJob

        job = ProducerJob(
            source=str(loaded.source),
            spec=spec,
            arm=arm,
            seed=seed,
            out_dir=Path(out_dir),
            policy=str(models.policy_path),
            threads=settings.producer_threads or torch.get_num_threads(),
            index=0,
        )
        collector = AsyncCollector(*parts, job=job, settings=settings)
    run = Run(
        context=context,
        hooks=hooks,
        components=components,
        requirements=req,
        mode=mode,
        learner=learner,
        sampler=sampler,
        eval_rows=eval_rows(evaluation, spec.evaluation.num_prompts),
        scorer=scorer,
        behaviour=behaviour,
        collector=collector,
        labeling=labeling,
        episodes=episodes,
        mirror=(  # rank 0 writes checkpoints, so it mirrors them
            mirror_for(arm_spec.training.checkpoint_mirror, spec.name, arm, seed)
            if distributed.is_main()
            else None
        ),
    )
    hooks.on_run_start(context)
    if EVAL_LABELER in components:  # one labeler evaluates every arm (evaluation.labeler)
        run.eval_labeling = evaluation_stage(spec, components[EVAL_LABELER], seed)
        for slot in run.eval_labeling.slots:
            slot.call.hooks.on_run_start(_EvaluationContext(context))
    start_fallbacks(labeling, context)
    run.sync_weights()
    seed_everything(seed)  # every arm enters the loop with the same RNG state for a seed
    return run
