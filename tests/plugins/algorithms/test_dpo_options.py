"""DPO's TRL 1.16 options: ``ld_alpha`` (LD-DPO), ``f_divergence_type`` with
``f_alpha_divergence_coef`` (f-DPO) and ``use_weighting`` (WPO). The contract suite with each
on (its ``direction`` check, and a flipped copy failing it), refused values and combinations
(from the params and from ``alignzoo validate``), and hand-computed values on test_dpo.py's
golden batch. Parity with TRL: tests/parity/test_trl_dpo_options.py; the engine's own pass
(offline and online pairs): tests/core/engine/test_loss_context.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from alignzoo import cli
from alignzoo.errors import UserError
from alignzoo.plugins.algorithms.dpo import DPO, f_divergence_score, ld_token_weights
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import CHECKS, check_algorithm

from .pref_helpers import neg_log_sigmoid, run_loss
from .test_dpo import golden_batch
from .test_dpo_loss_types import EXAMPLES, flipped_loss, result_of

nls = neg_log_sigmoid

VARIANTS: dict[str, dict[str, Any]] = {
    "ld_alpha_0.5": {"ld_alpha": 0.5},
    "ld_alpha_0": {"ld_alpha": 0.0},
    "ld_alpha_sigmoid_norm": {"loss_type": "sigmoid_norm", "ld_alpha": 0.5},
    "ld_alpha_sigmoid+sft": {"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.2},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence": {"f_divergence_type": "js_divergence"},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence"},
    "alpha_divergence_0.2": {
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.2,
    },
    "js_robust": {
        "loss_type": "robust",
        "label_smoothing": 0.1,
        "f_divergence_type": "js_divergence",
    },
    "forward_kl_sigmoid_norm": {"loss_type": "sigmoid_norm", "f_divergence_type": "forward_kl"},
    "use_weighting": {"use_weighting": True},
    "use_weighting_bco_pair": {"loss_type": "bco_pair", "use_weighting": True},
    "use_weighting_sigmoid+sft": {"loss_type": ["sigmoid", "sft"], "use_weighting": True},
    "all": {"ld_alpha": 0.5, "f_divergence_type": "js_divergence", "use_weighting": True},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_each_option_meets_the_contract(name: str) -> None:
    results = check_algorithm(DPO(VARIANTS[name]), max_examples=EXAMPLES, checks=list(CHECKS))
    failed = {r.name: r.detail for r in results if not r.passed}
    assert failed == {}, failed
    assert [r.name for r in results] == list(CHECKS)
    assert "direction" in CHECKS and "weights_honoured" in CHECKS


@pytest.mark.parametrize("name", VARIANTS)
def test_a_flipped_copy_fails_the_direction_check(name: str) -> None:
    result = result_of(flipped_loss(VARIANTS[name]), "direction", max_examples=EXAMPLES)
    assert not result.passed
    assert result.detail.startswith("direction: a gradient step on the loss ")


def test_requirements_ask_for_log_sum_sq_probs_with_use_weighting_only() -> None:
    def requirements(params: dict[str, Any]) -> Any:
        return build_plugin_manager([DPO(params)]).hook.algorithm_requirements()

    assert requirements({"use_weighting": True}).log_sum_sq_probs
    assert not requirements({}).log_sum_sq_probs
    assert not requirements(
        {"ld_alpha": 0.5, "f_divergence_type": "js_divergence"}
    ).log_sum_sq_probs


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"ld_alpha": -0.1}, "ld_alpha"),
        ({"ld_alpha": 1.5}, "ld_alpha"),
        ({"ld_alpha": math.nan}, "ld_alpha"),
        ({"f_divergence_type": "kl"}, "f_divergence_type"),
        ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 1.5}, "f_alpha_divergence_coef"),
        ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": math.nan}, "f_alpha_divergence_coef"),
        ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": -math.inf}, "f_alpha_divergence_coef"),
        ({"f_alpha_divergence_coef": 0.3}, "f_alpha_divergence_coef applies to f_divergence_type alpha_divergence"),
        ({"f_divergence_type": "js_divergence", "f_alpha_divergence_coef": 0.3}, "f_alpha_divergence_coef applies"),
        ({"loss_type": "nca_pair", "f_divergence_type": "forward_kl"}, "f_divergence_type 'forward_kl' applies to loss_type"),
        ({"loss_type": ["sigmoid", "apo_down"], "f_divergence_type": "js_divergence"}, "not apo_down"),
        ({"loss_type": "aot", "use_weighting": True}, "use_weighting"),
        ({"loss_type": ["sigmoid", "aot_unpaired"], "use_weighting": True}, "use_weighting"),
        ({"use_weighting": "sometimes"}, "use_weighting"),
    ],
)  # fmt: skip
def test_bad_values_and_combinations_are_refused_naming_the_field(
    params: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        DPO(params)


def test_the_accepted_edges() -> None:
    for alpha in (0.0, 1.0):
        assert DPO({"ld_alpha": alpha}).params.ld_alpha == alpha
    for coef in (-2.0, 0.0, 1.0):
        params = {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": coef}
        assert DPO(params).params.f_alpha_divergence_coef == coef
    takers = ["sigmoid", "sigmoid_norm", "hinge", "ipo", "robust", "discopop", "sft"]
    DPO({"loss_type": takers, "f_divergence_type": "forward_kl"})
    DPO({"loss_type": "exo_pair", "label_smoothing": 1e-3, "f_divergence_type": "js_divergence"})


EXPERIMENT = """\
name: dpo_options
seeds: [0]
budget: {{steps: 3}}
defaults:
  labeler: arithmetic
  backend: hf
arms:
  a:
    algorithm: {{name: dpo, params: {params}}}
    online: true
"""


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ("{ld_alpha: 1.5}", "arms.a.algorithm.params.ld_alpha"),
        ("{loss_type: aot, use_weighting: true}", "use_weighting"),
        ("{loss_type: bco_pair, f_divergence_type: js_divergence}", "f_divergence_type"),
        ("{f_alpha_divergence_coef: 0.2}", "f_alpha_divergence_coef"),
    ],
)
def test_validate_names_the_field(tmp_path, capsys, params: str, says: str) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.format(params=params))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "exp.yaml:9" in err, err


def test_validate_accepts_the_options_online(tmp_path) -> None:
    """Online pairs (the preference mode sampling and pairing by score) take every option."""
    path = tmp_path / "exp.yaml"
    options = (
        "{ld_alpha: 0.5, f_divergence_type: alpha_divergence, f_alpha_divergence_coef: 0.3, "
        "use_weighting: true}"
    )
    path.write_text(EXPERIMENT.format(params=options))
    assert cli.main(["validate", str(path)]) == 0


# --------------------------------------------------------------------------- golden values
# golden_batch (test_dpo.py), rows [B rejected, A chosen, B chosen, A rejected]:
# A: y_w (-0.5, -1.0 | ref -1, -1), y_l (-2.0, -0.25, -1.5 | ref -1, -1, -1): public length 2
# B: y_w (-3.0 | ref -2.0), y_l (-0.5, -0.5 | ref -1.0, -0.5): public length 1


def golden(params: dict[str, Any], sq: list[list[float]] | None = None) -> Any:
    batch, outputs = golden_batch()
    if sq is not None:
        outputs.log_sum_sq_probs = torch.tensor(sq, dtype=torch.float64)
    return run_loss(DPO(params), batch, outputs), outputs


def test_ld_token_weights_split_each_pair_at_its_shorter_response() -> None:
    batch, _ = golden_batch()
    assert batch.labels is not None
    chosen, rejected = torch.tensor([2, 1]), torch.tensor([0, 3])  # pairs B and A
    weights = ld_token_weights(batch.response_mask, chosen, rejected, 0.25)
    assert weights.tolist() == [
        [1.0, 0.25, 0.0],
        [1.0, 1.0, 0.0],
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 0.25],
    ]
    gap = batch.response_mask.clone()
    gap[3] = torch.tensor([1.0, 0.0, 1.0])  # a hole: the real tokens are counted in order
    assert ld_token_weights(gap, chosen, rejected, 0.25)[3].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_golden_ld_alpha(alpha: float) -> None:
    # A's rejected tail (-1.5 | ref -1.0) counts α times: ρ_l = -0.25 - 0.5 α; B's rejected
    # tail (-0.5 | ref -0.5) has log-ratio 0, so B's h stays -1.5.
    h_a, h_b = 0.5 - (-0.25 - 0.5 * alpha), -1.5
    result, outputs = golden({"beta": 1.0, "ld_alpha": alpha})
    assert result.loss.item() == pytest.approx((nls(h_a) + nls(h_b)) / 2, rel=1e-12)
    logps_rejected = (-2.25 - 1.5 * alpha + -0.5 - 0.5 * alpha) / 2
    assert result.metrics["dpo/logps/rejected"] == pytest.approx(logps_rejected, rel=1e-12)
    result.loss.backward()
    grad = outputs.logprobs.grad
    assert float(grad[3, 2]) == pytest.approx(alpha * float(grad[3, 0]), abs=1e-15)  # the tail
    assert float(grad[0, 1]) == pytest.approx(alpha * float(grad[0, 0]), abs=1e-15)
    assert float(grad[3, 0]) != 0.0


def test_sft_reads_every_token_under_ld_alpha() -> None:
    # sft is -(-4.5) / 3 = 1.5 (test_dpo_loss_types), with or without LD-DPO
    plain, _ = golden({"loss_type": ["sigmoid", "sft"]})
    ld, _ = golden({"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.0})
    assert ld.metrics["dpo/loss/sft"] == pytest.approx(1.5, rel=1e-12)
    assert plain.metrics["dpo/loss/sft"] == pytest.approx(1.5, rel=1e-12)
    assert ld.metrics["dpo/loss/sigmoid"] != pytest.approx(plain.metrics["dpo/loss/sigmoid"])


RHO = {"A": (0.5, -0.75), "B": (-1.0, 0.5)}  # (ρ_w, ρ_l) of each golden pair


@pytest.mark.parametrize(
    ("kind", "coef", "psi"),
    [
        ("reverse_kl", None, lambda r: r),
        ("forward_kl", None, lambda r: 1.0 - math.exp(-r)),
        ("js_divergence", None, lambda r: math.log(2.0) - nls(r)),
        ("alpha_divergence", None, lambda r: (math.exp(-0.5 * r) - 1.0) / -0.5),
        ("alpha_divergence", 0.2, lambda r: (math.exp(-0.8 * r) - 1.0) / -0.8),
        ("alpha_divergence", 1.0, lambda r: r),
        ("alpha_divergence", 0.0, lambda r: 1.0 - math.exp(-r)),  # the forward KL
    ],
)
def test_golden_f_divergence(kind: str, coef: float | None, psi: Any) -> None:
    options: dict[str, Any] = {"f_divergence_type": kind}
    if coef is not None:
        options["f_alpha_divergence_coef"] = coef
    result, _ = golden({"beta": 0.5, **options})
    h = [psi(w) - psi(lo) for w, lo in RHO.values()]
    assert result.loss.item() == pytest.approx((nls(0.5 * h[0]) + nls(0.5 * h[1])) / 2, rel=1e-12)
    # the rewards stay β ρ (as TRL's metrics)
    assert result.metrics["dpo/rewards/margin"] == pytest.approx(0.5 * (1.25 - 1.5) / 2, rel=1e-12)
    # sigmoid_norm divides the scores by the lengths: A |y_w| 2, |y_l| 3; B 1, 2
    norm, _ = golden({"beta": 0.5, "loss_type": "sigmoid_norm", **options})
    per_token = [psi(0.5) / 2 - psi(-0.75) / 3, psi(-1.0) / 1 - psi(0.5) / 2]
    expected = (nls(0.5 * per_token[0]) + nls(0.5 * per_token[1])) / 2
    assert norm.loss.item() == pytest.approx(expected, rel=1e-12)


def test_the_f_divergence_score_is_capped_where_it_would_overflow() -> None:
    """e^((α-1)ρ) is capped at e^80 (e^11 in fp16), as TRL caps it: finite, no gradient past
    the cap; the forward KL (α = 0) too, where TRL's overflows in fp32 past -ρ ≈ 88.7."""
    ratio = torch.tensor([-200.0, -50.0, 0.0, 50.0], requires_grad=True)
    params = DPO({"f_divergence_type": "forward_kl"}).params
    score = f_divergence_score(ratio, params)
    assert torch.isfinite(score).all()
    assert score[0].item() == pytest.approx(-math.expm1(80.0), rel=1e-6)
    score.sum().backward()
    assert ratio.grad is not None
    assert float(ratio.grad[0]) == 0.0
    assert float(ratio.grad[1]) == pytest.approx(math.exp(50.0), rel=1e-6)
    half = torch.tensor([-200.0], dtype=torch.float16)
    assert torch.isfinite(f_divergence_score(half, params)).all()


# log Σ_v p_v² of each golden row, constant along it (padding 9.0, to be ignored): the
# responses' aligned means log p(y_t) - log Σ_v p_v² are B_l 1.5, A_w -0.25, B_w -1.0,
# A_l mean(-1, 0.75, -0.5) = -0.25: pair weights A e^(-0.5), B e^(0.5).
SQ = [[-2.0, -2.0, 9.0], [-0.5, -0.5, 9.0], [-2.0, 9.0, 9.0], [-1.0, -1.0, -1.0]]
W_A, W_B = math.exp(-0.5), math.exp(0.5)


def test_golden_use_weighting() -> None:
    result, outputs = golden({"beta": 0.1, "use_weighting": True}, SQ)
    expected = (W_A * nls(0.1 * 1.25) + W_B * nls(0.1 * -1.5)) / 2
    assert result.loss.item() == pytest.approx(expected, rel=1e-12)
    assert result.metrics["dpo/loss"] == pytest.approx(expected, rel=1e-12)
    assert result.metrics["dpo/wpo_weight"] == pytest.approx((W_A + W_B) / 2, rel=1e-12)
    result.loss.backward()
    weighted = outputs.logprobs.grad
    plain, plain_outputs = golden({"beta": 0.1}, SQ)
    plain.loss.backward()
    assert "dpo/wpo_weight" not in plain.metrics
    # the weights carry no gradient: each pair's gradient is its plain one times its weight
    row_weight = torch.tensor([W_B, W_A, W_B, W_A], dtype=torch.float64)[:, None]
    torch.testing.assert_close(weighted, plain_outputs.logprobs.grad * row_weight)


def test_use_weighting_with_batch_weights_and_a_list_of_losses() -> None:
    params = {"beta": 0.1, "use_weighting": True, "loss_type": ["sigmoid", "sft"]}
    batch, outputs = golden_batch()
    outputs.log_sum_sq_probs = torch.tensor(SQ, dtype=torch.float64)
    batch.weights = torch.tensor([1.0, 0.5, 3.0, 1.5], dtype=torch.float64)  # pairs: A 1, B 2
    result = run_loss(DPO(params), batch, outputs)
    sigmoid = (W_A * 1.0 * nls(0.125) + W_B * 2.0 * nls(-0.15)) / 2
    sft = (W_A * 1.0 * 1.5 / 1.5 + W_B * 2.0 * 3.0 / 1.5) / 2  # -log π(y_w) / L̄_w, L̄_w = 1.5
    assert result.loss.item() == pytest.approx(sigmoid + sft, rel=1e-12)
    assert result.metrics["dpo/loss/sft"] == pytest.approx(sft, rel=1e-12)


def test_use_weighting_without_log_sum_sq_probs_is_a_clear_error() -> None:
    batch, outputs = golden_batch()
    with pytest.raises(UserError, match=r"outputs\.log_sum_sq_probs"):
        run_loss(DPO({"use_weighting": True}), batch, outputs)
