"""A labeler function for the engine's overlap test (named by module path in its experiment)."""

from __future__ import annotations

import threading

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


def kills_its_producer_once(prompts, completions, **columns):
    """Labels by length; in a producer process (training.async), the first call after
    ``KILL_MARK`` names a missing file creates it and kills its own process with SIGKILL:
    a producer dies in the middle of a batch, once per test."""
    import multiprocessing
    import os
    import signal
    from pathlib import Path

    mark = os.environ.get("ALIGNZOO_TEST_KILL_MARK")
    producer = multiprocessing.current_process().name.startswith("alignzoo-producer")
    if mark and producer and not Path(mark).exists():
        Path(mark).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(c)) for c in completions]


def fails_in_a_producer(prompts, completions, **columns):
    """Raises in a producer process (training.async); labels by length elsewhere."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("alignzoo-producer"):
        raise ValueError("this labeler fails in producers")
    return [float(len(c)) for c in completions]


def kills_the_trainer_once(prompts, completions, trainer_state=None, **columns):
    """Labels by length; in a producer (training.async), at the step ``ALIGNZOO_TEST_KILL_STEP``
    and only while the file ``ALIGNZOO_TEST_KILL_MARK`` does not exist, writes this producer's
    pid to it and kills its parent, the trainer, with SIGKILL."""
    import multiprocessing
    import os
    import signal
    from pathlib import Path

    mark, step = (
        os.environ.get("ALIGNZOO_TEST_KILL_MARK"),
        os.environ.get("ALIGNZOO_TEST_KILL_STEP"),
    )
    producer = multiprocessing.current_process().name.startswith("alignzoo-producer")
    at = getattr(trainer_state, "global_step", None)
    if mark and step and producer and at == int(step) and not Path(mark).exists():
        Path(mark).write_text(str(os.getpid()))
        os.kill(os.getppid(), signal.SIGKILL)
    return [float(len(c)) for c in completions]


def notes_where_it_labels(prompts, completions, **columns):
    """Labels by length, and appends where it runs to the file ``ALIGNZOO_TEST_WHERE`` names:
    'ray actor' inside a Ray actor, else the process's name."""
    import multiprocessing
    import os
    import sys

    where = multiprocessing.current_process().name
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id():
        where = "ray actor"
    with open(os.environ["ALIGNZOO_TEST_WHERE"], "a", encoding="utf-8") as notes:
        notes.write(where + "\n")
    return [float(len(c)) for c in completions]


CALLS = [0]


def waits_in_a_producer_for_the_trainer(prompts, completions, **columns):
    """Labels by length. In a producer process (training.async), its third call (step 3's
    batch) notes whether the trainer had trained step 2 when the call began, then waits (up to
    30 s) until the trainer has, and notes that too, in ``ALIGNZOO_TEST_WAIT_MARK``: a trainer
    that waited for this labeling would never train step 2 meanwhile."""
    import json
    import multiprocessing
    import os
    import time
    from pathlib import Path

    if multiprocessing.current_process().name.startswith("alignzoo-producer"):
        CALLS[0] += 1
        if CALLS[0] == 3:
            metrics = Path(os.environ["ALIGNZOO_TEST_METRICS"])

            def trained() -> bool:
                if not metrics.exists():
                    return False
                rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
                return any(row.get("step") == 2 for row in rows)

            before = trained()
            deadline = time.monotonic() + 30
            while not trained() and time.monotonic() < deadline:
                time.sleep(0.05)
            Path(os.environ["ALIGNZOO_TEST_WAIT_MARK"]).write_text(
                json.dumps({"before": before, "meanwhile": trained()})
            )
    return [float(len(c)) for c in completions]
