"""Labelers and helpers for the labeling tests; the labelers must be importable by a worker
process (spawn)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from alignzoo import Labeler, LabelRequest, Score, hookimpl
from alignzoo.errors import LabelerTimeout, LabelerUnavailable, UserError

RAISES = {
    # a timeout inside the labeler: the ``timeout`` outcome, in process and in a worker
    "httpx_read_timeout": True,
    "httpx_connect_timeout": True,
    "timeout_error": True,
    "socket_timeout": True,
    "labeler_timeout": True,
    "unavailable_from_timeout": True,  # LabelerUnavailable raised from a timeout
    # not a timeout: ``error``
    "unavailable": False,
    "runtime_error": False,
    "connect_error": False,
}


def _raise(kind: str) -> None:
    import httpx

    if kind == "httpx_read_timeout":
        raise httpx.ReadTimeout("timed out")
    if kind == "httpx_connect_timeout":
        raise httpx.ConnectTimeout("timed out")
    if kind == "timeout_error":
        raise TimeoutError("no answer")
    if kind == "socket_timeout":
        raise socket.timeout("timed out")  # noqa: UP041 - the alias, as code raises it
    if kind == "labeler_timeout":
        raise LabelerTimeout("slow service")
    if kind == "unavailable_from_timeout":
        try:
            raise TimeoutError("the gateway waited")
        except TimeoutError as exc:
            raise LabelerUnavailable("gateway timeout", retry_after=0.0) from exc
    if kind == "unavailable":
        raise LabelerUnavailable("HTTP 503")
    if kind == "runtime_error":
        raise RuntimeError("bug")
    if kind == "connect_error":
        raise httpx.ConnectError("refused")
    if kind == "user_error":
        raise UserError("the token is wrong")
    raise AssertionError(kind)


class Raising(Labeler):
    """Scores ``len(response)``; a response ``raise:<kind>`` raises that exception instead.

    Its ``stats()``: ``raised`` (a counter: exceptions so far) and ``last_batch`` (a gauge:
    requests in the last call)."""

    stats_counters: ClassVar[frozenset[str]] = frozenset({"raised"})

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.raised = 0
        self.last_batch = 0

    def stats(self) -> dict[str, float]:
        return {"raised": float(self.raised), "last_batch": float(self.last_batch)}

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        self.last_batch = len(requests)
        for r in requests:
            if r.response.startswith("raise:"):
                self.raised += 1
                _raise(r.response.removeprefix("raise:"))
        return [Score(float(len(r.response))) for r in requests]


class Counting(Labeler):
    """Scores ``len(response) + shift`` (``shift`` from the request's extra), counts the
    requests it scored (``scored``, a counter) and its calls (``calls_so_far``, a counter not
    declared: a plain value)."""

    stats_counters: ClassVar[frozenset[str]] = frozenset({"scored"})

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        self.scored = 0
        self.calls_so_far = 0

    def stats(self) -> dict[str, float]:
        return {"scored": float(self.scored), "calls_so_far": float(self.calls_so_far)}

    @hookimpl
    def score_batch(self, requests: list[LabelRequest]) -> list[Score]:
        self.calls_so_far += 1
        self.scored += len(requests)
        return [Score(float(len(r.response)) + float(r.extra.get("shift", 0.0))) for r in requests]


class Constant(Labeler):
    """Scores 1.0 (a fallback that always answers)."""

    def score(self, request: LabelRequest) -> Score:
        return Score(1.0)


# --------------------------------------------------------------------------- helpers


def free_port(span: int = 1) -> int:
    """A port p on 127.0.0.1 such that p .. p + span - 1 are free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span > 65535:
            continue
        ok = True
        for p in range(base + 1, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def run_context(arm: str = "a", seed: int = 0, arms=("a",), seeds=(0,), experiment="exp"):
    """What the stage reads of a run's context: names, the experiment's arms and seeds, state."""
    spec = SimpleNamespace(arms={a: None for a in arms}, seeds=list(seeds))
    return SimpleNamespace(
        experiment=experiment,
        arm=arm,
        seed=seed,
        name=f"{experiment}/{arm}/seed-{seed}",
        spec=spec,
        state={},
    )


class _ScoreHandler(http.server.BaseHTTPRequestHandler):
    """The labeler protocol: score ``len(response)``; a response containing ``slow`` makes the
    reply wait ``server.slow_s``; ``fail`` gives HTTP 500."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        responses = [item["response"] for item in body["requests"]]
        if any("slow" in r for r in responses):
            time.sleep(self.server.slow_s)  # type: ignore[attr-defined]
        if any("fail" in r for r in responses):
            self.send_response(500)
            self.end_headers()
            return
        data = json.dumps(
            {
                "version": 1,
                "labeler": "test",
                "scores": [{"value": float(len(r))} for r in responses],
            }
        ).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its read timeout)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def score_server(slow_s: float = 2.0) -> Iterator[str]:
    """A labeler server on 127.0.0.1 (a free port); yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScoreHandler)
    server.daemon_threads = True
    server.slow_s = slow_s  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def serve_one_run(base: int, arm: str, seed: int, ready: Any, stop: Any) -> None:
    """A run's labeling in a worker process of its own (what --jobs and Ray tasks start):
    arms a, b x seeds 0, 1, serving on ``base`` + its index; labels one pass, says ``ready``,
    serves until ``stop``."""
    from alignzoo.config.schema import LabelingConfig
    from alignzoo.engine.hooks import Hooks
    from alignzoo.labeling.orchestrator import LabelingStage
    from alignzoo.registry import build_plugin_manager

    labeler = Counting()
    chain = [("l0", labeler, Hooks(build_plugin_manager([labeler])))]
    labeling = LabelingStage.build(LabelingConfig(metrics_port=base, store=None), chain)
    labeling.attach(run_context(arm, seed, arms=("a", "b"), seeds=(0, 1)))
    labeling.label([LabelRequest(prompt="p", response=r) for r in ("a", "bb", "ccc")])
    ready.set()
    stop.wait(60)
    labeling.close()


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
