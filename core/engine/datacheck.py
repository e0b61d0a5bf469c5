"""The data check that ``alignzoo validate`` and ``alignzoo run`` make before any model loads.

Every arm reads ``data.train`` in the columns of its data mode (online prompts, preference
pairs, unpaired feedback) and ``data.eval`` as prompts. Each source is opened and checked the
way a run reads it (:func:`alignzoo.engine.datasets.load_split`: columns, types, empty prompts,
split names), once per kind of data rather than once per arm or seed; conversational data is
also checked against the arm's policy tokenizer (it needs a chat template); a teacher must
tokenize as the policy does (a served one must also answer and serve its model). Every ``python``
labeler an arm uses (its labeler, fallbacks and ``combine`` parts) is called once on the first
row of the data it will label, as a training step calls it, so a reward function that cannot
be called is refused here rather than minutes into a run. A problem is a
:class:`~alignzoo.errors.ConfigError` naming the experiment field, the data file, the row and
the column (exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alignzoo.config.loader import LoadedExperiment
from alignzoo.errors import ConfigError, ConfigIssue, UserError


def _data_kind(loaded: LoadedExperiment, arm: str) -> str:
    from alignzoo.engine.assemble import arm_is_online
    from alignzoo.engine.modes import select_mode
    from alignzoo.registry import build_plugin_manager

    spec = loaded.spec
    algorithm = loaded.components[arm]["algorithm"]
    requirements = build_plugin_manager([algorithm]).hook.algorithm_requirements()
    mode = select_mode(requirements, arm_is_online(spec, spec.arms[arm]))
    return "online" if mode.online else mode.kind


def _tokenizer(policy: str) -> Any:
    """The policy's tokenizer, when it can be had without loading a model: the embedded one,
    or a local folder's; None for a hub id (checked when the run loads it)."""
    if policy == "embedded":
        from alignzoo.world.tokenizer import build_tokenizer

        return build_tokenizer()
    folder = Path(policy).expanduser()
    if not folder.is_dir():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def check_data(loaded: LoadedExperiment) -> None:
    """Open and check every data source each arm reads; raise ConfigError listing problems."""
    from alignzoo.engine.datasets import is_conversational, load_split, render

    spec = loaded.spec
    issues: list[ConfigIssue] = []
    seen: dict[tuple[str, str], Any] = {}
    for arm in spec.arms:
        try:
            kind = _data_kind(loaded, arm)
        except Exception:  # the component's own problem: the run reports it
            continue
        for split, wanted in (("train", kind), ("eval", "online")):
            field = f"data.{split}"
            key = (split, wanted)
            if key not in seen:
                try:
                    seen[key] = load_split(spec.data, split, wanted)  # type: ignore[arg-type]
                except UserError as exc:
                    seen[key] = None
                    issues.append(ConfigIssue(loaded.source, None, field, f"{exc} ({wanted} data)"))
            dataset = seen[key]
            if dataset is None:
                continue
            policy = spec.arms[arm].model.policy
            labels_it = (split == "train") == (kind == "online")  # what the labelers score
            if not is_conversational(dataset):
                if labels_it and len(dataset):
                    issues += _dry_call_issues(loaded, arm, dict(dataset[0]), policy, field)
                continue
            try:
                tokenizer = _tokenizer(policy)
                if tokenizer is not None:
                    rendered = render(dataset.select(range(min(len(dataset), 8))), tokenizer,
                                      wanted, getattr(spec.data, split))  # fmt: skip
                    if labels_it and len(rendered):
                        issues += _dry_call_issues(loaded, arm, dict(rendered[0]), policy, field)
            except UserError as exc:
                issues.append(ConfigIssue(loaded.source, None, field, f"arm {arm}: {exc}"))
            except OSError as exc:
                issues.append(
                    ConfigIssue(
                        loaded.source, None, f"arms.{arm}.model.policy",
                        f"cannot read the tokenizer of {policy}: {exc}",
                    )
                )  # fmt: skip
        issues += _model_issues(loaded, arm)
        issues += _teacher_issues(loaded, arm)
        mirror = spec.arms[arm].training.checkpoint_mirror
        if mirror:
            from alignzoo.engine.mirror import open_mirror

            field = f"arms.{arm}.training.checkpoint_mirror"
            try:
                open_mirror(mirror, field)
            except UserError as exc:
                issues.append(ConfigIssue(loaded.source, None, field, str(exc)))
    unique = list({str(i): i for i in issues}.values())
    if unique:
        raise ConfigError(unique)


def _model_issues(loaded: LoadedExperiment, arm: str) -> list[ConfigIssue]:
    """What the arm's backend says it cannot run of the arm's policy (its ``check_model``,
    given the policy's Hugging Face config: the embedded world's shape, or config.json)."""
    backend = loaded.components.get(arm, {}).get("backend")
    check = getattr(backend, "check_model", None)
    if not callable(check):
        return []
    model = loaded.spec.arms[arm].model
    if model.policy == "embedded":
        shape = model.embedded
        config = {"hidden_size": shape.hidden_size, "num_attention_heads": shape.num_heads}
    else:
        try:
            config = json.loads((Path(model.policy) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []  # the model check reports an unreadable policy folder
    problem = check(config)
    if not problem:
        return []
    return [ConfigIssue(loaded.source, None, f"arms.{arm}.backend", f"arm {arm}: {problem}")]


def _teacher_issues(loaded: LoadedExperiment, arm: str) -> list[ConfigIssue]:
    """A teacher given as a folder must exist and tokenize as the policy does (distillation
    compares log-probs token by token); both tokenizers are named when they differ."""
    model = loaded.spec.arms[arm].model
    teacher = model.teacher
    if teacher is not None and teacher.served is not None:
        return _served_teacher_issues(loaded, arm)
    if teacher is None or teacher.path is None:
        return []  # none, or the embedded world's (the policy's own tokenizer)
    field = f"arms.{arm}.model.teacher.path"
    folder = Path(teacher.path).expanduser()
    if not folder.is_dir():
        why = f"{teacher.path!r} is not a folder (a local checkpoint written by save_pretrained)"
        return [ConfigIssue(loaded.source, None, field, why)]
    try:
        own_tokenizer = _tokenizer(model.policy)
        if own_tokenizer is None:
            return []  # a hub policy: compared when the run loads it
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(str(folder)).get_vocab()
    except (OSError, ValueError) as exc:
        return [ConfigIssue(loaded.source, None, field, f"cannot read a tokenizer: {exc}")]
    own = own_tokenizer.get_vocab()
    if own == theirs:
        return []
    differ = len(set(own.items()) ^ set(theirs.items()))
    why = (
        f"the teacher's tokenizer ({teacher.path}, {len(theirs)} tokens) is not the policy's "
        f"({model.policy}, {len(own)} tokens; {differ} token ids differ): distillation "
        "compares log-probs token by token, so both must tokenize alike"
    )
    return [ConfigIssue(loaded.source, None, field, why)]


def _served_teacher_issues(loaded: LoadedExperiment, arm: str) -> list[ConfigIssue]:
    """A served teacher must answer, serve its ``model`` and tokenize as the policy does
    (:meth:`~alignzoo.engine.served.ServedTeacher.problems`: GET /v1/models, POST /tokenize
    with a probe, the ``tokenizer`` folder's vocabulary); a hub policy's tokenizer is compared
    when the run loads it."""
    from alignzoo.engine.served import ServedTeacher

    model = loaded.spec.arms[arm].model
    assert model.teacher is not None and model.teacher.served is not None
    try:
        tokenizer = _tokenizer(model.policy)
    except (OSError, ValueError):
        tokenizer = None  # the policy's own check reports it
    teacher = ServedTeacher(model.teacher.served, f"arms.{arm}.model.teacher.served")
    try:
        found = teacher.problems(tokenizer)
    finally:
        teacher.close()
    at = ("arms", arm, "model", "teacher", "served")
    return [loaded.issue((*at, sub), why) for sub, why in found]


DRY_RESPONSE = "a response"
"""The completion a validate-time call of a reward function scores."""


def _parts(field: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in field.split(".")]


def _dry_callable_labelers(
    component: Any, path: tuple[str | int, ...]
) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(experiment field, labeler) for every labeler in ``component`` that can be dry-called
    (it has ``dry_call(request, where) -> str``, as the ``python`` labeler does), looking inside
    ``combine`` parts."""
    if callable(getattr(component, "dry_call", None)):
        yield path, component
    for i, (_, manager) in enumerate(getattr(component, "parts", None) or []):
        for part in manager.get_plugins():
            yield from _dry_callable_labelers(part, (*path, "params", "labelers", i))


def _dry_call_issues(
    loaded: LoadedExperiment, arm: str, row: dict[str, Any], policy: str, source: str
) -> list[ConfigIssue]:
    """Call each python labeler of ``arm`` once on ``row`` (the first of ``source``) with a
    placeholder completion (its ids from the policy's tokenizer when that can be read without
    a model, else none)."""
    from alignzoo.engine.modes.base import split_rows
    from alignzoo.labeling import LabelRequest

    labelers = [
        found
        for field, component in loaded.components.get(arm, {}).items()
        if field == "labeler" or field.startswith("labeling.fallbacks.")
        for found in _dry_callable_labelers(component, ("arms", arm, *_parts(field)))
        if getattr(found[1].params, "validate_call", True)
    ]
    if not labelers:
        return []
    try:
        tokenizer = _tokenizer(policy)
    except OSError:
        tokenizer = None
    ids = tokenizer(DRY_RESPONSE, add_special_tokens=False)["input_ids"] if tokenizer else []
    (prompt,), (extra,) = split_rows([row])
    request = LabelRequest(prompt, DRY_RESPONSE, extra, completion_ids=list(ids), step=1)
    issues = []
    for path, labeler in labelers:
        problem = labeler.dry_call(request, f"the first row of {source}")
        if problem:
            issues.append(loaded.issue(path, problem))
    return issues
