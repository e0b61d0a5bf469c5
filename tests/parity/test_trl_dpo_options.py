"""Loss-and-gradient parity of DPO's objective-changing options with TRL 1.16.0's DPOTrainer:
``ld_alpha`` (LD-DPO), ``f_divergence_type`` / ``f_alpha_divergence_coef`` (f-DPO) and
``use_weighting`` (WPO), each at TRL's default and at other values, alone and together.

The harness is test_trl_parity.py's (imported): a real DPOTrainer computes its loss with
``_compute_loss`` on hand-built pairs (several seeds, responses of mixed lengths, padding)
whose per-token policy log-probs a stand-in for the policy returns, and alignzoo's DPO plugin
gets the same log-probs through its hooks; losses and gradients w.r.t. the per-token log-probs
agree within 1e-5 (to 1e-9 where both sides run in float64).

- ``ld_alpha``: TRL weights the policy's and the reference's per-token log-probs in
  ``_compute_loss`` and ``compute_ref_log_probs``; here TRL computes its reference sums itself,
  with ``compute_ref_log_probs`` on the same per-token reference log-probs alignzoo's batch
  holds (so both sides split each response at the same public length).
- ``f_divergence_type``: TRL's ``alpha_divergence`` indexes a table of float32 / bfloat16 /
  float16 clamps by the log-ratios' dtype, so it runs in float32 (alignzoo in float64).
- ``use_weighting``: both sides' inputs come from the same logits ``[B, R, V]``: the policy's
  per-token log-probs are their log-softmax at the response tokens, and each side computes
  log Σ_v p_v² from them with its own code (TRL with its chunked log-prob kernel, the one its
  fused LM head runs; alignzoo with :func:`alignzoo.ops.token_outputs`, its policy pass's).

alignzoo DPOParams ↔ TRL DPOConfig (DPOTrainer attributes read at every loss call):
  ld_alpha ↔ ld_alpha (None by default in both); f_divergence_type ↔ f_divergence_type
  ("reverse_kl"); f_alpha_divergence_coef ↔ f_alpha_divergence_coef (0.5); use_weighting ↔
  use_weighting (False); the rest as in test_trl_dpo_loss_types.py.

Where the two differ by construction the test asserts the relation that holds: TRL's weighted
``sft`` term is the batch's token-mean NLL times the mean pair weight, alignzoo's weights each
pair's NLL (micro-batch invariant), see test_wpo_weights_sft_per_pair.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.ops import token_outputs
from alignzoo.plugins.algorithms.dpo import DPO, LOSS_TYPES

from .test_trl_parity import (  # noqa: F401 - tokenizer, trl_args, dpo_trainer are fixtures
    F64,
    MAX_TOKEN,
    PAD_JUNK,
    PAIR_SHAPES,
    DPOTrainer,
    FusedHeadStub,
    Pairs,
    assert_parity,
    dpo_trainer,
    from_shifted,
    make_pairs,
    masked_sum,
    padded_mask,
    run_alignzoo,
    set_attributes,
    set_dpo,
    to_shifted,
    tokenizer,
    trl_args,
    trl_examples,
)

LOOSE = {"rtol": 1e-5, "atol": 1e-7}
"""Where one side runs in float32 (TRL's alpha_divergence, its log Σ p² kernel)."""


class WeightingStub(FusedHeadStub):
    """:class:`FusedHeadStub` that also returns TRL's ``log_sum_sq_probs`` (``[N, L-1]``), as
    the fused LM head does when ``use_weighting`` asks for it."""

    def __init__(self, sq_probs: torch.Tensor, *tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(*tables)
        self.sq_probs = sq_probs

    def __call__(self, *args: Any, **kwargs: Any) -> SimpleNamespace:
        out = super().__call__(*args, **kwargs)
        out.log_sum_sq_probs = self.sq_probs
        return out


def run_trl(
    trainer: DPOTrainer,
    pairs: Pairs,
    *,
    dtype: torch.dtype = F64,
    ref_pass: bool = False,
    sq_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's loss on the pairs and its gradient w.r.t. the per-token policy log-probs, in
    alignzoo's row order ``[2N, R]`` (as test_trl_parity.run_trl_dpo). ``ref_pass``: TRL
    computes the reference sums itself (``compute_ref_log_probs``, which applies ``ld_alpha``)
    instead of being given their plain sums; ``sq_probs`` ``[2N, R]`` (TRL's row order): the
    log Σ_v p_v² its fused head returns."""
    n = pairs.n
    inputs = trainer.data_collator(trl_examples(pairs))
    completion = inputs["completion_mask"]
    if ref_pass:
        ref_table = to_shifted(pairs.ref_logps, pairs.lengths, completion).detach().to(dtype)
        ref_stub = FusedHeadStub((inputs["input_ids"], ref_table))
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(ref_stub, inputs)
        assert ref_stub.calls == 1
    else:
        ref = masked_sum(pairs.ref_logps, pairs.mask).to(dtype)
        ref_chosen, ref_rejected = ref[:n], ref[n:]
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref_chosen, ref_rejected
    leaf = to_shifted(pairs.logps, pairs.lengths, completion).detach().to(dtype)
    leaf.requires_grad_(True)
    table = (inputs["input_ids"], leaf)
    if sq_probs is None:
        stub: FusedHeadStub = FusedHeadStub(table)
    else:
        shifted_sq = to_shifted(sq_probs, pairs.lengths, completion, fill=0.0).detach().to(dtype)
        stub = WeightingStub(shifted_sq, table)
    loss = trainer._compute_loss(stub, inputs, return_outputs=False)
    assert stub.calls == 1
    loss.backward()
    assert leaf.grad is not None
    grad = from_shifted(leaf.grad, pairs.lengths, completion, pairs.width)
    return loss.detach().to(F64), grad[pairs.order]


def set_options(monkeypatch: pytest.MonkeyPatch, trainer: DPOTrainer, **options: Any) -> None:
    """Set DPOTrainer's option attributes (``ld_alpha``, ``f_divergence_type``,
    ``f_alpha_divergence_coef``, ``use_weighting``) for one test."""
    set_attributes(monkeypatch, trainer, **options)


def az_params(loss_types: list[str], beta: float, label_smoothing: float = 0.0, **options: Any):
    params: dict[str, Any] = {
        "beta": beta,
        "loss_type": loss_types[0] if len(loss_types) == 1 else loss_types,
        "label_smoothing": label_smoothing,
        **options,
    }
    return params


def configure(
    monkeypatch: pytest.MonkeyPatch,
    trainer: DPOTrainer,
    loss_types: list[str],
    beta: float,
    label_smoothing: float = 0.0,
    **options: Any,
) -> dict[str, Any]:
    """TRL's trainer set for one case (its options at TRL's names, label_smoothing as a numpy
    float64 as test_trl_dpo_loss_types.configure explains); alignzoo's params for the same."""
    set_dpo(monkeypatch, trainer, loss_types, beta, np.float64(label_smoothing))
    set_options(monkeypatch, trainer, **options)
    return az_params(loss_types, beta, label_smoothing, **options)


def test_trainer_defaults_are_alignzoos() -> None:
    """TRL 1.16's DPOConfig defaults of the options are the params' defaults."""
    from trl import DPOConfig

    fields = DPOConfig.__dataclass_fields__
    params = DPO().params
    for name in ("ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "use_weighting"):
        assert fields[name].default == getattr(params, name), name
    assert (params.ld_alpha, params.f_divergence_type) == (None, "reverse_kl")
    assert (params.f_alpha_divergence_coef, params.use_weighting) == (0.5, False)


# --------------------------------------------------------------------------- ld_alpha


LD_CASES = [
    (["sigmoid"], 0.1, 0.0),
    (["sigmoid"], 0.5, 0.0),
    (["sigmoid_norm"], 0.3, 0.0),
    (["apo_zero"], 0.3, 0.0),
    (["aot"], 0.5, 0.1),  # AOT sorts TRL's desensitised sums too
    (["sigmoid", "sft"], 0.3, 0.0),  # sft's NLL counts every token once in both
    (["robust", "bco_pair"], 0.2, 0.1),
]


@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize("ld_alpha", [None, 0.0, 0.5, 1.0])
@pytest.mark.parametrize(("loss_types", "beta", "label_smoothing"), LD_CASES)
def test_ld_alpha_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_types: list[str],
    beta: float,
    label_smoothing: float,
    ld_alpha: float | None,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    params = configure(
        monkeypatch, dpo_trainer, loss_types, beta, label_smoothing, ld_alpha=ld_alpha
    )
    trl_side = run_trl(dpo_trainer, pairs, ref_pass=True)
    assert_parity(run_alignzoo(DPO(params), *pairs.alignzoo_batch()), trl_side)


def test_ld_alpha_changes_the_loss_where_lengths_differ(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The premise of the cases above: LD-DPO's sums differ from the plain ones (a pair of
    responses of different lengths), and at α = 1 they are the plain ones."""
    pairs = make_pairs(seed=1, n_pairs=5, width=6)
    assert any(pairs.lengths[k] != pairs.lengths[pairs.n + k] for k in range(pairs.n))
    losses = {}
    for alpha in (None, 0.5, 1.0):
        params = configure(monkeypatch, dpo_trainer, ["sigmoid"], 0.5, ld_alpha=alpha)
        losses[alpha] = run_alignzoo(DPO(params), *pairs.alignzoo_batch())[0]
    assert not torch.isclose(losses[0.5], losses[None], rtol=1e-3)
    torch.testing.assert_close(losses[1.0], losses[None], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- f_divergence_type


def test_the_f_divergence_loss_types_are_trls() -> None:
    """The loss types TRL 1.16 lets take a non-default f_divergence_type are those registered
    with the f_divergence trait, and its divergences are the params' values."""
    source = inspect.getsource(DPOTrainer.__init__)
    found = re.search(r"f_divergence_loss_types = \{([^}]*)\}", source)
    assert found is not None
    trl_types = set(re.findall(r'"(\w+)"', found.group(1)))
    assert trl_types == {name for name, entry in LOSS_TYPES.items() if entry.f_divergence}
    compute = inspect.getsource(DPOTrainer._compute_loss)
    trl_divergences = set(re.findall(r'f_divergence_type == "(\w+)"', compute))
    schema = DPO.Params.model_json_schema()["properties"]["f_divergence_type"]
    assert trl_divergences == set(schema["enum"])


F_CASES = [
    ("sigmoid", 0.1, 0.0),
    ("sigmoid", 0.5, 0.0),
    ("hinge", 0.3, 0.0),
    ("robust", 0.2, 0.1),
    ("exo_pair", 0.3, 1e-3),
    ("discopop", 0.2, 0.0),
    ("sigmoid_norm", 0.5, 0.0),
]
DIVERGENCES = [
    ("reverse_kl", None),
    ("forward_kl", None),
    ("js_divergence", None),
    ("alpha_divergence", None),  # TRL's default α = 0.5
    ("alpha_divergence", 0.2),
    ("alpha_divergence", 1.0),  # the reverse-KL limit
    ("alpha_divergence", 0.8),
]


def divergence_options(kind: str, coef: float | None) -> dict[str, Any]:
    return {"f_divergence_type": kind} | ({} if coef is None else {"f_alpha_divergence_coef": coef})


@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize(("kind", "coef"), DIVERGENCES)
@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing"), F_CASES)
def test_f_divergence_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    beta: float,
    label_smoothing: float,
    kind: str,
    coef: float | None,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    options = divergence_options(kind, coef)
    params = configure(monkeypatch, dpo_trainer, [loss_type], beta, label_smoothing, **options)
    if coef is None:
        assert dpo_trainer.f_alpha_divergence_coef == 0.5  # TRL's default, alignzoo's too
    alignzoo = run_alignzoo(DPO(params), *pairs.alignzoo_batch())
    if kind == "alpha_divergence":  # TRL's clamp table has no float64 entry
        loss, grad = run_trl(dpo_trainer, pairs, dtype=torch.float32)
        torch.testing.assert_close(alignzoo[0], loss, **LOOSE)
        assert alignzoo[1].abs().max() > 1e-4
        torch.testing.assert_close(alignzoo[1], grad, **LOOSE)
    else:
        assert_parity(alignzoo, run_trl(dpo_trainer, pairs))


@pytest.mark.parametrize(("kind", "coef"), DIVERGENCES[1:5])
def test_f_divergence_on_ipo_and_sft_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    coef: float | None,
) -> None:
    """IPO on one-token responses (TRL length-normalises its scores, test_trl_parity.py) in a
    list with sft, whose NLL no divergence changes."""
    pairs = make_pairs(seed=3, n_pairs=4, width=3, unit_length=True)
    options = divergence_options(kind, coef)
    params = configure(monkeypatch, dpo_trainer, ["ipo", "sft"], 0.4, **options)
    params["loss_weights"] = [1.0, 0.5]
    set_attributes(monkeypatch, dpo_trainer, loss_weights=[1.0, 0.5])
    alignzoo = run_alignzoo(DPO(params), *pairs.alignzoo_batch())
    dtype = torch.float32 if kind == "alpha_divergence" else F64
    loss, grad = run_trl(dpo_trainer, pairs, dtype=dtype)
    torch.testing.assert_close(alignzoo[0], loss, **LOOSE)
    torch.testing.assert_close(alignzoo[1], grad, **LOOSE)


def test_a_divergence_changes_the_loss(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The premise: each divergence is its own loss on these pairs."""
    pairs = make_pairs(seed=0, n_pairs=3, width=4)
    losses = []
    for kind, coef in DIVERGENCES[:5]:
        params = configure(
            monkeypatch, dpo_trainer, ["sigmoid"], 0.3, **divergence_options(kind, coef)
        )
        losses.append(float(run_alignzoo(DPO(params), *pairs.alignzoo_batch())[0]))
    assert len({round(loss, 6) for loss in losses}) == len(losses), losses


@pytest.mark.parametrize("loss_type", ["nca_pair", "bco_pair", "apo_zero", "aot", "sppo_hard"])
@pytest.mark.parametrize("kind", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_the_loss_types_trl_refuses_a_divergence_for_are_refused(loss_type: str, kind: str) -> None:
    """TRL 1.16 refuses these combinations in DPOTrainer.__init__ (the set read from its source
    above); alignzoo's params refuse them, naming the field and the loss type."""
    with pytest.raises(ValidationError, match="f_divergence_type") as refused:
        DPO({"loss_type": loss_type, "f_divergence_type": kind})
    assert loss_type in str(refused.value)
    with pytest.raises(ValidationError, match="f_divergence_type"):
        DPO({"loss_type": ["sigmoid", loss_type], "f_divergence_type": kind})


# --------------------------------------------------------------------------- use_weighting


VOCABULARY = MAX_TOKEN
"""Token ids of the pairs are below MAX_TOKEN: the logits' vocabulary."""


def with_logits(pairs: Pairs, seed: int, scale: float = 2.0) -> tuple[Pairs, torch.Tensor]:
    """The pairs with policy log-probs taken from random logits ``[2N, R, V]`` (TRL's row
    order; PAD_JUNK on padding, as before), and the logits. Each response token's logit is
    raised by a draw in [0, 6], so that its probability ranges from below the expected one
    (WPO weight < 1) to dominant."""
    gen = torch.Generator().manual_seed(100 + seed)
    logits = scale * torch.randn(2 * pairs.n, pairs.width, VOCABULARY, generator=gen, dtype=F64)
    ids = torch.zeros(2 * pairs.n, pairs.width, dtype=torch.long)
    for row, completion in enumerate(pairs.completions):
        ids[row, : len(completion)] = torch.tensor(completion)
    boost = 6.0 * torch.rand(2 * pairs.n, pairs.width, 1, generator=gen, dtype=F64)
    logits = logits.scatter_add(-1, ids[..., None], boost)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None])[..., 0]
    real = padded_mask(pairs.lengths, pairs.width).bool()
    return replace(pairs, logps=torch.where(real, logps, PAD_JUNK)), logits


def trl_log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v p_v² ``[2N, R]`` by TRL's chunked log-prob kernel (the fused LM head's), its
    hidden states the logits and its head the identity."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    flat = logits.reshape(-1, logits.shape[-1])
    eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
    targets = torch.zeros(flat.shape[0], dtype=torch.long)
    outputs = ChunkedLogProbFunction.apply(
        flat, eye, None, targets, 1.0, 16, None, 1.0, ("log_sum_sq_probs",)
    )
    return outputs[2].to(F64).view(logits.shape[:-1])


def az_log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """alignzoo's log Σ_v p_v² ``[2N, R]``, from its policy pass's whole-logits path."""
    tokens = torch.zeros(logits.shape[:-1], dtype=torch.long)
    sq = token_outputs(logits, tokens, log_sum_sq_probs=True)[2]
    assert sq is not None
    return sq


def alignzoo_weighted(pairs: Pairs, logits: torch.Tensor) -> tuple[RolloutBatch, PolicyOutputs]:
    batch, outputs = pairs.alignzoo_batch()
    outputs.log_sum_sq_probs = az_log_sum_sq_probs(logits)[pairs.order]
    return batch, outputs


def test_both_kernels_agree_on_log_sum_sq_probs() -> None:
    logits = with_logits(make_pairs(0, 3, 4), seed=0)[1]
    direct = torch.log((torch.softmax(logits, -1) ** 2).sum(-1))
    torch.testing.assert_close(az_log_sum_sq_probs(logits), direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trl_log_sum_sq_probs(logits), direct, rtol=1e-6, atol=1e-6)


WPO_CASES = [  # hinge and sft: test_trl_fails_on_hinge_and_sft_with_weighting
    (["sigmoid"], 0.1, 0.0),
    (["sigmoid"], 0.5, 0.0),
    (["robust"], 0.2, 0.1),
    (["exo_pair"], 0.3, 1e-3),
    (["nca_pair"], 0.3, 0.0),
    (["bco_pair"], 0.3, 0.0),
    (["sppo_hard"], 0.5, 0.0),
    (["apo_zero"], 0.3, 0.0),
    (["apo_down"], 0.3, 0.0),
    (["discopop"], 0.2, 0.0),
    (["sigmoid_norm"], 0.5, 0.0),
    (["apo_zero", "bco_pair"], 0.3, 0.0),
]


@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize("use_weighting", [False, True])
@pytest.mark.parametrize(("loss_types", "beta", "label_smoothing"), WPO_CASES)
def test_use_weighting_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_types: list[str],
    beta: float,
    label_smoothing: float,
    use_weighting: bool,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs, logits = with_logits(make_pairs(seed, n_pairs, width), seed)
    params = configure(
        monkeypatch, dpo_trainer, loss_types, beta, label_smoothing, use_weighting=use_weighting
    )
    if len(loss_types) > 1:
        set_attributes(monkeypatch, dpo_trainer, loss_weights=[0.7, 1.3])
        params["loss_weights"] = [0.7, 1.3]
    trl_loss, trl_grad = run_trl(dpo_trainer, pairs, sq_probs=trl_log_sum_sq_probs(logits))
    az_loss, az_grad = run_alignzoo(DPO(params), *alignzoo_weighted(pairs, logits))
    torch.testing.assert_close(az_loss, trl_loss, **LOOSE)
    assert az_grad.abs().max() > 1e-4
    torch.testing.assert_close(az_grad, trl_grad, **LOOSE)


def test_use_weighting_changes_the_loss(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The premise: the pair weights are not all 1 on these inputs, and the loss moves."""
    pairs, logits = with_logits(make_pairs(1, 5, 6), 1)
    plain = run_alignzoo(DPO({"beta": 0.3}), *alignzoo_weighted(pairs, logits))[0]
    weighted = run_alignzoo(
        DPO({"beta": 0.3, "use_weighting": True}), *alignzoo_weighted(pairs, logits)
    )[0]
    assert not torch.isclose(plain, weighted, rtol=1e-2)


def trl_pair_weights(pairs: Pairs, sq: torch.Tensor) -> torch.Tensor:
    """TRL's WPO weight of each pair ``[N]`` (DPOTrainer._compute_loss's formula, restated):
    exp of the mean over each response's tokens of log p(y_t) - log Σ_v p_v², chosen times
    rejected."""
    n, mask = pairs.n, pairs.mask
    aligned = torch.where(mask.bool(), pairs.logps - sq, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.exp(aligned[:n]) * torch.exp(aligned[n:])


def test_trl_fails_on_hinge_and_sft_with_weighting(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TRL 1.16 cannot run use_weighting with hinge (it multiplies the ReLU's output in place,
    which the ReLU's backward needs) nor with sft (it multiplies in place a scalar expanded to
    every pair), so there is no TRL loss to compare with. alignzoo weights each pair's term as
    TRL weights the other losses': hinge is mean_k w_k max(0, 1 - β h_k), sft
    Σ_k w_k NLL_k / Σ_k |y_w,k| (each pair's own NLL, micro-batch invariant)."""
    pairs, logits = with_logits(make_pairs(1, 5, 6), 1)
    sq = trl_log_sum_sq_probs(logits)
    for loss_type in ("hinge", "sft"):
        configure(monkeypatch, dpo_trainer, [loss_type], 0.3, use_weighting=True)
        with pytest.raises(RuntimeError, match=r"in-?place|memory location"):
            run_trl(dpo_trainer, pairs, sq_probs=sq)
    w = trl_pair_weights(pairs, sq)
    assert float(w.max()) > 10 * float(w.min())  # the premise: the weights matter
    n, mask = pairs.n, pairs.mask
    seq = masked_sum(pairs.logps, mask)
    ref = masked_sum(pairs.ref_logps, mask)
    h = (seq[:n] - ref[:n]) - (seq[n:] - ref[n:])
    hinge = DPO({"loss_type": "hinge", "beta": 0.3, "use_weighting": True})
    az_loss, _ = run_alignzoo(hinge, *alignzoo_weighted(pairs, logits))
    torch.testing.assert_close(az_loss, (w * torch.relu(1 - 0.3 * h)).mean(), **LOOSE)
    sft = DPO({"loss_type": "sft", "use_weighting": True})
    az_loss, _ = run_alignzoo(sft, *alignzoo_weighted(pairs, logits))
    nll = -seq[:n]
    torch.testing.assert_close(az_loss, (w * nll).sum() / mask[:n].sum(), **LOOSE)


# --------------------------------------------------------------------------- all at once


@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize(
    ("loss_types", "kind"),
    [(["sigmoid"], "js_divergence"), (["robust"], "forward_kl"), (["sigmoid_norm"], "reverse_kl")],
)
def test_the_options_together_match_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_types: list[str],
    kind: str,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs, logits = with_logits(make_pairs(seed, n_pairs, width), seed)
    options = {"ld_alpha": 0.3, "f_divergence_type": kind, "use_weighting": True}
    params = configure(
        monkeypatch, dpo_trainer, loss_types, 0.4, 0.1 * (loss_types == ["robust"]), **options
    )
    trl_loss, trl_grad = run_trl(
        dpo_trainer, pairs, ref_pass=True, sq_probs=trl_log_sum_sq_probs(logits)
    )
    az_loss, az_grad = run_alignzoo(DPO(params), *alignzoo_weighted(pairs, logits))
    torch.testing.assert_close(az_loss, trl_loss, **LOOSE)
    assert az_grad.abs().max() > 1e-4
    torch.testing.assert_close(az_grad, trl_grad, **LOOSE)
