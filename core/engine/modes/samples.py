"""Online samples: each step samples ``samples_per_prompt`` responses to ``prompts_per_step``
prompts and the labeler scores them (PPO, GRPO, RLOO, REINFORCE++ and any policy-gradient
method). The batch trains as sampled: grouped by prompt (``group_ids == i // n``)."""

from __future__ import annotations

from typing import Any, ClassVar

from alignzoo.engine.modes.base import Collected, DataMode, StepSource, sample_and_label


class OnlineSamples(DataMode):
    """Sampled prompts, scored by the labeler; every sample trains."""

    name: ClassVar[str] = "online samples"
    kind = "online"
    online = True

    def collect(self, rows: list[dict[str, Any]], source: StepSource) -> Collected:
        return sample_and_label(rows, source)
