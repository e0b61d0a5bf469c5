"""Exceptions with exit codes: 2 for what the user can fix, 1 for a failure inside a run."""

from __future__ import annotations

from dataclasses import dataclass


class AlignzooError(Exception):
    """Base of every error alignzoo raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = 1


class UserError(AlignzooError):
    """Bad input the user can fix: a config, a file, a plugin name. The CLI prints it without traceback."""

    exit_code = 2


class PluginLoadError(UserError):
    """A plugin's entry point could not be imported or is not a valid component."""


class UnknownComponentError(UserError):
    """A name in a config that no installed plugin provides."""


class DuplicateComponentError(UserError):
    """Two installed plugins provide a component of the same kind and name."""


class RunError(AlignzooError):
    """A failure inside a running training job (NaN loss, plugin crash, ...)."""

    exit_code = 1


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file: where it is and what is wrong."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.path or '<top level>'}: {self.message}"


class ConfigError(UserError):
    """One or more problems in an experiment file, each located by file, line and dotted path."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        super().__init__("\n".join(str(issue) for issue in issues))


class LabelerUnavailable(Exception):
    """Raised by a labeler when its infrastructure fails (connection refused, HTTP 5xx, 429):
    the samples of that call get the ``error`` outcome and the arm's policy for it (by default
    retried with backoff, then the next labeler of the chain). ``retry_after`` (seconds), when
    the service said so (HTTP 429 / 503 Retry-After), is waited before the next try."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LabelerTimeout(LabelerUnavailable):
    """Raised by a labeler whose own call ran out of time (an HTTP read timeout, say): the
    samples of that call get the ``timeout`` outcome."""
