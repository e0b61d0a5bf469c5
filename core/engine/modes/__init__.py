"""Data modes: where a step's batch comes from, what it holds and how it counts.

An algorithm declares the kind of data it learns from (``AlgorithmRequirements.data``); with
the arm's ``online`` setting that picks one mode:

================== ======================================= =====================================
mode               batch                                   module
================== ======================================= =====================================
online samples     ``prompts x samples_per_prompt`` sampled :mod:`~alignzoo.engine.modes.samples`
                   and scored (PPO, GRPO, RLOO, ...)
online pairs       per prompt, best vs worst sample (DPO)  :mod:`~alignzoo.engine.modes.preference`
offline preference prompt / chosen / rejected rows         :mod:`~alignzoo.engine.modes.preference`
online unpaired    sampled, labelled desirable or not (KTO) :mod:`~alignzoo.engine.modes.unpaired`
offline unpaired   prompt / completion / label rows        :mod:`~alignzoo.engine.modes.unpaired`
offline            prompt / completion rows imitated (SFT) :mod:`~alignzoo.engine.modes.demonstrations`
demonstrations
================== ======================================= =====================================

A mode owns the dataset columns it reads, how it builds the step's :class:`RolloutBatch`
(:meth:`DataMode.collect`, then :meth:`DataMode.select` after the no-grad forward passes),
anything more it computes without gradients (:meth:`DataMode.prepare`, after batch
transforms), which samples minibatching must keep together (:attr:`DataMode.unit`) and how a
step counts towards the budget (:meth:`DataMode.step_sizes`). The engine has no branch on an
algorithm or a data kind: a new algorithm with a new data need adds a mode here and names its
kind, and touches nothing else in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignzoo.engine.modes import demonstrations, preference, samples, unpaired
from alignzoo.engine.modes.base import (
    Collected,
    DataMode,
    StepSource,
    correct_flags,
    labeled,
    part_rewards,
    read_rows,
    sample,
    sample_and_label,
    split_rows,
)
from alignzoo.errors import RunError

if TYPE_CHECKING:
    from alignzoo.types import AlgorithmRequirements

__all__ = [
    "Collected",
    "DataMode",
    "StepSource",
    "correct_flags",
    "labeled",
    "part_rewards",
    "read_rows",
    "required_columns",
    "sample",
    "sample_and_label",
    "select_mode",
    "split_rows",
]


def _mode_classes() -> dict[tuple[str, bool], type[DataMode]]:
    """(data kind, online) -> the mode: the one table of data modes."""
    return {
        ("online", True): samples.OnlineSamples,
        ("preference", True): preference.OnlinePairs,
        ("preference", False): preference.OfflinePreference,
        ("unpaired", True): unpaired.OnlineUnpaired,
        ("unpaired", False): unpaired.OfflineUnpaired,
        ("demonstrations", False): demonstrations.OfflineDemonstrations,
    }


def select_mode(requirements: AlgorithmRequirements, online: bool) -> DataMode:
    """The data mode for an algorithm's data kind, sampled online or read offline (online data
    is always sampled)."""
    # online data is always sampled; demonstrations are always read (no online mode for them)
    kind = requirements.data
    key = (kind, (online or kind == "online") and kind != "demonstrations")
    modes = _mode_classes()
    if key not in modes:
        raise RunError(f"no data mode for data kind {requirements.data!r}")
    mode = modes[key]()
    mode.on_policy_fraction = requirements.on_policy_fraction
    return mode


def required_columns(kind: str) -> tuple[str, ...]:
    """The columns a data file of ``kind`` (online, preference, unpaired, demonstrations) must
    have: those of the mode that reads such a file (the online one for prompts, the offline one
    otherwise)."""
    mode = _mode_classes().get((kind, kind == "online"))
    if mode is None:
        raise ValueError(
            f"mode must be one of online, preference, unpaired, demonstrations, got {kind!r}"
        )
    return mode.columns
