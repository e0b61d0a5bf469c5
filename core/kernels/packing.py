"""Sequence packing: a batch's samples laid end to end in a few rows, without padding.

A padded batch is ``[B, P + R]``: each prompt left-padded to the longest prompt, each response
right-padded to the longest response. Packed, every sample's real tokens (its prompt's, then its
response's attended ones) are placed one after another in rows of at most ``length`` tokens
(best-fit decreasing); the rows are ``[N, L]`` with ``N <= B`` and ``L`` at most the longest
sample's length or ``length``. Each sample keeps its own positions (0, 1, 2, ... from its first
token, as :func:`~alignzoo.kernels.forward.model_inputs` gives it unpacked) and attends only to
its own earlier tokens:

    attend(i, j) = [segment(i) == segment(j)] and j <= i

so a packed forward computes the same logits at each real token as the padded one (up to
floating-point summation order), and the loss over them is the same (tested).

:class:`PackedRows` gathers what the packed forward returns at the positions that predict each
response token back into the batch's ``[B, R]`` layout, so nothing after the forward pass
(warping, log-probs, losses, metrics) knows the batch was packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignzoo.batch import RolloutBatch


@dataclass(frozen=True)
class Packing:
    """How a forward pass packs its batch: rows of at most ``length`` tokens (None: the
    longest sample's length, so no row is longer than the padded batch's)."""

    length: int | None = None


@dataclass
class PackedRows:
    """A batch packed into ``[N, L]`` rows and the way back to its ``[B, R]`` layout.

    ``input_ids``, ``position_ids`` and ``segments`` are ``[N, L]``; ``segments`` holds each
    token's sample index + 1 and 0 on the rows' padding. ``row`` and ``column`` ``[B, R]`` name
    the packed position whose output predicts each response token (response padding points at
    the one that predicts the sample's last response token: a finite value, masked like padding
    is unpacked).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        """``[N, L]`` bool: the rows' real tokens (not padding)."""
        return self.segments > 0

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive ``[N, 1, L, L]`` mask (0 where a query sees a key, the dtype's lowest
        value where not) that a transformers model takes as a ready 4-D attention mask; a
        padding position sees itself only, so no softmax row is empty."""
        return torch.zeros(self.see().shape, dtype=dtype, device=self.segments.device).masked_fill_(
            ~self.see(), torch.finfo(dtype).min
        )

    def see(self) -> torch.Tensor:
        """``[N, 1, L, L]`` bool: query ``i`` sees key ``j`` (same sample, ``j <= i``; itself)."""
        width = self.segments.shape[1]
        index = torch.arange(width, device=self.segments.device)
        causal = index[None, :] <= index[:, None]  # [L, L]: key j at or before query i
        same = self.segments[:, :, None] == self.segments[:, None, :]  # [N, L, L]
        own = (self.segments > 0)[:, :, None] & same & causal[None]
        return (own | torch.eye(width, dtype=torch.bool, device=index.device)[None]).unsqueeze(1)

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed [N, L, ...]`` (logits, hidden states, values) at each response token's
        predicting position: ``[B, R, ...]``."""
        row, column = self.row.to(packed.device), self.column.to(packed.device)
        return packed[row, column]


def _response_attended(batch: RolloutBatch) -> torch.Tensor:
    if batch.response_attention is not None:
        return batch.response_attention > 0
    return batch.response_mask > 0


def _best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the fullest row it fits (best-fit
    decreasing), a new row when none has room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        fits = [r for r in range(len(rows)) if room[r] >= size]
        if fits:
            best = min(fits, key=lambda r: room[r])
            rows[best].append(index)
            room[best] -= size
        else:
            rows.append([index])
            room.append(capacity - size)
    return rows


def pack(batch: RolloutBatch, packing: Packing) -> PackedRows | None:
    """``batch`` packed as :class:`Packing` says, or None when it cannot be without changing
    what the model sees: a sample with no prompt token, or a response whose attended tokens
    are not a prefix of it (the caller then runs the padded forward)."""
    # The rows are laid out on the CPU (a batch already on an accelerator is read from there);
    # the forward pass moves them to the model.
    prompt_ids, response_ids = batch.prompt_ids.cpu(), batch.response_ids.cpu()
    prompt_real = batch.prompt_mask.cpu() > 0
    attended = _response_attended(batch).cpu()
    prompt_len = prompt_real.sum(dim=1)
    response_len = attended.sum(dim=1)
    resp_width = batch.response_ids.shape[1]
    positions = torch.arange(resp_width)
    if bool((prompt_len == 0).any()):
        return None  # the first response token would have nothing to be predicted from
    if not bool((attended == (positions[None, :] < response_len[:, None])).all()):
        return None  # attended tokens after a gap: the padded forward sees them otherwise
    lengths = (prompt_len + response_len).tolist()
    capacity = max(max(lengths), packing.length or 0)
    rows = _best_fit(lengths, capacity)
    width = max(sum(lengths[i] for i in members) for members in rows)
    input_ids = torch.zeros(len(rows), width, dtype=prompt_ids.dtype)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.zeros(len(rows), width, dtype=torch.long)
    row = torch.zeros(batch.size, resp_width, dtype=torch.long)
    column = torch.zeros(batch.size, resp_width, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for sample in members:
            tokens = torch.cat(
                [prompt_ids[sample][prompt_real[sample]], response_ids[sample][attended[sample]]]
            )
            end = start + len(tokens)
            input_ids[r, start:end] = tokens
            position_ids[r, start:end] = torch.arange(len(tokens))
            segments[r, start:end] = sample + 1
            # response token t is predicted at the sample's position P_b + t - 1
            first = start + int(prompt_len[sample]) - 1
            predict = first + positions.clamp(max=max(int(response_len[sample]) - 1, 0))
            row[sample] = r
            column[sample] = predict.clamp(max=end - 1)
            start = end
    return PackedRows(input_ids, position_ids, segments, row, column)


def padding_fraction(batch: RolloutBatch, packing: Packing | None) -> float:
    """The share of a forward pass's positions that are padding: of the padded ``[B, P + R]``
    rows, or of the packed rows when ``packing`` packs the batch."""
    real = int((batch.prompt_mask > 0).sum()) + int(_response_attended(batch).sum())
    rows, width = batch.size, batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    packed = pack(batch, packing) if packing is not None else None
    if packed is not None:
        rows, width = packed.input_ids.shape
    return 1.0 - real / max(rows * width, 1)
