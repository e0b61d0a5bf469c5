"""Rollout backend "hf": batched sampling on the trainer's own Hugging Face module.

With ``weights: shared`` (the default) the backend samples with the very module the trainer
updates, in this process: ``sync_weights`` notes the version and copies nothing. With
``weights: copy`` it keeps its own plain copy of the policy on the ``rollout`` role's device
(which may differ from the actor's) and loads the engine's weight stream into it after every
update, LoRA merged: the path a backend with its own engine takes. An actor sharded over
processes (``training.parallel: fsdp2``) always gets such a copy. Per chunk of prompts:

1. each prompt is encoded once and left-padded;
2. with ``decoder: loop`` (the default), a lean decode loop over the model's KV cache: one
   prefill per *prompt* (its cache and last logits then repeated for the ``n`` samples, so
   ``group_ids[i] == i // n``), then one forward per new token for the whole batch, stopping
   when every row has reached EOS; temperature, top-k and top-p are applied by transformers'
   own logits warpers, and the log-softmax of the warped logits (the distribution the token is
   drawn from, as the trainer recomputes it) gives each sampled token's log-prob (the raw
   logits' under greedy decoding). ``decoder: generate`` calls
   ``model.generate`` instead (prompts repeated ``n`` times), with a logits processor of ours
   that records the same log-probs, for models whose forward the loop cannot drive;
3. everything after the first EOS becomes padding with mask 0.

The sampled tokens' log-probs are returned as ``rollout_logprobs``; the engine compares them
with the trainer's (``rollout/logprob_diff``).

In an asynchronous producer with partial rollouts (:mod:`alignzoo.rollout.partial`), the
decode loop of ``generate`` takes newer weights from the trainer before any decode step and goes
on with them (the KV cache of the tokens so far kept), recording each token's policy version in
``token_versions``. ``generate_ids`` (an episode's turn) samples each turn with one version; the
episode runner takes newer weights between turns.

The checkpoint's own ``generation_config`` (a repetition penalty, top-k 20, ...) is never used:
the backend samples exactly with the experiment's ``SamplingParams``, so the recorded
``rollout_logprobs`` and the training loss refer to the same distribution.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError
from alignzoo.kernels.generation import cut_after_eos, encode_prompts, eos_token_ids
from alignzoo.plugin import Backend, hookimpl
from alignzoo.rollout import partial

if TYPE_CHECKING:
    import torch

    from alignzoo.batch import RolloutBatch
    from alignzoo.types import SamplingParams
    from alignzoo.weights import PolicyWeights
else:
    torch = lazy_import("torch")


class HFBackend(Backend):
    """Hugging Face generate on the actor's own weights: batched, KV cache, n samples per prompt."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_batch_size: int = Field(
            64, ge=1, description="Prompts per generate call (each gives n sequences)."
        )
        use_cache: bool = Field(True, description="Use the KV cache while decoding.")
        add_special_tokens: bool = Field(
            True, description="Let the tokenizer add its special tokens (e.g. BOS) to prompts."
        )
        weights: Literal["shared", "copy"] = Field(
            "shared",
            description="'shared': sample with the trainer's own module (no copy); 'copy': a "
            "separate copy of the policy on the rollout device, loaded from the weight stream "
            "after every update. An actor sharded with training.parallel: fsdp2 always gets "
            "a copy (a rank holds only a slice of each weight).",
        )
        decoder: Literal["loop", "generate"] = Field(
            "loop",
            description="'loop': alignzoo's decode loop over the KV cache (one prefill per "
            "prompt for its n samples); 'generate': transformers' model.generate (always used "
            "when use_cache is false).",
        )
        pack_weights: bool = Field(
            True,
            description="'loop' decoder on a CPU with MKL, at least 32 new tokens: decode "
            "steps multiply by MKL-packed copies of the fp32 projection weights (taken once per "
            "generate call, about 8 MB more than the weight per matrix while generating; "
            "10-15% faster decoding at 64 rows on AVX512; for shorter generations packing "
            "costs more than it saves). false multiplies by the weights themselves.",
        )

    def __init__(self, params: BaseModel | dict[str, Any] | None = None) -> None:
        super().__init__(params)
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: str = "cpu"
        self.version: int | None = None  # of the weights last synced
        self.own_copy = False  # weights: copy, or a sharded actor
        self.autocast: Any = contextlib.nullcontext  # the run's precision (model.dtype)

    # ------------------------------------------------------------------ lifecycle
    @hookimpl
    def on_run_start(self, run: Any) -> None:
        rollout, actor = run.device("rollout"), run.device("actor")
        from alignzoo.weights import is_sharded

        module = getattr(run, "actor", None)
        # A sharded actor (training.parallel: fsdp2) holds a slice of each weight per rank,
        # and its forward is a collective that ranks sampling different lengths cannot share:
        # each rank samples with its own copy instead.
        own_copy = getattr(self.params, "weights", "shared") == "copy" or (
            module is not None and is_sharded(module)
        )
        placement = getattr(run, "placement", None)
        placed = placement("rollout") if callable(placement) else None
        if placed is not None and (placed.tensor_parallel_size > 1 or placed.gpu_share):
            raise UserError(
                "devices: the hf backend samples on one device with the whole of it; "
                "tensor_parallel_size and gpu_share of role 'rollout' need a backend that "
                "shards or shares (vllm); leave them unset"
            )
        if rollout != actor and not own_copy:
            raise UserError(
                f"devices: the hf backend samples with the actor's own module, so role 'rollout' "
                f"must be on the actor's device ({actor}), not {rollout}; leave rollout unset, "
                f"set it to {actor}, or give the backend its own copy (backend params "
                "weights: copy)"
            )
        self.own_copy = own_copy
        self.tokenizer = run.tokenizer
        self.device = rollout
        models = getattr(run, "models", None)
        self.autocast = getattr(models, "autocast", None) or contextlib.nullcontext
        if module is not None:
            self.model = _plain_copy(module, rollout) if own_copy else module

    @hookimpl
    def sync_weights(self, weights: PolicyWeights) -> None:
        self.version = weights.version
        if not self.own_copy:
            return  # generate runs on the trainer's module itself: nothing to copy
        if self.model is None:
            raise RuntimeError("HFBackend.sync_weights called before on_run_start")
        _load_stream(self.model, weights)

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
        if self.model is None or self.tokenizer is None:
            raise RuntimeError("HFBackend.generate called before on_run_start")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        prompt_tokens, extras = encode_prompts(
            self.tokenizer, prompts, extras, self.params.add_special_tokens
        )

        size = self.params.max_batch_size
        chunks = []
        # A subclass may bring Params of its own: defaults for the fields it lacks.
        decoder = getattr(self.params, "decoder", "loop")
        use_cache = getattr(self.params, "use_cache", True)
        with _eval_mode(self.model), torch.no_grad(), self.autocast():
            for start in range(0, len(prompts), size):
                part = prompt_tokens[start : start + size]
                use_loop = decoder == "loop" and use_cache
                if use_loop:
                    part_seeds = seeds[start : start + size] if seeds is not None else None
                    whole = len(prompts) <= size  # a trace covers one decode loop's rows
                    chunks.append(
                        self._decode_chunk(
                            part, n, sampling, part_seeds, refresh=True, record=whole
                        )
                    )
                else:  # transformers' generate samples from the global RNG
                    chunks.append(self._generate_chunk(part, n, sampling))
        pad = self._pad_id()
        prompt_ids = _pad_rows([c[0] for c in chunks], pad, left=True)
        prompt_mask = _pad_rows([c[1] for c in chunks], 0, left=True)
        response_ids = _pad_rows([c[2] for c in chunks], pad, left=False)
        response_mask = _pad_rows([c[3] for c in chunks], 0, left=False)
        rollout_logprobs = _pad_rows([c[4] for c in chunks], 0, left=False)
        token_versions = None
        if all(c[5] is not None for c in chunks):  # a partial rollout's versions
            versions = _pad_rows([c[5] for c in chunks], -1, left=False).long()
            token_versions = versions.masked_fill(response_mask == 0, -1)

        lengths = response_mask.sum(dim=1).long().tolist()
        responses = self.tokenizer.batch_decode(
            [ids[:length] for ids, length in zip(response_ids.tolist(), lengths, strict=True)],
            skip_special_tokens=True,
        )
        from alignzoo.batch import RolloutBatch

        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            prompts=[p for p in prompts for _ in range(n)],
            responses=responses,
            extras=[dict(e) for e in extras for _ in range(n)],
            rollout_logprobs=rollout_logprobs,
            token_versions=token_versions,
        )

    @hookimpl
    def generate_ids(
        self,
        contexts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        if self.model is None or self.tokenizer is None:
            raise RuntimeError("HFBackend.generate_ids called before on_run_start")
        out: list[tuple[list[int], list[float]]] = []
        size = self.params.max_batch_size
        with _eval_mode(self.model), torch.no_grad(), self.autocast():
            for start in range(0, len(contexts), size):
                part = contexts[start : start + size]
                part_seeds = seeds[start : start + size] if seeds is not None else None
                chunk = self._decode_chunk(part, 1, sampling, part_seeds, stop_token_ids)
                _, _, response, mask, logprobs, _ = chunk
                for row in range(len(part)):
                    length = int(mask[row].sum())
                    out.append((response[row, :length].tolist(), logprobs[row, :length].tolist()))
        return out

    def _left_padded(self, prompt_tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids and attention mask ``[b, P]``, left-padded to the longest prompt."""
        pad = self._pad_id()
        width = max(len(ids) for ids in prompt_tokens)
        ids = torch.full((len(prompt_tokens), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompt_tokens), width), dtype=torch.long)
        for row, tokens in enumerate(prompt_tokens):
            ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens) :] = 1
        return ids, mask

    def _decode_chunk(
        self,
        prompt_tokens: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
        refresh: bool = False,
        record: bool = False,
    ) -> tuple[torch.Tensor | None, ...]:
        """Sample n continuations of each prompt with the decode loop; tensors as
        :meth:`_generate_chunk` returns them, then each token's policy version ``[rows, T]``
        (None unless a partial rollout recorded them). With ``seeds``, prompt i's rows draw
        from a generator seeded ``seeds[i]`` (the same tokens whatever else is in the batch).
        ``stop_token_ids`` end a row like EOS (kept in the response).

        ``refresh``: before the prefill and each decode step, take newer weights from an
        asynchronous producer's feed (:mod:`alignzoo.rollout.partial`, when one is installed)
        and go on with them; the cache of the tokens so far is kept. ``record``: the rows are
        the whole batch, whose activations the lean loop may record for the update
        (:func:`alignzoo.kernels.trace.start` decides)."""
        model, pad = self.model, self._pad_id()
        version = partial.refresh() if refresh else None
        eos_ids = list(dict.fromkeys([*self._eos_ids(), *(stop_token_ids or [])]))
        device = _model_device(model)
        prompt_ids, prompt_mask = self._left_padded(prompt_tokens)
        mask = prompt_mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        # Packing the weights pays over long generations only.
        pack = (
            getattr(self.params, "pack_weights", True)
            and sampling.max_new_tokens >= PACK_FROM_NEW_TOKENS
        )
        capacity = mask.shape[1] + sampling.max_new_tokens
        decoder = _decoder(model, len(prompt_tokens), capacity, pack)
        trace = None
        # The update's backward pass can run against this loop's activations
        # (alignzoo.kernels.trace), over long generations only, as the packed weights.
        if (
            record
            and isinstance(decoder, _LeanDecoder)
            and not self.own_copy  # the trainer's own module only: its weights are trained
            and not partial.active()
            and sampling.max_new_tokens >= PACK_FROM_NEW_TOKENS
        ):
            from alignzoo.kernels import trace as decode_trace

            # The loop feeds the prompt and every sampled token but the last.
            trace = decode_trace.start(model, len(prompt_tokens), n, capacity - 1)
            decoder.trace = trace
        # One prefill per prompt: its n samples share the cache.
        logits = decoder.prefill(prompt_ids.to(device), mask, positions)
        if n > 1:
            decoder.repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            positions = positions.repeat_interleave(n, dim=0)
        position = positions[:, -1:] + 1
        rows = logits.shape[0]
        warpers = _warpers(sampling)
        generators = None
        if seeds is not None and sampling.temperature > 0:
            generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        uniforms = _uniforms(generators, n, sampling.max_new_tokens, device)
        eos = torch.tensor(eos_ids, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        versions: list[int] = []  # the version whose logits drew each step's tokens
        for t in range(sampling.max_new_tokens):
            if sampling.temperature == 0:
                token = logits.argmax(dim=-1)
                sampled_logp = torch.log_softmax(logits, dim=-1)  # greedy: the policy's own
            else:
                scores = logits
                for warper in warpers:
                    scores = warper(None, scores)
                sampled_logp = torch.log_softmax(scores, dim=-1)  # what the token is drawn from
                token = _draw(
                    torch.softmax(scores, dim=-1), None if uniforms is None else uniforms[t]
                )
            token = token.masked_fill(finished, pad)
            tokens.append(token)
            logprobs.append(sampled_logp.gather(1, token.unsqueeze(1)).squeeze(1))
            if version is not None:
                versions.append(version)
            finished = finished | torch.isin(token, eos)
            if t + 1 == sampling.max_new_tokens or bool(finished.all()):
                break
            if version is not None:
                newer = partial.refresh()
                if newer is not None and newer != version:
                    decoder.weights_changed()
                    version = newer
            logits = decoder.step(token.unsqueeze(1), position)
            position = position + 1
        if tokens:
            response = torch.stack(tokens, dim=1)
            response_logprobs = torch.stack(logprobs, dim=1)
        else:
            response = torch.zeros((rows, 0), dtype=torch.long, device=device)
            response_logprobs = torch.zeros((rows, 0), device=device)
        response, response_mask = cut_after_eos(response, eos_ids, pad)
        response_logprobs = response_logprobs.masked_fill(response_mask == 0, 0.0)
        ids = prompt_ids.repeat_interleave(n, dim=0)
        if trace is not None:
            assert isinstance(decoder, _LeanDecoder)
            trace.finish(
                decoder.cache, ids, prompt_mask.repeat_interleave(n, dim=0), response, response_mask
            )
        token_versions = None
        if version is not None:
            token_versions = torch.tensor(versions, dtype=torch.long).expand(rows, -1).clone()
        return (
            ids,
            prompt_mask.repeat_interleave(n, dim=0),
            response.cpu(),
            response_mask.cpu(),
            response_logprobs.float().cpu(),
            token_versions,
        )

    def _generate_chunk(
        self, prompt_tokens: list[list[int]], n: int, sampling: SamplingParams
    ) -> tuple[torch.Tensor | None, ...]:
        """Sample n continuations of each prompt; tensors on CPU: prompt ids/mask, response
        ids/mask/logprobs, and None for the tokens' versions (generate takes no newer weights)."""
        from transformers import GenerationConfig

        pad = self._pad_id()
        eos_ids = self._eos_ids()
        device = _model_device(self.model)
        ids, mask = self._left_padded(prompt_tokens)
        width = ids.shape[1]
        ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)

        greedy = sampling.temperature == 0
        recorder = _SamplingProcessor(sampling)
        # Filtering is done by `recorder`, after it has read the raw logits: generate's own
        # warpers stay off (top_k must be 0 explicitly, or generate defaults it to 50).
        warpers_off = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            num_beams=1,
            eos_token_id=eos_ids,
            pad_token_id=pad,
            use_cache=self.params.use_cache,
            **warpers_off,
        )
        with _own_generation_config(self.model, config):
            sequences = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                logits_processor=[recorder],
            )
        response = sequences[:, width:]
        logprobs = recorder.finish(response)
        response, response_mask = cut_after_eos(response, eos_ids, pad)
        logprobs = logprobs.masked_fill(response_mask == 0, 0.0)
        return ids, mask, response.cpu(), response_mask.cpu(), logprobs.float().cpu(), None

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self._eos_ids()[0]

    def _eos_ids(self) -> list[int]:
        """The tokenizer's EOS plus any EOS the checkpoint's generation config lists."""
        return eos_token_ids(self.tokenizer, self.model)


# The fewest new tokens for which the decode loop packs the weights (packing 56 matrices of
# the 25.8M model takes about 13 ms and 450 MB; each of its decode steps then saves about 3 ms).
PACK_FROM_NEW_TOKENS = 32


def _decoder(model: Any, rows: int, capacity: int, pack: bool) -> _LeanDecoder | _CacheDecoder:
    """The decode loop's forward passes: alignzoo's lean forward for the models it runs exactly
    (:func:`alignzoo.kernels.lean.lean_reason`), the model's own forward over a DynamicCache
    otherwise."""
    from alignzoo.kernels.lean import can_run_lean

    if can_run_lean(model):
        return _LeanDecoder(model, rows, capacity, pack)
    return _CacheDecoder(model)


class _LeanDecoder:
    """Prefill and decode steps through :func:`alignzoo.kernels.lean.lean_logits` over one
    preallocated KV cache (no mask growing per token, no cache or output objects)."""

    def __init__(self, model: Any, rows: int, capacity: int, pack: bool) -> None:
        from alignzoo.kernels.lean import KVCache

        self.model = model
        self.cache = KVCache.empty(model, rows, capacity, _model_device(model))
        self.pack = pack  # decode steps through MKL-packed weights (HFBackend's pack_weights)
        self.linear: Any = None  # the weights packed for the decode steps' row count
        self.trace: Any = None  # a DecodeTrace recording the activations (alignzoo.kernels.trace)

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The last position's logits ``[rows, V]`` (fp32) after the left-padded prompts."""
        return self._logits(ids, mask, positions)

    def repeat_interleave(self, n: int) -> None:
        self.cache = self.cache.repeat_interleave(n)

    def weights_changed(self) -> None:
        """The model's weights were replaced in place: pack them again at the next step."""
        self.linear = None

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The next logits ``[rows, V]`` after one more token ``[rows, 1]`` at ``position``."""
        if self.pack and self.linear is None:  # the steps' rows never change: pack once
            from alignzoo.kernels.lean import PackedLinears

            self.linear = PackedLinears(self.model, token.shape[0])
        return self._logits(token, torch.ones_like(token), position, self.linear)

    def _logits(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, linear: Any = None
    ) -> torch.Tensor:
        from alignzoo.kernels.lean import lean_logits

        logits = lean_logits(
            self.model,
            ids,
            mask,
            positions,
            logits_to_keep=1,
            cache=self.cache,
            linear=linear,
            trace=self.trace,
        )
        return logits[:, -1].float()


class _CacheDecoder:
    """The same steps through the model's own forward and transformers' DynamicCache."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        from alignzoo.kernels.forward import forward_parameters

        self.model = model
        takes = forward_parameters(model)
        try:  # filled in place by every forward
            cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers: the cache builds its layers lazily, no config
            cache = DynamicCache()
        self.cache = cache
        self.with_cache = {
            "cache" if "cache" in takes else "past_key_values": cache,
            "use_cache": True,
        }
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
        self.mask: torch.Tensor | None = None

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        self.mask = mask
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **self.with_cache,
            **self.keep,
        )
        return out.logits[:, -1].float()

    def repeat_interleave(self, n: int) -> None:
        assert self.mask is not None
        self.cache.batch_repeat_interleave(n)
        self.mask = self.mask.repeat_interleave(n, dim=0)

    def weights_changed(self) -> None:
        """The model's weights were replaced in place: its forward reads them as they are."""

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=token, attention_mask=self.mask, position_ids=position, **self.with_cache
        )
        return out.logits[:, -1].float()


class _SamplingProcessor:
    """A logits processor that applies temperature/top-k/top-p, then records the log-probs of
    the distribution the token is drawn from.

    ``generate`` calls it once per step with the tokens so far and that step's logits.
    """

    def __init__(self, sampling: SamplingParams) -> None:
        self.warpers = _warpers(sampling)
        self.token_logprobs: list[torch.Tensor] = []  # [B] per generated token, in order
        self.last: torch.Tensor | None = None  # [B, V] log-softmax of the latest step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the previous step's token is now the last input id
            self.token_logprobs.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.last = torch.log_softmax(scores.float(), dim=-1)  # the distribution drawn from
        return scores

    def finish(self, response: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` log-probs of ``response`` (generate may have run steps it then dropped)."""
        length = response.shape[1]
        if len(self.token_logprobs) < length and self.last is not None:
            token = response[:, len(self.token_logprobs)].unsqueeze(1)
            self.token_logprobs.append(self.last.gather(1, token).squeeze(1))
        if length == 0:
            return torch.zeros_like(response, dtype=torch.float32)
        return torch.stack(self.token_logprobs[:length], dim=1)


def _cdf_dtype(device: torch.device) -> torch.dtype:
    """float64 for the uniforms and the CDF, except on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _uniforms(
    generators: list[Any] | None, n: int, steps: int, device: torch.device
) -> torch.Tensor | None:
    """``[steps, rows]`` uniforms in [0, 1): prompt i's n rows (columns ``i*n .. i*n+n-1``) for
    every decode step, all drawn up front from prompt i's own generator (one call per prompt,
    not one per prompt and token); None without generators."""
    if generators is None:
        return None
    dtype = _cdf_dtype(device)
    draws = [torch.rand((steps, n), generator=g, device=device, dtype=dtype) for g in generators]
    return torch.cat(draws, dim=1)


def _draw(probs: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
    """One token per row from ``probs`` ``[rows, V]``: from the global RNG, or by inverting each
    row's CDF at its uniform ``uniforms[row]`` (the first token whose cumulative probability
    exceeds it), which never picks a token of probability 0. A row that is not a distribution
    (NaN, inf or negative entries, or all zeros) raises, as ``torch.multinomial`` does."""
    if uniforms is None:
        return torch.multinomial(probs, 1).squeeze(1)
    cdf = probs.to(uniforms.dtype).cumsum(dim=-1)
    total = cdf[:, -1:]
    valid = torch.isfinite(total).all() & (total > 0).all() & (probs >= 0).all()
    if not bool(valid):  # one host sync per token, like the loop's own finished check
        raise RuntimeError(
            "sampling: a row of next-token probabilities holds NaN, inf or negative values "
            "or sums to 0 (non-finite logits: check the model's precision and learning rate)"
        )
    target = uniforms.unsqueeze(1) * total  # the rows need not sum to exactly 1
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total may round up to total: then the last token of positive probability.
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(token, last)


def _warpers(sampling: SamplingParams) -> list[Any]:
    """transformers' logits warpers for the sampling parameters: temperature, top-k, top-p."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers: list[Any] = []
    if sampling.temperature > 0:
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


def _pad_rows(tensors: list[torch.Tensor], value: float, left: bool) -> torch.Tensor:
    """Concatenate ``[b_i, L_i]`` tensors along rows, padding columns on the left or right."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        gap = width - t.shape[1]
        padded.append(torch.nn.functional.pad(t, (gap, 0) if left else (0, gap), value=value))
    return torch.cat(padded)


def _plain_copy(module: Any, device: str) -> Any:
    """A separate plain model with ``module``'s architecture (no adapters) on ``device``; its
    weights arrive with the first ``sync_weights``."""
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if callable(get_base) else module
    config = copy.deepcopy(base.config)
    dtype = next(base.parameters()).dtype
    with _default_dtype(dtype):
        model = type(base)(config)
    model.generation_config = copy.deepcopy(getattr(base, "generation_config", None))
    return model.to(device).eval().requires_grad_(False)


def _load_stream(model: Any, weights: PolicyWeights) -> None:
    """Copy the stream's tensors into ``model`` by name, one at a time; every name must match."""
    own = model.state_dict()
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights.named_tensors():
            target = own.get(name)
            if target is None:
                raise RuntimeError(
                    f"hf backend (weights: copy): the weight stream has {name!r}, which the "
                    "backend's copy of the policy lacks"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise RuntimeError(
                    f"hf backend (weights: copy): {name!r} has shape {list(tensor.shape)} in the "
                    f"stream and {list(target.shape)} in the backend's copy"
                )
            target.copy_(tensor)  # converts dtype and device
            seen.add(name)
    missing = sorted(set(own) - seen)
    if missing:
        raise RuntimeError(
            f"hf backend (weights: copy): the weight stream (version {weights.version}) lacks "
            f"{len(missing)} tensor(s) of the policy, e.g. {missing[0]!r}"
        )


class _default_dtype:
    """torch's default dtype set to ``dtype`` inside the block."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.saved: Any = None

    def __enter__(self) -> None:
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.saved)


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


class _eval_mode:
    """Put every submodule in eval mode; restore each one's own mode afterwards."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.modes: list[tuple[Any, bool]] = []

    def __enter__(self) -> None:
        self.modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        for module, mode in self.modes:
            module.training = mode


class _own_generation_config:
    """Set the checkpoint's generation_config aside so none of its defaults leak into sampling."""

    def __init__(self, model: Any, config: Any) -> None:
        # A peft model generates through its base model, which owns the generation config.
        get_base = getattr(model, "get_base_model", None)
        self.owner = get_base() if callable(get_base) else model
        self.config = config
        self.saved: Any = None

    def __enter__(self) -> None:
        self.saved = getattr(self.owner, "generation_config", None)
        self.owner.generation_config = self.config

    def __exit__(self, *exc: object) -> None:
        self.owner.generation_config = self.saved
