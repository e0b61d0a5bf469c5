"""Loss-and-gradient parity of alignzoo's DPO, KTO, GRPO and SimPO with TRL 1.16.0.

On identical inputs (per-token policy and reference log-probs, masks, advantages) the loss of
alignzoo's algorithm plugin equals the loss TRL's trainer computes, and so does its gradient
w.r.t. the per-token policy log-probs. Nothing is trained: a real TRL trainer is built once per
module around a tiny random Qwen2 and the project's embedded tokenizer (nothing is downloaded),
and its loss method is called on hand-built batches with the policy replaced by a stand-in that
returns the given log-probs: ``_compute_loss`` of DPOTrainer, KTOTrainer and GRPOTrainer, and
``compute_loss`` of the experimental CPOTrainer, whose ``loss_type="simpo"`` is SimPO. Each test
says which alignzoo param corresponds to which TRL field.

Where the frameworks define a variant differently, the test asserts the exact relation that
holds instead: IPO (TRL length-normalises the log-ratios), GRPO's KL term (TRL 1.16 weights it
by the importance ratio by default), ``bnpo`` under gradient accumulation, and cDPO (TRL 1.16
has none).

Pinned to trl 1.16.0: the tests mirror that release's code paths and defaults, so with another
version installed the module fails (it does not skip) until the mappings are re-checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.engine.modes.unpaired import mismatch_partners
from alignzoo.plugin import Algorithm
from alignzoo.plugins.algorithms.dpo import DPO
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.plugins.algorithms.kto import KTO
from alignzoo.plugins.algorithms.simpo import SimPO
from alignzoo.registry import build_plugin_manager
from alignzoo.testing import make_batch
from alignzoo.types import LossContext
from alignzoo.world.tokenizer import build_tokenizer

trl = pytest.importorskip("trl")

TRL_VERSION = "1.16.0"
if trl.__version__ != TRL_VERSION:
    pytest.fail(
        f"tests/parity is pinned to trl {TRL_VERSION}: its parameter mappings and expected "
        f"relations follow that release's source, but trl {trl.__version__} is installed. "
        f"Install trl=={TRL_VERSION}, or re-check every mapping against the new release and "
        "move the pin.",
        pytrace=False,
    )

import datasets  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
)
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

F64 = torch.float64
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
"""Everything is float64, so the frameworks agree far below the 1e-5 the parity is stated to."""

PAD_JUNK = 5.0
"""What alignzoo's batches hold on padding (not a log-prob: it must be ignored)."""
OFF_COMPLETION = -1.0
"""What TRL's per-token layout holds off the completion tokens (masked out by TRL)."""
MAX_TOKEN = 64
"""Token ids are drawn in [2, MAX_TOKEN): 0 is the pad token, 1 the EOS."""


# --------------------------------------------------------------------------- TRL trainers


def tiny_model(vocab: int) -> Qwen2ForCausalLM:
    """A random one-layer Qwen2 (only built so that TRL's trainers can be constructed)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


PREFERENCE_ROWS = {
    "prompt": ["1+1=", "2+2=", "3+3=", "4+4="],
    "chosen": ["2", "4", "6", "8"],
    "rejected": ["3", "5", "7", "9"],
}
UNPAIRED_ROWS = {
    "prompt": ["1+1=", "2+2=", "3+3=", "4+4="],
    "completion": ["2", "5", "6", "9"],
    "label": [True, False, True, False],
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def trl_args(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {
        "output_dir": str(tmp_path_factory.mktemp("trl")),
        "report_to": "none",
        "use_cpu": True,
        "per_device_train_batch_size": 2,
        "save_strategy": "no",
    }


@pytest.fixture(scope="module")
def dpo_trainer(tokenizer: Any, trl_args: dict[str, Any]) -> DPOTrainer:
    """A DPOTrainer whose reference log-probs come with the batch (precompute_ref_log_probs)."""
    trainer = DPOTrainer(
        tiny_model(len(tokenizer)),
        args=DPOConfig(**trl_args, precompute_ref_log_probs=True),
        train_dataset=datasets.Dataset.from_dict(PREFERENCE_ROWS),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is None and trainer.precompute_ref_logps
    assert trainer.f_divergence_type == "reverse_kl" and trainer.ld_alpha is None
    assert not trainer.use_weighting and not trainer.aux_loss_enabled
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def kto_trainer(tokenizer: Any, trl_args: dict[str, Any]) -> KTOTrainer:
    """A KTOTrainer (loss_type "kto", KL from mismatched pairs), reference log-probs given."""
    trainer = KTOTrainer(
        tiny_model(len(tokenizer)),
        args=KTOConfig(**trl_args, precompute_ref_log_probs=True),
        train_dataset=datasets.Dataset.from_dict(UNPAIRED_ROWS),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is None and trainer.precompute_ref_logps
    assert trainer.loss_type == "kto" and trainer.calculate_KL and not trainer.aux_loss_enabled
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def grpo_trainer(tokenizer: Any, trl_args: dict[str, Any]) -> GRPOTrainer:
    """A GRPOTrainer with none of the extras that would change the loss (one process, no vLLM,
    no entropy mask or bonus, no two-sided delta clip); beta and the rest are set per test."""
    trainer = GRPOTrainer(
        tiny_model(len(tokenizer)),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=GRPOConfig(**trl_args, num_generations=2, beta=0.0, max_completion_length=8),
        train_dataset=datasets.Dataset.from_dict({"prompt": PREFERENCE_ROWS["prompt"]}),
        processing_class=tokenizer,
    )
    assert trainer.accelerator.num_processes == 1 and not trainer.use_vllm
    assert trainer.top_entropy_quantile == 1.0 and trainer.off_policy_mask_threshold is None
    assert not trainer._entropy_bonus_enabled and not trainer.aux_loss_enabled
    assert trainer.args.delta is None
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def cpo_trainer(tokenizer: Any, trl_args: dict[str, Any]) -> CPOTrainer:
    """TRL's SimPO: the experimental CPOTrainer with loss_type "simpo" and cpo_alpha 0."""
    trainer = CPOTrainer(
        tiny_model(len(tokenizer)),
        args=CPOConfig(**trl_args, loss_type="simpo", cpo_alpha=0.0),
        train_dataset=datasets.Dataset.from_dict(PREFERENCE_ROWS),
        processing_class=tokenizer,
    )
    assert trainer.alpha == 0.0 and trainer.label_smoothing == 0.0
    assert not trainer.is_encoder_decoder and not trainer.aux_loss_enabled
    trainer.model.train()
    return trainer


def set_attributes(monkeypatch: pytest.MonkeyPatch, target: object, **values: object) -> None:
    """Set existing attributes of a module-scoped trainer for one test (undone after it)."""
    for name, value in values.items():
        monkeypatch.setattr(target, name, value)


class FusedHeadStub:
    """Stands in for the policy in TRL's ``model(..., labels=labels, fused_lm_head=True)`` call.

    For the ``input_ids`` tensor it is called with it returns the per-token log-probs it holds
    for it (``[N, L-1]``, aligned with ``input_ids[:, 1:]``), zero where the shifted label is
    -100, as TRL's fused LM head does (``trl.trainer.utils.add_fused_lm_head``).
    """

    def __init__(self, *tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.tables = tables
        self.calls = 0

    def __call__(
        self, input_ids: torch.Tensor, labels: torch.Tensor, fused_lm_head: bool = False, **_: Any
    ) -> SimpleNamespace:
        assert fused_lm_head, "TRL 1.16 asks the policy for fused-head log-probs"
        tables = [logps for ids, logps in self.tables if ids is input_ids]
        assert len(tables) == 1, "called with input_ids the stub holds no log-probs for"
        keep = labels[:, 1:] != -100
        log_probs = torch.where(keep, tables[0], torch.zeros_like(tables[0]))
        zeros = torch.zeros_like(log_probs.detach())
        self.calls += 1
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=keep)


class LogitsStub:
    """Stands in for the policy in CPOTrainer's ``model(input_ids, attention_mask=...)`` call.

    Returns logits ``[N, L, V]`` whose log-softmax gives token ``input_ids[:, t + 1]`` the
    log-prob ``table[:, t]`` (the remaining mass on one other token, the other logits at -1e4),
    so TRL's own ``get_batch_logps`` recovers the table and passes its gradient back unchanged.
    """

    def __init__(self, input_ids: torch.Tensor, table: torch.Tensor, vocab: int) -> None:
        self.input_ids, self.table, self.vocab = input_ids, table, vocab

    def __call__(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        assert torch.equal(input_ids, self.input_ids), "not the layout the table was built for"
        target = input_ids[:, 1:].unsqueeze(-1)
        other = (target + 1) % self.vocab
        rows, length = input_ids.shape
        logits = torch.full((rows, length, self.vocab), -1e4, dtype=F64)
        head = logits[:, :-1].scatter(-1, target, self.table.unsqueeze(-1))
        rest = torch.log(-torch.expm1(self.table))  # log(1 - p): the mass the target lacks
        head = head.scatter(-1, other, rest.unsqueeze(-1))
        return SimpleNamespace(logits=torch.cat([head, logits[:, -1:]], dim=1))


# --------------------------------------------------------------------------- layouts


def to_shifted(
    values: torch.Tensor,
    lengths: Sequence[int],
    completion_mask: torch.Tensor,
    fill: float = OFF_COMPLETION,
) -> torch.Tensor:
    """Response-layout values ``[M, R]`` placed in TRL's per-token layout ``[M, L-1]``.

    Position t of TRL's layout is the log-prob of ``input_ids[:, t + 1]``, so row i's response
    token j sits at the j-th position where ``completion_mask[i, 1:]`` is 1. Every other
    position holds ``fill``. Returns a fresh leaf with gradient.
    """
    shifted = completion_mask[:, 1:].bool()
    out = torch.full(shifted.shape, fill, dtype=F64)
    for row, length in enumerate(lengths):
        positions = shifted[row].nonzero().flatten()
        assert positions.numel() == length, "TRL's completion mask disagrees with the lengths"
        out[row, positions] = values[row, :length].to(F64)
    return out.requires_grad_(True)


def from_shifted(
    shifted_values: torch.Tensor,
    lengths: Sequence[int],
    completion_mask: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The inverse of :func:`to_shifted`: TRL's ``[M, L-1]`` as right-padded ``[M, width]``."""
    shifted = completion_mask[:, 1:].bool()
    out = torch.zeros(len(lengths), width, dtype=F64)
    for row, length in enumerate(lengths):
        out[row, :length] = shifted_values[row, shifted[row]]
    return out


def padded_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Right-padded float64 mask ``[M, width]`` with ``lengths[i]`` leading ones in row i."""
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).to(F64)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sums over the real tokens (sequence log-probs): ``[M, R]`` -> ``[M]``."""
    return torch.where(mask.bool(), values, 0.0).sum(-1)


def uniform(gen: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """Float64 uniform draws in [low, high)."""
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=F64)


def draw_lengths(gen: torch.Generator, count: int, width: int) -> list[int]:
    """``count`` response lengths in [1, width], one of them 1 and one ``width``, shuffled."""
    lengths = torch.randint(1, width + 1, (count,), generator=gen).tolist()
    lengths[0], lengths[-1] = 1, width
    return [lengths[i] for i in torch.randperm(count, generator=gen).tolist()]


def draw_ids(gen: torch.Generator, count: int) -> list[int]:
    """``count`` token ids (no pad or EOS)."""
    return torch.randint(2, MAX_TOKEN, (count,), generator=gen).tolist()


# --------------------------------------------------------------------------- comparisons


def alignzoo_loss(
    algorithm: Algorithm,
    batch: RolloutBatch,
    outputs: PolicyOutputs,
    context: LossContext | None = None,
    *,
    advantages: bool = True,
) -> torch.Tensor:
    """compute_advantages (unless ``advantages`` is False) then compute_loss, through a plugin
    manager holding only ``algorithm``; the batch is one optimizer step unless ``context``."""
    pm = build_plugin_manager([algorithm])
    if advantages:
        batch = pm.hook.compute_advantages(batch=batch)
    context = batch.loss_context() if context is None else context
    return pm.hook.compute_loss(batch=batch, outputs=outputs, context=context).loss


def run_alignzoo(
    algorithm: Algorithm, batch: RolloutBatch, outputs: PolicyOutputs, *, advantages: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """alignzoo's loss and its gradient w.r.t. ``outputs.logprobs``."""
    loss = alignzoo_loss(algorithm, batch, outputs, advantages=advantages)
    loss.backward()
    assert outputs.logprobs.grad is not None
    return loss.detach(), outputs.logprobs.grad


def assert_parity(
    alignzoo: tuple[torch.Tensor, torch.Tensor], trl_side: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Equal losses and equal gradients (both in alignzoo's ``[B, R]`` layout), not all zero."""
    (az_loss, az_grad), (trl_loss, trl_grad) = alignzoo, trl_side
    torch.testing.assert_close(az_loss, trl_loss, **TOLERANCE)
    assert az_grad.abs().max() > 1e-4, "a degenerate case: the loss has no gradient"
    torch.testing.assert_close(az_grad, trl_grad, **TOLERANCE)


# --------------------------------------------------------------------------- preference pairs


@dataclass
class Pairs:
    """N preference pairs in TRL's row order (rows 0..N-1 chosen, N..2N-1 rejected; rows k and
    N + k are one pair), with the order in which alignzoo's batch holds the same rows."""

    prompts: list[list[int]]
    completions: list[list[int]]  # 2N
    lengths: list[int]  # 2N
    logps: torch.Tensor  # [2N, R] policy per-token log-probs, PAD_JUNK on padding
    ref_logps: torch.Tensor  # [2N, R] reference per-token log-probs, PAD_JUNK on padding
    order: torch.Tensor  # [2N]: alignzoo row j is TRL row order[j]

    @property
    def n(self) -> int:
        return len(self.prompts)

    @property
    def width(self) -> int:
        return int(self.logps.shape[1])

    @property
    def mask(self) -> torch.Tensor:
        return padded_mask(self.lengths, self.width)

    def alignzoo_batch(self, reference: bool = True) -> tuple[RolloutBatch, PolicyOutputs]:
        """The pairs as alignzoo's preference mode lays them out: one row per response, rows
        shuffled, a pair's rows sharing a group id, labels 1.0 chosen and 0.0 rejected."""
        rows = torch.arange(2 * self.n)
        group_ids = 10 + 3 * (rows % self.n)
        labels = (rows < self.n).to(F64)
        o = self.order
        return make_batch(
            self.logps[o],
            mask=self.mask[o],
            group_ids=group_ids[o],
            labels=labels[o],
            ref_logprobs=self.ref_logps[o] if reference else None,
            dtype=F64,
        )


def make_pairs(seed: int, n_pairs: int, width: int, unit_length: bool = False) -> Pairs:
    """Random pairs: responses of mixed lengths (one of length 1) or all of length 1."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * n_pairs
    lengths = [1] * rows if unit_length else draw_lengths(gen, rows, width)
    real = padded_mask(lengths, width).bool()
    logps = torch.where(real, uniform(gen, (rows, width), -3.0, -0.05), PAD_JUNK)
    ref_logps = torch.where(real, uniform(gen, (rows, width), -3.0, -0.05), PAD_JUNK)
    prompt_lengths = torch.randint(1, 4, (n_pairs,), generator=gen).tolist()
    return Pairs(
        prompts=[draw_ids(gen, n) for n in prompt_lengths],
        completions=[draw_ids(gen, n) for n in lengths],
        lengths=lengths,
        logps=logps,
        ref_logps=ref_logps,
        order=torch.randperm(rows, generator=gen),
    )


def trl_examples(pairs: Pairs) -> list[dict[str, list[int]]]:
    """The pairs as DPOTrainer's data collator takes them (prompt, chosen, rejected ids)."""
    n = pairs.n
    return [
        {
            "prompt_ids": pairs.prompts[k],
            "chosen_ids": pairs.completions[k],
            "rejected_ids": pairs.completions[n + k],
        }
        for k in range(n)
    ]


def run_trl_dpo(trainer: DPOTrainer, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's DPO loss on the pairs and its gradient, in alignzoo's row order ``[2N, R]``."""
    n = pairs.n
    inputs = trainer.data_collator(
        trl_examples(pairs)
    )  # input_ids [2N, L]: [chosen..., rejected...]
    ref = masked_sum(pairs.ref_logps, pairs.mask)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref[:n], ref[n:]
    leaf = to_shifted(pairs.logps, pairs.lengths, inputs["completion_mask"])
    stub = FusedHeadStub((inputs["input_ids"], leaf))
    loss = trainer._compute_loss(stub, inputs, return_outputs=False)
    assert stub.calls == 1
    loss.backward()
    assert leaf.grad is not None
    grad = from_shifted(leaf.grad, pairs.lengths, inputs["completion_mask"], pairs.width)
    return loss.detach(), grad[pairs.order]


def set_dpo(
    monkeypatch: pytest.MonkeyPatch,
    trainer: DPOTrainer,
    loss_types: list[str],
    beta: float,
    label_smoothing: float = 0.0,
    loss_weights: list[float] | None = None,
) -> None:
    """TRL reads these DPOTrainer attributes (set from DPOConfig) at every loss call."""
    set_attributes(
        monkeypatch,
        trainer,
        loss_types=loss_types,
        loss_weights=loss_weights or [1.0] * len(loss_types),
        beta=beta,
        label_smoothing=label_smoothing,
    )


PAIR_SHAPES = [(0, 3, 4), (1, 5, 6), (2, 2, 1)]
"""(seed, pairs, padded width); width 1 makes every response one token long."""


# alignzoo DPOParams ↔ TRL DPOConfig:
#   beta ↔ beta; loss_type ↔ loss_type (one entry: trainer.loss_types = [loss_type], weight 1);
#   label_smoothing ↔ label_smoothing (read by "robust" only, in both);
#   reference_free: false ↔ reference log-probs given: TRL's precomputed ref_chosen_logps /
#   ref_rejected_logps are the masked sums of alignzoo's per-token batch.ref_logprobs.
# Both average the per-pair losses over the pairs (alignzoo: context.groups, a group per pair).
@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize(
    ("loss_type", "beta", "label_smoothing"),
    [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 0.5, 0.0),
        ("hinge", 0.1, 0.0),
        ("hinge", 0.3, 0.0),
        ("robust", 0.1, 0.1),
        ("robust", 0.5, 0.3),
    ],
)
def test_dpo_matches_trl(
    dpo_trainer: DPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    beta: float,
    label_smoothing: float,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    set_dpo(monkeypatch, dpo_trainer, [loss_type], beta, label_smoothing)
    trl_side = run_trl_dpo(dpo_trainer, pairs)
    params = {"beta": beta, "loss_type": loss_type, "label_smoothing": label_smoothing}
    assert_parity(run_alignzoo(DPO(params), *pairs.alignzoo_batch()), trl_side)


# IPO: TRL 1.16 length-normalises it. Its margin is chosen_logratio / |y_w| - rejected_logratio
# / |y_l| (DPOTrainer._compute_loss: "we therefore normalize by the number of completion
# tokens"), while alignzoo's IPO builds h from summed log-ratios, as in Azar et al. (the
# plugin's docstring says so). The two are one loss on rescaled inputs: TRL's IPO on per-token
# log-probs l (policy and reference) equals alignzoo's on l / |y|, and TRL's gradient is
# alignzoo's divided by |y| (chain rule). With one-token responses they agree as they are.
# alignzoo DPOParams(loss_type="ipo", beta) ↔ TRL loss_type "ipo", beta (τ in both).
@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES[:2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_matches_trl_on_length_normalised_inputs(
    dpo_trainer: DPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    set_dpo(monkeypatch, dpo_trainer, ["ipo"], beta)
    trl_loss, trl_grad = run_trl_dpo(dpo_trainer, pairs)
    lengths = torch.tensor(pairs.lengths, dtype=F64).unsqueeze(1)
    scaled = replace(pairs, logps=pairs.logps / lengths, ref_logps=pairs.ref_logps / lengths)
    ipo = DPO({"beta": beta, "loss_type": "ipo"})
    az_loss, az_grad = run_alignzoo(ipo, *scaled.alignzoo_batch())
    assert_parity((az_loss, az_grad / lengths[pairs.order]), (trl_loss, trl_grad))
    # The normalisation is a real difference: on the same (unscaled) inputs the losses differ.
    plain_loss, _ = run_alignzoo(ipo, *pairs.alignzoo_batch())
    assert not torch.isclose(plain_loss, trl_loss, rtol=1e-3)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_matches_trl_on_one_token_responses(
    dpo_trainer: DPOTrainer, monkeypatch: pytest.MonkeyPatch, beta: float
) -> None:
    pairs = make_pairs(seed=3, n_pairs=4, width=3, unit_length=True)
    set_dpo(monkeypatch, dpo_trainer, ["ipo"], beta)
    trl_side = run_trl_dpo(dpo_trainer, pairs)
    ipo = DPO({"beta": beta, "loss_type": "ipo"})
    assert_parity(run_alignzoo(ipo, *pairs.alignzoo_batch()), trl_side)


# cDPO (alignzoo: loss_type "sigmoid" with label_smoothing ε; Mitchell 2023) is not defined by
# TRL 1.16: its "sigmoid" loss is -log σ(βh) and ignores label_smoothing (only "robust",
# "exo_pair", "aot" and "aot_unpaired" read it), so there is no TRL cDPO to compare with. What
# can be compared is an identity between TRL's own terms: with rDPO = [-(1-ε) log σ(βh)
# + ε log σ(-βh)] / (1-2ε), cDPO = 2(1-ε)·sigmoid - (1-2ε)·robust, which TRL evaluates as
# loss_types ["sigmoid", "robust"] with those loss_weights.
@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES[:2])
@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.1), (0.5, 0.25)])
def test_cdpo_against_trl_sigmoid_and_robust_terms(
    dpo_trainer: DPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    eps: float,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    cdpo = DPO({"beta": beta, "loss_type": "sigmoid", "label_smoothing": eps})
    weights = [2.0 * (1.0 - eps), -(1.0 - 2.0 * eps)]
    set_dpo(monkeypatch, dpo_trainer, ["sigmoid", "robust"], beta, eps, weights)
    trl_side = run_trl_dpo(dpo_trainer, pairs)
    assert_parity(run_alignzoo(cdpo, *pairs.alignzoo_batch()), trl_side)
    # TRL's "sigmoid" alone ignores label_smoothing: it is alignzoo's plain DPO (ε = 0).
    set_dpo(monkeypatch, dpo_trainer, ["sigmoid"], beta, eps)
    plain = DPO({"beta": beta, "loss_type": "sigmoid"})
    assert_parity(run_alignzoo(plain, *pairs.alignzoo_batch()), run_trl_dpo(dpo_trainer, pairs))


# --------------------------------------------------------------------------- SimPO


def run_trl_simpo(trainer: CPOTrainer, pairs: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's SimPO (CPOTrainer.compute_loss) on the pairs and its gradient, alignzoo's order."""
    n = pairs.n
    features = []
    for k in range(n):
        prompt, chosen, rejected = pairs.prompts[k], pairs.completions[k], pairs.completions[n + k]
        features.append(
            {
                "prompt_input_ids": prompt,
                "prompt_attention_mask": [1] * len(prompt),
                "chosen_input_ids": prompt + chosen,
                "chosen_attention_mask": [1] * (len(prompt) + len(chosen)),
                "chosen_labels": [-100] * len(prompt) + chosen,
                "rejected_input_ids": prompt + rejected,
                "rejected_attention_mask": [1] * (len(prompt) + len(rejected)),
                "rejected_labels": [-100] * len(prompt) + rejected,
            }
        )
    batch = trainer.data_collator(features)
    # The [chosen..., rejected...] layout CPOTrainer.concatenated_forward builds from the batch
    concatenated = CPOTrainer.concatenated_inputs(batch, padding_value=trainer.pad_token_id)
    completion_mask = (concatenated["concatenated_labels"] != -100).long()
    leaf = to_shifted(pairs.logps, pairs.lengths, completion_mask)
    stub = LogitsStub(concatenated["concatenated_input_ids"], leaf, MAX_TOKEN)
    loss = trainer.compute_loss(stub, batch)
    loss.backward()
    assert leaf.grad is not None
    grad = from_shifted(leaf.grad, pairs.lengths, completion_mask, pairs.width)
    return loss.detach(), grad[pairs.order]


# alignzoo SimPOParams ↔ TRL CPOConfig (trl.experimental.cpo) with loss_type="simpo":
#   beta ↔ beta; the target margin γ = gamma_beta_ratio·beta ↔ simpo_gamma (TRL subtracts
#   simpo_gamma / beta from the average-log-prob margin, then scales by beta);
#   cpo_alpha = 0 (no NLL term on the chosen responses), label_smoothing = 0, alpha = 0 (no
#   AlphaPO reward shaping). TRL averages each response's log-probs over its completion tokens
#   (get_batch_logps with average_log_prob=True for "simpo"), as alignzoo's average_logps does,
#   and both take the mean over the pairs.
@pytest.mark.parametrize(("seed", "n_pairs", "width"), PAIR_SHAPES)
@pytest.mark.parametrize(("beta", "gamma_beta_ratio"), [(2.0, 0.5), (2.5, 0.3), (1.0, 0.0)])
def test_simpo_matches_trl(
    cpo_trainer: CPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    gamma_beta_ratio: float,
    seed: int,
    n_pairs: int,
    width: int,
) -> None:
    pairs = make_pairs(seed, n_pairs, width)
    set_attributes(
        monkeypatch,
        cpo_trainer,
        loss_type="simpo",
        beta=beta,
        simpo_gamma=gamma_beta_ratio * beta,
        cpo_alpha=0.0,
        label_smoothing=0.0,
        alpha=0.0,
    )
    trl_side = run_trl_simpo(cpo_trainer, pairs)
    simpo = SimPO({"beta": beta, "gamma_beta_ratio": gamma_beta_ratio})
    assert_parity(run_alignzoo(simpo, *pairs.alignzoo_batch(reference=False)), trl_side)


# --------------------------------------------------------------------------- KTO


@dataclass
class Unpaired:
    """B unpaired completions in TRL's row order, and the mismatched completions TRL's KL term
    pairs them with: row i's prompt with row (i - 1) mod B's completion (KTOTrainer's
    ``add_kl_completion_ids`` rotation)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    lengths: list[int]
    labels: list[bool]  # True: desirable
    logps: torch.Tensor  # [B, R] policy per-token log-probs, PAD_JUNK on padding
    ref_logps: torch.Tensor  # [B, R]
    kl_logps: torch.Tensor  # [B, R] policy log-probs of prompt i with completion i - 1
    kl_ref_logps: torch.Tensor  # [B, R] reference log-probs of the same

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def width(self) -> int:
        return int(self.logps.shape[1])

    @property
    def kl_lengths(self) -> list[int]:
        return [self.lengths[(i - 1) % self.size] for i in range(self.size)]

    @property
    def order(self) -> torch.Tensor:
        """alignzoo row j is TRL row order[j]: reversed, so that the unpaired mode's partner of
        alignzoo row j, (j + 1) mod B, is TRL row (i - 1) mod B: the same mismatched pairs."""
        return torch.arange(self.size - 1, -1, -1)

    def alignzoo_batch(self) -> tuple[RolloutBatch, PolicyOutputs]:
        """The unpaired mode's batch: labels, per-token reference log-probs, and the mismatched
        pairs' sequence log-probs in ``batch.columns``."""
        o = self.order
        kl_mask = padded_mask(self.kl_lengths, self.width)
        mask = padded_mask(self.lengths, self.width)
        return make_batch(
            self.logps[o],
            mask=mask[o],
            labels=torch.tensor(self.labels, dtype=F64)[o],
            ref_logprobs=self.ref_logps[o],
            mismatched_logprobs=masked_sum(self.kl_logps, kl_mask)[o],
            mismatched_ref_logprobs=masked_sum(self.kl_ref_logps, kl_mask)[o],
            dtype=F64,
        )


def make_unpaired(seed: int, size: int, width: int, kl_shift: float, labels: str) -> Unpaired:
    """Random completions whose mismatched pairs have policy-minus-reference log-probs of the
    sign of ``kl_shift`` on every token (so the KL estimate is positive, or clamped to 0)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = draw_lengths(gen, size, width)
    real = padded_mask(lengths, width).bool()
    kl_lengths = [lengths[(i - 1) % size] for i in range(size)]
    kl_real = padded_mask(kl_lengths, width).bool()
    kl_ref = torch.where(kl_real, uniform(gen, (size, width), -3.0, -0.5), PAD_JUNK)
    kl_policy = kl_ref + kl_shift + uniform(gen, (size, width), -0.1, 0.1)
    desirable = [True] * size
    if labels == "mixed":
        desirable = [bool(x) for x in torch.randint(0, 2, (size,), generator=gen)]
        desirable[:2] = [True, False]
    prompt_lengths = torch.randint(1, 4, (size,), generator=gen).tolist()
    return Unpaired(
        prompts=[draw_ids(gen, n) for n in prompt_lengths],
        completions=[draw_ids(gen, n) for n in lengths],
        lengths=lengths,
        labels=desirable,
        logps=torch.where(real, uniform(gen, (size, width), -3.0, -0.05), PAD_JUNK),
        ref_logps=torch.where(real, uniform(gen, (size, width), -3.0, -0.05), PAD_JUNK),
        kl_logps=torch.where(kl_real, kl_policy, PAD_JUNK),
        kl_ref_logps=kl_ref,
    )


def run_trl_kto(trainer: KTOTrainer, data: Unpaired) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's KTO loss on the completions and its gradient, in alignzoo's row order."""
    size = data.size
    examples = [
        {
            "prompt_ids": data.prompts[i],
            "completion_ids": data.completions[i],
            "KL_completion_ids": data.completions[(i - 1) % size],
            "label": data.labels[i],
        }
        for i in range(size)
    ]
    inputs = trainer.data_collator(examples)
    inputs["ref_logps"] = masked_sum(data.ref_logps, padded_mask(data.lengths, data.width))
    kl_mask = padded_mask(data.kl_lengths, data.width)
    inputs["ref_KL_logps"] = masked_sum(data.kl_ref_logps, kl_mask)
    leaf = to_shifted(data.logps, data.lengths, inputs["completion_mask"])
    kl_table = to_shifted(data.kl_logps, data.kl_lengths, inputs["KL_completion_mask"]).detach()
    stub = FusedHeadStub((inputs["input_ids"], leaf), (inputs["KL_input_ids"], kl_table))
    loss = trainer._compute_loss(stub, inputs, return_outputs=False)
    assert stub.calls == 2  # the KL forward (no gradient) and the policy forward
    loss.backward()
    assert leaf.grad is not None
    grad = from_shifted(leaf.grad, data.lengths, inputs["completion_mask"], data.width)
    return loss.detach(), grad[data.order]


# alignzoo KTOParams ↔ TRL KTOConfig (loss_type "kto"):
#   beta ↔ beta; desirable_weight ↔ desirable_weight; undesirable_weight ↔ undesirable_weight;
#   labels 1.0 / 0.0 ↔ label True / False; per-token batch.ref_logprobs ↔ ref_logps (their sums);
#   z0 = max(0, mean(mismatched_logprobs - mismatched_ref_logprobs)) ↔ TRL's
#   kl = mean(KL_logps - ref_KL_logps).detach().clamp(min=0), from the same mismatched pairs;
#   both average the weighted per-sample losses over all B samples (alignzoo:
#   context.sequences; TRL: nanmean of the concatenated desirable and undesirable losses).
@pytest.mark.filterwarnings("ignore:KTO")  # alignzoo's weight-ratio advice
@pytest.mark.parametrize(("seed", "size", "width"), [(0, 4, 4), (1, 7, 5), (2, 3, 1)])
@pytest.mark.parametrize("labels", ["mixed", "all_desirable"])
@pytest.mark.parametrize("kl_shift", [0.3, -0.3], ids=["kl>0", "kl<0-clamped"])
@pytest.mark.parametrize(("beta", "desirable", "undesirable"), [(0.1, 1.0, 1.0), (0.5, 1.33, 0.8)])
def test_kto_matches_trl(
    kto_trainer: KTOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    beta: float,
    desirable: float,
    undesirable: float,
    kl_shift: float,
    labels: str,
    seed: int,
    size: int,
    width: int,
) -> None:
    data = make_unpaired(seed, size, width, kl_shift, labels)
    # alignzoo's mismatched partner of each row is the completion TRL pairs that prompt with
    partners, order = mismatch_partners(size), data.order.tolist()
    assert all(order[partners[j]] == (order[j] - 1) % size for j in range(size))
    set_attributes(
        monkeypatch,
        kto_trainer,
        loss_type="kto",
        beta=beta,
        desirable_weight=desirable,
        undesirable_weight=undesirable,
    )
    trl_side = run_trl_kto(kto_trainer, data)
    kto = KTO({"beta": beta, "desirable_weight": desirable, "undesirable_weight": undesirable})
    batch, outputs = data.alignzoo_batch()
    assert_parity(run_alignzoo(kto, batch, outputs), trl_side)
    z0 = float(batch.columns["kto/z0"][0])  # set by compute_advantages, as TRL's kl
    assert (z0 > 0.1) if kl_shift > 0 else (z0 == 0.0)


# --------------------------------------------------------------------------- GRPO


@dataclass
class Rollouts:
    """B sampled completions: current, behaviour (old) and reference per-token log-probs
    ``[B, R]`` and sequence advantages ``[B]``. TRL's per-token log-probs are aligned with
    ``completion_ids``, so its layout is alignzoo's; padding holds (finite) log-probs too, as a
    real policy gives every position one."""

    lengths: list[int]
    logps: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    advantages: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return padded_mask(self.lengths, int(self.logps.shape[1]))

    def alignzoo_batch(self, reference: bool) -> tuple[RolloutBatch, PolicyOutputs]:
        """alignzoo's batch: the sequence advantage on every response token."""
        mask = self.mask
        return make_batch(
            self.logps,
            mask=mask,
            group_ids=torch.arange(len(self.lengths)) // 2,
            old_logprobs=self.old_logps,
            ref_logprobs=self.ref_logps if reference else None,
            advantages=self.advantages.unsqueeze(1) * mask,
            dtype=F64,
        )

    def trl_inputs(self, rows: torch.Tensor, beta: float, num_items: float) -> dict[str, Any]:
        """GRPOTrainer._compute_loss's inputs for ``rows`` (what _generate_and_score_completions
        hands it: left-padded prompts, right-padded completions, an int completion mask)."""
        mask = self.mask[rows].int()
        count = rows.numel()
        inputs = {
            "prompt_ids": torch.full((count, 3), 7),
            "prompt_mask": torch.ones(count, 3, dtype=torch.int),
            "completion_ids": torch.where(mask.bool(), 9, 0),
            "completion_mask": mask,
            "advantages": self.advantages[rows],
            "old_per_token_logps": self.old_logps[rows],
            "num_items_in_batch": torch.tensor(num_items, dtype=F64),
        }
        if beta > 0:
            inputs["ref_per_token_logps"] = self.ref_logps[rows]
        return inputs


def make_rollouts(seed: int, size: int, width: int) -> Rollouts:
    """Random rollouts whose behaviour policy makes the clip bind both ways.

    Each sequence's log-ratio to the behaviour policy is shifted by +0.45, -0.45 or 0 (ratio
    about 1.57, 0.64 or 1), plus token noise within ±0.15, and advantages of both signs meet
    every shift: some tokens are clipped above, some below, some not at all, at ε = 0.2 or 0.28
    and at token or sequence level.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(size)
    shift = torch.tensor([0.45, -0.45, 0.0], dtype=F64)[rows % 3]
    sign = torch.where(rows % 2 == 0, 1.0, -1.0).to(F64)
    perm = torch.randperm(size, generator=gen)
    shift, sign = shift[perm], sign[perm]
    logps = uniform(gen, (size, width), -3.0, -0.05)
    old = logps - shift.unsqueeze(1) - uniform(gen, (size, width), -0.15, 0.15)
    return Rollouts(
        lengths=draw_lengths(gen, size, width),
        logps=logps,
        old_logps=old,
        ref_logps=logps + uniform(gen, (size, width), -0.5, 0.5),
        advantages=sign * uniform(gen, (size,), 0.2, 1.5),
    )


def clipped(
    r: Rollouts, level: str, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response tokens whose gradient the lower / upper clip removes, ``[B, R]`` bool each."""
    mask = r.mask.bool()
    log_ratio = torch.where(mask, r.logps - r.old_logps, 0.0)
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1) / r.mask.sum(-1)).unsqueeze(1).expand_as(log_ratio)
    ratio, adv = log_ratio.exp(), r.advantages.unsqueeze(1)
    return mask & (ratio < 1 - eps_low) & (adv < 0), mask & (ratio > 1 + eps_high) & (adv > 0)


def trl_grpo_loss(
    trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    per_token_logps: torch.Tensor,
    inputs: dict[str, Any],
    entropies: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPOTrainer._compute_loss with the policy's per-token log-probs ``per_token_logps`` (and
    entropies ``entropies``, zeros when not given)."""

    def given(
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        assert logits_to_keep == per_token_logps.shape[1]
        if entropies is not None:
            return per_token_logps, entropies, None
        return per_token_logps, torch.zeros_like(per_token_logps.detach()), None

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", given)
    return trainer._compute_loss(trainer.model, inputs)


def set_grpo(
    monkeypatch: pytest.MonkeyPatch,
    trainer: GRPOTrainer,
    *,
    loss_type: str,
    level: str,
    beta: float,
    eps_low: float,
    eps_high: float,
    max_completion_length: int,
    accumulation: int = 1,
    bias_correction: bool = False,
) -> None:
    """The GRPOTrainer attributes (and args) _compute_loss reads, for one test."""
    set_attributes(
        monkeypatch,
        trainer,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        max_completion_length=max_completion_length,
    )
    # Set by transformers' training loop (not at construction); "train" mode reads it.
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", accumulation, raising=False)
    assert trainer.model.training
    set_attributes(
        monkeypatch,
        trainer.args,
        steps_per_generation=accumulation,
        use_bias_correction_kl=bias_correction,
    )


GRPO_AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}
"""TRL GRPOConfig.loss_type ↔ alignzoo GRPOParams.loss_aggregation."""


def alignzoo_grpo(
    loss_type: str, level: str, beta: float, eps_low: float, eps_high: float, norm: int
) -> GRPO:
    """alignzoo's GRPO configured as TRL's ``loss_type`` (see the mapping above the tests)."""
    aggregation = GRPO_AGGREGATION[loss_type]
    return GRPO(
        {
            "beta": beta,
            "clip_eps_low": eps_low,
            "clip_eps_high": eps_high,
            "importance_ratio": level,
            "loss_aggregation": aggregation,
            "norm_constant": norm if aggregation == "seq-mean-token-sum-norm" else None,
        }
    )


# alignzoo GRPOParams ↔ TRL GRPOConfig (GRPOTrainer attributes):
#   loss_aggregation ↔ loss_type: seq-mean-token-mean ↔ "grpo", token-mean ↔ "bnpo" and
#     "dapo", seq-mean-token-sum-norm ↔ "dr_grpo";
#   norm_constant ↔ max_completion_length (Dr. GRPO's constant divisor);
#   LossContext.tokens (the optimizer step's response tokens) ↔ num_items_in_batch (DAPO's
#     normaliser, the generation batch's tokens);
#   clip_eps_low ↔ epsilon (trainer.epsilon_low); clip_eps_high ↔ epsilon_high;
#   importance_ratio ↔ importance_sampling_level ("token", or "sequence": GSPO);
#   beta ↔ beta (k3 KL to the reference; 0 turns it off in both) with use_bias_correction_kl
#     False: TRL's default True weights the KL by the importance ratio, alignzoo does not
#     (test_grpo_trl_default_bias_corrected_kl);
#   batch.advantages [B, R] (the sequence advantage on every response token) ↔ advantages [B].
# In "train" mode TRL divides "grpo" / "bnpo" / "dr_grpo" by current_gradient_accumulation_steps
# and scales DAPO's num_items_in_batch by current_gradient_accumulation_steps / (num_processes ·
# steps_per_generation); here one micro-batch is one optimizer step (all three 1), and
# test_grpo_micro_batches_match_trl splits a step in two.
@pytest.mark.parametrize(("seed", "size", "width"), [(0, 6, 5), (1, 8, 7)])
@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.2, 0.2), (0.2, 0.28)])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_matches_trl(
    grpo_trainer: GRPOTrainer,
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    level: str,
    beta: float,
    eps_low: float,
    eps_high: float,
    seed: int,
    size: int,
    width: int,
) -> None:
    r = make_rollouts(seed, size, width)
    low, high = clipped(r, level, eps_low, eps_high)
    assert low.any() and high.any() and not (low | high)[r.mask.bool()].all()
    norm = width + 3  # Dr. GRPO's constant: the generation budget, not the padded width
    set_grpo(
        monkeypatch,
        grpo_trainer,
        loss_type=loss_type,
        level=level,
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        max_completion_length=norm,
    )
    leaf = r.logps.clone().requires_grad_(True)
    inputs = r.trl_inputs(torch.arange(size), beta, num_items=float(r.mask.sum()))
    trl_loss = trl_grpo_loss(grpo_trainer, monkeypatch, leaf, inputs)
    trl_loss.backward()
    algorithm = alignzoo_grpo(loss_type, level, beta, eps_low, eps_high, norm)
    az = run_alignzoo(algorithm, *r.alignzoo_batch(reference=beta > 0), advantages=False)
    assert_parity(az, (trl_loss.detach(), leaf.grad))


# One optimizer step in two micro-batches of 4 sequences: alignzoo normalises each micro-batch's
# share by the step's counts (LossContext), TRL by current_gradient_accumulation_steps = 2 (and
# DAPO by num_items_in_batch, the step's tokens, times accumulation / steps_per_generation = 1).
# "grpo" and "dr_grpo" agree because the micro-batches hold equally many sequences. "bnpo" does
# not: TRL takes a token mean over each micro-batch and halves it, alignzoo's token-mean is over
# the whole step's tokens (micro-batch invariant; that is DAPO's normalisation, TRL's "dapo").
# The relation that holds for bnpo: TRL's is the mean over micro-batches of alignzoo's
# token-mean with each micro-batch taken as its own step.
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_grpo_micro_batches_match_trl(
    grpo_trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch, loss_type: str
) -> None:
    r = make_rollouts(seed=5, size=8, width=6)
    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    beta, eps_low, eps_high, norm = 0.04, 0.2, 0.28, 9
    set_grpo(
        monkeypatch,
        grpo_trainer,
        loss_type=loss_type,
        level="token",
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        max_completion_length=norm,
        accumulation=2,
    )
    leaf = r.logps.clone().requires_grad_(True)
    step_tokens = float(r.mask.sum())
    trl_loss = sum(
        trl_grpo_loss(grpo_trainer, monkeypatch, leaf[rows], r.trl_inputs(rows, beta, step_tokens))
        for rows in halves
    )
    assert isinstance(trl_loss, torch.Tensor)
    trl_loss.backward()

    algorithm = alignzoo_grpo(loss_type, "token", beta, eps_low, eps_high, norm)
    batch, outputs = r.alignzoo_batch(reference=True)
    step = batch.loss_context(micro_batches=2)

    def share(rows: torch.Tensor, context: LossContext) -> torch.Tensor:
        micro = PolicyOutputs(logprobs=outputs.logprobs[rows])
        return alignzoo_loss(algorithm, batch.select(rows), micro, context, advantages=False)

    if loss_type == "bnpo":
        own = [batch.select(rows).loss_context() for rows in halves]
        assert own[0].tokens != own[1].tokens  # else bnpo and the step's token mean coincide
        az_loss = sum(0.5 * share(rows, ctx) for rows, ctx in zip(halves, own, strict=True))
        step_mean = sum(share(rows, step) for rows in halves)
        assert not torch.isclose(step_mean.detach(), trl_loss.detach(), rtol=1e-3)
    else:
        az_loss = sum(share(rows, step) for rows in halves)
    assert isinstance(az_loss, torch.Tensor)
    az_loss.backward()
    assert outputs.logprobs.grad is not None
    assert_parity((az_loss.detach(), outputs.logprobs.grad), (trl_loss.detach(), leaf.grad))


# TRL 1.16's default use_bias_correction_kl=True multiplies the per-token k3 KL by the
# (differentiable) importance ratio; alignzoo's GRPO adds the plain k3 term, i.e. it is TRL with
# use_bias_correction_kl=False (test_grpo_matches_trl). On-policy (old = current log-probs,
# ratio 1) the losses still agree, but TRL's gradient carries an extra β·k3_t·w_t per token,
# since d(ratio·k3)/d log π = k3 + d k3/d log π at ratio 1 (w_t: the aggregation weight of
# token t, 1 / (|y_i| B) for "grpo").
def test_grpo_trl_default_bias_corrected_kl(
    grpo_trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = make_rollouts(seed=3, size=6, width=5)
    r = replace(r, old_logps=r.logps.clone())  # on-policy
    beta, size = 0.1, 6
    set_grpo(
        monkeypatch,
        grpo_trainer,
        loss_type="grpo",
        level="token",
        beta=beta,
        eps_low=0.2,
        eps_high=0.2,
        max_completion_length=8,
        bias_correction=True,
    )
    leaf = r.logps.clone().requires_grad_(True)
    inputs = r.trl_inputs(torch.arange(size), beta, num_items=float(r.mask.sum()))
    trl_loss = trl_grpo_loss(grpo_trainer, monkeypatch, leaf, inputs)
    trl_loss.backward()
    algorithm = alignzoo_grpo("grpo", "token", beta, 0.2, 0.2, 8)
    az_loss, az_grad = run_alignzoo(algorithm, *r.alignzoo_batch(reference=True), advantages=False)
    log_r = r.ref_logps - r.logps
    k3 = log_r.exp() - log_r - 1.0
    weight = r.mask / (r.mask.sum(-1, keepdim=True) * size)
    assert_parity((az_loss, az_grad + beta * k3 * weight), (trl_loss.detach(), leaf.grad))
    assert not torch.allclose(az_grad, leaf.grad, rtol=1e-3)


# --------------------------------------------------------------------------- the stand-ins


def test_fused_head_stub_follows_trls_layout(dpo_trainer: DPOTrainer) -> None:
    """The real fused head's log-probs are [N, L-1], aligned with input_ids[:, 1:] and zero
    where the shifted label is -100: the layout FusedHeadStub and to_shifted assume."""
    pairs = make_pairs(seed=4, n_pairs=2, width=4)
    n = pairs.n
    examples = [
        {
            "prompt_ids": p,
            "chosen_ids": pairs.completions[k],
            "rejected_ids": pairs.completions[n + k],
        }
        for k, p in enumerate(pairs.prompts)
    ]
    inputs = dpo_trainer.data_collator(examples)
    ids, attention = inputs["input_ids"], inputs["attention_mask"]
    labels = ids.masked_fill(inputs["completion_mask"] == 0, -100)
    model = dpo_trainer.model
    with torch.no_grad():
        fused = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        logits = model(input_ids=ids, attention_mask=attention).logits
    expected = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = labels[:, 1:] != -100
    assert fused.log_probs.shape == keep.shape
    assert (fused.log_probs[~keep] == 0).all()
    torch.testing.assert_close(fused.log_probs[keep], expected[keep], rtol=1e-5, atol=1e-5)
    # to_shifted puts response token j of a row where TRL's log-prob of that token is
    positions = to_shifted(pairs.logps, pairs.lengths, inputs["completion_mask"]).detach()
    token_of = torch.where(keep, ids[:, 1:], -1)
    for row, completion in enumerate(pairs.completions):
        assert token_of[row][keep[row]].tolist() == completion
        assert positions[row][keep[row]].tolist() == pairs.logps[row, : len(completion)].tolist()


def test_grpo_per_token_logps_follow_the_completion_layout(grpo_trainer: GRPOTrainer) -> None:
    """GRPOTrainer's per-token log-probs are [B, C], aligned with completion_ids: the layout
    alignzoo's response tensors have, which the GRPO tests rely on."""
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = (prompt_ids != 0).int()
    completion_ids = torch.tensor([[10, 11, 0, 0], [12, 13, 14, 15]])
    completion_mask = (completion_ids != 0).int()
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    model = grpo_trainer.model
    with torch.no_grad():
        logps, _, _ = grpo_trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.shape[1]
        )
        with grpo_trainer.accelerator.autocast():  # TRL's configs default to bf16, also on CPU
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    width = completion_ids.shape[1]
    logits = logits[:, -width - 1 : -1].float() / grpo_trainer.temperature
    expected = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
    real = completion_mask.bool()
    torch.testing.assert_close(logps[real], expected[real], rtol=1e-5, atol=1e-5)
