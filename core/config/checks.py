"""The checks across an experiment's fields and built components, made before anything runs.

Each field may be valid on its own and the combination still unable to run: ``online: false``
for an algorithm that learns from sampled rollouts, a greedy temperature for one that trains
on the log-probs of what it sampled, a modifier whose sample weights the algorithm ignores, an
``evaluation.metric`` the arms' labelers cannot produce, a model folder that does not exist.
Every problem is a located issue.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from alignzoo import metrics as canonical
from alignzoo.config.components import EVAL_LABELER, BuiltArm, slot_field
from alignzoo.config.locate import Locator
from alignzoo.config.schema import ExperimentSpec
from alignzoo.config.yamlfile import FieldPath
from alignzoo.errors import ConfigIssue, PluginLoadError
from alignzoo.plugin import Component
from alignzoo.registry import build_plugin_manager


def _async_issues(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """``training.async`` needs batches that producers sample and label: an online arm,
    without ``labeling.overlap`` (which labels a step ahead in one process)."""
    spec, algorithm = arm.spec, arm.components.get("algorithm")
    if spec.training.async_ is None or algorithm is None:
        return []
    at = ("arms", arm.name, "training", "async")
    if not (arm.requirements.data == "online" or arm.online):
        return [
            locator.issue(
                at,
                f"{spec.algorithm.name} reads its data offline here; producers sample and label "
                "online batches, so there is nothing for them to produce; leave async unset "
                "(or train the algorithm online, on pairs it samples)",
            )
        ]
    if spec.labeling.overlap:
        return [
            locator.issue(
                at,
                "labeling.overlap labels a step ahead in one process, and producers label in "
                "their own processes: use one or the other (async with max_staleness 1 is "
                "the overlap's successor)",
            )
        ]
    return []


def arm_issues(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """What keeps ``arm``'s components and settings from running together: its data (online
    or offline, an environment), its teacher, its sampling temperature, rollout correction,
    moving reference and parallelism, each component's hook implementations against the
    hookspecs, and sample weights nothing multiplies in."""
    spec, algorithm = arm.spec, arm.components.get("algorithm")
    at = ("arms", arm.name)
    issues: list[ConfigIssue] = []
    if spec.online is False and algorithm is not None and arm.requirements.data == "online":
        issues.append(
            locator.issue(
                (*at, "online"),
                f"{spec.algorithm.name} learns from sampled rollouts; 'online: false' applies "
                "only to preference or unpaired-feedback algorithms (dpo, simpo, kto, ...)",
            )
        )
    imitates = (
        arm.loaded_requirements is not None and arm.loaded_requirements.data == "demonstrations"
    )
    if spec.online is True and imitates:
        issues.append(
            locator.issue(
                (*at, "online"),
                f"{spec.algorithm.name} imitates demonstrations read from data.train (prompt / "
                "completion rows); there is nothing to sample, so leave 'online' unset",
            )
        )
    issues += _environment_issues(arm, locator)
    requirements = arm.loaded_requirements
    if requirements is not None and requirements.teacher and spec.model.teacher is None:
        issues.append(
            locator.issue(
                (*at, "model", "teacher"),
                f"{spec.algorithm.name} distills from a teacher and the arm has none: set "
                "model.teacher: {path: <a checkpoint folder with the policy's tokenizer>}, "
                "{embedded: {...}} (the embedded world's teacher) or {served: {base_url: ..., "
                "model: ...}} (an OpenAI-compatible endpoint)",
            )
        )
    teacher = spec.model.teacher
    if teacher is not None and teacher.embedded is not None and spec.model.policy != "embedded":
        issues.append(
            locator.issue(
                (*at, "model", "teacher", "embedded"),
                "the embedded world's teacher tokenizes as the embedded policy does, not as "
                f"the policy {spec.model.policy!r}; give the teacher as a path (a checkpoint "
                "with the policy's tokenizer)",
            )
        )
    if (
        teacher is not None
        and teacher.served is not None
        and requirements is not None
        and requirements.teacher_logits
    ):
        issues.append(
            locator.issue(
                (*at, "model", "teacher", "served"),
                f"{spec.algorithm.name} learns the teacher's whole next-token distribution, and "
                "a served teacher returns the log-probs of the sampled tokens only; give the "
                "teacher as a path (a local checkpoint) or embedded",
            )
        )
    if (
        teacher is not None
        and teacher.served is not None
        and requirements is not None
        and requirements.teacher_completions
    ):
        issues.append(
            locator.issue(
                (*at, "model", "teacher", "served"),
                f"{spec.algorithm.name} with seq_kd trains on completions the teacher writes, "
                "and a served teacher is read for log-probs only; give the teacher as a path "
                "(a local checkpoint) or embedded",
            )
        )
    temperature = spec.training.sampling.temperature
    if teacher is not None and teacher.served is not None and temperature not in (0, 1):
        issues.append(
            locator.issue(
                (*at, "model", "teacher", "served"),
                f"a served teacher's log-probs are at temperature 1 (the endpoint's prompt "
                f"log-probs come from the raw logits, and a log-prob cannot be re-tempered), "
                f"and the arm samples at training.sampling.temperature {temperature:g}: the "
                "teacher would score another distribution than the policy samples; sample at "
                "temperature 1, or give the teacher as a path (a local teacher's log-probs are "
                "taken at the sampling temperature)",
            )
        )
    greedy = spec.training.sampling.temperature == 0 and algorithm is not None
    if greedy and (arm.requirements.data == "online" or arm.online):
        issues.append(
            locator.issue(
                (*at, "training", "sampling", "temperature"),
                f"0 samples greedily, and {spec.algorithm.name} trains on the log-probs of "
                "what it sampled: a greedy policy gives every sample of a prompt the same "
                "response and no distribution to learn from; give a temperature above 0 "
                "(evaluation decodes greedily on its own)",
            )
        )
    correction = spec.training.rollout_correction.level
    if correction != "off" and algorithm is not None and not arm.requirements.rollout_correction:
        issues.append(
            locator.issue(
                (*at, "training", "rollout_correction", "level"),
                f"{correction!r} needs an online policy-gradient algorithm (grpo, ppo, rloo, "
                f"reinforce_pp); {spec.algorithm.name} applies no importance weights to a "
                "sampled surrogate; set level off",
            )
        )
    issues += _async_issues(arm, locator)
    if spec.training.sync_ref_model and requirements is not None and not requirements.reference:
        issues.append(
            locator.issue(
                (*at, "training", "sync_ref_model"),
                f"{spec.algorithm.name} loads no reference model with these params (grpo with "
                "beta 0, dpo with reference_free, simpo, sft, ...), so there is no reference "
                "to sync; set sync_ref_model: false, or give the algorithm a reference",
            )
        )
    if spec.training.parallel == "fsdp2" and spec.model.lora is not None:
        issues.append(
            locator.issue(
                (*at, "training", "parallel"),
                "fsdp2 does not shard LoRA adapters yet; use parallel: ddp for a LoRA arm "
                "(its adapters are small), or drop model.lora",
            )
        )
    # Each component's hook implementations must match the hookspecs (a misspelled hook or
    # argument): found here, by `alignzoo validate`, rather than when the run is assembled.
    for slot, component in arm.components.items():
        try:
            build_plugin_manager([component])
        except PluginLoadError as exc:
            issues.append(locator.issue(slot_field(arm.name, slot), str(exc)))
    issues += _weights_without_a_taker(arm, locator)
    issues += _steps_without_a_taker(arm, locator)
    issues += _reward_components_issues(arm, locator)
    return issues


def _environment_issues(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """An arm with an environment samples episodes: its algorithm must learn from sampled
    rollouts and its backend must sample from token ids (``generate_ids``)."""
    if arm.spec.environment is None:
        return []
    out = []
    where: FieldPath = ("arms", arm.name, "environment")
    algorithm, backend = arm.components.get("algorithm"), arm.components.get("backend")
    try:
        if algorithm is not None:
            data = arm.requirements.data
            if data != "online":
                out.append(
                    locator.issue(
                        where,
                        f"algorithm {arm.spec.algorithm.name!r} learns from {data} data; an "
                        "environment's episodes train an online algorithm (grpo, rloo, "
                        "reinforce_pp, ppo)",
                    )
                )
            elif arm.requirements.truncation:
                out.append(
                    locator.issue(
                        ("arms", arm.name, "algorithm", "params", "mask_truncated_completions"),
                        "masks the responses the length budget cut, which the engine records "
                        "for single-turn samples only; an environment's episodes end by "
                        "episodes.on_failure (truncated, timeout, ...): drop the option, or "
                        "set episodes.on_failure",
                    )
                )
        if (
            backend is not None
            and not build_plugin_manager([backend]).hook.generate_ids.get_hookimpls()
        ):
            out.append(
                locator.issue(
                    where,
                    f"backend {arm.spec.backend.name!r} does not implement generate_ids "
                    "(sampling a turn from token ids), which episodes need; use the hf or "
                    "vllm backend",
                )
            )
    except Exception:  # a component's own problem: reported by the checks above
        return out
    return out


def _weights_without_a_taker(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """A modifier that sets sample weights around an algorithm that does not declare it
    multiplies them in (``AlgorithmRequirements.weights``): the weights would change nothing."""
    setters = [
        (i, ref.name)
        for i, ref in enumerate(arm.spec.modifiers)
        if getattr(arm.components.get(f"modifiers.{i}"), "sets_weights", False)
    ]
    if "algorithm" not in arm.components or not setters:
        return []
    try:
        if arm.requirements.weights:
            return []
    except Exception:  # reported by the checks above, or when the run is assembled
        return []
    return [
        locator.issue(
            ("arms", arm.name, "modifiers", i),
            f"modifier {name!r} sets sample weights, but algorithm {arm.spec.algorithm.name!r} "
            "does not declare that its loss multiplies them in (AlgorithmRequirements"
            "(weights=True)): the weights would apply to nothing; drop the modifier or make "
            "the algorithm honour batch.weights",
        )
        for i, name in setters
    ]


def _steps_without_a_taker(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """A training labeler that gives step scores (``Labeler.gives_steps``: dense rewards, a
    process reward model's) in front of an algorithm that does not read them
    (``AlgorithmRequirements.dense_rewards``): the steps would train nothing, silently."""
    givers = [
        slot
        for slot, component in arm.components.items()
        if (slot == "labeler" or slot.startswith("labeling.fallbacks."))
        and getattr(component, "gives_steps", False) is True
    ]
    requirements = arm.loaded_requirements
    if not givers or requirements is None or requirements.dense_rewards:
        return []
    algorithm = arm.spec.algorithm.name
    fallbacks = arm.spec.labeling.fallbacks

    def name(slot: str) -> str:
        ref = arm.spec.labeler if slot == "labeler" else fallbacks[int(slot.rsplit(".", 1)[1])]
        return str(getattr(ref, "name", slot))

    return [
        locator.issue(
            slot_field(arm.name, slot),
            f"labeler {name(slot)!r} gives step scores (dense rewards, "
            f"batch.dense_rewards), but algorithm {algorithm!r} does not read them "
            "(AlgorithmRequirements(dense_rewards=True)): they would train nothing; use an "
            "algorithm that adds them to its per-token rewards (ppo, reinforce_pp, with "
            "dense_reward_coef > 0), or have the labeler give its sequence score only "
            "(process_reward_model: dense: false)",
        )
        for slot in givers
    ]


def _reward_components_issues(arm: BuiltArm, locator: Locator) -> list[ConfigIssue]:
    """An algorithm that weighs a labeler's rewards apart (``AlgorithmRequirements.
    reward_components``, GRPO's ``multi_objective_aggregation`` / ``reward_weights``) in front
    of a labeler whose rewards are known (``Labeler.reward_components``, a combine's parts): it
    must report as many as the algorithm has weights, with the same names along the chain,
    weigh none of them in its value (those weights would apply to nothing), and have no
    ``labeling.normalize`` (which rescales the value only)."""
    requirements = arm.loaded_requirements
    if requirements is None or requirements.reward_components is None:
        return []
    wanted, algorithm = requirements.reward_components, arm.spec.algorithm.name
    fallbacks = arm.spec.labeling.fallbacks
    known: list[tuple[str, str, dict[str, float]]] = []  # slot, labeler name, its rewards
    for slot, component in arm.components.items():
        if slot != "labeler" and not slot.startswith("labeling.fallbacks."):
            continue
        rewards = getattr(component, "reward_components", None)
        if isinstance(rewards, dict) and rewards:
            ref = arm.spec.labeler if slot == "labeler" else fallbacks[int(slot.rsplit(".", 1)[1])]
            known.append((slot, str(getattr(ref, "name", slot)), rewards))
    issues = []
    for slot, name, rewards in known:
        listed = ", ".join(rewards)
        if wanted and len(rewards) != wanted:
            issues.append(
                locator.issue(
                    ("arms", arm.name, "algorithm", "params", "reward_weights"),
                    f"reward_weights has {wanted} weights, and labeler {name!r} reports "
                    f"{len(rewards)} rewards ({listed}): give one weight per reward, in that "
                    "order",
                )
            )
        if any(w != 1.0 for w in rewards.values()):
            issues.append(
                locator.issue(
                    (*slot_field(arm.name, slot), "params", "weights"),
                    f"labeler {name!r} weighs its rewards ({listed}) by "
                    f"{list(rewards.values())} in its value, and algorithm {algorithm!r} "
                    "(multi_objective_aggregation normalize_then_sum or reward_weights) reads "
                    "each reward raw and weighs them itself: these weights would apply to "
                    "nothing; move them to the algorithm's reward_weights and leave the "
                    "labeler's unset",
                )
            )
        if list(rewards) != list(known[0][2]):
            issues.append(
                locator.issue(
                    slot_field(arm.name, slot),
                    f"labeler {name!r} reports the rewards ({listed}), and the chain's first "
                    f"reports ({', '.join(known[0][2])}): algorithm {algorithm!r} weighs each "
                    "reward by its place, so every labeler of the chain must report the same",
                )
            )
    named = {slot for slot, _, _ in known}
    for slot in arm.components:
        if known and slot.startswith("labeling.fallbacks.") and slot not in named:
            ref = fallbacks[int(slot.rsplit(".", 1)[1])]
            issues.append(
                locator.issue(
                    slot_field(arm.name, slot),
                    f"fallback {getattr(ref, 'name', slot)!r} reports no rewards apart, and "
                    f"algorithm {algorithm!r} reads the rewards ({', '.join(known[0][2])}) of "
                    "each sample: a sample this fallback scores would have none to read (its "
                    "advantage 0); give a fallback that reports the same rewards (a combine of "
                    "the same parts), or no fallback",
                )
            )
    normalize = arm.spec.labeling.normalize
    if known and normalize is not None and (normalize.mode != "none" or normalize.clip is not None):
        issues.append(
            locator.issue(
                ("arms", arm.name, "labeling", "normalize"),
                f"normalize rescales (or clips) the labeler's value, and algorithm {algorithm!r} "
                "(multi_objective_aggregation normalize_then_sum or reward_weights) reads the "
                f"labeler's rewards ({', '.join(known[0][2])}) raw, not the value: it would "
                "change nothing; remove it (the advantages are normalised in their groups anyway)",
            )
        )
    return issues


def eval_metric_issues(
    spec: ExperimentSpec, components: dict[str, dict[str, Component]], locator: Locator
) -> list[ConfigIssue]:
    """``evaluation.metric`` is one that evaluation produces for every arm's labeler."""
    ev = spec.evaluation
    metric = ev.metric if "/" in ev.metric else f"eval/{ev.metric}"
    where: FieldPath = ("evaluation", "metric")
    counted = [canonical.EVAL_EXACT_MATCH] + ([f"eval/pass@{ev.pass_at_k}"] if ev.pass_at_k else [])
    known = [canonical.EVAL_SCORE, canonical.EVAL_RESPONSE_LENGTH, *counted]
    if metric not in known:
        hint = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
        return [
            locator.issue(
                where,
                f"evaluation produces no metric {ev.metric!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (it produces {', '.join(known)}"
                + ("" if ev.pass_at_k else "; eval/pass@k with evaluation.pass_at_k set")
                + ")",
            )
        ]
    if metric != canonical.EVAL_EXACT_MATCH:
        return []
    scorers = [
        arm
        for arm, built in components.items()
        if getattr(built.get(EVAL_LABELER, built.get("labeler")), "marks_correct", None) is False
    ]
    if not scorers:
        return []
    return [
        locator.issue(
            where,
            f"exact_match counts the responses a labeler marks correct, and the labeler of "
            f"arm(s) {', '.join(scorers)} only scores; compare on 'score' instead",
        )
    ]


def _looks_local(value: str) -> bool:
    """A path rather than a hub id ('org/name'): absolute, relative with ./ or ../, ~, or
    more than one '/'."""
    return value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1


def model_path_issues(spec: ExperimentSpec, locator: Locator) -> list[ConfigIssue]:
    """Every local model folder an arm names exists (hub ids cannot be checked offline), and
    so does every data file or folder. A model an arm inherits is one problem, reported at
    ``model.<field>`` on the line where the arm or the shared ``model`` section writes it."""
    lines = locator.index.lines
    issues: dict[str, ConfigIssue] = {}
    for arm_name, arm in spec.arms.items():
        for field_name in ("policy", "reward_model"):
            value = getattr(arm.model, field_name)
            if not value or value == "embedded" or not _looks_local(value):
                continue
            folder = Path(value).expanduser()
            if folder.is_dir():
                continue
            at: FieldPath = ("arms", arm_name, "model", field_name)
            line = lines.get(at) or lines.get(("model", field_name))
            state = "is a file, not a model folder" if folder.exists() else "does not exist"
            issues.setdefault(
                f"{field_name}:{value}",
                ConfigIssue(
                    locator.file,
                    line or locator.index.line_of(at),
                    f"model.{field_name}",
                    f"{value!r} {state} (a folder written by save_pretrained is expected)",
                ),
            )
    for field_name in ("train", "eval"):
        value = getattr(spec.data, field_name)
        if not isinstance(
            value, str
        ):  # a generator (reasoning_gym, verifiers): checked when opened
            continue
        if value == "embedded" or Path(value).expanduser().exists():
            continue
        issues[f"data:{field_name}"] = locator.issue(
            ("data", field_name),
            f"{value!r} does not exist (give 'embedded', a jsonl / parquet file or a dataset "
            "folder written by save_to_disk)"
            + (
                "; it looks like a Hugging Face Hub dataset id, which alignzoo does not "
                f"download: save it once with datasets.load_dataset({value!r}).save_to_disk(DIR)"
                " and give DIR"
                if value.count("/") == 1 and not value.startswith((".", "/", "~"))
                else ""
            ),
        )
    return list(issues.values())
