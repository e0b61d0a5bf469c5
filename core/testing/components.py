"""Contract suites for labelers, backends, device mappers and modifiers (public API).

Each ``check_<kind>`` takes a registered name, a class or an instance (plus ``params`` for a
name or a class), runs its properties with hypothesis where it fits, and returns one
:class:`~alignzoo.testing.contract.CheckResult` per check; a failure names the property and
shows the smallest example hypothesis found. ``assert_contract(kind, ...)`` raises with every
failed check, for a plugin's own tests; ``alignzoo check KIND NAME`` runs the same suite.

Labeler (``check_labeler``):

- ``instantiate``: builds (with ``params``) and answers one request;
- ``one_score_per_request``: for any list of requests (empty, huge, unicode and adversarial
  responses; with and without an ``answer`` column) ``score_batch`` returns exactly one
  :class:`~alignzoo.types.Score` per request, with a finite value for every ``value`` outcome,
  and raises nothing: bad model output is a value (or an abstain), never an exception;
- ``batch_equals_items``: the answer to a batch is the answers to its requests one by one, in
  order;
- ``deterministic``: the same requests twice give the same scores (skipped for a labeler class
  that sets ``deterministic = False``, e.g. people or a sampled judge).

Backend (``check_backend``, on a small random Qwen2 of the embedded world):

- ``layout``: ``len(prompts) * n`` samples grouped ``i // n``, left-padded prompts and
  right-padded responses with 0/1 masks, nothing masked in after an EOS, at most
  ``max_new_tokens`` tokens, texts and extras per sample;
- ``greedy_deterministic``: greedy decoding twice gives the same tokens;
- ``sampling_logprobs``: sampling log-probs the backend returns (``rollout_logprobs``) match a
  forward pass of the synced weights under the distribution each token was drawn from, at
  temperature 1 and at :data:`WARPED` (temperature 0.7, top-k 20, top-p 0.9): a backend that
  returns the raw logits' log-probs fails it (not run when it returns none);
- ``sync_changes_outputs``: after ``sync_weights`` with weights that favour one token the greedy
  outputs follow them, and syncing the old weights back restores the old outputs.

Device mapper (``check_device_mapper``):

- ``places_every_role``: for any roles and any devices available, either every role is placed
  on an available device or the placement is refused with a :class:`~alignzoo.errors.UserError`
  (nothing else raised);
- ``stable``: the same roles and devices give the same placement.

Modifier (``check_modifier``): wrapped around each built-in algorithm (GRPO, PPO, RLOO, DPO,
KTO) the algorithm contract still holds (``<algorithm>/output_types``,
``finite_extreme_logprobs``, ``padding_invariance``, ``sample_permutation``,
``micro_batch_invariance``), and ``transform_batch`` returns None or a batch whose per-sample
fields agree in length (``transform_batch_layout``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from alignzoo.errors import UserError
from alignzoo.registry import build_plugin_manager, get_registry
from alignzoo.testing.contract import (
    REBUILD_HINT,
    CheckResult,
    ContractViolation,
    build_for_check,
    check_algorithm,
    component_factory,
    run_property,
)
from alignzoo.types import LabelRequest, Outcome, SamplingParams, Score
from alignzoo.weights import PolicyWeights

__all__ = [
    "ADVERSARIAL_RESPONSES",
    "KIND_CHECKS",
    "assert_contract",
    "check_backend",
    "check_component",
    "check_device_mapper",
    "check_labeler",
    "check_modifier",
]

KIND_CHECKS: dict[str, tuple[str, ...]] = {
    "labeler": ("instantiate", "one_score_per_request", "batch_equals_items", "deterministic"),
    "backend": (
        "instantiate",
        "layout",
        "greedy_deterministic",
        "sampling_logprobs",
        "sync_changes_outputs",
    ),
    "device_mapper": ("instantiate", "places_every_role", "stable"),
    "modifier": ("instantiate", "transform_batch_layout"),  # + <algorithm>/<check>
}
"""The checks of each kind, in the order they are reported."""

ADVERSARIAL_RESPONSES = (
    "",
    " ",
    "\x00",
    "NaN",
    "inf",
    "-1e308",
    "1e309",
    "None",
    "null",
    "0" * 400,
    "🙂" * 50,
    "ç∂ƒ∆ unicode ✓",
    "\n\n\n",
    "'; DROP TABLE labels; --",
    "{{prompt}} {response} %s %d",
    "<script>alert(1)</script>",
    "import os; os.system('echo hi')",
    "x" * 20000,
)
"""Model outputs every labeler must score without an exception."""

MODIFIER_ALGORITHMS = ("grpo", "ppo", "rloo", "dpo", "kto")
MODIFIER_CHECKS = (
    "output_types",
    "finite_extreme_logprobs",
    "padding_invariance",
    "sample_permutation",
    "micro_batch_invariance",
)


def _not_run(names: Iterable[str], why: str) -> list[CheckResult]:
    return [CheckResult(n, False, f"not run: {why}") for n in names]


# --------------------------------------------------------------------------- labelers


def _requests(extra: dict[str, Any]) -> st.SearchStrategy[list[LabelRequest]]:
    """Requests with any model output (prompt and response) and the data's ``extra`` columns."""
    response = st.one_of(
        st.sampled_from(ADVERSARIAL_RESPONSES),
        st.text(max_size=40),
        st.integers(-1000, 1000).map(str),
    )
    request = st.builds(
        LabelRequest,
        prompt=st.one_of(st.sampled_from(["3+4=", "", "Say hi."]), st.text(max_size=30)),
        response=response,
        extra=st.just(extra).map(copy.deepcopy),
    )
    every = [LabelRequest("3+4=", r, copy.deepcopy(extra)) for r in ADVERSARIAL_RESPONSES]
    return st.one_of(st.just(every), st.lists(request, min_size=0, max_size=6))


EXTRA_GUESSES: tuple[dict[str, Any], ...] = ({"answer": "7"}, {})
"""Data columns tried when none are given: the embedded task's, then none."""


def _score(hook: Any, requests: list[LabelRequest]) -> list[Score]:
    """``score_batch`` through a plugin manager, checked the way the labeling stage checks it."""
    from alignzoo.labeling.interface import check_scores

    try:
        answer = hook.score_batch(requests=list(requests))
    except Exception as exc:
        raise ContractViolation(
            f"score_batch raised {type(exc).__name__}: {exc} (bad model output must be a value "
            "or an abstain; an unavailable service raises LabelerUnavailable)"
        ) from None
    checked = check_scores(answer, len(requests), [r.response for r in requests])
    if isinstance(checked, str):
        raise ContractViolation(f"score_batch {checked}")
    for i, score in enumerate(checked):
        if score.outcome == Outcome.REJECTED and score.info.get("reason", "").startswith("the "):
            raise ContractViolation(f"request {i} would be rejected: {score.info['reason']}")
    return checked


def _same(a: Score, b: Score) -> bool:
    if a.outcome != b.outcome:
        return False
    if a.outcome != Outcome.VALUE:
        return True
    return abs(float(a.value) - float(b.value)) <= 1e-6 * max(1.0, abs(float(a.value)))


def _assert_same(first: list[Score], second: list[Score], what: str) -> None:
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if not _same(a, b):
            raise ContractViolation(
                f"{what}: request {i} scored {b.outcome.value} {b.value!r}, "
                f"expected {a.outcome.value} {a.value!r}"
            )


def check_labeler(
    labeler: Any,
    params: Any = None,
    max_examples: int = 50,
    shrink_seconds: float = 10.0,
    extra: dict[str, Any] | None = None,
) -> list[CheckResult]:
    """The labeler contract suite (see the module docstring). ``extra``: the data columns a
    request carries (for example ``{"tests": [...]}``); model output varies, the data does
    not. Without it, ``{"answer": "7"}`` and then no columns are tried."""
    label, factory = component_factory("labeler", labeler, params)
    instance = build_for_check(label, factory, "labeler")
    if isinstance(instance, CheckResult):
        return [instance, *_not_run(KIND_CHECKS["labeler"][1:], "the labeler did not build")]
    hook = build_plugin_manager([instance]).hook
    guesses = [extra] if extra is not None else list(EXTRA_GUESSES)
    columns: dict[str, Any] = guesses[0]
    for guess in guesses:  # the data columns it answers with (its faults are the checks')
        try:
            _score(hook, [LabelRequest("3+4=", "7", copy.deepcopy(guess))])
        except ContractViolation:
            continue
        columns = guess
        break
    results = [CheckResult("instantiate", True, f"{label} (data columns {sorted(columns)})")]
    one = (
        "example = the requests of one score_batch call; reproduce with "
        "labeler.score_batch([LabelRequest(prompt, response, extra)])"
    )
    results.append(
        run_property(
            "one_score_per_request",
            _requests(columns),
            lambda r: _score(hook, r),
            max_examples,
            shrink_seconds,
            one,
        )
    )

    if getattr(type(instance), "deterministic", True) is False:  # people, a sampled judge
        skipped = "skipped: the labeler declares deterministic = False"
        results += [CheckResult(n, True, skipped) for n in ("batch_equals_items", "deterministic")]
    else:

        def items(requests: list[LabelRequest]) -> None:
            whole = _score(hook, requests)
            alone = [_score(hook, [r])[0] for r in requests]
            _assert_same(alone, whole, "the batch answer differs from the per-request answers")

        def twice(requests: list[LabelRequest]) -> None:
            _assert_same(_score(hook, requests), _score(hook, requests), "scored again")

        for name, prop in (("batch_equals_items", items), ("deterministic", twice)):
            results.append(
                run_property(name, _requests(columns), prop, max_examples, shrink_seconds, one)
            )
    close = getattr(instance, "close", None)
    if callable(close):
        close()
    return results


# --------------------------------------------------------------------------- backends


class _BackendRun:
    """What a backend's ``on_run_start`` reads: devices, the tokenizer and the actor."""

    def __init__(self, actor: Any, tokenizer: Any) -> None:
        self.actor, self.tokenizer = actor, tokenizer
        self.models = None
        self.step = 0
        self.state: dict[str, Any] = {}

    def device(self, role: str) -> str:
        return "cpu"

    def placement(self, role: str) -> Any:
        from alignzoo.types import Placement

        return Placement(device="cpu")


def _small_policy() -> tuple[Any, Any]:
    from alignzoo.config.schema import EmbeddedModelConfig
    from alignzoo.world.model import build_model
    from alignzoo.world.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    cfg = EmbeddedModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return build_model(cfg, tokenizer).eval(), tokenizer


PROMPTS = ["3+4=", "12+9=", "7-2=", "1+1=", "45+45="]


def _prompts_and_n() -> st.SearchStrategy[tuple[list[str], int, int]]:
    return st.tuples(
        st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=4),
        st.integers(1, 3),
        st.integers(1, 6),
    )


def _check_layout(batch: Any, prompts: list[str], n: int, max_new: int, eos: set[int]) -> None:
    from alignzoo.batch import RolloutBatch

    if not isinstance(batch, RolloutBatch):
        raise ContractViolation(f"generate returned {type(batch).__name__}, not a RolloutBatch")
    size = len(prompts) * n
    if batch.size != size:
        raise ContractViolation(f"{batch.size} samples for {len(prompts)} prompts x n={n}")
    expected = torch.arange(len(prompts)).repeat_interleave(n)
    if batch.group_ids.tolist() != expected.tolist():
        raise ContractViolation(f"group_ids {batch.group_ids.tolist()}, expected i // n")
    for name in ("prompts", "responses", "extras"):
        if len(getattr(batch, name)) != size:
            raise ContractViolation(f"{name} has {len(getattr(batch, name))} entries, not {size}")
    if batch.prompts != [p for p in prompts for _ in range(n)]:
        raise ContractViolation("batch.prompts is not each prompt repeated n times, in order")
    for name, left in (("prompt_mask", True), ("response_mask", False)):
        mask = getattr(batch, name)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ContractViolation(f"{name} is not 0/1")
        for row, values in enumerate(mask.long().tolist()):
            ones = [i for i, v in enumerate(values) if v]
            if ones and ones != list(range(ones[0], ones[-1] + 1)):
                raise ContractViolation(f"{name} row {row} has a hole: {values}")
            if ones and left and ones[-1] != len(values) - 1:
                raise ContractViolation(f"prompt_mask row {row} is not left-padded: {values}")
            if ones and not left and ones[0] != 0:
                raise ContractViolation(f"response_mask row {row} is not right-padded: {values}")
    lengths = batch.response_mask.sum(dim=1).long().tolist()
    if max(lengths, default=0) > max_new:
        raise ContractViolation(f"a response has {max(lengths)} tokens, max_new_tokens {max_new}")
    for row, (ids, length) in enumerate(zip(batch.response_ids.tolist(), lengths, strict=True)):
        stops = [i for i, t in enumerate(ids[:length]) if t in eos]
        if stops and stops[0] != length - 1:
            raise ContractViolation(
                f"response {row}: tokens after the EOS at {stops[0]} are masked in ({length})"
            )


def check_backend(
    backend: Any, params: Any = None, max_examples: int = 10, shrink_seconds: float = 10.0
) -> list[CheckResult]:
    """The backend contract suite (see the module docstring), on a small random policy."""
    from alignzoo.kernels.forward import policy_forward
    from alignzoo.ops import sampling_rows

    label, factory = component_factory("backend", backend, params)
    instance = build_for_check(label, factory, "backend")
    names = KIND_CHECKS["backend"]
    if isinstance(instance, CheckResult):
        return [instance, *_not_run(names[1:], "the backend did not build")]
    actor, tokenizer = _small_policy()
    hook = build_plugin_manager([instance]).hook
    try:
        hook.on_run_start(run=_BackendRun(actor, tokenizer))
        hook.sync_weights(weights=PolicyWeights(actor, 0))
    except Exception as exc:
        first = CheckResult("instantiate", False, f"{label}: {type(exc).__name__}: {exc}")
        return [first, *_not_run(names[1:], "the backend did not start")]
    eos = {int(t) for t in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}

    def generate(
        prompts: list[str], n: int, max_new: int, greedy: bool, warped: bool = False
    ) -> Any:
        sampling = SamplingParams(
            max_new_tokens=max_new,
            temperature=0.0 if greedy else WARPED["temperature"] if warped else 1.0,
            top_p=WARPED["top_p"] if warped else 1.0,
            top_k=WARPED["top_k"] if warped else 0,
        )
        batch = hook.generate(
            prompts=prompts, extras=[{} for _ in prompts], n=n, sampling=sampling, seeds=None
        )
        batch.sampling = sampling_rows(sampling.temperature, sampling.top_k, sampling.top_p,
                                       batch.size)  # fmt: skip
        return batch

    def layout(example: tuple[list[str], int, int]) -> None:
        prompts, n, max_new = example
        for greedy in (False, True):
            _check_layout(generate(prompts, n, max_new, greedy), prompts, n, max_new, eos)

    def greedy_twice(example: tuple[list[str], int, int]) -> None:
        prompts, n, max_new = example
        a, b = generate(prompts, n, max_new, True), generate(prompts, n, max_new, True)
        if a.response_ids.tolist() != b.response_ids.tolist() or a.responses != b.responses:
            raise ContractViolation(f"greedy decoding gave {a.responses} then {b.responses}")

    def sampling_logprobs(example: tuple[list[str], int, int]) -> None:
        prompts, n, max_new = example
        for warped in (False, True):  # T = 1; then temperature, top-k and top-p (WARPED)
            batch = generate(prompts, n, max_new, False, warped)
            recorded = _sampling_logprobs(batch)
            if recorded is None:
                raise ContractViolation(
                    "returned rollout_logprobs for some calls and not for others"
                )
            with torch.no_grad():  # under the distribution the tokens were drawn from
                forward, _ = policy_forward(actor, batch)
            mask = batch.response_mask.bool()
            diff = (forward.float() - recorded.float()).abs().masked_fill(~mask, 0.0)
            if float(diff.max()) > 1e-3:
                row, col = divmod(int(diff.argmax()), diff.shape[1])
                how = f"sampled at {WARPED}" if warped else "sampled at temperature 1"
                raise ContractViolation(
                    f"sampling log-prob [{row}, {col}] is {float(recorded[row, col])!r}, "
                    f"a forward pass of the synced weights gives {float(forward[row, col])!r} "
                    f"({how}: a backend returns the log-probs of the distribution it drew "
                    "each token from, after temperature, top-k and top-p)"
                )

    results = [CheckResult("instantiate", True, label)]
    legend = "example = (prompts, n, max_new_tokens)"
    for name, prop in (("layout", layout), ("greedy_deterministic", greedy_twice)):
        results.append(
            run_property(name, _prompts_and_n(), prop, max_examples, shrink_seconds, legend)
        )
    if _sampling_logprobs(generate(PROMPTS[:1], 1, 2, False)) is None:  # optional
        results.append(CheckResult("sampling_logprobs", True, "skipped: no sampling log-probs"))
    else:
        results.append(run_property("sampling_logprobs", _prompts_and_n(), sampling_logprobs,
                            max_examples, shrink_seconds, legend))  # fmt: skip
    results.append(_sync_check(hook, actor, tokenizer, generate))
    return results


WARPED = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
"""The warped sampling the backend contract checks recorded log-probs at (besides T = 1)."""


def _sampling_logprobs(batch: Any) -> Any:
    """The backend's recorded sampling log-probs (``rollout_logprobs``, formerly ``old_logprobs``)."""
    recorded = getattr(batch, "rollout_logprobs", None)
    return recorded if recorded is not None else batch.old_logprobs


def _sync_check(hook: Any, actor: Any, tokenizer: Any, generate: Callable[..., Any]) -> CheckResult:
    """Sync weights that make one token certain: greedy outputs must start with it; sync the
    old weights back: the old outputs return."""
    try:
        before = generate(PROMPTS, 1, 3, True)
        first = {row[0] for row in before.response_ids.tolist()}
        special = set(tokenizer.all_special_ids)
        token = next(t for t in range(len(tokenizer)) if t not in first and t not in special)
        saved = copy.deepcopy(actor.state_dict())
        head = actor.get_output_embeddings()
        with torch.no_grad():  # the trainer's update, in place (a shared module sees it too)
            head.weight.zero_()
            if getattr(head, "bias", None) is not None:
                head.bias.zero_()
            head.weight[token].fill_(1.0)
            actor.get_input_embeddings().weight.abs_()  # a positive hidden state favours it
        hook.sync_weights(weights=PolicyWeights(actor, 1))
        after = generate(PROMPTS, 1, 3, True)
        actor.load_state_dict(saved)
        hook.sync_weights(weights=PolicyWeights(actor, 2))
        back = generate(PROMPTS, 1, 3, True)
    except Exception as exc:
        return CheckResult("sync_changes_outputs", False, f"{type(exc).__name__}: {exc}")
    starts = [row[0] for row in after.response_ids.tolist()]
    if starts == [row[0] for row in before.response_ids.tolist()]:
        return CheckResult(
            "sync_changes_outputs",
            False,
            f"greedy outputs did not change after sync_weights with new weights: {after.responses}",
        )
    if back.response_ids.tolist() != before.response_ids.tolist():
        return CheckResult(
            "sync_changes_outputs",
            False,
            f"syncing the old weights back gave {back.responses}, not {before.responses}",
        )
    return CheckResult("sync_changes_outputs", True, f"favoured token {token}: {starts}")


# --------------------------------------------------------------------------- device mappers

ROLES = ("actor", "rollout", "labeler", "ref", "critic", "reward")


def _placements() -> st.SearchStrategy[tuple[list[str], list[str]]]:
    roles = st.lists(st.sampled_from(ROLES[1:]), unique=True).map(lambda r: ["actor", *r])
    gpus = st.integers(0, 4).map(lambda k: [f"cuda:{i}" for i in range(k)])
    available = st.tuples(st.booleans(), gpus).map(lambda t: (["cpu"] if t[0] else []) + t[1])
    return st.tuples(roles, available.filter(bool))


def _placed_devices(value: Any) -> list[str]:
    """The devices a mapper's value for one role occupies (a device name, Placement or mapping)."""
    from alignzoo.devices import normalize_device
    from alignzoo.types import Placement

    if isinstance(value, dict):
        try:
            value = Placement.model_validate(value)
        except Exception as exc:
            raise ContractViolation(f"a placement {value!r} is not valid: {exc}") from None
    if isinstance(value, Placement):
        return [normalize_device(d) for d in value.devices()]
    if isinstance(value, str):
        return [normalize_device(value)]
    raise ContractViolation(f"placed a role on {value!r}: not a device name or a Placement")


def check_device_mapper(
    mapper: Any, params: Any = None, max_examples: int = 100, shrink_seconds: float = 10.0
) -> list[CheckResult]:
    """The device-mapper contract suite (see the module docstring)."""
    from alignzoo.engine.hooks import Hooks

    label, factory = component_factory("device_mapper", mapper, params)
    instance = build_for_check(label, factory, "device_mapper")
    if isinstance(instance, CheckResult):
        return [instance, *_not_run(KIND_CHECKS["device_mapper"][1:], "it did not build")]
    hooks = Hooks(build_plugin_manager([instance]), label)

    def place(roles: list[str], available: list[str]) -> dict[str, list[str]] | None:
        """Role -> every device the mapper itself placed it on (before the engine's check)."""
        try:
            placed = hooks.pm.hook.place_roles(roles=list(roles), available=list(available))
        except UserError:
            return None  # refused, with a message for the user
        except Exception as exc:
            raise ContractViolation(
                f"place_roles raised {type(exc).__name__}: {exc}; a placement it cannot make "
                "must be refused with a UserError"
            ) from None
        if not isinstance(placed, dict):
            raise ContractViolation(f"place_roles returned {type(placed).__name__}, not a dict")
        return {str(role): _placed_devices(value) for role, value in placed.items()}

    def every_role(example: tuple[list[str], list[str]]) -> None:
        roles, available = example
        placed = place(roles, available)
        if placed is None:
            return
        missing = [r for r in roles if r not in placed]
        if missing:
            raise ContractViolation(f"role(s) {missing} were not placed")
        wrong = {r: d for r, d in placed.items() if any(x not in available for x in d)}
        if wrong:
            raise ContractViolation(f"placed on devices that are not available: {wrong}")
        hooks.place_roles(roles, available)  # and the engine accepts the placement

    def stable(example: tuple[list[str], list[str]]) -> None:
        roles, available = example
        if place(roles, available) != place(roles, available):
            raise ContractViolation("the same roles and devices gave another placement")

    legend = "example = (roles, available devices)"
    return [
        CheckResult("instantiate", True, label),
        run_property(
            "places_every_role", _placements(), every_role, max_examples, shrink_seconds, legend
        ),
        run_property("stable", _placements(), stable, max_examples, shrink_seconds, legend),
    ]


# --------------------------------------------------------------------------- modifiers


class _Stack:
    """An algorithm with modifiers around it, checked as one component."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)

    def state_dict(self) -> dict[str, Any]:
        return {
            str(i): p.state_dict() for i, p in enumerate(self.parts) if hasattr(p, "state_dict")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, part in enumerate(self.parts):
            if str(i) in state:
                part.load_state_dict(state[str(i)])


def _transform_layout(hook: Any, case: Any) -> None:
    from alignzoo.batch import RolloutBatch

    batch, _ = case.build()
    batch.responses = ["r"] * batch.size
    batch.prompts = ["p"] * batch.size
    out = hook.transform_batch(batch=batch, run=None)
    for result in out:
        if result is None:
            continue
        if not isinstance(result, RolloutBatch):
            raise ContractViolation(f"transform_batch returned {type(result).__name__}")
        n = result.size
        for name in ("prompt_ids", "response_ids", "response_mask", "group_ids"):
            if getattr(result, name).shape[0] != n:
                raise ContractViolation(
                    f"{name} has {getattr(result, name).shape[0]} rows, not {n}"
                )
        for name in ("scores", "old_logprobs", "weights", "labels"):
            value = getattr(result, name)
            if value is not None and value.shape[0] != n:
                raise ContractViolation(f"{name} has {value.shape[0]} rows, not {n}")
        for name in ("prompts", "responses"):
            if getattr(result, name) and len(getattr(result, name)) != n:
                raise ContractViolation(f"{name} has {len(getattr(result, name))} entries, not {n}")


def check_modifier(
    modifier: Any,
    params: Any = None,
    algorithms: Iterable[str] = MODIFIER_ALGORITHMS,
    max_examples: int = 20,
    shrink_seconds: float = 10.0,
) -> list[CheckResult]:
    """The modifier contract suite (see the module docstring)."""
    from alignzoo.testing.strategies import batch_cases
    from alignzoo.types import AlgorithmRequirements

    label, factory = component_factory("modifier", modifier, params)
    instance = build_for_check(label, factory, "modifier")
    if isinstance(instance, CheckResult):
        return [instance, CheckResult("transform_batch_layout", False, "not run: did not build")]
    results = [CheckResult("instantiate", True, label)]
    hook = build_plugin_manager([instance]).hook
    cases = batch_cases(AlgorithmRequirements(data="online"))
    results.append(
        run_property(
            "transform_batch_layout",
            cases,
            lambda c: _transform_layout(hook, c),
            max_examples,
            shrink_seconds,
            "example = one sampled batch",
            REBUILD_HINT,
        )
    )
    registry = get_registry()
    for name in algorithms:
        algorithm = registry.get("algorithm", name)
        stacked = check_algorithm(
            _StackFactory(algorithm, factory),
            max_examples=max_examples,
            shrink_seconds=shrink_seconds,
            checks=MODIFIER_CHECKS,
        )
        for result in stacked:
            if result.name != "instantiate" or not result.passed:
                results.append(CheckResult(f"{name}/{result.name}", result.passed, result.detail))
    return results


class _StackFactory:
    """Called like an algorithm class by :func:`check_algorithm`: a fresh algorithm with a fresh
    modifier around it."""

    def __init__(self, algorithm: type, modifier: Callable[[], Any]) -> None:
        self.algorithm, self.modifier = algorithm, modifier
        self.__qualname__ = f"{algorithm.__qualname__} + modifier"

    def __call__(self) -> _Stack:
        return _Stack([self.algorithm(), self.modifier()])


# --------------------------------------------------------------------------- any kind


def check_component(
    kind: str, component: Any, params: Any = None, max_examples: int | None = None
) -> list[CheckResult]:
    """The contract suite of ``kind`` (algorithm, labeler, backend, device_mapper, modifier,
    environment)."""
    if kind == "algorithm":
        target = component
        if params is not None:
            cls = (
                get_registry().get("algorithm", component)
                if isinstance(component, str)
                else component
            )
            target = cls(params)
        return check_algorithm(target, max_examples=max_examples or 50)
    from alignzoo.testing.environments import check_environment

    suites: dict[str, Callable[..., list[CheckResult]]] = {
        "labeler": check_labeler,
        "backend": check_backend,
        "device_mapper": check_device_mapper,
        "modifier": check_modifier,
        "environment": check_environment,
    }
    if kind not in suites:
        raise UserError(f"unknown kind {kind!r}; expected algorithm or one of {', '.join(suites)}")
    extra = {} if max_examples is None else {"max_examples": max_examples}
    return suites[kind](component, params, **extra)


def assert_contract(
    kind: str, component: Any, params: Any = None, max_examples: int | None = None
) -> list[CheckResult]:
    """Run :func:`check_component` and raise AssertionError listing every failed check."""
    results = check_component(kind, component, params, max_examples)
    failed = [r for r in results if not r.passed]
    if failed:
        report = "\n\n".join(f"[{r.name}] {r.detail}" for r in failed)
        raise AssertionError(f"{len(failed)} {kind} contract check(s) failed:\n\n{report}")
    return results
