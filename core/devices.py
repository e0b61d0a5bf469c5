"""Which devices exist here, and checks that a requested device is one of them.

Device mappers receive the list of available devices as an argument (so they can be tested with
any list); the engine and ``alignzoo validate`` get it from :func:`available_devices`. torch is
imported only inside the function, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from alignzoo.errors import UserError
from alignzoo.types import Placement


def available_devices() -> list[str]:
    """``"cpu"``, then ``"cuda:0"`` ... ``"cuda:N-1"`` for each visible GPU, then ``"mps"`` if present."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


def normalize_device(device: str) -> str:
    """Canonical spelling of a device name: ``"cuda"`` is ``"cuda:0"``; case and spaces ignored."""
    name = device.strip().lower()
    if name == "cuda":
        return "cuda:0"
    if name == "mps:0":
        return "mps"
    return name


def check_device(role: str, device: str, available: Sequence[str], where: str = "devices") -> str:
    """Return the canonical name of ``device`` for ``role``, or raise UserError if it does not exist.

    ``where`` names the config place the device came from (for the message).
    """
    name = normalize_device(device)
    known = [normalize_device(d) for d in available]
    if name not in known:
        raise UserError(
            f"{where}: role '{role}' is placed on device '{device}', which does not exist on "
            f"this machine; available devices: {', '.join(known) or 'none'}"
        )
    return name


def check_placement(
    role: str, placement: Any, available: Sequence[str], where: str = "devices"
) -> Placement:
    """Validate ``placement`` (a device string, a mapping or a :class:`Placement`) for ``role``.

    Returns the canonical Placement: every device of its tensor-parallel group exists here, a
    ``gpu_share`` or a ``tensor_parallel_size`` above 1 is only on a GPU. Raises UserError
    naming ``where``, the role and what was expected.
    """
    if isinstance(placement, str):
        placement = Placement(device=placement)
    elif isinstance(placement, dict):
        try:
            placement = Placement.model_validate(placement)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'placement'}: {e['msg']}"
                for e in exc.errors()
            )
            raise UserError(f"{where}: role '{role}': {problems}") from None
    elif not isinstance(placement, Placement):
        raise UserError(
            f"{where}: role '{role}' was placed on {placement!r}; expected a device name or a "
            "placement {device, gpu_share, tensor_parallel_size}"
        )
    device = check_device(role, placement.device, available, where)
    on_gpu = device.startswith("cuda")
    if not on_gpu and placement.gpu_share is not None:
        raise UserError(
            f"{where}: role '{role}' has gpu_share {placement.gpu_share} on {device}; a share "
            "of memory applies to GPUs only (leave gpu_share unset)"
        )
    if not on_gpu and placement.tensor_parallel_size > 1:
        raise UserError(
            f"{where}: role '{role}' has tensor_parallel_size {placement.tensor_parallel_size} "
            f"on {device}; tensor parallelism shards over GPUs only"
        )
    placement = placement.model_copy(update={"device": device})
    for extra in placement.devices()[1:]:
        check_device(
            role,
            extra,
            available,
            where=f"{where} (tensor_parallel_size {placement.tensor_parallel_size} from {device})",
        )
    return placement
