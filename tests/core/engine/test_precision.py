"""Precision as a setting: ``model.dtype: bfloat16`` runs the forward passes under bf16 autocast on
CPU too, with losses within bf16's tolerance of fp32's; a dtype the actor's device cannot train
in (float16 on CPU, bf16 on a GPU without it) is refused by validate and by run before anything
is written."""

from __future__ import annotations

import math

import pytest
import torch

from alignzoo.batch import PolicyOutputs, RolloutBatch
from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig
from alignzoo.engine import models as model_loading
from alignzoo.engine.loop import run_one
from alignzoo.errors import UserError
from alignzoo.kernels.forward import policy_forward
from alignzoo.plugins.algorithms.dpo import DPO
from alignzoo.plugins.algorithms.grpo import GRPO
from alignzoo.registry import build_plugin_manager
from alignzoo.world.model import build_model
from alignzoo.world.tokenizer import build_tokenizer

from .conftest import read_jsonl, tiny_experiment


def _autocast(dtype: str):
    return model_loading.autocast_factory(ModelConfig(dtype=dtype), "cpu")


def test_bfloat16_on_cpu_is_bf16_autocast_and_the_rest_stay_fp32():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with _autocast("bfloat16")():
        assert layer(x).dtype == torch.bfloat16
    for dtype in ("auto", "float32"):
        with _autocast(dtype)():
            assert layer(x).dtype == torch.float32, dtype
    assert layer.weight.dtype == torch.float32  # the weights themselves stay fp32
    with pytest.raises(UserError, match=r"model\.dtype: float16 .* GPUs"):
        _autocast("float16")


def test_the_slow_emulated_case_is_said(monkeypatch):
    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: False)
    note = model_loading.precision_note(ModelConfig(dtype="bfloat16"), "cpu")
    assert note is not None and "slower" in note
    monkeypatch.setattr(model_loading, "cpu_has_native_bf16", lambda: True)
    assert model_loading.precision_note(ModelConfig(dtype="bfloat16"), "cpu") is None
    assert model_loading.precision_note(ModelConfig(dtype="auto"), "cpu") is None


def _policy_and_batch() -> tuple[torch.nn.Module, RolloutBatch]:
    tokenizer = build_tokenizer()
    cfg = EmbeddedModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
    model = build_model(cfg, tokenizer)
    generator = torch.Generator().manual_seed(0)
    b, p, r = 8, 6, 5
    vocab = len(tokenizer)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2, 5, 3])
    mask = (torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)).float()
    batch = RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (b, p), generator=generator),
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (b, r), generator=generator),
        response_mask=mask,
        group_ids=torch.arange(b) // 4,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]),
        labels=torch.tensor([1.0, 0.0] * 4),
    )
    return model, batch


@pytest.mark.parametrize("algorithm", [GRPO({"beta": 0.0}), DPO()], ids=["grpo", "dpo"])
def test_bf16_losses_and_gradients_are_within_bf16_tolerance_of_fp32(algorithm):
    model, batch = _policy_and_batch()
    with torch.no_grad():
        reference, _ = policy_forward(model, batch)
    batch.ref_logprobs = reference + 0.1 * torch.sin(torch.arange(reference.numel())).view_as(
        reference
    )  # a reference a little away from the policy, so DPO's margins are not all 0
    batch.old_logprobs = reference.detach()
    if isinstance(algorithm, DPO):
        batch.group_ids = torch.arange(batch.size) // 2  # adjacent (chosen, rejected) pairs
    pm = build_plugin_manager([algorithm])
    batch = pm.hook.compute_advantages(batch=batch)
    results = {}
    for dtype in ("float32", "bfloat16"):
        model.zero_grad(set_to_none=True)
        logprobs, _ = policy_forward(model, batch, autocast=_autocast(dtype))
        assert logprobs.dtype == torch.float32  # log-softmax in fp32 whatever the autocast
        out = pm.hook.compute_loss(
            batch=batch, outputs=PolicyOutputs(logprobs=logprobs), context=batch.loss_context()
        )
        loss = out[0] if isinstance(out, tuple) else out.loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[dtype] = (logprobs.detach(), float(loss), grads)
    (lp32, loss32, g32), (lp16, loss16, g16) = results["float32"], results["bfloat16"]
    assert not torch.equal(lp32, lp16), "premise: bf16 autocast changed the arithmetic"
    mask = batch.response_mask > 0
    # bf16 keeps 8 bits of mantissa: log-probs of a few units agree to about 1e-2.
    torch.testing.assert_close(lp16[mask], lp32[mask], atol=5e-2, rtol=2e-2)
    assert loss16 == pytest.approx(loss32, rel=5e-2, abs=5e-3)
    cosine = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    assert cosine > 0.99, f"bf16 gradient direction departs from fp32's (cosine {cosine:.4f})"


@pytest.mark.slow
def test_an_arm_trains_in_bf16_on_cpu(write_experiment, tmp_path):
    spec = tiny_experiment(budget={"steps": 2}, training={"checkpoint_every": 2})
    spec["arms"] = {"bf16": {"algorithm": "grpo", "model": {"dtype": "bfloat16"}}}
    loaded = load_experiment(write_experiment(spec))
    summary = run_one(loaded, "bf16", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["entropy"]) for r in rows)


def test_validate_and_run_refuse_float16_on_cpu_before_anything_runs(
    write_experiment, tmp_path, capsys
):
    from alignzoo import cli

    exp = write_experiment()
    for argv in (["validate", str(exp)], ["run", str(exp), "--out", str(tmp_path / "out")]):
        code = cli.main([*argv, "--set", "model.dtype=float16"])
        text = " ".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
        assert code == 2, text
        assert "Traceback" not in text
        # the field (at the --set that gave it), the device, and what would work
        assert "--set model.dtype=float16: model.dtype:" in text, text
        assert "placed on cpu" in text and "bfloat16" in text and "float32" in text, text
        assert not (tmp_path / "out").exists()  # the run never started: nothing written
    # written in the file, the problem is placed at its line
    spec = tiny_experiment(model={"dtype": "float16"})
    code = cli.main(["validate", str(write_experiment(spec, name="f16.yaml"))])
    text = " ".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
    assert code == 2 and "f16.yaml:" in text and ": model.dtype:" in text, text


def test_bfloat16_on_a_gpu_without_it_is_refused_and_auto_falls_back_to_fp32(
    write_experiment, monkeypatch, capsys
):
    from alignzoo import cli, devices
    from alignzoo.engine.assemble import check_precision
    from alignzoo.errors import ConfigError

    # a machine with one GPU that has no bf16 (a V100, say); nothing touches CUDA itself
    monkeypatch.setattr(devices, "available_devices", lambda: ["cpu", "cuda:0"])
    monkeypatch.setattr(model_loading, "cuda_has_bf16", lambda device: False)
    monkeypatch.setattr(model_loading, "gpu_name", lambda device: "Tesla V100")
    on_gpu = {"devices": {"name": "single", "params": {"device": "cuda"}}}
    spec = tiny_experiment(model={"dtype": "bfloat16"})
    spec["arms"]["grpo"].update(on_gpu)
    loaded = load_experiment(write_experiment(spec))
    with pytest.raises(ConfigError) as caught:
        check_precision(loaded)
    (issue,) = caught.value.issues
    assert issue.path == "model.dtype" and issue.line is not None
    assert "cuda:0 (Tesla V100) does not support bfloat16" in issue.message
    assert "float16" in issue.message and "float32" in issue.message
    assert cli.main(["validate", str(write_experiment(spec, name="again.yaml"))]) == 2
    assert "does not support bfloat16" in capsys.readouterr().err
    # float16 and float32 train there; auto means float32 on such a GPU (not bf16)
    for dtype in ("float16", "float32", "auto"):
        spec["model"]["dtype"] = dtype
        check_precision(load_experiment(write_experiment(spec, name=f"{dtype}.yaml")))
    assert model_loading.autocast_dtype(ModelConfig(dtype="auto"), "cuda:0") is None
    assert model_loading.autocast_dtype(ModelConfig(dtype="float16"), "cuda:0") == torch.float16
    monkeypatch.setattr(model_loading, "cuda_has_bf16", lambda device: True)
    assert model_loading.autocast_dtype(ModelConfig(dtype="auto"), "cuda:0") == torch.bfloat16
