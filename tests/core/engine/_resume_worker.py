"""Run one arm of an experiment in a child process (used by the kill-and-resume test).

Usage: python -m tests.core.engine._resume_worker EXPERIMENT.yaml ARM SEED OUT_DIR RESUME(0|1)
"""

from __future__ import annotations

import sys
from pathlib import Path

from alignzoo.config.loader import load_experiment
from alignzoo.engine.loop import run_one

if __name__ == "__main__":
    path, arm, seed, out, resume = sys.argv[1:6]
    summary = run_one(load_experiment(path), arm, int(seed), Path(out), resume=resume == "1")
    print(summary)
    sys.exit(0 if summary.status == "finished" else 1)
