"""Device mappers place roles on devices that exist, and refuse those that do not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from alignzoo.devices import available_devices, check_device, normalize_device
from alignzoo.errors import UserError
from alignzoo.plugins.devices.single import SingleDevice
from alignzoo.plugins.devices.split import SplitDevices
from alignzoo.registry import build_plugin_manager
from alignzoo.types import ROLES, Placement

CPU_ONLY = ["cpu"]


def devices_of(placed: dict) -> dict[str, str]:
    """Role -> device of a mapper's placements."""
    return {role: p.device if isinstance(p, Placement) else p for role, p in placed.items()}


TWO_GPUS = ["cpu", "cuda:0", "cuda:1"]
THREE_GPUS = ["cpu", "cuda:0", "cuda:1", "cuda:2"]


def test_available_devices_lists_cpu_first_and_real_gpus():
    import torch

    devices = available_devices()
    assert devices[0] == "cpu"
    assert sum(d.startswith("cuda:") for d in devices) == torch.cuda.device_count()
    assert len(set(devices)) == len(devices)


def test_normalize_and_check():
    assert normalize_device("cuda") == "cuda:0"
    assert normalize_device(" CUDA:1 ") == "cuda:1"
    assert check_device("actor", "cuda", TWO_GPUS) == "cuda:0"
    with pytest.raises(UserError, match=r"role 'ref'.*'cuda:3'.*cpu, cuda:0, cuda:1"):
        check_device("ref", "cuda:3", TWO_GPUS)


# --------------------------------------------------------------------------- single


def test_single_defaults_to_cpu_for_every_role():
    assert devices_of(SingleDevice().place_roles(ROLES, CPU_ONLY)) == {
        role: "cpu" for role in ROLES
    }


def test_single_cuda_means_cuda0():
    placed = devices_of(SingleDevice({"device": "cuda"}).place_roles(["actor", "ref"], TWO_GPUS))
    assert placed == {"actor": "cuda:0", "ref": "cuda:0"}


def test_single_missing_device_names_role_device_and_what_exists():
    with pytest.raises(UserError) as err:
        devices_of(SingleDevice({"device": "cuda:0"}).place_roles(["actor", "rollout"], CPU_ONLY))
    message = str(err.value)
    assert "'actor'" in message and "'cuda:0'" in message and "available devices: cpu" in message


def test_single_auto_prefers_first_gpu():
    assert devices_of(SingleDevice({"device": "auto"}).place_roles(["actor"], TWO_GPUS)) == {
        "actor": "cuda:0"
    }
    assert devices_of(SingleDevice({"device": "auto"}).place_roles(["actor"], CPU_ONLY)) == {
        "actor": "cpu"
    }
    assert devices_of(SingleDevice({"device": "auto"}).place_roles(["actor"], ["cpu", "mps"])) == {
        "actor": "mps"
    }


def test_single_params_reject_unknown_fields():
    with pytest.raises(ValidationError):
        SingleDevice({"devices": "cpu"})


# --------------------------------------------------------------------------- split


def test_split_places_each_role_and_defaults_the_rest():
    mapper = SplitDevices(
        {"actor": "cuda:0", "ref": "cuda:1", "critic": "cuda:1", "labeler": "cuda:2"}
    )
    assert devices_of(mapper.place_roles(ROLES, THREE_GPUS)) == {
        "actor": "cuda:0",
        "ref": "cuda:1",
        "critic": "cuda:1",
        "reward": "cpu",  # default
        "rollout": "cuda:0",  # follows the actor
        "labeler": "cuda:2",
    }


def test_split_default_and_follow_rules():
    mapper = SplitDevices({"default": "cuda:1", "reward": "cuda:0"})
    placed = devices_of(mapper.place_roles(ROLES, TWO_GPUS))
    assert placed["actor"] == "cuda:1" and placed["ref"] == "cuda:1"
    assert placed["rollout"] == "cuda:1"  # follows the (defaulted) actor
    assert placed["labeler"] == "cuda:0"  # follows reward
    # An explicit rollout device wins over following the actor.
    explicit = devices_of(
        SplitDevices({"actor": "cuda:0", "rollout": "cuda:1"}).place_roles(
            ["actor", "rollout"], TWO_GPUS
        )
    )
    assert explicit == {"actor": "cuda:0", "rollout": "cuda:1"}


def test_split_places_only_the_roles_asked():
    placed = devices_of(
        SplitDevices({"actor": "cuda:1"}).place_roles(["actor", "rollout"], TWO_GPUS)
    )
    assert placed == {"actor": "cuda:1", "rollout": "cuda:1"}


def test_split_missing_device_is_an_error_even_for_an_unused_role():
    mapper = SplitDevices({"actor": "cuda:0", "critic": "cuda:7"})
    with pytest.raises(UserError, match=r"devices\.params\.critic.*'critic'.*'cuda:7'"):
        devices_of(mapper.place_roles(["actor"], TWO_GPUS))


def test_split_missing_default_is_an_error():
    with pytest.raises(UserError, match=r"'cuda:0'.*available devices: cpu"):
        devices_of(SplitDevices({"default": "cuda:0"}).place_roles(["actor"], CPU_ONLY))


def test_split_unknown_role_key_is_rejected_with_known_roles():
    with pytest.raises(ValidationError, match=r"unknown role\(s\) actr.*actor, ref"):
        SplitDevices({"actr": "cuda:0"})


def test_split_unknown_role_asked_by_engine_is_an_error():
    with pytest.raises(UserError, match="unknown role"):
        devices_of(SplitDevices().place_roles(["policy"], CPU_ONLY))


def test_mappers_answer_through_the_hook():
    pm = build_plugin_manager([SplitDevices({"actor": "cuda:1"})])
    placed = pm.hook.place_roles(roles=["actor", "ref"], available=TWO_GPUS)
    assert devices_of(placed) == {"actor": "cuda:1", "ref": "cpu"}


# --------------------------------------------------------------------------- placements

FOUR_GPUS = ["cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_a_placement_names_its_tensor_parallel_group_and_is_checked_whole():
    from alignzoo.devices import check_placement

    placed = check_placement("rollout", {"device": "cuda:2", "tensor_parallel_size": 2}, FOUR_GPUS)
    assert placed.devices() == ["cuda:2", "cuda:3"] and placed.gpu_share is None
    assert check_placement("actor", "CUDA", FOUR_GPUS) == Placement(device="cuda:0")
    with pytest.raises(
        UserError, match=r"tensor_parallel_size 2 from cuda:3.*role 'rollout'.*'cuda:4'"
    ):
        check_placement("rollout", {"device": "cuda:3", "tensor_parallel_size": 2}, FOUR_GPUS)
    with pytest.raises(UserError, match=r"gpu_share 0.5 on cpu.*GPUs only"):
        check_placement("rollout", {"device": "cpu", "gpu_share": 0.5}, CPU_ONLY)
    with pytest.raises(UserError, match=r"tensor_parallel_size 2 on cpu"):
        check_placement("rollout", {"device": "cpu", "tensor_parallel_size": 2}, CPU_ONLY)
    with pytest.raises(UserError, match=r"where: role 'rollout': gpu_share: .*less than or equal"):
        check_placement("rollout", {"device": "cuda:0", "gpu_share": 1.5}, FOUR_GPUS, "where")
    with pytest.raises(UserError, match=r"expected a device name or a placement"):
        check_placement("actor", 3, CPU_ONLY)


def test_split_places_a_sharded_rollout_and_single_a_colocated_share():
    split = SplitDevices(
        {
            "actor": "cuda:0",
            "rollout": {"device": "cuda:2", "tensor_parallel_size": 2, "gpu_share": 0.9},
        }
    )
    placed = split.place_roles(["actor", "rollout", "labeler"], FOUR_GPUS)
    assert (
        placed["rollout"].devices() == ["cuda:2", "cuda:3"] and placed["rollout"].gpu_share == 0.9
    )
    assert placed["actor"] == Placement(device="cuda:0") and placed["labeler"].device == "cpu"
    with pytest.raises(UserError, match=r"devices.params.rollout.*'cuda:4'"):
        SplitDevices({"rollout": {"device": "cuda:3", "tensor_parallel_size": 2}}).place_roles(
            ["actor"], FOUR_GPUS
        )
    single = SingleDevice({"device": "cuda:0", "rollout_gpu_share": 0.3})
    placed = single.place_roles(["actor", "rollout"], TWO_GPUS)
    assert placed["rollout"].gpu_share == 0.3 and placed["actor"].gpu_share is None
    with pytest.raises(UserError, match=r"gpu_share 0.3 on cpu"):
        SingleDevice({"rollout_gpu_share": 0.3}).place_roles(["actor", "rollout"], CPU_ONLY)


def test_the_engine_checks_what_any_mapper_returns():
    from alignzoo import DeviceMapper, hookimpl
    from alignzoo.engine.hooks import Hooks

    class Sharding(DeviceMapper):
        @hookimpl
        def place_roles(self, roles, available):
            return {role: {"device": "cuda:1", "tensor_parallel_size": 2} for role in roles}

    hooks = Hooks(build_plugin_manager([Sharding()]), "test")
    placed = hooks.place_roles(["actor"], FOUR_GPUS)
    assert placed["actor"].devices() == ["cuda:1", "cuda:2"]
    with pytest.raises(UserError, match=r"devices \(Sharding\).*'cuda:2'"):
        hooks.place_roles(["actor"], TWO_GPUS)
