"""Labelers for the labeling tests that must be importable by a worker process (spawn)."""

from __future__ import annotations

import os
import threading
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


# For the overlap test: the run's training generations are counted (the test wraps the
# backend), and the k-th labeling pass off the main thread (which labels the k-th training
# batch) returns only once generation k + 1 has begun: possible only when labeling really
# overlaps the next step's generation (without overlap the run would wait here for ever).
GENERATIONS = [0]
GENERATED = threading.Condition()
PASSES = [0]
WAITED = 4  # the passes that wait: those of the 4 trained batches (the 5th is the last look-ahead)
WAITS: list[bool] = []  # per waiting pass: did the next generation begin while it waited


def generation_began() -> None:
    with GENERATED:
        GENERATIONS[0] += 1
        GENERATED.notify_all()


def waits_for_next_generation(prompts, completions, **columns):
    if threading.current_thread() is not threading.main_thread():
        with GENERATED:
            PASSES[0] += 1
            batch = PASSES[0]
            if batch <= WAITED:
                WAITS.append(GENERATED.wait_for(lambda: GENERATIONS[0] > batch, timeout=30))
    return [float(len(c)) for c in completions]
