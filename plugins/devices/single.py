"""Device mapper "single": every role on one device (cpu unless told otherwise)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.devices import check_placement
from alignzoo.plugin import DeviceMapper, hookimpl
from alignzoo.types import Placement


class SingleDevice(DeviceMapper):
    """Every role (actor, ref, critic, reward, rollout, labeler) on one device: cpu, cuda:0, mps or auto.

    ``device: auto`` picks ``cuda:0`` when a GPU is visible, then ``mps``, else ``cpu``.
    ``rollout_gpu_share`` gives the rollout role a share of that GPU's memory (a colocated
    vLLM engine). A device that does not exist here is an error before anything loads.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        device: str = Field(
            "cpu",
            description="Device for every role: 'cpu', 'cuda' (= 'cuda:0'), 'cuda:N', 'mps' "
            "or 'auto' (first GPU if any, else cpu).",
        )
        rollout_gpu_share: float | None = Field(
            None,
            gt=0.0,
            le=1.0,
            description="Share of the GPU's memory the rollout engine may use while it shares "
            "the GPU with training (a colocated vLLM's gpu_memory_utilization); GPUs only.",
        )

    @hookimpl
    def place_roles(self, roles: Sequence[str], available: Sequence[str]) -> dict[str, Placement]:
        device = self.params.device
        if device.strip().lower() == "auto":
            device = _auto(available)
        share = self.params.rollout_gpu_share
        return {
            role: check_placement(
                role,
                Placement(device=device, gpu_share=share if role == "rollout" else None),
                available,
                where="devices.params",
            )
            for role in roles
        }


def _auto(available: Sequence[str]) -> str:
    for preferred in ("cuda:0", "mps"):
        if preferred in available:
            return preferred
    return "cpu"
