"""`alignzoo export`: the exported folder loads with from_pretrained (peft for a LoRA adapter,
transformers alone when merged) and reproduces the run's own final greedy evaluation exactly;
the model card says what produced it."""

from __future__ import annotations

import pytest

from alignzoo.cli import main
from alignzoo.config.loader import load_experiment
from alignzoo.config.schema import DataConfig
from alignzoo.engine.datasets import load_split
from alignzoo.engine.evaluate import eval_rows, evaluate
from alignzoo.engine.hooks import Hooks
from alignzoo.engine.loop import run_one
from alignzoo.plugins.backends.hf import HFBackend
from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
from alignzoo.registry import build_plugin_manager

from .conftest import read_jsonl, tiny_experiment


class _Run:
    def __init__(self, model, tokenizer):
        self.actor, self.tokenizer, self.step, self.state = model, tokenizer, 0, {}

    def device(self, role):
        return "cpu"


def greedy_eval(model, tokenizer, spec):
    """The engine's own greedy evaluation, with a model loaded from the export."""
    hooks = Hooks(build_plugin_manager([HFBackend(), ArithmeticLabeler()]), "export")
    hooks.on_run_start(_Run(model.eval(), tokenizer))
    rows = eval_rows(load_split(DataConfig.model_validate(spec["data"]), "eval", "online"),
                     spec["evaluation"]["num_prompts"])  # fmt: skip
    return evaluate(hooks, rows, spec["training"]["sampling"]["max_new_tokens"])


def train(write_experiment, tmp_path, **model):
    spec = tiny_experiment(budget={"steps": 4}, model=model)
    summary = run_one(load_experiment(write_experiment(spec)), "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    final = read_jsonl(tmp_path / "run" / "eval.jsonl")[-1]
    assert final["step"] == 4
    return spec, final


def test_an_export_loads_and_reproduces_the_final_evaluation(write_experiment, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, final = train(write_experiment, tmp_path)
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= names
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    again = greedy_eval(model, tokenizer, spec)
    assert again["eval/exact_match"] == final["eval/exact_match"]
    assert again["eval/score"] == pytest.approx(final["eval/score"], abs=1e-9)
    assert again["eval/response_length"] == pytest.approx(final["eval/response_length"])
    card = (out / "README.md").read_text()
    assert "algorithm `grpo`" in card and "4 steps, seed 0" in card and "eval/exact_match" in card
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2  # not over it
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"),
                 "--step", "3"]) == 2  # fmt: skip


def test_a_lora_export_loads_with_peft_and_merged_with_transformers(write_experiment, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, final = train(write_experiment, tmp_path, lora={"r": 4, "alpha": 8})
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(tmp_path / "run"), "--out", str(adapter)]) == 0
    assert (adapter / "adapter_config.json").is_file()
    assert not (adapter / "model.safetensors").exists()
    assert main(["export", str(tmp_path / "run"), "--out", str(merged), "--merge"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    for model in (AutoPeftModelForCausalLM.from_pretrained(adapter),
                  AutoModelForCausalLM.from_pretrained(merged)):  # fmt: skip
        again = greedy_eval(model, tokenizer, spec)
        assert again["eval/exact_match"] == final["eval/exact_match"]
