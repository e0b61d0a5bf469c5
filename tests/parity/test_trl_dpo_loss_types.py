"""Loss-and-gradient parity of alignzoo's DPO ``loss_type`` variants with TRL 1.16.0's DPOTrainer.

The variants test_trl_parity.py does not cover: exo_pair, nca_pair, bco_pair, sppo_hard, aot,
aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm, and a list of loss types with
``loss_weights``. As there, a real DPOTrainer (a tiny random Qwen2, reference log-probs given
with the batch) computes its loss with ``_compute_loss`` on hand-built pairs whose per-token
policy log-probs a stand-in returns; alignzoo's DPO plugin gets the same log-probs through its
hooks; losses and gradients w.r.t. the per-token log-probs agree to 1e-9 (float64). The
fixtures and helpers are test_trl_parity.py's, imported.

alignzoo DPOParams ↔ TRL DPOConfig (DPOTrainer attributes read at every loss call):
  loss_type ↔ loss_type (a name: trainer.loss_types = [name]; a list: the same list);
  loss_weights ↔ loss_weights (default 1 per loss in both); beta ↔ beta;
  label_smoothing ↔ label_smoothing (read by exo_pair, aot and aot_unpaired here);
  discopop_tau ↔ discopop_tau (trainer.args.discopop_tau);
  reference log-probs ↔ TRL's precomputed ref_chosen_logps / ref_rejected_logps (the masked
  sums of alignzoo's per-token batch.ref_logprobs).
Every pair's loss is averaged over the pairs in both; TRL's "sft" is a token mean over the
batch's chosen tokens, which alignzoo reproduces with the step's mean chosen length.

Pinned to trl 1.16.0 by test_trl_parity.py (importing it fails the module on another version).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import numpy as np
import pytest
import torch

from alignzoo.plugins.algorithms.dpo import DPO, LOSS_TYPES
from alignzoo.preference import pair_indices, sequence_logps

from .test_trl_parity import (  # noqa: F401 - tokenizer, trl_args, dpo_trainer are fixtures
    F64,
    PAIR_SHAPES,
    DPOTrainer,
    assert_parity,
    dpo_trainer,
    make_pairs,
    run_alignzoo,
    run_trl_dpo,
    set_attributes,
    set_dpo,
    tokenizer,
    trl_args,
)

NEW_LOSS_TYPES = [
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]

# (loss_type, beta, label_smoothing, discopop_tau): each variant at two settings; exo_pair needs
# ε > 0 (TRL refuses 0 too), aot and aot_unpaired are also checked with their ε.
CASES = [
    ("exo_pair", 0.1, 1e-3, None),
    ("exo_pair", 0.5, 0.2, None),
    ("nca_pair", 0.1, 0.0, None),
    ("nca_pair", 0.5, 0.0, None),
    ("bco_pair", 0.1, 0.0, None),
    ("bco_pair", 0.5, 0.0, None),
    ("sppo_hard", 0.1, 0.0, None),
    ("sppo_hard", 0.5, 0.0, None),
    ("aot", 0.1, 0.0, None),
    ("aot", 0.5, 0.2, None),
    ("aot_unpaired", 0.1, 0.0, None),
    ("aot_unpaired", 0.5, 0.2, None),
    ("apo_zero", 0.1, 0.0, None),
    ("apo_zero", 0.5, 0.0, None),
    ("apo_down", 0.1, 0.0, None),
    ("apo_down", 0.5, 0.0, None),
    ("discopop", 0.1, 0.0, None),  # TRL's default τ = 0.05
    ("discopop", 0.5, 0.0, 0.3),
    ("sft", 0.1, 0.0, None),
    ("sigmoid_norm", 0.1, 0.0, None),
    ("sigmoid_norm", 0.5, 0.0, None),
]


def configure(
    monkeypatch: pytest.MonkeyPatch,
    trainer: DPOTrainer,
    loss_types: list[str],
    beta: float,
    label_smoothing: float = 0.0,
    discopop_tau: float | None = None,
    loss_weights: list[float] | None = None,
) -> dict[str, Any]:
    """Set TRL's trainer for one case and return alignzoo's DPO params for the same case.

    TRL's exo_pair builds ``torch.tensor(self.label_smoothing)``, a float32 constant from a
    Python float; given the same number as a numpy float64 (still a float) it computes log ε and
    log(1-ε) in float64, as alignzoo does (test_exo_pair_trl_float32_constants shows the gap
    otherwise)."""
    set_dpo(monkeypatch, trainer, loss_types, beta, np.float64(label_smoothing), loss_weights)
    if discopop_tau is not None:
        set_attributes(monkeypatch, trainer.args, discopop_tau=discopop_tau)
    assert trainer.args.discopop_tau == (0.05 if discopop_tau is None else discopop_tau)
    params: dict[str, Any] = {
        "beta": beta,
        "loss_type": loss_types[0] if len(loss_types) == 1 else loss_types,
        "label_smoothing": label_smoothing,
    }
    if discopop_tau is not None:
        params["discopop_tau"] = discopop_tau
    if loss_weights is not None:
        params["loss_weights"] = loss_weights
    return params


def test_every_trl_loss_type_is_a_dpo_variant() -> None:
    """Every loss type TRL 1.16's DPOTrainer._compute_loss branches on is an alignzoo variant,
    and the new ones are all tested here."""
    source = inspect.getsource(DPOTrainer._compute_loss)
    trl_types = set(re.findall(r'loss_type == "(\w+)"', source))
    assert len(trl_types) == 15, trl_types
    assert trl_types == set(LOSS_TYPES)
    assert trl_types - {"sigmoid", "hinge", "ipo", "robust"} == set(NEW_LOSS_TYPES)
    assert {case[0] for case in CASES} == set(NEW_LOSS_TYPES)


@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing", "discopop_tau"), CASES)
def test_dpo_loss_type_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    beta: float,
    label_smoothing: float,
    discopop_tau: float | None,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    params = configure(monkeypatch, dpo_trainer, [loss_type], beta, label_smoothing, discopop_tau)
    trl_side = run_trl_dpo(dpo_trainer, pairs)
    assert_parity(run_alignzoo(DPO(params), *pairs.alignzoo_batch()), trl_side)


# A list of loss types is TRL's Σ_j loss_weights[j] · mean(per_sequence_loss_j): the same sum
# in alignzoo. sigmoid with label_smoothing 0 is TRL's sigmoid (with ε > 0 alignzoo's is cDPO,
# test_trl_parity.py's test_cdpo_against_trl_sigmoid_and_robust_terms).
@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES[:2])
@pytest.mark.parametrize(
    ("loss_types", "loss_weights", "label_smoothing"),
    [
        (["sigmoid", "sft"], None, 0.0),  # RPO-style: DPO plus the chosen NLL
        (["sigmoid", "sft"], [1.0, 0.25], 0.0),
        (["apo_zero", "bco_pair", "sigmoid_norm"], [0.5, 1.5, 2.0], 0.0),
        (["exo_pair", "aot", "hinge"], [1.0, 0.5, 0.3], 0.1),
        # TRL length-normalises IPO (test_trl_parity.py): the two agree on one-token responses
        (["discopop", "ipo"], [1.0, 0.01], 0.0),
    ],
)
def test_a_list_of_loss_types_matches_trl(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    loss_types: list[str],
    loss_weights: list[float] | None,
    label_smoothing: float,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width, unit_length="ipo" in loss_types)
    params = configure(
        monkeypatch,
        dpo_trainer,
        loss_types,
        beta=0.3,
        label_smoothing=label_smoothing,
        loss_weights=loss_weights,
    )
    trl_side = run_trl_dpo(dpo_trainer, pairs)
    assert_parity(run_alignzoo(DPO(params), *pairs.alignzoo_batch()), trl_side)


# TRL's "sft" is a token mean over every chosen token of its batch, not a mean of per-response
# means: with chosen responses of different lengths the two differ, and alignzoo follows TRL.
def test_sft_is_a_token_mean_over_the_chosen_tokens(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pairs = make_pairs(seed=1, n_pairs=5, width=6)
    params = configure(monkeypatch, dpo_trainer, ["sft"], beta=0.1)
    trl_loss, _ = run_trl_dpo(dpo_trainer, pairs)
    n, mask = pairs.n, pairs.mask
    chosen_tokens = torch.where(mask[:n].bool(), pairs.logps[:n], 0.0)
    token_mean = -chosen_tokens.sum() / mask[:n].sum()
    per_response = (-chosen_tokens.sum(-1) / mask[:n].sum(-1)).mean()
    torch.testing.assert_close(trl_loss, token_mean, rtol=1e-12, atol=1e-12)
    assert not torch.isclose(trl_loss, per_response, rtol=1e-3)
    az_loss, _ = run_alignzoo(DPO(params), *pairs.alignzoo_batch())
    torch.testing.assert_close(az_loss, token_mean, rtol=1e-12, atol=1e-12)


# With a plain Python float, TRL's exo_pair computes log ε and log(1-ε) from a float32 tensor
# (torch.tensor(self.label_smoothing)); alignzoo computes them in float64. The gap is exactly
# the float32 rounding of the two constants: TRL = alignzoo + mean_k[σ(βh_k)(a64 - a32) +
# σ(-βh_k)(b64 - b32)], a = log(1-ε), b = log ε, and its gradient likewise.
def test_exo_pair_trl_float32_constants(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pairs = make_pairs(seed=0, n_pairs=3, width=4)
    beta, eps = 0.3, 1e-3
    set_dpo(monkeypatch, dpo_trainer, ["exo_pair"], beta, eps)  # a plain float
    trl_loss, trl_grad = run_trl_dpo(dpo_trainer, pairs)
    exo = DPO({"beta": beta, "loss_type": "exo_pair", "label_smoothing": eps})
    batch, outputs = pairs.alignzoo_batch()
    a32 = float(torch.log1p(-torch.tensor(eps)))
    b32 = float(torch.log(torch.tensor(eps)))
    da, db = math.log1p(-eps) - a32, math.log(eps) - b32
    assert da != 0.0 and db != 0.0
    assert batch.labels is not None and batch.ref_logprobs is not None
    chosen, rejected = pair_indices(batch.group_ids, batch.labels)
    ratio = sequence_logps(outputs.logprobs, batch.response_mask) - sequence_logps(
        batch.ref_logprobs, batch.response_mask
    )
    h = ratio[chosen] - ratio[rejected]
    correction = (torch.sigmoid(beta * h) * da + torch.sigmoid(-beta * h) * db).mean()
    az_loss = run_alignzoo_loss_plus(exo, batch, outputs, correction)
    assert outputs.logprobs.grad is not None
    assert_parity((az_loss, outputs.logprobs.grad), (trl_loss, trl_grad))
    plain_loss, _ = run_alignzoo(exo, *pairs.alignzoo_batch())
    assert abs(float(plain_loss - trl_loss)) > 1e-10  # the gap is real, and float32-sized
    torch.testing.assert_close(plain_loss, trl_loss, rtol=1e-6, atol=1e-7)


def run_alignzoo_loss_plus(
    algorithm: DPO, batch: Any, outputs: Any, extra: torch.Tensor
) -> torch.Tensor:
    """alignzoo's loss plus ``extra`` (a function of the same log-probs), back-propagated."""
    from .test_trl_parity import alignzoo_loss

    total = alignzoo_loss(algorithm, batch, outputs) + extra
    total.backward()
    return total.detach()


def test_aot_sorts_the_whole_batch_as_trl_does(
    dpo_trainer: DPOTrainer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AOT is not a sum of per-pair terms: TRL's loss on a batch is not the mean of its losses
    on each pair alone, and alignzoo's whole-batch loss agrees with TRL's whole-batch one."""
    pairs = make_pairs(seed=5, n_pairs=4, width=3)  # the two sorts order the pairs differently
    params = configure(monkeypatch, dpo_trainer, ["aot"], beta=0.5)
    trl_loss, _ = run_trl_dpo(dpo_trainer, pairs)
    az_loss, _ = run_alignzoo(DPO(params), *pairs.alignzoo_batch())
    torch.testing.assert_close(az_loss, trl_loss, rtol=1e-9, atol=1e-12)
    n, mask = pairs.n, pairs.mask
    seq = torch.where(mask.bool(), pairs.logps, 0.0).sum(-1)
    ref = torch.where(mask.bool(), pairs.ref_logps, 0.0).sum(-1)
    h = (seq[:n] - ref[:n]) - (seq[n:] - ref[n:])  # unsorted: per-pair DPO margins
    per_pair = torch.nn.functional.softplus(-0.5 * h).mean()  # what a per-pair loss would be
    assert not torch.isclose(per_pair.to(F64), trl_loss, rtol=1e-2)
