"""Which devices exist here, and checks that a requested device is one of them.

Device mappers receive the list of available devices as an argument (so they can be tested with
any list); the engine and ``alignzoo validate`` get it from :func:`available_devices`. torch is
imported only inside the function, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

from alignzoo.errors import UserError


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
