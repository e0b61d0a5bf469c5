"""The vllm and hf backends on the same weights: tokens/s of each, and whether their greedy
outputs agree, before and after a weight sync. Prints one JSON object.

    python benchmarks/gpu_check.py                      # on cuda:0 (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --device cpu --hidden 64 --layers 1 --prompts 16 --tokens 8

The model is a random Qwen2 built from the embedded tokenizer (no download), its weights
scaled so that greedy continuations differ between prompts; ``--hidden`` / ``--layers`` set its
size (head size 64). Greedy decoding, fp32 by default (``--dtype bfloat16`` for speed; bf16
kernels differ between engines, so parity is then expected to drop). The sync step changes
every weight in place, as a training step would, and streams them to vLLM.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def build_policy(folder: Path, hidden: int, layers: int) -> Path:
    import torch

    from alignzoo.config.schema import EmbeddedModelConfig
    from alignzoo.world.model import build_model, save_policy
    from alignzoo.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    heads = max(1, hidden // 64)
    config = EmbeddedModelConfig(
        hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=hidden * 3, seed=3
    )
    model = build_model(config, tokenizer)
    with torch.no_grad():  # peaked, context-dependent logits (see tests/plugins/backends)
        model.get_input_embeddings().weight.mul_(4.0)
        for name, param in model.model.layers.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(10.0)
    return save_policy(model, tokenizer, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gpu-share", type=float, default=0.3)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignzoo.plugins.backends.hf import HFBackend
    from alignzoo.plugins.backends.vllm import VLLMBackend
    from alignzoo.types import Placement, SamplingParams
    from alignzoo.weights import PolicyWeights

    root = Path(tempfile.mkdtemp(prefix="alignzoo-gpu-check-"))
    folder = build_policy(root / "policy", args.hidden, args.layers)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    on_gpu = args.device.startswith("cuda")
    placement = Placement(device=args.device, gpu_share=args.gpu_share if on_gpu else None)
    run = SimpleNamespace(
        models=SimpleNamespace(policy_path=str(folder)),
        placement=lambda role: placement,
        device=lambda role: args.device,
        tokenizer=tokenizer,
        actor=model,
        seed=0,
        out_dir=root,
    )
    hf, engine = HFBackend({"max_batch_size": 64}), VLLMBackend({"max_model_len": 256})
    start = time.perf_counter()
    for backend in (hf, engine):
        backend.on_run_start(run)
        backend.sync_weights(PolicyWeights(model, 0))
    started_s = time.perf_counter() - start
    prompts = [
        f"{a}+{b}=" for a, b in zip(range(args.prompts), range(7, 7 + args.prompts), strict=True)
    ]
    greedy = SamplingParams(temperature=0, max_new_tokens=args.tokens)

    def timed(backend):
        backend.generate(prompts[:8], [], 1, greedy)  # warm-up
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        batch = backend.generate(prompts, [], 1, greedy)
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        return batch, float(batch.response_mask.sum()) / seconds

    def parity(a, b) -> float:
        rows = zip(a.response_ids.tolist(), b.response_ids.tolist(), strict=True)
        return sum(x == y for x, y in rows) / a.size

    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "dtype": args.dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompts": args.prompts,
        "max_new_tokens": args.tokens,
        "startup_s": round(started_s, 1),
    }
    a, hf_tps = timed(hf)
    b, vllm_tps = timed(engine)
    report.update(hf_tokens_per_s=round(hf_tps, 1), vllm_tokens_per_s=round(vllm_tps, 1))
    report["greedy_parity_before_sync"] = parity(a, b)
    with torch.no_grad():  # a training step, in place
        generator = torch.Generator(device=args.device).manual_seed(1)
        for param in model.parameters():
            noise = torch.randn(
                param.shape, generator=generator, device=args.device, dtype=param.dtype
            )
            param.add_(0.5 * param.abs().mean() * noise)
    t = time.perf_counter()
    engine.sync_weights(PolicyWeights(model, 1))
    report["sync_s"] = round(time.perf_counter() - t, 3)
    a, _ = timed(hf)
    b, _ = timed(engine)
    report["greedy_parity_after_sync"] = parity(a, b)
    torch.manual_seed(0)
    sampled = engine.generate(prompts[:64], [], 4, SamplingParams(max_new_tokens=args.tokens))
    from alignzoo.kernels.forward import policy_forward

    with torch.no_grad():
        trainer, _ = policy_forward(model, sampled.to(args.device))
    mask = sampled.response_mask.bool().to(args.device)
    diff = (trainer.float() - sampled.rollout_logprobs.to(args.device)).abs()[mask]
    report["rollout_logprob_diff_mean"] = float(diff.mean())
    report["rollout_logprob_diff_max"] = float(diff.max())
    engine.on_run_end(run, "finished")
    print(json.dumps(report, indent=2))
    if args.json is not None:
        from alignzoo.report.results import write_measurement

        document = {"report": report, "settings": vars(args) | {"json": None}}
        write_measurement(args.json, document)


if __name__ == "__main__":
    main()
