"""A verifiers taskset as a user would write one: two-number sums, scored in process by an
exact-answer reward (weight 1) and a digits-only format reward (weight 0.2), with a metric."""

from __future__ import annotations

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str
    operands: list[int]


class SumsConfig(vf.TasksetConfig):
    size: int = 40
    seed: int = 0
    max_operand: int = 49


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.2)
    async def digits_only(self, trace) -> float:
        return float(trace.last_reply.isdigit())

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            data = SumData(prompt=f"{a}+{b}=", answer=str(a + b), operands=[a, b])
            yield SumTask(data, self.config.task)


__all__ = ["SumsTaskset"]
