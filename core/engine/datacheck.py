"""The data check that ``alignzoo validate`` and ``alignzoo run`` make before any model loads.

Every arm reads ``data.train`` in the columns of its data mode (online prompts, preference
pairs, unpaired feedback) and ``data.eval`` as prompts. Each source is opened and checked the
way a run reads it (:func:`alignzoo.engine.datasets.load_split`: columns, types, empty prompts,
split names), once per kind of data rather than once per arm or seed; conversational data is
also checked against the arm's policy tokenizer (it needs a chat template). A problem is a
:class:`~alignzoo.errors.ConfigError` naming the experiment field, the data file, the row and
the column (exit 2).
"""

from __future__ import annotations

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
            if dataset is None or not is_conversational(dataset):
                continue
            policy = spec.arms[arm].model.policy
            try:
                tokenizer = _tokenizer(policy)
                if tokenizer is not None:
                    render(dataset.select(range(min(len(dataset), 8))), tokenizer, wanted,
                           getattr(spec.data, split))  # fmt: skip
            except UserError as exc:
                issues.append(ConfigIssue(loaded.source, None, field, f"arm {arm}: {exc}"))
            except OSError as exc:
                issues.append(
                    ConfigIssue(
                        loaded.source, None, f"arms.{arm}.model.policy",
                        f"cannot read the tokenizer of {policy}: {exc}",
                    )
                )  # fmt: skip
    unique = list({str(i): i for i in issues}.values())
    if unique:
        raise ConfigError(unique)
