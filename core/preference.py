"""Helpers for pairwise preference losses (DPO, SimPO, IPO, ... and your own).

A preference batch holds pairs: the two responses of a pair share a ``group_ids`` value, the
chosen one has ``labels == 1.0`` and the rejected one ``0.0``. The engine's preference data
modes (:mod:`alignzoo.engine.modes.preference`) build such batches offline from
prompt / chosen / rejected rows or online from scored samples; these helpers read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError

if TYPE_CHECKING:
    import torch

    from alignzoo import ops
    from alignzoo.batch import RolloutBatch
    from alignzoo.types import LossContext
else:
    torch = lazy_import("torch")
    ops = lazy_import("alignzoo.ops")


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π(y|x) = Σ_t log π(y_t | x, y_<t) over real tokens: ``[B, R]`` -> ``[B]``."""
    return ops.masked_sum(logprobs, mask, dim=-1)


def require_labels(batch: RolloutBatch, algorithm: str) -> torch.Tensor:
    """``batch.labels``, or a UserError saying that preference data is needed."""
    if batch.labels is None:
        raise UserError(
            f"{algorithm} needs batch.labels (1.0 chosen / 0.0 rejected per sample); "
            "use preference data (prompt / chosen / rejected) or run the arm online"
        )
    return batch.labels


def pair_indices(
    group_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair samples by group id: returns (chosen rows, rejected rows), both ``[N]``, sorted by group.

    Each group must hold exactly one sample labelled 1.0 (chosen) and one labelled 0.0
    (rejected); anything else raises :class:`UserError` naming the group and its rows.
    """
    chosen_of: dict[int, list[int]] = {}
    rejected_of: dict[int, list[int]] = {}
    for row, (group, label) in enumerate(zip(group_ids.tolist(), labels.tolist(), strict=True)):
        if label == 1.0:
            chosen_of.setdefault(group, []).append(row)
        elif label == 0.0:
            rejected_of.setdefault(group, []).append(row)
        else:
            raise UserError(
                f"batch.labels row {row} is {label!r}; expected 1.0 (chosen) or 0.0 (rejected)"
            )
    chosen: list[int] = []
    rejected: list[int] = []
    for group in sorted(set(chosen_of) | set(rejected_of)):
        c, r = chosen_of.get(group, []), rejected_of.get(group, [])
        if len(c) != 1 or len(r) != 1:
            raise UserError(
                f"preference group {group} (rows {sorted(c + r)}) has {len(c)} chosen and "
                f"{len(r)} rejected samples; expected exactly one of each "
                "(batch.labels 1.0 / 0.0 sharing a batch.group_ids value)"
            )
        chosen.append(c[0])
        rejected.append(r[0])
    device = group_ids.device
    return (
        torch.tensor(chosen, dtype=torch.long, device=device),
        torch.tensor(rejected, dtype=torch.long, device=device),
    )


def pair_weights(
    weights: torch.Tensor | None, chosen: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor | None:
    """Weight of each pair: the mean of its chosen and rejected samples' weights (None if unset)."""
    if weights is None:
        return None
    return 0.5 * (weights[chosen] + weights[rejected])


def mean_over_pairs(
    losses: torch.Tensor, weights: torch.Tensor | None, context: LossContext | None
) -> torch.Tensor:
    """The batch loss from per-pair losses ``[N]``: Σ w·ℓ over this micro-batch's pairs divided by
    the pairs of the whole optimizer step (``context.groups``; this micro-batch's when None)."""
    weighted = losses if weights is None else weights * losses
    pairs = context.groups if context is not None else losses.shape[0]
    return weighted.sum() / max(1, pairs)


def preference_metrics(
    prefix: str,
    loss: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, float]:
    """The metrics every pairwise preference loss reports, as plain floats, under ``prefix/``.

    ``prefix/loss`` is the mean pair loss of the micro-batch; ``prefix/rewards/*`` the implicit
    rewards of chosen and rejected responses, their margin and how often chosen wins.
    """
    return {
        f"{prefix}/loss": float(loss.detach()),
        f"{prefix}/rewards/chosen": float(chosen_rewards.mean()),
        f"{prefix}/rewards/rejected": float(rejected_rewards.mean()),
        f"{prefix}/rewards/margin": float((chosen_rewards - rejected_rewards).mean()),
        f"{prefix}/rewards/accuracy": float((chosen_rewards > rejected_rewards).float().mean()),
        f"{prefix}/logps/chosen": float(chosen_logps.detach().mean()),
        f"{prefix}/logps/rejected": float(rejected_logps.detach().mean()),
    }
