"""Hypothesis strategies for algorithm batches, and a builder for hand-written ones.

Everything here produces the two objects an algorithm's hooks receive, a
:class:`~alignzoo.batch.RolloutBatch` and a :class:`~alignzoo.batch.PolicyOutputs`, either from
hypothesis draws or from explicit numbers:

- :func:`make_batch` builds them from nested lists or tensors (golden-value tests).
- :func:`logprob_values`, :func:`extreme_logprob_values`: per-token log-probs in [-50, 0], with
  the edges (exactly 0, just below 0, -50) drawn often.
- :func:`response_lengths`, :func:`response_masks`: right-padded masks with any amount of padding
  and at least one real token per row.
- :func:`rewards`, :func:`group_ids`, :func:`preference_pairs`, :func:`unpaired_labels`: the
  per-sample columns of online, preference and unpaired data.
- :func:`batch_cases`: a whole :class:`BatchCase` for given :class:`AlgorithmRequirements`
  (fills ``old_logprobs``/``scores`` for online data, ``ref_logprobs`` for a reference,
  ``teacher_logprobs`` for a teacher,
  ``values`` for a critic, ``labels`` for preference/unpaired data, the unpaired mode's
  ``mismatched_*`` sequence log-probs, ``entropy``), and :func:`batches` which builds it into
  tensors.

A :class:`BatchCase` is plain Python numbers, so hypothesis prints a falsifying example you can
paste back (``BatchCase(...).build()``), and so the contract suite can pad, permute and relabel
it before building fresh tensors. Example, in a plugin's own tests::

    from hypothesis import given
    from alignzoo.testing.strategies import batch_cases
    from alignzoo.types import AlgorithmRequirements

    @given(batch_cases(AlgorithmRequirements(data="online")))
    def test_my_loss_is_finite(case):
        batch, outputs = case.build()
        ...

Values on padding positions are arbitrary (not zero): an algorithm must not read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from hypothesis import strategies as st

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.types import AlgorithmRequirements

__all__ = [
    "LOGPROB_MIN",
    "SAMPLE_FIELDS",
    "TOKEN_FIELDS",
    "BatchCase",
    "batch_cases",
    "batches",
    "extreme_logprob_values",
    "group_ids",
    "logprob_values",
    "make_batch",
    "padding_fill",
    "preference_pairs",
    "response_lengths",
    "response_masks",
    "rewards",
    "unpaired_labels",
]

LOGPROB_MIN = -50.0
"""The most negative per-token log-prob the strategies draw (a token the policy all but rules out)."""

Rows = tuple[tuple[float, ...], ...]

VOCABULARY = 32
"""Token ids of a case are below this; it is the vocabulary of whole-distribution cases."""

TOKEN_FIELDS = (
    "logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "values",
    "policy_values",
    "entropy",
    "log_sum_sq_probs",
)
"""Per-token ``[B, R]`` fields of a :class:`BatchCase`."""

SAMPLE_FIELDS = (
    "scores",
    "labels",
    "weights",
    "mismatched_logprobs",
    "mismatched_ref_logprobs",
)
"""Per-sample ``[B]`` fields of a :class:`BatchCase`."""


# --------------------------------------------------------------------------- building tensors


def _tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().to(dtype)
    return torch.tensor(value, dtype=dtype)


def make_batch(
    logprobs: Any,
    *,
    mask: Any = None,
    group_ids: Any = None,
    labels: Any = None,
    ref_logprobs: Any = None,
    old_logprobs: Any = None,
    teacher_logprobs: Any = None,
    values: Any = None,
    scores: Any = None,
    weights: Any = None,
    entropy: Any = None,
    log_sum_sq_probs: Any = None,
    policy_values: Any = None,
    mismatched_logprobs: Any = None,
    mismatched_ref_logprobs: Any = None,
    advantages: Any = None,
    returns: Any = None,
    response_ids: Any = None,
    vocabulary: int | None = None,
    dense_rewards: Any = None,
    dense_mask: Any = None,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = True,
) -> tuple[RolloutBatch, PolicyOutputs]:
    """Build a (RolloutBatch, PolicyOutputs) pair from nested lists or tensors.

    ``logprobs`` ``[B, R]`` become ``outputs.logprobs``, a fresh leaf tensor with
    ``requires_grad`` (read its ``.grad`` after ``loss.backward()``); so do ``policy_values``
    (``outputs.values``). ``entropy`` and ``log_sum_sq_probs`` fill the ``outputs`` fields of
    those names (without gradients). ``mismatched_logprobs`` and ``mismatched_ref_logprobs`` go to
    ``batch.columns`` under those names (what the unpaired data mode computes, without
    gradients). ``mask`` defaults to all ones, ``group_ids`` to one group per sample,
    ``response_ids`` to token 1 everywhere. Every other argument fills the batch field of the
    same name (``values`` is the critic's rollout-time ``batch.values``).

    ``vocabulary`` V (for an algorithm that asks for ``teacher_logits``) adds whole
    distributions: ``outputs.logits`` ``[B, R, V]``, the leaf with ``requires_grad``, puts each
    response token's log-prob on it and spreads the rest evenly over the other V - 1 tokens
    (``outputs.logprobs`` is then their log-softmax at the response tokens, computed from
    them); ``outputs.teacher_logits`` does the same from ``teacher_logprobs``.
    """
    logp = _tensor(logprobs, dtype)
    if logp.dim() != 2:
        raise ValueError(f"logprobs must be [B, R], got shape {tuple(logp.shape)}")
    size, width = logp.shape
    response_mask = torch.ones(size, width, dtype=dtype) if mask is None else _tensor(mask, dtype)
    groups = torch.arange(size) if group_ids is None else _tensor(group_ids, torch.long)
    ids = (
        torch.ones(size, width, dtype=torch.long)
        if response_ids is None
        else _tensor(response_ids, torch.long)
    )
    prompt_ids = torch.stack([groups % 97 + 2, torch.full_like(groups, 1)], dim=1)

    def opt(value: Any, value_dtype: torch.dtype = dtype) -> torch.Tensor | None:
        return None if value is None else _tensor(value, value_dtype)

    def leaf(value: Any) -> torch.Tensor | None:
        tensor = opt(value)
        if tensor is not None and requires_grad:
            tensor.requires_grad_(True)
        return tensor

    score_tensor = opt(scores)
    columns = {
        name: tensor
        for name, tensor in (
            ("mismatched_logprobs", opt(mismatched_logprobs)),
            ("mismatched_ref_logprobs", opt(mismatched_ref_logprobs)),
        )
        if tensor is not None
    }
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        response_ids=ids,
        response_mask=response_mask,
        group_ids=groups,
        prompts=[f"prompt {int(g)}" for g in groups],
        responses=[" ".join(str(t) for t in row) for row in ids.tolist()],
        extras=[{} for _ in range(size)],
        old_logprobs=opt(old_logprobs),
        ref_logprobs=opt(ref_logprobs),
        teacher_logprobs=opt(teacher_logprobs),
        values=opt(values),
        scores=score_tensor,
        score_valid=None if score_tensor is None else torch.ones(size, dtype=torch.bool),
        labels=opt(labels),
        weights=opt(weights),
        advantages=opt(advantages),
        returns=opt(returns),
        dense_rewards=opt(dense_rewards),
        dense_mask=opt(dense_mask),
        columns=columns,
    )
    if vocabulary is not None:
        logits = spread_logits(logp, ids, vocabulary)
        if requires_grad:
            logits.requires_grad_(True)
        teacher = batch.teacher_logprobs
        outputs = PolicyOutputs(
            logprobs=torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None])[..., 0],
            entropy=opt(entropy),
            values=leaf(policy_values),
            logits=logits,
            teacher_logits=None if teacher is None else spread_logits(teacher, ids, vocabulary),
            log_sum_sq_probs=opt(log_sum_sq_probs),
        )
        return batch, outputs
    if requires_grad:
        logp.requires_grad_(True)
    outputs = PolicyOutputs(
        logprobs=logp,
        entropy=opt(entropy),
        values=leaf(policy_values),
        log_sum_sq_probs=opt(log_sum_sq_probs),
    )
    return batch, outputs


def spread_logits(logprobs: torch.Tensor, ids: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Logits ``[B, R, V]`` whose log-softmax gives each token ``ids[b, t]`` the log-prob
    ``logprobs[b, t]`` (to within 1e-6 of the rest's floor) and the other V - 1 tokens equal
    shares of what is left."""
    rest = torch.log(torch.clamp(-torch.expm1(logprobs.detach()), min=1e-6) / (vocabulary - 1))
    logits = rest[..., None].expand(*logprobs.shape, vocabulary).clone()
    return logits.scatter(-1, ids[..., None], logprobs.detach()[..., None])


# --------------------------------------------------------------------------- the case record


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return repr(float(value))
    return repr(value)


@dataclass(frozen=True, repr=False)
class BatchCase:
    """A batch as plain numbers: what a strategy draws and a falsifying example prints.

    ``lengths[i]`` real tokens in row i (then padding up to the width ``R``); every per-token
    field (:data:`TOKEN_FIELDS`) is ``B`` rows of ``R`` floats, the values past ``lengths[i]``
    being arbitrary padding; per-sample fields (:data:`SAMPLE_FIELDS`) are ``B`` floats. A field
    is None when the requirements do not ask for it. ``build()`` turns the case into tensors.
    """

    lengths: tuple[int, ...]
    group_ids: tuple[int, ...]
    response_ids: tuple[tuple[int, ...], ...]
    logprobs: Rows
    old_logprobs: Rows | None = None
    ref_logprobs: Rows | None = None
    teacher_logprobs: Rows | None = None
    values: Rows | None = None
    policy_values: Rows | None = None
    entropy: Rows | None = None
    log_sum_sq_probs: Rows | None = None
    scores: tuple[float, ...] | None = None
    labels: tuple[float, ...] | None = None
    weights: tuple[float, ...] | None = None
    mismatched_logprobs: tuple[float, ...] | None = None
    mismatched_ref_logprobs: tuple[float, ...] | None = None
    vocabulary: int | None = None

    @property
    def size(self) -> int:
        """Number of samples B."""
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Padded response length R."""
        return len(self.logprobs[0])

    def mask_rows(self) -> list[list[float]]:
        """The response mask as nested lists."""
        return [[1.0 if t < n else 0.0 for t in range(self.width)] for n in self.lengths]

    def build(
        self, dtype: torch.dtype = torch.float32, requires_grad: bool = True
    ) -> tuple[RolloutBatch, PolicyOutputs]:
        """Fresh tensors for this case (see :func:`make_batch`)."""
        return make_batch(
            self.logprobs,
            mask=self.mask_rows(),
            group_ids=self.group_ids,
            response_ids=self.response_ids,
            labels=self.labels,
            ref_logprobs=self.ref_logprobs,
            old_logprobs=self.old_logprobs,
            teacher_logprobs=self.teacher_logprobs,
            values=self.values,
            scores=self.scores,
            weights=self.weights,
            entropy=self.entropy,
            log_sum_sq_probs=self.log_sum_sq_probs,
            policy_values=self.policy_values,
            mismatched_logprobs=self.mismatched_logprobs,
            mismatched_ref_logprobs=self.mismatched_ref_logprobs,
            vocabulary=self.vocabulary,
            dtype=dtype,
            requires_grad=requires_grad,
        )

    def permuted(self, order: Sequence[int]) -> BatchCase:
        """The samples in ``order`` (row i of the result is row ``order[i]`` of this case)."""
        updates: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name != "vocabulary":
                updates[f.name] = tuple(value[i] for i in order)
        return replace(self, **updates)

    def relabeled(self, mapping: dict[int, int]) -> BatchCase:
        """Group ids renamed through ``mapping`` (old id -> new id)."""
        return replace(self, group_ids=tuple(mapping[g] for g in self.group_ids))

    def repadded(self, fill: dict[str, Rows], fill_ids: tuple[tuple[int, ...], ...]) -> BatchCase:
        """Same real tokens, new padding: every padding position (old and new) takes ``fill``'s value.

        ``fill`` maps each per-token field that is set to ``B`` rows of the new width (at least
        the current one); ``fill_ids`` likewise gives the padding token ids.
        """
        updates: dict[str, Any] = {}

        def merge(rows: tuple[tuple[Any, ...], ...], filler: tuple[tuple[Any, ...], ...]) -> Any:
            return tuple(
                tuple(row[t] if t < n else pad[t] for t in range(len(pad)))
                for row, pad, n in zip(rows, filler, self.lengths, strict=True)
            )

        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                updates[name] = merge(value, fill[name])
        updates["response_ids"] = merge(self.response_ids, fill_ids)
        return replace(self, **updates)

    def __repr__(self) -> str:
        parts = [f"{f.name}={_fmt(getattr(self, f.name))}" for f in fields(self)]
        set_parts = [
            p for p, f in zip(parts, fields(self), strict=True) if getattr(self, f.name) is not None
        ]
        return "BatchCase(" + ", ".join(set_parts) + ")"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis' pretty printer
        printer.text(repr(self))


# --------------------------------------------------------------------------- value strategies


def logprob_values(min_value: float = LOGPROB_MIN) -> st.SearchStrategy[float]:
    """Per-token log-probs in [min_value, 0]; 0, values just below 0 and min_value come up often."""
    return st.one_of(
        st.floats(min_value, 0.0, allow_nan=False, width=32),
        st.sampled_from([0.0, -1e-7, -1e-3, -0.5, -2.0, min_value]),
    )


def extreme_logprob_values(min_value: float = LOGPROB_MIN) -> st.SearchStrategy[float]:
    """Only the edges: log-probs within 2⁻¹⁰ of 0 (certain tokens) or within 5 of ``min_value``."""
    return st.one_of(
        st.sampled_from([0.0, -1e-8, min_value]),
        st.floats(-(2.0**-10), 0.0, width=32),
        st.floats(min_value, min_value + 5.0, width=32),
    )


def rewards(min_value: float = -10.0, max_value: float = 10.0) -> st.SearchStrategy[float]:
    """Sequence rewards (labeler scores); ties (0 and 1) come up often."""
    return st.one_of(
        st.floats(min_value, max_value, allow_nan=False, width=32), st.sampled_from([0.0, 1.0])
    )


def response_lengths(batch_size: int, width: int) -> st.SearchStrategy[list[int]]:
    """Real-token counts for ``batch_size`` rows of width ``width``: each in [1, width]."""
    return st.lists(st.integers(1, width), min_size=batch_size, max_size=batch_size)


def response_masks(batch_size: int, width: int) -> st.SearchStrategy[torch.Tensor]:
    """Right-padded float masks ``[batch_size, width]`` with at least one real token per row."""
    return response_lengths(batch_size, width).map(
        lambda lengths: (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    )


@st.composite
def group_ids(
    draw: st.DrawFn,
    min_groups: int = 1,
    max_groups: int = 3,
    min_size: int = 2,
    max_size: int = 4,
) -> list[int]:
    """Group ids of a shuffled batch: ``min_groups..max_groups`` groups of ``min_size..max_size``.

    Ids are distinct non-negative integers that need not be contiguous or start at 0, and the
    samples of a group need not be adjacent; group sizes may differ (as after a filter).
    """
    n_groups = draw(st.integers(min_groups, max_groups))
    ids = draw(st.lists(st.integers(0, 99), min_size=n_groups, max_size=n_groups, unique=True))
    sizes = draw(st.lists(st.integers(min_size, max_size), min_size=n_groups, max_size=n_groups))
    flat = [g for g, n in zip(ids, sizes, strict=True) for _ in range(n)]
    return draw(st.permutations(flat))


@st.composite
def preference_pairs(
    draw: st.DrawFn, min_pairs: int = 1, max_pairs: int = 4
) -> tuple[list[int], list[float]]:
    """(group_ids, labels) of shuffled preference pairs: one 1.0 (chosen) and one 0.0 per group."""
    n_pairs = draw(st.integers(min_pairs, max_pairs))
    ids = draw(st.lists(st.integers(0, 99), min_size=n_pairs, max_size=n_pairs, unique=True))
    rows = [(g, label) for g in ids for label in (1.0, 0.0)]
    rows = draw(st.permutations(rows))
    return [g for g, _ in rows], [label for _, label in rows]


def unpaired_labels(size: int) -> st.SearchStrategy[list[float]]:
    """``size`` labels, each 1.0 (desirable) or 0.0 (undesirable)."""
    return st.lists(st.sampled_from([1.0, 0.0]), min_size=size, max_size=size)


# --------------------------------------------------------------------------- whole batches


def _rows(draw: st.DrawFn, values: st.SearchStrategy[float], size: int, width: int) -> Rows:
    row = st.lists(values, min_size=width, max_size=width).map(tuple)
    return tuple(draw(st.lists(row, min_size=size, max_size=size)))


def _column(draw: st.DrawFn, values: st.SearchStrategy[float], size: int) -> tuple[float, ...]:
    return tuple(draw(st.lists(values, min_size=size, max_size=size)))


@st.composite
def batch_cases(
    draw: st.DrawFn,
    requirements: AlgorithmRequirements,
    *,
    max_width: int = 6,
    logprobs: st.SearchStrategy[float] | None = None,
    weighted: bool | None = None,
) -> BatchCase:
    """A :class:`BatchCase` with what ``requirements`` says the engine provides.

    - ``data="online"``: groups of 2-4 samples (:func:`group_ids`), ``scores``,
      ``old_logprobs``.
    - ``data="preference"``: 1-4 shuffled pairs (:func:`preference_pairs`), ``labels``.
    - ``data="unpaired"``: 1-8 samples with ``labels`` (:func:`unpaired_labels`).
    - ``data="demonstrations"``: 1-8 samples, a group each, nothing but the log-probs.
    - ``reference``: ``ref_logprobs``; ``critic``: ``values`` and ``policy_values``;
      ``entropy``: ``entropy``; ``log_sum_sq_probs``: ``log_sum_sq_probs`` in [-10, 0];
      unpaired data: ``mismatched_logprobs`` (and
      ``mismatched_ref_logprobs`` with a reference), sequence log-probs in [-50·R, 0].

    ``logprobs`` is the strategy of every per-token log-prob (policy, old, reference), default
    :func:`logprob_values`; ``weighted`` forces ``weights`` on (True) or off (False); by default
    they are drawn or left None.
    """
    values_of = logprobs if logprobs is not None else logprob_values()
    if requirements.data == "preference":
        groups, labels = draw(preference_pairs())
        size = len(groups)
    elif requirements.data == "unpaired":
        size = draw(st.integers(1, 8))
        labels = draw(unpaired_labels(size))
        groups = draw(st.lists(st.integers(0, size), min_size=size, max_size=size))
    elif requirements.data == "demonstrations":  # one demonstration per sample, no labels
        size = draw(st.integers(1, 8))
        labels = None
        groups = list(range(size))
    else:
        groups = draw(group_ids())
        size = len(groups)
        labels = None
    width = draw(st.integers(1, max_width))
    lengths = tuple(draw(response_lengths(size, width)))
    token_ids = st.integers(0, VOCABULARY - 1)
    response_ids = tuple(
        tuple(draw(st.lists(token_ids, min_size=width, max_size=width))) for _ in range(size)
    )
    case: dict[str, Any] = {
        "lengths": lengths,
        "group_ids": tuple(groups),
        "response_ids": response_ids,
        "logprobs": _rows(draw, values_of, size, width),
        "labels": None if labels is None else tuple(labels),
    }
    if requirements.data == "online":
        case["old_logprobs"] = _rows(draw, values_of, size, width)
        case["scores"] = _column(draw, rewards(), size)
    if requirements.reference:
        case["ref_logprobs"] = _rows(draw, values_of, size, width)
    if requirements.teacher:
        case["teacher_logprobs"] = _rows(draw, values_of, size, width)
    if requirements.teacher_logits:  # whole distributions over the ids' vocabulary
        case["vocabulary"] = VOCABULARY
    if requirements.critic:
        value_strategy = st.floats(-5.0, 5.0, width=32)
        case["values"] = _rows(draw, value_strategy, size, width)
        case["policy_values"] = _rows(draw, value_strategy, size, width)
    if requirements.entropy:
        case["entropy"] = _rows(draw, st.floats(0.0, 5.0, width=32), size, width)
    if requirements.log_sum_sq_probs:  # from a certain token (0) to e^10 equally likely ones
        case["log_sum_sq_probs"] = _rows(draw, st.floats(-10.0, 0.0, width=32), size, width)
    if requirements.data == "unpaired":
        seq = st.floats(LOGPROB_MIN * width, 0.0, width=32)
        case["mismatched_logprobs"] = _column(draw, seq, size)
        if requirements.reference:
            case["mismatched_ref_logprobs"] = _column(draw, seq, size)
    use_weights = draw(st.booleans()) if weighted is None else weighted
    if use_weights:
        case["weights"] = _column(draw, st.floats(0.25, 2.0, width=32), size)
    return BatchCase(**case)


def batches(
    requirements: AlgorithmRequirements, **kwargs: Any
) -> st.SearchStrategy[tuple[RolloutBatch, PolicyOutputs]]:
    """Built (RolloutBatch, PolicyOutputs) pairs from :func:`batch_cases` (same arguments)."""
    return batch_cases(requirements, **kwargs).map(lambda case: case.build())


@st.composite
def padding_fill(
    draw: st.DrawFn, case: BatchCase, max_extra: int = 4
) -> tuple[dict[str, Rows], tuple[tuple[int, ...], ...]]:
    """Arbitrary padding for :meth:`BatchCase.repadded`: 1..max_extra more columns.

    Log-prob fields get values in [-50, 0], values in [-10, 10], entropy in [0, 10],
    ``log_sum_sq_probs`` in [-20, 0].
    """
    width = case.width + draw(st.integers(1, max_extra))
    logp = st.floats(LOGPROB_MIN, 0.0, width=32)
    kinds = {
        "logprobs": logp,
        "old_logprobs": logp,
        "ref_logprobs": logp,
        "teacher_logprobs": logp,
        "values": st.floats(-10.0, 10.0, width=32),
        "policy_values": st.floats(-10.0, 10.0, width=32),
        "entropy": st.floats(0.0, 10.0, width=32),
        "log_sum_sq_probs": st.floats(-20.0, 0.0, width=32),
    }
    fill = {
        name: _rows(draw, kinds[name], case.size, width)
        for name in TOKEN_FIELDS
        if getattr(case, name) is not None
    }
    ids = tuple(
        tuple(draw(st.lists(st.integers(0, VOCABULARY - 1), min_size=width, max_size=width)))
        for _ in range(case.size)
    )
    return fill, ids
