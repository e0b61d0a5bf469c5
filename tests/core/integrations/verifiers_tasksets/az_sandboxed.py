"""A verifiers taskset whose reward needs a runtime (a container): alignzoo cannot score it."""

from __future__ import annotations

import verifiers.v1 as vf


class ShellTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def tests_pass(self, trace, runtime) -> float:
        return 1.0


class ShellTaskset(vf.Taskset[ShellTask, vf.TasksetConfig]):
    def load(self):
        yield ShellTask(vf.TaskData(prompt="fix the build"), self.config.task)


__all__ = ["ShellTaskset"]
