"""How long discovery takes: `alignzoo --help`, `alignzoo plugins`, and `import alignzoo`.

Target: well under 1 s each (torch is never imported by discovery). Prints a small table of
the median of several runs; run with `make bench`.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import alignzoo": [sys.executable, "-c", "import alignzoo"],
    "alignzoo --help": [sys.executable, "-m", "alignzoo.cli", "--help"],
    "alignzoo plugins": [sys.executable, "-m", "alignzoo.cli", "plugins"],
    "import torch (for scale)": [sys.executable, "-c", "import torch"],
}


def median_seconds(command: list[str], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print(f"{'command':28s} median wall-clock (s)")
    for label, command in COMMANDS.items():
        print(f"{label:28s} {median_seconds(command):.3f}")


if __name__ == "__main__":
    main()
