"""The labeler server and its http client: protocol, batching, auth, limits, and a training run
against a real server on 127.0.0.1 that fails 30% of its calls in every way it can."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from alignzoo import LabelRequest
from alignzoo.errors import LabelerUnavailable, UserError
from alignzoo.labeling.service import ServeConfig, build_app
from alignzoo.plugins.labelers.http import HTTPLabeler
from alignzoo.registry import build_plugin_manager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


ARITHMETIC = {
    "labeler": {"name": "arithmetic"},
    "batching": {"max_batch_size": 64, "max_wait_ms": 20},
}
REQS = [LabelRequest(prompt=f"{i}+1=", response=str(i + 1 if i % 2 else i), extra={"answer": str(i + 1)})
        for i in range(6)]  # fmt: skip


def client(url: str, **params: Any) -> Any:
    return build_plugin_manager([HTTPLabeler(HTTPLabeler.Params(url=url, **params))]).hook


def test_protocol_health_metrics_and_server_side_batching() -> None:
    with running(build_app(ServeConfig.model_validate(ARITHMETIC))) as url:
        scores = client(url).score_batch(requests=REQS)
        assert [s.value for s in scores] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        assert [s.info["correct"] for s in scores] == [False, True] * 3
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and "ArithmeticLabeler" in health["labeler"]

        async def many() -> list[Any]:  # 16 concurrent one-item requests
            async with httpx.AsyncClient(base_url=url) as http:
                body = {
                    "version": 1,
                    "requests": [{"prompt": "1+1=", "response": "2", "extra": {"answer": "2"}}],
                }
                return await asyncio.gather(*(http.post("/v1/score", json=body) for _ in range(16)))

        replies = asyncio.run(many())
        assert all(r.status_code == 200 and r.json()["scores"][0]["value"] == 1.0 for r in replies)
        metrics = httpx.get(f"{url}/metrics").text
        assert "alignzoo_labeler_items_total 22.0" in metrics
        calls = float(
            next(
                x for x in metrics.splitlines() if x.startswith("alignzoo_labeler_batch_size_count")
            ).split()[-1]
        )
        assert calls < 1 + 16  # concurrent requests were batched together


def test_bad_bodies_limits_and_the_token(monkeypatch) -> None:
    monkeypatch.setenv("LABEL_TOKEN", "s3cret")
    cfg = ServeConfig.model_validate(
        {**ARITHMETIC, "token_env": "LABEL_TOKEN", "max_request_bytes": 2048}
    )
    with running(build_app(cfg)) as url:
        assert httpx.post(f"{url}/v1/score", json={"requests": []}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{url}/v1/score", content=b"{nope", headers=auth).status_code == 400
        assert (
            httpx.post(
                f"{url}/v1/score", json={"requests": [{"prompt": 1}]}, headers=auth
            ).status_code
            == 400
        )
        assert (
            httpx.post(
                f"{url}/v1/score", json={"version": 9, "requests": []}, headers=auth
            ).status_code
            == 400
        )
        big = {"requests": [{"prompt": "x" * 4096, "response": "y"}]}
        assert httpx.post(f"{url}/v1/score", json=big, headers=auth).status_code == 413
        with pytest.raises(UserError, match="refused the token"):
            client(url).score_batch(requests=REQS)
        monkeypatch.setenv("WRONG", "nope")
        assert len(client(url, token_env="LABEL_TOKEN").score_batch(requests=REQS)) == 6
    with pytest.raises(UserError, match="NOT_SET"):
        build_app(ServeConfig.model_validate({**ARITHMETIC, "token_env": "NOT_SET"}))


def test_client_maps_failures_to_outcomes() -> None:
    port = free_port()  # nothing listens here
    with pytest.raises(LabelerUnavailable, match="ConnectError"):
        client(f"http://127.0.0.1:{port}", connect_timeout_s=0.5).score_batch(requests=REQS)


class Faults:
    """ASGI middleware: /v1/score calls fail (500, 503, 429, a hang past the client's timeout,
    malformed JSON, NaN values, too few scores); every call is logged. Every other call fails
    until each kind has occurred once (so every kind occurs however few calls a slow machine
    makes), then 30% of them, at random."""

    KINDS = ("500", "503", "429", "hang", "json", "nan", "short")

    def __init__(self, app: Any, seed: int = 0) -> None:
        self.app, self.rng = app, random.Random(seed)
        self.log: list[str] = []
        self.next_kind = 0  # the faults take turns, so every kind occurs

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/score":
            await self.app(scope, receive, send)
            return
        fault = "ok"
        first_round = self.next_kind < len(self.KINDS)
        if (len(self.log) % 2 == 1) if first_round else (self.rng.random() < 0.3):
            fault = self.KINDS[self.next_kind % len(self.KINDS)]
            self.next_kind += 1
        self.log.append(fault)
        if fault in ("500", "503", "429"):
            headers = [(b"content-type", b"application/json")]
            if fault != "500":
                headers.append((b"retry-after", b"0"))
            await send({"type": "http.response.start", "status": int(fault), "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error": "injected"}'})
            return
        if fault == "hang":
            await asyncio.sleep(3.0)
        chunks: list[bytes] = []
        start: dict[str, Any] = {}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        body = b"".join(chunks)
        if fault == "json":
            body = b"<html>502 Bad Gateway</html>"
        elif fault in ("nan", "short"):
            data = json.loads(body)
            if fault == "nan":
                for s in data["scores"]:
                    s["value"] = None
            else:
                data["scores"] = data["scores"][:-1]
            body = json.dumps(data).encode()
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start["status"], "headers": headers})
        await send({"type": "http.response.body", "body": body})


class FlakyNetwork:
    """A TCP proxy in front of the server, for the faults an ASGI app cannot make. Every
    ``every``-th request is not forwarded: in turn, its connection is reset (RST, "connection
    reset by peer"), or the server "restarts": that connection is reset, the others are closed
    and the port refuses connections for ``down_s`` (so the client's quick retries are refused).
    """

    def __init__(self, target: str, every: int = 7, down_s: float = 0.1) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.port = free_port()
        self.every, self.down_s = every, down_s
        self.requests = 0
        self.log: list[str] = []
        self.stopping = threading.Event()
        self.restart = threading.Event()
        self.listening = threading.Event()
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FlakyNetwork:
        self.threads.append(threading.Thread(target=self._accept, daemon=True))
        self.threads[0].start()
        assert self.listening.wait(10)
        return self

    def __exit__(self, *_: Any) -> None:
        self.stopping.set()
        self._close_all()
        for thread in self.threads:
            thread.join(timeout=5)

    def _close_all(self) -> None:
        with self.lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self.sockets = []

    def _accept(self) -> None:
        while not self.stopping.is_set():
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            listener.settimeout(0.02)
            self.listening.set()
            while not self.stopping.is_set() and not self.restart.is_set():
                try:
                    client_sock, _ = listener.accept()
                except TimeoutError:
                    continue
                thread = threading.Thread(target=self._serve, args=(client_sock,), daemon=True)
                self.threads.append(thread)
                thread.start()
            listener.close()  # refused from now until it listens again
            self._close_all()
            self.stopping.wait(self.down_s)
            self.restart.clear()

    def _fault(self) -> str | None:
        """What happens to the request that starts now: None (forwarded), reset or restart."""
        with self.lock:
            self.requests += 1
            if self.requests % self.every:
                return None
            fault = ("reset", "restart")[(self.requests // self.every) % 2]
        self.log.append(fault)
        return fault

    def _serve(self, client_sock: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        with self.lock:
            self.sockets += [client_sock, upstream]

        def pump(src: socket.socket, dst: socket.socket, requests: bool) -> None:
            try:
                while data := src.recv(65536):
                    fault = self._fault() if requests and data.startswith(b"POST ") else None
                    if fault is not None:
                        linger = struct.pack("ii", 1, 0)  # close with RST, not FIN
                        client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                        if fault == "restart":
                            self.restart.set()
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock in (client_sock, upstream):
                    with contextlib.suppress(OSError):
                        sock.close()

        back = threading.Thread(target=pump, args=(upstream, client_sock, False), daemon=True)
        back.start()
        pump(client_sock, upstream, True)
        back.join(timeout=5)


@pytest.mark.slow
def test_a_training_run_against_a_server_failing_30_percent(write_experiment, tmp_path) -> None:
    from alignzoo.config.loader import load_experiment
    from alignzoo.engine.loop import run_one

    from ..engine.conftest import read_jsonl, tiny_experiment

    faults = Faults(build_app(ServeConfig.model_validate(ARITHMETIC)))
    threads_before = threading.active_count()
    import os

    fds_before = len(os.listdir("/proc/self/fd"))
    with running(faults) as server, FlakyNetwork(server) as network:
        url = network.url
        spec = tiny_experiment(
            budget={"steps": 40},
            arms={
                "grpo": {
                    "algorithm": "grpo",
                    "labeler": {"name": "http", "params": {"url": url, "timeout_s": 0.5}},
                    "labeling": {
                        "fallbacks": ["arithmetic"],
                        "retries": 2,
                        "backoff_s": 0.01,
                        "deadline_s": 2.0,
                        "breaker": {"cooldown_s": 0.2},  # trips now and then, and recovers
                        "store": None,
                    },
                }
            },
        )
        loaded = load_experiment(write_experiment(spec))
        summary = run_one(loaded, "grpo", 0, tmp_path / "run")
    assert summary.status == "finished", summary.error
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 40
    for row in rows:
        assert (
            row["label/generated"]
            == row["label/valued"] + row["label/fallback_valued"] + row["label/dropped"]
        )
        # Bounded by the deadline and one call's timeout (plus the fallback's own time).
        assert row["timing/label"] < 2.0 + 0.5 + 1.5, row["timing/label"]
    injected = [f for f in faults.log if f != "ok"]
    assert len(faults.log) >= 2 * len(Faults.KINDS), (
        f"premise: the first {2 * len(Faults.KINDS)} calls hold every fault kind, but only "
        f"{len(faults.log)} calls reached the server: {faults.log}"
    )
    assert set(injected) == set(Faults.KINDS), faults.log
    # The network faults reached the client: refused connections and resets, counted apart.
    kinds = ("network_errors", "connect_errors", "rate_limited", "server_errors")
    # The http labeler's counters are per-step increases: the run's totals are their sums.
    total = {k: sum(r.get(f"labeler/http/{k}", 0) for r in rows) for k in kinds}
    assert {"reset", "restart"} <= set(network.log), network.log
    assert total["network_errors"] > 0, network.log
    assert total["connect_errors"] > 0, "no call met the port closed: " + str(network.log)
    assert total["rate_limited"] > 0 and total["server_errors"] > 0
    assert (
        sum(r["label/fallback_valued"] for r in rows) > 0
        or sum(r.get("labeler/http/retries", 0) for r in rows) > 0
    )
    time.sleep(0.2)
    assert threading.active_count() <= threads_before + 1  # no leaked client or worker threads
    # No leaked connections or files (a little slack for what torch opens once, lazily).
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 4


def test_a_reward_model_served_loads_its_weights_and_matches_in_process(tmp_path) -> None:
    from alignzoo.labeling.interface import start_labeler
    from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
    from tests.plugins.labelers.test_reward_model import save_reward_model

    folder = tmp_path / "rm"
    save_reward_model(folder)
    local = build_plugin_manager([RewardModelLabeler(RewardModelLabeler.Params(path=str(folder)))])
    start_labeler(local)
    expected = [s.value for s in local.hook.score_batch(requests=REQS)]
    cfg = ServeConfig.model_validate(
        {"labeler": {"name": "reward_model", "params": {"path": str(folder)}}}
    )
    with running(build_app(cfg)) as url:
        served = [s.value for s in client(url).score_batch(requests=REQS)]
    assert served == pytest.approx(expected, abs=1e-5)
