"""Assembly: roles placed before models load, only the models the algorithm needs, fresh components."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from alignzoo.config.loader import load_experiment
from alignzoo.engine import assemble as assemble_mod
from alignzoo.engine import models
from alignzoo.engine.assemble import assemble
from alignzoo.errors import UserError


def _assembled(write_experiment: Callable[..., Path], tmp_path: Path, arm: dict, name: str = "a"):
    loaded = load_experiment(write_experiment(arms={name: arm}))
    return loaded, assemble(loaded, name, 0, tmp_path / "run", log=lambda *_: None)


def test_grpo_without_kl_loads_no_reference_and_no_critic(write_experiment, tmp_path) -> None:
    loaded, assembled = _assembled(
        write_experiment, tmp_path, {"algorithm": {"name": "grpo", "params": {"beta": 0.0}}}
    )
    run = assembled.context
    assert run.reference is None and run.critic is None
    assert set(run.devices) == {"actor", "rollout", "labeler"}
    assert all(d == "cpu" for d in run.devices.values())
    assert run.actor.training and next(run.actor.parameters()).requires_grad
    # Fresh instances: the run never touches the components held by the loaded experiment.
    assert all(c is not loaded.components["a"][slot] for slot, c in assembled.components.items())
    assert assembled.hooks.pm.is_registered(assembled.components["algorithm"])
    assert not assembled.hooks.pm.is_registered(loaded.components["a"]["algorithm"])
    # The backend got the run's tokenizer and samples from the actor.
    assert assembled.components["backend"].model is run.actor


def test_ppo_loads_a_frozen_reference_and_a_value_head(write_experiment, tmp_path) -> None:
    _, assembled = _assembled(write_experiment, tmp_path, {"algorithm": "ppo"})
    run = assembled.context
    assert set(run.devices) == {"actor", "rollout", "labeler", "ref", "critic"}
    assert run.reference is not None and not run.reference.training
    assert not any(p.requires_grad for p in run.reference.parameters())
    assert type(run.critic).__name__.endswith("ForTokenClassification")
    assert run.critic.config.num_labels == 1
    # The critic's parameters are trained (second param group), the reference's are not.
    groups = assembled.learner.optimizer.param_groups
    assert len(groups) == 2
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in run.critic.parameters()}


def test_critic_head_init_is_seeded(write_experiment, tmp_path) -> None:
    loaded = load_experiment(write_experiment(arms={"ppo": {"algorithm": "ppo"}}))
    a = assemble(loaded, "ppo", 5, tmp_path / "a", log=lambda *_: None).models.critic
    b = assemble(loaded, "ppo", 5, tmp_path / "b", log=lambda *_: None).models.critic
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert (pa == pb).all(), name


def test_lora_trains_only_adapters(write_experiment, tmp_path) -> None:
    loaded = load_experiment(
        write_experiment(arms={"a": {"algorithm": "rloo", "model": {"lora": {"r": 2, "alpha": 4}}}})
    )
    assembled = assemble(loaded, "a", 0, tmp_path / "run", log=lambda *_: None)
    trainable = [n for n, p in assembled.models.actor.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_a_missing_device_fails_before_any_model_loads(
    write_experiment, tmp_path, monkeypatch
) -> None:
    loaded = load_experiment(
        write_experiment(
            arms={
                "a": {
                    "algorithm": "grpo",
                    "devices": {"name": "single", "params": {"device": "cuda:7"}},
                }
            }
        )
    )

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the devices were checked")

    monkeypatch.setattr(models, "load_actor", no_loading)
    monkeypatch.setattr(assemble_mod, "policy_path", no_loading)
    with pytest.raises(UserError, match="cuda:7"):
        assemble(loaded, "a", 0, tmp_path / "run", log=lambda *_: None)


def test_online_preference_needs_two_samples_per_prompt(write_experiment, tmp_path) -> None:
    loaded = load_experiment(
        write_experiment(arms={"a": {"algorithm": "dpo", "training": {"samples_per_prompt": 1}}})
    )
    with pytest.raises(UserError, match="samples_per_prompt"):
        assemble_mod.assemble(loaded, "a", 0, tmp_path / "run", log=lambda *_: None)


def test_an_arm_can_read_its_preference_data_offline(write_experiment, tmp_path) -> None:
    loaded = load_experiment(
        write_experiment(
            arms={
                "online": {"algorithm": "dpo", "training": {"samples_per_prompt": 2}},
                "offline": {"algorithm": "dpo", "online": False},
            }
        )
    )
    online = assemble_mod.assemble(loaded, "online", 0, tmp_path / "on", log=lambda *_: None)
    offline = assemble_mod.assemble(loaded, "offline", 0, tmp_path / "off", log=lambda *_: None)
    assert online.mode.online and not offline.mode.online
    assert (online.mode.name, offline.mode.name) == ("online pairs", "offline preference")
    assert {"chosen", "rejected"} <= set(offline.sampler.dataset.column_names)


def test_dropout_is_disabled_unless_asked_to_keep_it(tmp_path) -> None:
    """A checkpoint with dropout: train-mode forwards agree only when dropout is zeroed."""
    import torch

    from alignzoo.config.schema import EmbeddedModelConfig, ModelConfig
    from alignzoo.world.model import build_model, save_policy
    from alignzoo.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2), tokenizer)
    model.config.attention_dropout = 0.5
    save_policy(model, tokenizer, tmp_path / "policy")
    ids = torch.tensor([tokenizer.encode("12+34=46")])

    def two_forwards(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        actor = models.load_actor(str(tmp_path / "policy"), cfg, "cpu")
        assert actor.training
        torch.manual_seed(0)
        return actor(ids).logits, actor(ids).logits

    first, second = two_forwards(ModelConfig(attn_implementation="eager"))
    assert torch.equal(first, second)
    first, second = two_forwards(ModelConfig(attn_implementation="eager", disable_dropout=False))
    assert not torch.equal(first, second)


def test_a_lora_reference_is_the_actor_with_adapters_off(write_experiment, tmp_path) -> None:
    """No second copy of the base weights, and the reference stays the starting policy while
    the adapters train."""
    from alignzoo.engine.models import AdaptersOff, load_reference
    from alignzoo.engine.scoring import Scorer
    from alignzoo.engine.step import train_step

    lora = {"r": 2, "alpha": 4}
    spec = {"algorithm": {"name": "grpo", "params": {"beta": 0.1}}, "model": {"lora": lora}}
    loaded = load_experiment(write_experiment(arms={"a": spec}))
    run = assemble(loaded, "a", 0, tmp_path / "run", log=lambda *_: None)
    models = run.models
    assert isinstance(models.reference, AdaptersOff)
    assert not list(models.reference.named_modules())[1:]  # holds no module of its own
    run.context.step = 1
    assert train_step(run, 1).metrics["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # B starts at 0
    torch.manual_seed(1)
    with torch.no_grad():  # adapters that change the policy, as training would
        for name, param in models.actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    batch = run.hooks.generate(["3+4=", "1+2="], [{}, {}], 2, run.arm.training.sampling)
    scorer = Scorer(models, 8)
    shared = scorer.reference_logprobs(batch)
    actor, _ = scorer.behaviour(batch)
    mask = batch.response_mask.bool()
    assert (actor - shared).abs().masked_fill(~mask, 0).max() > 1e-3  # premise: they differ
    base = load_reference(models.policy_path, run.arm.model, "cpu")
    separate = Scorer(type(models)(models.tokenizer, models.actor, models.policy_path,
                                   reference=base), 8).reference_logprobs(batch)  # fmt: skip
    assert (shared - separate).abs().masked_fill(~mask, 0).max() < 1e-5
    assert models.actor.training  # the actor's mode is restored after a reference pass


def test_a_run_closes_what_it_owns_in_order_even_when_one_part_fails(
    write_experiment, tmp_path, monkeypatch
) -> None:
    """Run.close: the sinks, the look-ahead collector, the training and evaluation labeling
    stages, then the components' on_run_end with the status; a part that raises stops none of
    the later ones, and its error comes out after the last."""
    spec = {
        "arms": {"a": {"algorithm": "grpo", "labeling": {"overlap": True}}},
        "evaluation": {"labeler": "arithmetic"},
    }
    loaded = load_experiment(write_experiment(**spec))
    run = assemble(loaded, "a", 0, tmp_path / "run", log=lambda *_: None)
    run.open_sinks({})
    assert run.eval_labeling is not None and run.evaluation_labeling is run.eval_labeling
    closed: list[str] = []

    def closer(name: str, fails: bool = False) -> Callable[[], None]:
        def close() -> None:
            closed.append(name)
            if fails:
                raise RuntimeError(f"{name} failed")

        return close

    monkeypatch.setattr(run.sinks, "close", closer("sinks"))
    monkeypatch.setattr(run.collector, "close", closer("collector"))
    monkeypatch.setattr(run.labeling, "close", closer("labeling", fails=True))
    monkeypatch.setattr(run.eval_labeling, "close", closer("evaluation labeling"))
    monkeypatch.setattr(
        run.hooks, "on_run_end", lambda context, status: closed.append(f"on_run_end {status}")
    )
    with pytest.raises(RuntimeError, match="labeling failed"):
        run.close("finished")
    assert closed == [
        "sinks",
        "collector",
        "labeling",
        "evaluation labeling",
        "on_run_end finished",
    ]


def test_the_hooks_hold_only_the_plugin_manager(write_experiment, tmp_path) -> None:
    """The labeling stage and the episode runner belong to the run, not to its hooks."""
    _, run = _assembled(write_experiment, tmp_path, {"algorithm": "grpo"})
    assert set(vars(run.hooks)) == {"pm", "algorithm"}
    assert run.collector.labeling is run.labeling and run.episodes is None
