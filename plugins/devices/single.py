"""Device mapper "single": every role on one device (cpu unless told otherwise)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.devices import check_device
from alignzoo.plugin import DeviceMapper, hookimpl


class SingleDevice(DeviceMapper):
    """Every role (actor, ref, critic, reward, rollout, labeler) on one device: cpu, cuda:0, mps or auto.

    ``device: auto`` picks ``cuda:0`` when a GPU is visible, then ``mps``, else ``cpu``.
    A device that does not exist here is an error before anything loads.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        device: str = Field(
            "cpu",
            description="Device for every role: 'cpu', 'cuda' (= 'cuda:0'), 'cuda:N', 'mps' "
            "or 'auto' (first GPU if any, else cpu).",
        )

    @hookimpl
    def place_roles(self, roles: Sequence[str], available: Sequence[str]) -> dict[str, str]:
        device = self.params.device
        if device.strip().lower() == "auto":
            device = _auto(available)
        return {
            role: check_device(role, device, available, where="devices.params.device")
            for role in roles
        }


def _auto(available: Sequence[str]) -> str:
    for preferred in ("cuda:0", "mps"):
        if preferred in available:
            return preferred
    return "cpu"
