"""Device mapper "split": each role on its own named device (e.g. actor cuda:0, ref cuda:1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignzoo.devices import check_device, check_placement
from alignzoo.errors import UserError
from alignzoo.plugin import DeviceMapper, hookimpl
from alignzoo.types import ROLES, Placement

# A role left out follows another role before it falls back to ``default``: the Hugging Face
# backend samples with the actor's own module, and the labeler runs the reward model.
FOLLOWS = {"rollout": "actor", "labeler": "reward"}


class SplitDevices(DeviceMapper):
    """Each role on a named device (actor, ref, critic, reward, rollout, labeler); `default` for the rest.

    Example: ``{actor: cuda:0, ref: cuda:1, critic: cuda:1, labeler: cuda:2}``; a role may also
    get a placement, ``rollout: {device: cuda:2, tensor_parallel_size: 2, gpu_share: 0.9}``
    (vLLM over cuda:2 and cuda:3, 90% of their memory). A role not listed
    goes where the role it follows goes (rollout follows actor, labeler follows reward) and
    otherwise to ``default``. Every device must exist here: the check runs before anything loads.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        default: str = Field("cpu", description="Device of every role not listed.")
        actor: str | Placement | None = Field(None, description="Device of the trained policy.")
        ref: str | Placement | None = Field(
            None, description="Device of the frozen reference policy."
        )
        critic: str | Placement | None = Field(None, description="Device of the value model (PPO).")
        reward: str | Placement | None = Field(None, description="Device of a reward model.")
        rollout: str | Placement | None = Field(
            None,
            description="Device the backend samples on (defaults to the actor's); or "
            "{device, gpu_share, tensor_parallel_size} for a backend that shares or shards GPUs.",
        )
        labeler: str | Placement | None = Field(
            None, description="Device of the labeler's model (defaults to the reward's)."
        )

        @model_validator(mode="before")
        @classmethod
        def _known_roles(cls, data: Any) -> Any:
            if isinstance(data, dict):
                unknown = sorted(str(k) for k in data if k != "default" and k not in ROLES)
                if unknown:
                    raise ValueError(
                        f"unknown role(s) {', '.join(unknown)}; known roles: {', '.join(ROLES)} "
                        "(and 'default' for the rest)"
                    )
            return data

    def requested(self, role: str) -> str | Placement:
        """The placement asked for ``role``, following FOLLOWS and then ``default``."""
        asked = getattr(self.params, role, None)
        if asked is None and role in FOLLOWS:
            asked = getattr(self.params, FOLLOWS[role], None)
            if isinstance(asked, Placement):  # follow the device, not another role's shares
                asked = asked.device
        return asked if asked is not None else self.params.default

    @hookimpl
    def place_roles(self, roles: Sequence[str], available: Sequence[str]) -> dict[str, Placement]:
        unknown = [role for role in roles if role not in ROLES]
        if unknown:
            raise UserError(f"devices: cannot place unknown role(s) {unknown}; known: {ROLES}")
        # Every listed device is checked, also for roles this run does not load (a typo in
        # `critic:` is still a typo when the algorithm needs no critic).
        for role in ROLES:
            asked = getattr(self.params, role)
            if asked is not None:
                check_placement(role, asked, available, where=f"devices.params.{role}")
        check_device("default", self.params.default, available, where="devices.params.default")
        return {
            role: check_placement(role, self.requested(role), available, where="devices.params")
            for role in roles
        }
