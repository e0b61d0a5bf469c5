"""The prompt sampler: dataset rows in an order that depends on the run seed only.

Every arm of an experiment sees the same prompts in the same order for a given seed, because
the order is a permutation drawn from the seed (and the epoch), never from the global RNG. The
cursor (epoch, position) is saved in checkpoints, so a resumed run continues where it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptSampler:
    """Yields rows of a dataset in a seeded order, epoch after epoch."""

    def __init__(self, dataset: Any, seed: int) -> None:
        if len(dataset) == 0:
            raise ValueError("cannot sample from an empty dataset")
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        rng = np.random.default_rng([abs(self.seed), int(self.seed < 0), epoch, 0x5A17])
        return rng.permutation(len(self.dataset)).tolist()

    def next(self, k: int) -> list[dict[str, Any]]:
        """The next ``k`` rows (dicts of column -> value), wrapping to a new epoch when needed."""
        return self.next_seeded(k)[0]

    def next_seeded(self, k: int) -> tuple[list[dict[str, Any]], list[int]]:
        """The next ``k`` rows and, for each, a sampling seed of its own, drawn from the run
        seed and the row's place in the stream (epoch, position): a prompt's samples then come
        from its own generator, the same whatever the batch or the process that samples it."""
        indices: list[int] = []
        seeds: list[int] = []
        while len(indices) < k:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            indices.append(self._order[self.position])
            sequence = [abs(self.seed), int(self.seed < 0), self.epoch, self.position, 0x5EED]
            seeds.append(int(np.random.SeedSequence(sequence).generate_state(1, np.uint64)[0] >> 1))
            self.position += 1
        columns = self.dataset[indices]  # one query of the Arrow table (no new Dataset)
        rows = [{name: values[i] for name, values in columns.items()} for i in range(k)]
        return rows, seeds

    def state_dict(self) -> dict[str, int]:
        """The cursor: enough to continue the exact sequence."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
