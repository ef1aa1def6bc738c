"""User-facing errors.

A :class:`PitError` is a problem with the user's input (a path, a model, an option) that the
CLI prints as one line and answers with exit code 2, never a traceback. Code raises it with a
message that names the problem and what to do about it.
"""

from __future__ import annotations


class PitError(Exception):
    """A user mistake or unusable input; the CLI prints ``error: <message>`` and exits 2."""

    exit_code: int = 2
