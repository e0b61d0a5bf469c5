"""Labelers for the labeling tests that must be importable by a worker process (spawn)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from alignzoo import Labeler, LabelRequest, Score


class SleepyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    flag: str = ""  # while this file exists, every call hangs
    log: str = ""  # every call appends its pid and the responses it scored


class Sleepy(Labeler):
    """Scores len(response); hangs for an hour while ``params.flag`` exists."""

    Params = SleepyParams

    def score(self, request: LabelRequest) -> Score:
        if self.params.flag and Path(self.params.flag).exists():
            time.sleep(3600)
        if self.params.log:
            with open(self.params.log, "a", encoding="utf-8") as fh:
                fh.write(f"{os.getpid()} {request.response}\n")
        return Score(float(len(request.response)))


class Crashing(Labeler):
    """Kills its own process on every call (a segfaulting native library, say)."""

    def score(self, request: LabelRequest) -> Score:
        os._exit(3)
