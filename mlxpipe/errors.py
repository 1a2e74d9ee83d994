"""Every error a user can cause, and the one way each becomes a line of text.

The command line maps them to exit statuses: :class:`UsageError` 2, :class:`ModelError` 3 (:class:`NoBackend`
among them: mlx has no backend here); a :class:`RecordError` fails one record (an ``error`` event) and the run
goes on; a :class:`ConstraintError` is a usage error on the command line and an error line for a record's own
constraint. :func:`first_line` and :func:`failure` make any message one line.
"""

from __future__ import annotations

__all__ = [
    "ConstraintError",
    "ModelError",
    "NoBackend",
    "RecordError",
    "UsageError",
    "failure",
    "first_line",
]


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def failure(exc: BaseException) -> str:
    """An unexpected exception as a one-line message: its type, then its first line."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


class UsageError(Exception):
    """Bad arguments, found before any work is done (exit status 2)."""


class ModelError(Exception):
    """The model could not be resolved, converted or loaded (exit status 3). The message is one line."""

    def __init__(self, message: str) -> None:
        # Keep messages to one line whatever the underlying error said.
        super().__init__(" ".join(str(message).split()))


class NoBackend(ModelError, ImportError):
    """mlx cannot be imported here: on Linux, plain ``mlx`` installed without ``mlx-cpu`` or ``mlx-cuda``.

    A :class:`ModelError` (exit status 3, one line) that is also an :class:`ImportError`, since it is raised
    where mlx is first imported.
    """


class RecordError(ValueError):
    """A record that this model cannot answer (too long, no chat template, …): an error line, not a crash."""


class ConstraintError(ValueError):
    """A schema, regex, grammar or choice list that cannot be used, or an answer that breaks one."""
