"""The served teacher (``model.teacher.served``): the teacher's log-probs of the policy's own
samples from an OpenAI-compatible ``/v1/completions`` endpoint (a vLLM server), without a local
copy of its weights.

Each sample goes out as token ids, its prompt (padding dropped) followed by its response tokens
(those the policy attends to), as one entry of the request's ``prompt`` (a list of token-id
lists, which vLLM's server takes as they are: no BOS added, nothing re-tokenized). The endpoint
scores the whole sequence as a prompt; its log-prob of token ``j`` given tokens ``< j`` is the
teacher's log-prob of that token. Two request forms (``logprobs_field``):

``prompt_logprobs`` (vLLM's extension, the default)
    ``{"prompt_logprobs": 0, "max_tokens": 1, "return_token_ids": true}``; read from
    ``choices[i].prompt_logprobs``: one entry per prompt token, ``None`` for the first, then
    ``{"<token id>": {"logprob": ..., "rank": ..., "decoded_token": ...}}`` holding the token sent.
``echo`` (the legacy OpenAI form)
    ``{"echo": true, "logprobs": 0, "max_tokens": 0, "return_tokens_as_token_ids": true}``; read
    from ``choices[i].logprobs.token_logprobs`` (``None`` first; vLLM clamps each to -9999),
    with ``tokens`` as ``"token_id:<id>"`` where the server writes them so.

Temperature: vLLM computes prompt log-probs from the raw logits (temperature 1) whatever the
request's temperature, and a log-prob cannot be re-tempered after the softmax; the local
teacher's log-probs are taken at the sampling temperature. So a served teacher is only for arms
that sample at temperature 1: ``alignzoo validate`` refuses any other, and so does a batch
sampled otherwise.

Failures: a request that fails by connection, timeout, HTTP 429 or 5xx is tried again
(``retries``, with backoff), then the step fails (:class:`~alignzoo.errors.RunError`) naming the
endpoint; any other HTTP error, a reply without log-probs, a list whose length is not the
sequence's, token ids other than those sent, or a value above 0 (logits, not log-probs: a server
started with ``--logprobs-mode raw_logits``) fails it at once. No log-prob is ever filled in.

Tokenizer: the served model must tokenize as the policy does (the ids sent are the policy's).
:meth:`ServedTeacher.problems` checks it without the teacher's weights: ``GET /v1/models`` must
list ``model``; vLLM's ``POST /tokenize`` must encode a probe string (with the policy's EOS) to
the policy's ids; a local ``tokenizer`` folder, when given, must have the policy's vocabulary.
A server with no ``/tokenize`` needs that folder.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import ServedTeacherConfig
from alignzoo.errors import RunError, UserError

FIELD = "model.teacher.served"

PROBE = "12+7=19; the teacher's probe: 3*45 = 135, naïve!"
"""The text whose token ids the served model's /tokenize and the policy's tokenizer must agree
on (the policy's EOS token is appended)."""

RETRY_WAIT_S = 0.5
"""The first wait before a failed request is tried again; it doubles each try (at most 8 s)."""

LOGITS_ABOVE = 1e-4
"""A returned value above this is no log-prob (the server returns logits)."""

CHECK_TIMEOUT_S = 30.0
"""The most a check's request waits (validate should not hang for a run's timeout_s)."""


def server_root(base_url: str) -> str:
    """``base_url`` without a trailing slash or ``/v1``: where ``/v1/...`` and ``/tokenize`` are."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def sequences(batch: RolloutBatch) -> list[tuple[list[int], list[int], list[int]]]:
    """Per sample: its prompt's token ids (padding dropped), its response tokens the policy
    attends to, and their positions in ``batch.response_ids`` (what the local forward pass
    sees: it attends to exactly these, at consecutive positions)."""
    attended = (
        batch.response_attention > 0
        if batch.response_attention is not None
        else batch.response_mask > 0
    )
    out = []
    for row in range(batch.size):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row] > 0].tolist()
        where = torch.nonzero(attended[row], as_tuple=False).flatten()
        response = batch.response_ids[row][where].tolist()
        out.append((prompt, response, where.tolist()))
    return out


class ServedTeacher:
    """The teacher behind ``model.teacher.served``: :meth:`logprobs` of a batch ``[B, R]``,
    by ``batch_size`` sequences a request and ``max_concurrency`` requests at once. Holds no
    weights and no state a checkpoint would need."""

    def __init__(self, cfg: ServedTeacherConfig, field: str = FIELD) -> None:
        self.cfg = cfg
        self.field = field
        self.root = server_root(cfg.base_url)
        self._client: Any = None

    # -- HTTP ---------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        name = self.cfg.api_key_env
        if name is None:
            return {}
        key = os.environ.get(name)
        if not key:
            raise UserError(f"{self.field}.api_key_env: the environment variable {name} is not set")
        return {"Authorization": f"Bearer {key}"}

    def http(self) -> Any:
        """The httpx client (made on first use; safe to share between threads)."""
        import httpx

        if self._client is None:
            self._client = httpx.Client(
                base_url=self.root, headers=self._headers(), timeout=self.cfg.timeout_s
            )
        return self._client

    def close(self) -> None:
        """Close the client's connections."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path``; the reply's JSON. Tried again on a connection failure, a
        timeout, HTTP 429 or 5xx; :class:`RunError` once the tries are spent or on any other
        HTTP error."""
        import httpx

        url = f"{self.root}{path}"
        tries = 1 + self.cfg.retries
        last = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(min(RETRY_WAIT_S * 2 ** (attempt - 1), 8.0))
            try:
                reply = self.http().post(path, json=body)
            except httpx.TimeoutException as exc:
                last = f"no answer within timeout_s {self.cfg.timeout_s:g} ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last = f"cannot connect ({type(exc).__name__}: {exc})"
                if attempt == tries - 1:
                    raise RunError(
                        f"{self.field}.base_url: POST {url} failed {tries} time(s): {last}; the "
                        "step needs the teacher's log-prob of every sampled token"
                    ) from None
                continue
            if reply.status_code == 429 or reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:300]}"
                continue
            if reply.status_code != 200:
                raise RunError(
                    f"{self.field}: POST {url} was refused, HTTP {reply.status_code}: "
                    f"{reply.text[:500]}"
                )
            try:
                return reply.json()
            except ValueError:
                raise RunError(
                    f"{self.field}: POST {url} answered with no JSON: {reply.text[:200]!r}"
                ) from None
        raise RunError(
            f"{self.field}: POST {url} failed {tries} time(s), last: {last}; the step needs the "
            "teacher's log-prob of every sampled token"
        )

    # -- log-probs ----------------------------------------------------------------------------

    def request_body(self, prompts: list[list[int]]) -> dict[str, Any]:
        """The /v1/completions request that scores ``prompts`` (token-id lists) as prompts."""
        body: dict[str, Any] = {"model": self.cfg.model, "prompt": prompts}
        if self.cfg.logprobs_field == "prompt_logprobs":
            body.update(prompt_logprobs=0, max_tokens=1, return_token_ids=True)
        else:
            body.update(echo=True, logprobs=0, max_tokens=0, return_tokens_as_token_ids=True)
        return body

    def _choice_logprobs(self, choice: Any, ids: list[int], where: str) -> list[float | None]:
        """The per-token log-prob list of one choice, checked against the ids sent."""
        if not isinstance(choice, dict):
            raise RunError(f"{self.field}: {where}: a choice is not an object: {choice!r:.200}")
        if self.cfg.logprobs_field == "prompt_logprobs":
            entries = choice.get("prompt_logprobs")
            if not isinstance(entries, list):
                raise RunError(
                    f"{self.field}: {where}: the reply has no prompt_logprobs (a server without "
                    "vLLM's prompt_logprobs extension: try logprobs_field: echo)"
                )
            sent = choice.get("prompt_token_ids")
            if isinstance(sent, list) and sent != ids:
                raise RunError(
                    f"{self.field}: {where}: the server scored other token ids than it was sent "
                    f"({len(sent)} ids, {len(ids)} sent)"
                )
            self._check_length(len(entries), len(ids), where)
            values: list[float | None] = [None]
            for j in range(1, len(ids)):
                entry = entries[j]
                found = None
                if isinstance(entry, dict):
                    found = entry.get(str(ids[j]), entry.get(ids[j]))
                if isinstance(found, dict):
                    found = found.get("logprob")
                if not isinstance(found, int | float):
                    raise RunError(
                        f"{self.field}: {where}: no log-prob of token {ids[j]} at position {j} "
                        f"(got {entry!r:.200})"
                    )
                values.append(float(found))
            return values
        logprobs = choice.get("logprobs")
        echoed = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(logprobs, dict) or not isinstance(echoed, list):
            raise RunError(
                f"{self.field}: {where}: the reply has no logprobs.token_logprobs (a server "
                "that does not echo the prompt's log-probs)"
            )
        self._check_length(len(echoed), len(ids), where)
        tokens = logprobs.get("tokens")
        as_ids = isinstance(tokens, list) and all(
            isinstance(t, str) and t.startswith("token_id:") for t in tokens
        )
        if as_ids and [int(t.removeprefix("token_id:")) for t in tokens or []] != ids:
            raise RunError(f"{self.field}: {where}: the server echoed other token ids than sent")
        bad = [v for v in echoed if v is not None and not isinstance(v, int | float)]
        if bad:
            raise RunError(f"{self.field}: {where}: a log-prob that is no number: {bad[0]!r:.100}")
        return [None if v is None else float(v) for v in echoed]

    def _check_length(self, got: int, sent: int, where: str) -> None:
        if got != sent:
            raise RunError(
                f"{self.field}: {where}: {got} log-probs for the {sent} tokens sent; they cannot "
                "be aligned with the sampled tokens (does the server add or drop tokens, or "
                "generate some into the list?)"
            )

    def _score(self, chunk: list[list[int]], first: int) -> list[list[float | None]]:
        body = self.request_body(chunk)
        data = self._post("/v1/completions", body)
        where = f"samples {first}..{first + len(chunk) - 1}"
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != len(chunk):
            count = len(choices) if isinstance(choices, list) else "no"
            raise RunError(
                f"{self.field}: {where}: {count} choices for {len(chunk)} prompts in the reply"
            )
        if all(isinstance(c, dict) and isinstance(c.get("index"), int) for c in choices):
            choices = sorted(choices, key=lambda c: c["index"])
        return [
            self._choice_logprobs(choice, ids, f"sample {first + i}")
            for i, (choice, ids) in enumerate(zip(choices, chunk, strict=True))
        ]

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The teacher's log-prob of each response token ``[B, R]`` (fp32, CPU): exactly the
        tokens the local forward pass attends to; 0 on padding. Raises when the batch was
        sampled at a temperature other than 1, or when any request fails."""
        if batch.sampling is not None:
            temperatures = batch.sampling[:, 0].float()
            off = (temperatures - 1.0).abs() > 1e-6
            if bool(off.any()):
                raise UserError(
                    f"{self.field}: the served teacher's log-probs are at temperature 1 and the "
                    f"batch was sampled at {float(temperatures[off][0]):g}; sample at "
                    "temperature 1 (training.sampling.temperature) or use a local teacher"
                )
        rows = sequences(batch)
        todo = [(row, p + r) for row, (p, r, _) in enumerate(rows) if r]
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        if not todo:
            return out
        size = self.cfg.batch_size
        chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
        workers = min(self.cfg.max_concurrency, len(chunks))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teacher") as pool:
            futures = [pool.submit(self._score, [ids for _, ids in c], c[0][0]) for c in chunks]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        for chunk, scored in zip(chunks, results, strict=True):
            for (row, _), values in zip(chunk, scored, strict=True):
                prompt, _, positions = rows[row]
                tail = values[len(prompt) :]
                for k, (value, position) in enumerate(zip(tail, positions, strict=True)):
                    if value is None or not math.isfinite(value):
                        raise RunError(
                            f"{self.field}: sample {row}: the log-prob of response token {k} "
                            f"is {value!r}"
                        )
                    if value > LOGITS_ABOVE:
                        raise RunError(
                            f"{self.field}: sample {row}: the server returned {value:g} for "
                            f"response token {k}, which is no log-prob (a server started with "
                            "--logprobs-mode raw_logits or processed_logits?)"
                        )
                    out[row, position] = value
        return out

    # -- checks -------------------------------------------------------------------------------

    def problems(self, tokenizer: Any) -> list[tuple[str, str]]:
        """What keeps this endpoint from serving as the teacher of a policy with ``tokenizer``
        (None: not checked), as (subfield of ``served``, message): it must answer, serve
        ``model``, and tokenize as the policy does (its /tokenize, or the ``tokenizer``
        folder's vocabulary)."""
        import httpx

        try:
            self._headers()
        except UserError as exc:
            return [("api_key_env", str(exc).split(": ", 1)[1])]
        url = f"{self.root}/v1/models"
        try:
            reply = self.http().get("/v1/models", timeout=self._check_timeout())
        except httpx.HTTPError as exc:
            return [("base_url", f"GET {url}: cannot connect ({type(exc).__name__}: {exc})")]
        if reply.status_code != 200:
            return [("base_url", f"GET {url}: HTTP {reply.status_code}: {reply.text[:300]}")]
        try:
            listed = [str(m.get("id")) for m in reply.json().get("data", [])]
        except (ValueError, AttributeError, TypeError):
            return [("base_url", f"GET {url}: not an OpenAI model list: {reply.text[:200]!r}")]
        if self.cfg.model not in listed:
            return [
                (
                    "model",
                    f"{self.cfg.base_url} serves {', '.join(map(repr, listed)) or 'no model'}, "
                    f"not {self.cfg.model!r}",
                )
            ]
        if tokenizer is None:
            return []
        out: list[tuple[str, str]] = []
        if self.cfg.tokenizer is not None:
            out += self._folder_problems(tokenizer)
        probe = PROBE + (tokenizer.eos_token or "")
        own = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        try:
            reply = self.http().post(
                "/tokenize",
                json={"model": self.cfg.model, "prompt": probe, "add_special_tokens": False},
                timeout=self._check_timeout(),
            )
        except httpx.HTTPError as exc:
            return [*out, ("base_url", f"POST {self.root}/tokenize: {type(exc).__name__}: {exc}")]
        if reply.status_code in (404, 405):
            if self.cfg.tokenizer is None:
                out.append(
                    (
                        "tokenizer",
                        f"{self.cfg.base_url} has no /tokenize endpoint to compare its "
                        "tokenizer with the policy's; give tokenizer: <a local folder with the "
                        "served model's tokenizer> (distillation compares log-probs token by "
                        "token, so both must tokenize alike)",
                    )
                )
            return out
        try:
            theirs = list(reply.json()["tokens"]) if reply.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            theirs = None
        if theirs is None:
            out.append(("base_url", f"POST {self.root}/tokenize: HTTP {reply.status_code}: "
                                    f"{reply.text[:200]}"))  # fmt: skip
        elif theirs != own:
            out.append(
                (
                    "model",
                    f"{self.cfg.model!r} tokenizes otherwise than the policy: {probe!r} is "
                    f"{_ids(theirs)} on the server and {_ids(own)} for the policy; "
                    "distillation compares log-probs token by token, so both must tokenize alike",
                )
            )
        return out

    def _check_timeout(self) -> float:
        return min(self.cfg.timeout_s, CHECK_TIMEOUT_S)

    def _folder_problems(self, tokenizer: Any) -> list[tuple[str, str]]:
        from transformers import AutoTokenizer

        folder = self.cfg.tokenizer
        try:
            theirs = AutoTokenizer.from_pretrained(folder).get_vocab()
        except (OSError, ValueError) as exc:
            return [("tokenizer", f"cannot load a tokenizer from {folder!r}: {exc}")]
        own = tokenizer.get_vocab()
        if own == theirs:
            return []
        differ = len(set(own.items()) ^ set(theirs.items()))
        return [
            (
                "tokenizer",
                f"the served model's tokenizer ({folder}, {len(theirs)} tokens) is not the "
                f"policy's ({len(own)} tokens; {differ} token ids differ): distillation compares "
                "log-probs token by token, so both must tokenize alike",
            )
        ]

    def check(self, tokenizer: Any) -> None:
        """Raise :class:`UserError` with every :meth:`problems`, each naming its field."""
        found = self.problems(tokenizer)
        if found:
            raise UserError("; ".join(f"{self.field}.{sub}: {why}" for sub, why in found))


def _ids(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 24 else f"{ids[:24]}... ({len(ids)} ids)"
