"""verifiers tasksets: their tasks as prompts, their in-process rewards as a labeler (the
``verifiers`` extra: ``pip install 'alignzoo[verifiers]'``, in an environment without the
``openenv`` extra, whose pins conflict with it; ``make verifiers-env`` builds one).

``data.train: {verifiers: {taskset: ID, config: {...}, select: {...}}}`` loads the taskset as
verifiers does (``ID`` is an installed package exporting a ``vf.Taskset`` subclass; ``config``
its ``TasksetConfig`` fields; ``select`` verifiers' ``SelectConfig``: include, exclude,
shuffle, seed, skip, limit) and becomes rows with ``prompt`` (the task's prompt: text, or its
messages with the system prompt as a conversation), the task data's own scalar fields (an
``answer`` among them, if it has one), and ``verifiers_source`` / ``verifiers_index`` /
``verifiers_key`` (the spec, the task's position in the selection and its verifiers key).

The ``verifiers`` labeler rebuilds the selection from the spec (once per process), checks the
task's key, writes the response (or an episode's transcript) into a verifiers ``Trace`` and
runs the task's own scoring (``Task.score``): the value is the trace's reward, the weighted sum
of its ``@vf.reward`` functions, each reward and ``@vf.metric`` kept in ``info``.

Only rewards that run in process are supported: a reward or metric that needs a runtime (a
container, a sandbox) or a judge (a model endpoint) cannot run here, and a taskset with one is
refused when its data is opened (``alignzoo validate`` does that before any model loads), not
scored without it. verifiers' own harness episodes (an agent against a model endpoint per
rollout) are not run by alignzoo: its episodes are alignzoo's environments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
from collections.abc import Coroutine
from functools import cache
from typing import TYPE_CHECKING, Any

from alignzoo.errors import UserError
from alignzoo.integrations import require

if TYPE_CHECKING:
    from alignzoo.config.schema import VerifiersSpec

SOURCE_COLUMN = "verifiers_source"
INDEX_COLUMN = "verifiers_index"
KEY_COLUMN = "verifiers_key"
_RESERVED = {"prompt", SOURCE_COLUMN, INDEX_COLUMN, KEY_COLUMN}


def _library() -> Any:
    try:
        return require("verifiers.v1", "verifiers", "verifiers")
    except UserError as exc:
        raise UserError(
            f"{exc} (in an environment without the openenv extra, whose pins conflict with it: "
            "make verifiers-env builds .venv-verifiers)"
        ) from None


def _load(spec: VerifiersSpec, where: str) -> list[Any]:
    """The tasks of ``spec``'s selection, each checked to score offline."""
    vf = _library()
    from pydantic import ValidationError
    from verifiers.v1.utils import loaders

    try:
        config_type = loaders.taskset_config_type(spec.taskset)
    except ModuleNotFoundError as exc:
        raise UserError(f"{where}.taskset: {exc}") from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise UserError(f"{where}.taskset: {spec.taskset!r} is not a taskset: {exc}") from None
    try:
        config = config_type.model_validate({**spec.config, "id": spec.taskset})
    except ValidationError as exc:
        raise UserError(f"{where}.config: {_first_error(exc)}") from None
    try:
        select = vf.SelectConfig.model_validate(spec.select)
    except ValidationError as exc:
        raise UserError(f"{where}.select: {_first_error(exc)}") from None
    try:
        tasks = list(loaders.load_taskset(config).select(select))
    except Exception as exc:  # the taskset's own load() failed
        raise UserError(
            f"{where}: taskset {spec.taskset!r} failed to load: {type(exc).__name__}: {exc}"
        ) from None
    if not tasks:
        raise UserError(f"{where}.select: the selection holds no task")
    _check_offline(tasks[0], f"{where}.taskset")
    return tasks


def _first_error(exc: Any) -> str:
    error = exc.errors()[0]
    at = ".".join(str(part) for part in error["loc"])
    return f"{at}: {error['msg']}" if at else str(error["msg"])


def _needs_runtime(fn: Any) -> bool:
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _check_offline(task: Any, field: str) -> None:
    """Refuse a task whose scoring needs what alignzoo cannot give it here."""
    needs = [
        fn.__name__
        for kind in ("reward", "metric")
        for fn in task.hooks(kind)
        if _needs_runtime(fn)
    ]
    judges = [judge.reward_name for judge in task.plugged_judges()]
    if needs or judges:
        what = ", ".join(
            [f"{name!r} needs a runtime (container or sandbox)" for name in needs]
            + [f"judge {name!r} needs a model endpoint" for name in judges]
        )
        raise UserError(
            f"{field}: {type(task).__name__}'s scoring cannot run in process: {what}; only "
            "tasksets whose rewards run in process are supported"
        )
    if not task.hooks("reward"):
        raise UserError(f"{field}: {type(task).__name__} declares no @vf.reward: nothing to score")


def _prompt(data: Any) -> str | list[dict[str, str]]:
    """The task's prompt as alignzoo reads prompts: text, or messages (a conversation)."""
    prompt = data.prompt
    if isinstance(prompt, str) and data.system_prompt is None:
        return prompt
    messages = []
    if data.system_prompt is not None:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    for message in prompt or []:
        messages.append({"role": message.role, "content": _text(message.content)})
    return messages


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return str(content_text(content) or "")


def generate(spec: VerifiersSpec, field: str) -> list[dict[str, Any]]:
    """The rows of ``spec`` (see the module docstring); ``field`` (``data.train``) starts every
    error message."""
    tasks = _load(spec, f"{field}.verifiers")
    source = spec.model_dump_json()
    base = set(_library().TaskData.model_fields)
    rows = []
    for index, task in enumerate(tasks):
        if task.data.prompt is None:
            raise UserError(
                f"{field}.verifiers: task {index} has no prompt (the user opens its conversation), "
                "which alignzoo cannot sample from"
            )
        own = {
            name: value
            for name, value in task.data.model_dump(mode="json").items()
            if name not in base and name not in _RESERVED and _scalar(value)
        }
        rows.append(
            {
                "prompt": _prompt(task.data),
                **own,
                SOURCE_COLUMN: source,
                INDEX_COLUMN: index,
                KEY_COLUMN: task.key,
            }
        )
    return rows


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


@cache
def _tasks(source: str) -> list[Any]:
    from alignzoo.config.schema import VerifiersSpec

    return _load(VerifiersSpec.model_validate_json(source), "verifiers labeler")


def task_for(source: str, index: int, key: str | None) -> Any:
    """The task a row came from: the selection of ``source`` rebuilt (once per process), its
    ``index``-th task, whose key must be the row's (else the taskset changed since)."""
    tasks = _tasks(source)
    if not 0 <= index < len(tasks):
        raise UserError(
            f"verifiers labeler: task {index} of {len(tasks)}: the taskset changed since the "
            "rows were generated"
        )
    task = tasks[index]
    if key is not None and task.key != key:
        raise UserError(
            f"verifiers labeler: task {index}'s key is {task.key[:12]}, the row's {key[:12]}: "
            "the taskset changed since the rows were generated"
        )
    return task


def trace_for(task: Any, messages: list[dict[str, Any]]) -> Any:
    """A completed verifiers Trace of ``messages`` (the prompt and what the model answered; the
    assistant messages marked as sampled), as the task's rewards read it."""
    _library()
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

    nodes: list[Any] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), str(message.get("content") or "")
        if role == "assistant":
            made: Any = AssistantMessage(content=content)
        elif role == "system":
            made = SystemMessage(content=content)
        elif role == "tool":
            call_id = str(message.get("tool_call_id") or f"call_{i}")
            made = ToolMessage(tool_call_id=call_id, content=content, name=message.get("name"))
        else:
            made = UserMessage(content=content)
        parent = len(nodes) - 1 if nodes else None
        nodes.append(MessageNode(parent=parent, message=made, sampled=role == "assistant"))
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=AgentConfig()),
        nodes=nodes,
        is_completed=True,
        ok=True,
    )


def score(task: Any, messages: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """The task's own scoring of ``messages``: the trace's reward (its rewards' weighted sum)
    and ``{"rewards": {name: value}, "metrics": {name: value}}``."""
    trace = trace_for(task, messages)
    _run(task.score(trace))
    rewards = {name: (None if r is None else r.value) for name, r in trace.rewards.items()}
    info = {"rewards": rewards, "metrics": dict(trace.metrics)}
    return float(trace.reward), json.loads(json.dumps(info, default=float))


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coroutine`` to its end from synchronous code, also from a thread whose event loop
    is running (then on a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
