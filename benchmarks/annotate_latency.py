"""Latency of the annotation app (`alignzoo annotate`) on a large queue, on this machine.

A queue of ``--items`` items (half ratings on 1-5, half pairs, 3 raters each), every item
already judged by two simulated annotators (so agreement rests on all of them), is served by
``alignzoo annotate`` in its own process on 127.0.0.1 (uvicorn, as annotators use it). One
annotator then works as the page does, ``--judgements`` times: ``GET /api/next``, ``POST
/api/judge``, ``GET /api/stats``; a second annotator does the same at the same time, so
that a slow request of one shows in the other's latencies.

    .venv/bin/python benchmarks/annotate_latency.py [--items 20000] [--judgements 300]

Prints the start-up time, then p50 / p95 / max per request (both annotators together), and
the time the full agreement computation over the queue takes (what ``/api/stats`` did on
every request before it kept the agreement up to date from the queue's log of changes).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from alignzoo.human.export import agreement
from alignzoo.human.queue import HumanQueue
from alignzoo.types import LabelRequest


def build(folder: Path, items: int) -> dict[str, str]:
    """The queue, every item judged by two simulated annotators; the two people's tokens."""
    queue = HumanQueue(folder)
    try:
        queue.db.execute("PRAGMA synchronous=OFF")  # filling only: the app commits normally
        half = items // 2
        ratings = [LabelRequest(prompt=f"{i}+{i}=", response=str(2 * i)) for i in range(half)]
        queue.enqueue(ratings, raters=3, scale=(1, 5))
        queue.enqueue_pairs([(f"{i}*2=", str(2 * i), str(2 * i + 1)) for i in range(half)], 3)
        rng = random.Random(0)
        for item, _ in queue.items():
            for rater in ("sim1", "sim2"):
                if item.kind == "pair":
                    value = rng.choice([1.0, 1.0, 1.0, 0.0, 0.5])
                else:
                    value = float(min(5, max(1, 4 + rng.choice([-1, 0, 0, 1]))))
                queue.submit(item.id, rater, value)
        return {name: queue.add_annotator(name) for name in ("ann", "bob")}
    finally:
        queue.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def work(url: str, token: str, n: int, out: dict[str, list[float]], rng: random.Random) -> None:
    """``n`` judgements as the page makes them; each request's seconds into ``out``."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for _ in range(n):
            start = time.perf_counter()
            item = client.get("/api/next").raise_for_status().json()["item"]
            took = time.perf_counter()
            out["next"].append(took - start)
            if item is None:
                return
            value = rng.choice([0, 0.5, 1]) if item["kind"] == "pair" else rng.randint(1, 5)
            answer = client.post("/api/judge", json={"item": item["id"], "value": value})
            judged = time.perf_counter()
            out["judge"].append(judged - took)
            if answer.status_code != 200:  # a 409 would be a collision of the two; count it
                out["refused"].append(judged - took)
            client.get("/api/stats").raise_for_status()
            done = time.perf_counter()
            out["stats"].append(done - judged)
            out["cycle"].append(done - start)


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p95 and max in milliseconds, and the count."""
    ms = sorted(1000 * s for s in seconds)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return {"p50_ms": statistics.median(ms), "p95_ms": p95, "max_ms": ms[-1], "n": len(ms)}


def summary(name: str, seconds: list[float]) -> str:
    p = percentiles(seconds)
    return (
        f"{name:>6}: p50 {p['p50_ms']:7.1f} ms  p95 {p['p95_ms']:7.1f} ms  "
        f"max {p['max_ms']:7.1f} ms  ({p['n']} requests)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--judgements", type=int, default=300, help="per annotator")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "queue"
        started = time.perf_counter()
        tokens = build(folder, args.items)
        print(f"queue: {args.items} items, {2 * args.items} judgements, built in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        server = subprocess.Popen(
            [sys.executable, "-m", "alignzoo", "annotate", str(folder), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            while True:
                try:
                    headers = {"Authorization": f"Bearer {tokens['ann']}"}
                    httpx.get(f"{url}/api/stats", headers=headers, timeout=60).raise_for_status()
                    break
                except httpx.TransportError:
                    if server.poll() is not None:
                        raise SystemExit("the app did not start") from None
                    time.sleep(0.05)
            figures["startup_s"] = time.perf_counter() - started
            print(f"start-up (process, first /api/stats): {figures['startup_s']:.2f} s")
            out: dict[str, list[float]] = {
                k: [] for k in ("next", "judge", "stats", "cycle", "refused")
            }
            threads = [
                threading.Thread(
                    target=work, args=(url, tokens[name], args.judgements, out, random.Random(k))
                )
                for k, name in enumerate(("ann", "bob"))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            server.terminate()
            server.wait(timeout=30)
        print("two annotators at once, each request as the page makes it:")
        for name in ("judge", "next", "stats", "cycle"):
            print(summary(name, out[name]))
        print(f"judgements refused: {len(out['refused'])}")
        queue = HumanQueue(folder)
        try:
            started = time.perf_counter()
            agreement(queue)
            full = time.perf_counter() - started
        finally:
            queue.close()
        print(f"the full agreement computation over the queue: {1000 * full:.0f} ms")
        if args.json is not None:
            from alignzoo.report.results import write_measurement

            for name in ("judge", "next", "stats", "cycle"):
                figures[name] = percentiles(out[name])
            figures["refused"] = len(out["refused"])
            figures["full_agreement_ms"] = 1000 * full
            document = {"figures": figures, "settings": {"items": args.items,
                        "judgements": args.judgements}}  # fmt: skip
            write_measurement(args.json, document)


if __name__ == "__main__":
    main()
