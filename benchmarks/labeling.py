"""Batched against per-sample labeling, and the labeling stage's own overhead, on this machine.

1. A reward model (a local Qwen2 sequence classifier, hidden 256, 4 layers, built here) served by
   ``alignzoo serve-labeler`` on 127.0.0.1 and scored through the ``http`` labeler: 64 responses
   in one request against 64 requests of one response.
2. The same reward model in process (the ``reward_model`` labeler): one call of 64 against 64
   calls of one.
3. The labeling stage's overhead per step: 128 responses labeled by the arithmetic rule through
   the stage (outcomes, ledger, store lookups and writes) against calling the rule directly.

    .venv/bin/python benchmarks/labeling.py [--repeats 5] [--json results.json]

Medians over ``--repeats``; prints one line per measurement, and with ``--json`` writes them
(milliseconds) with the provenance of the run (commit, lock, CPU and its kernels, threads).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from alignzoo.config.schema import LabelingConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.labeling.interface import start_labeler
from alignzoo.labeling.orchestrator import LabelingStage
from alignzoo.labeling.service import ServeConfig, build_app
from alignzoo.labeling.store import LabelStore
from alignzoo.plugins.labelers.arithmetic import ArithmeticLabeler
from alignzoo.plugins.labelers.http import HTTPLabeler
from alignzoo.plugins.labelers.reward_model import RewardModelLabeler
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest
from alignzoo.world.tokenizer import build_tokenizer


def reward_model(folder: Path) -> Path:
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=512, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    return folder


def requests(n: int, offset: int = 0) -> list[LabelRequest]:
    return [
        LabelRequest(f"{i}+{i % 7}=", str(i + i % 7 + (i % 3 == 0)), {"answer": str(i + i % 7)})
        for i in range(offset, offset + n)
    ]


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    figures: dict[str, float] = {}
    torch.set_num_threads(max(1, torch.get_num_threads()))
    reqs = requests(64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = reward_model(Path(tmp) / "rm")
        manager = build_plugin_manager(
            [RewardModelLabeler(RewardModelLabeler.Params(path=str(folder)))]
        )
        start_labeler(manager)
        rm = manager.hook

        batched = median_seconds(lambda: rm.score_batch(requests=reqs), args.repeats)
        single = median_seconds(lambda: [rm.score_batch(requests=[r]) for r in reqs], args.repeats)
        figures |= {"in_process_batched_ms": batched * 1e3, "in_process_single_ms": single * 1e3}
        print(f"reward model in process, 64 responses: one call {batched * 1e3:.1f} ms, "
              f"64 calls {single * 1e3:.1f} ms, speedup {single / batched:.1f}x")  # fmt: skip

        import uvicorn

        cfg = ServeConfig.model_validate(
            {
                "labeler": {"name": "reward_model", "params": {"path": str(folder)}},
                "batching": {"max_batch_size": 64, "max_wait_ms": 2},
            }
        )
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(build_app(cfg), host="127.0.0.1", port=port, log_level="error")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        http = build_plugin_manager(
            [HTTPLabeler(HTTPLabeler.Params(url=f"http://127.0.0.1:{port}"))]
        ).hook
        batched = median_seconds(lambda: http.score_batch(requests=reqs), args.repeats)
        single = median_seconds(
            lambda: [http.score_batch(requests=[r]) for r in reqs], args.repeats
        )
        figures |= {"http_batched_ms": batched * 1e3, "http_single_ms": single * 1e3}
        print(f"reward model over HTTP, 64 responses: one request {batched * 1e3:.1f} ms, "
              f"64 requests {single * 1e3:.1f} ms, speedup {single / batched:.1f}x")  # fmt: skip
        server.should_exit = True
        thread.join(timeout=10)

        many = requests(128)
        rule = ArithmeticLabeler()
        pm = build_plugin_manager([rule])
        direct = median_seconds(lambda: pm.hook.score_batch(requests=many), args.repeats * 4)
        stage = LabelingStage.build(LabelingConfig(), [("arithmetic", rule, Hooks(pm))])
        through = median_seconds(lambda: stage.label(many), args.repeats * 4)
        stored = LabelingStage.build(
            LabelingConfig(), [("arithmetic", rule, Hooks(pm))],
            store=LabelStore(Path(tmp) / "labels.sqlite"),
        )  # fmt: skip
        fresh = [requests(128, 1000 * (k + 1)) for k in range(args.repeats * 4 + 1)]
        cursor = iter(fresh)  # new responses each time: lookups miss, labels are written
        with_store = median_seconds(lambda: stored.label(next(cursor)), args.repeats * 4)
        stored.close()
        figures |= {
            "rule_direct_ms": direct * 1e3,
            "rule_through_stage_ms": through * 1e3,
            "rule_with_store_ms": with_store * 1e3,
        }
        print(f"labeling stage, 128 responses, arithmetic rule: direct {direct * 1e3:.2f} ms, "
              f"through the stage {through * 1e3:.2f} ms (+{(through - direct) * 1e3:.2f}), "
              f"with the label store {with_store * 1e3:.2f} ms "
              f"(+{(with_store - direct) * 1e3:.2f})")  # fmt: skip
    if args.json is not None:
        from alignzoo.report.results import write_measurement

        figures |= {
            "in_process_speedup": figures["in_process_single_ms"]
            / figures["in_process_batched_ms"],
            "http_speedup": figures["http_single_ms"] / figures["http_batched_ms"],
            "stage_overhead_ms": figures["rule_through_stage_ms"] - figures["rule_direct_ms"],
            "store_overhead_ms": figures["rule_with_store_ms"] - figures["rule_direct_ms"],
        }
        settings = {"repeats": args.repeats}
        document = {"figures": figures, "settings": settings}
        write_measurement(args.json, document)


if __name__ == "__main__":
    main()
