"""Discovery through entry points: listing, lazy loading, broken and duplicate plugins."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from alignzoo.errors import (
    DuplicateComponentError,
    PluginLoadError,
    UnknownComponentError,
)
from alignzoo.registry import Registry, build_plugin_manager, get_registry
from tests.core.helpers import ToyAlgorithm, entry_point, toy_registry

BUILTINS = {
    "algorithm": {
        "ppo",
        "grpo",
        "rloo",
        "reinforce_pp",
        "dpo",
        "simpo",
        "kto",
        "opd",
        "sft",
        "gkd",
    },
    "labeler": {"arithmetic", "reward_model"},
    "backend": {"hf"},
    "device_mapper": {"single", "split"},
    "modifier": {"entropy_bonus", "health_checks"},
}


def test_every_builtin_is_discovered_with_its_provider():
    registry = get_registry()
    for kind, names in BUILTINS.items():
        entries = {e.name: e for e in registry.entries(kind) if e.distribution == "alignzoo"}
        assert names <= set(entries), f"missing {kind}: {names - set(entries)}"
        for entry in entries.values():
            assert entry.version and entry.version != "?"


def test_outside_package_components_are_listed_with_their_distribution():
    registry = get_registry()
    outside = {
        (e.kind, e.name): e for e in registry.entries() if e.distribution == "alignzoo-testplugin"
    }
    assert set(outside) == {
        ("algorithm", "vanilla_pg"),
        ("labeler", "keyword"),
        ("backend", "canned"),
        ("device_mapper", "all_cpu"),
        ("modifier", "loss_scale"),
    }
    assert outside[("algorithm", "vanilla_pg")].version == "0.3.1"


def test_discovery_and_listing_never_import_torch():
    code = (
        "import sys\n"
        "from alignzoo.registry import get_registry\n"
        "entries = get_registry().load_all()\n"
        "assert len(entries) > 10, entries\n"
        "assert all(e.component is not None or e.error for e in entries)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules and "
        "type(sys.modules[m]).__name__ != '_LazyModule']\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported eagerly: {out.stdout}"


def test_unknown_name_lists_known_names_and_closest_match():
    registry = toy_registry()
    with pytest.raises(UnknownComponentError) as info:
        registry.get("algorithm", "grop")
    message = str(info.value)
    assert "did you mean 'grpo'" in message
    assert "grpo" in message and "ppo" in message


def test_plugin_whose_import_raises_is_reported_and_others_keep_working(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry(
        entry_points=[
            entry_point("algorithm.broken", "broken_plugin_mod:Broken"),
            entry_point("algorithm.toy", "tests.core.helpers:ToyAlgorithm"),
        ]
    )
    entries = {e.name: e for e in registry.load_all()}
    assert "boom at import" in entries["broken"].error
    assert entries["toy"].component is ToyAlgorithm
    with pytest.raises(PluginLoadError) as info:
        registry.get("algorithm", "broken")
    assert "broken_plugin_mod:Broken" in str(info.value) and "boom at import" in str(info.value)
    assert registry.get("algorithm", "toy") is ToyAlgorithm


def test_entry_point_of_the_wrong_kind_is_rejected():
    registry = Registry(
        entry_points=[entry_point("labeler.oops", "tests.core.helpers:ToyAlgorithm")]
    )
    with pytest.raises(PluginLoadError, match="is a algorithm"):
        registry.get("labeler", "oops")


def test_a_bare_reward_function_as_an_entry_point_points_to_the_python_labeler():
    registry = Registry(
        entry_points=[
            entry_point("labeler.reward_len", "tests.core.helpers:reward_len"),
            entry_point("algorithm.fn", "tests.core.helpers:reward_len"),
        ]
    )
    with pytest.raises(PluginLoadError) as info:
        registry.get("labeler", "reward_len")
    message = str(info.value)
    assert "it is a function" in message and "name it with the python labeler" in message
    assert "function: 'tests.core.helpers:reward_len'" in message
    with pytest.raises(PluginLoadError, match="it is a function: register a class"):
        registry.get("algorithm", "fn")


def test_malformed_entry_point_name_is_reported():
    registry = Registry(entry_points=[entry_point("grpo", "tests.core.helpers:ToyAlgorithm")])
    assert registry.entries() == []
    assert "must be '<kind>.<name>'" in registry.malformed[0].error


def test_two_providers_of_one_name_is_an_error_naming_both():
    dist_a = types.SimpleNamespace(name="pkg-a", version="1.0")
    dist_b = types.SimpleNamespace(name="pkg-b", version="2.0")
    ep_a = entry_point("algorithm.same", "tests.core.helpers:ToyAlgorithm")
    ep_b = entry_point("algorithm.same", "other.module:Thing")
    # EntryPoint is immutable; attach distributions the way importlib.metadata does.
    object.__setattr__(ep_a, "dist", dist_a)
    object.__setattr__(ep_b, "dist", dist_b)
    registry = Registry(entry_points=[ep_a, ep_b])
    with pytest.raises(DuplicateComponentError) as info:
        registry.get("algorithm", "same")
    assert "pkg-a 1.0" in str(info.value) and "pkg-b 2.0" in str(info.value)


def test_hookimpl_with_a_misspelled_hook_name_is_caught_at_assembly():
    from alignzoo import hookimpl

    class Typo(ToyAlgorithm):
        @hookimpl
        def compute_los(self, batch, outputs):  # not a hook
            return None

    with pytest.raises(PluginLoadError, match="compute_los"):
        build_plugin_manager([Typo()])


def test_hookimpl_with_an_argument_the_hookspec_lacks_is_a_plugin_load_error():
    from alignzoo import hookimpl

    class WrongArg(ToyAlgorithm):
        @hookimpl
        def compute_loss(self, batch, output):  # the hookspec says `outputs`
            return None

    with pytest.raises(PluginLoadError, match="output"):
        build_plugin_manager([WrongArg()])


def test_transform_batch_chains_with_only_the_declared_arguments_in_pluggy_order():
    from dataclasses import replace

    from alignzoo import Modifier, hookimpl
    from alignzoo.engine.hooks import Hooks
    from alignzoo.errors import RunError
    from alignzoo.testing import make_batch

    def trail(batch):
        return batch.extras[0].setdefault("trail", [])

    class AppendA(Modifier):
        @hookimpl
        def transform_batch(self, batch):  # pluggy allows omitting `run`
            new = replace(batch, extras=[{"trail": [*trail(batch), "a"]}])
            return new

    class AppendRun(Modifier):
        @hookimpl
        def transform_batch(self, batch, run):
            trail(batch).append(run)  # mutates in place and returns None: the same batch goes on

    class First(Modifier):
        @hookimpl(tryfirst=True)
        def transform_batch(self, run, batch):
            return replace(batch, extras=[{"trail": [*trail(batch), "first"]}])

    hooks = Hooks(build_plugin_manager([AppendA(), AppendRun(), First()]))
    batch, _ = make_batch([[0.0]])
    # tryfirst first, then last registered first (the order pluggy itself calls them in)
    assert trail(hooks.transform_batch(batch, "R")) == ["first", "R", "a"]

    class NotABatch(Modifier):
        @hookimpl
        def transform_batch(self, batch):
            return [batch]

    with pytest.raises(RunError, match="transform_batch of NotABatch returned list"):
        Hooks(build_plugin_manager([NotABatch()])).transform_batch(batch, "R")
