"""User-facing errors.

A :class:`PitError` is a problem with the user's input (a path, a model, an option) that the
CLI prints as one line and answers with exit code 2, never a traceback. Code raises it with a
message that names the problem and what to do about it. A :class:`BoundError` is the one kind
that is not a mistake: a step ran and its result missed a documented bound (exit 1).

A write that fails for a reason outside pit-deploy — a full disk, a file size limit, a quota, a
read-only or unwritable target — is a :class:`WriteError`: also exit 2, one line naming the path
and the cause. :func:`as_write_error` recognises such failures in the forms the libraries raise
them (an ``OSError``, torch's ``unexpected pos`` from its zip writer, safetensors' ``os error N``).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

#: errno → (cause, what to do) for the failures of a write that the user, not pit-deploy, can fix
WRITE_ERRNOS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free some space or choose another --out"),
    errno.EFBIG: ("file too large: the file size limit (ulimit -f) was reached",
                  "raise the limit or choose another --out"),
    errno.EACCES: ("permission denied", "check its permissions or choose another path"),
    errno.EPERM: ("operation not permitted", "check its permissions or choose another path"),
    errno.EROFS: ("read-only file system", "choose a writable location"),
}
if hasattr(errno, "EDQUOT"):  # not on every platform
    WRITE_ERRNOS[errno.EDQUOT] = ("disk quota exceeded", "free some space or choose another --out")
#: messages of writers that lose the errno (torch's zip writer) and of writers that only quote it
_STREAM_WRITER = re.compile(r"unexpected pos|PytorchStreamWriter failed|file write failed|iostream error")
_QUOTED_ERRNO = re.compile(r"os error (\d+)")


#: whether the code running now was called by the command line (its messages name flags)
_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("pit_deploy_command_line", default=False)
#: a command-line flag in a message: ``--calib-tokens``, ``--no-pit-correction``
_FLAG = re.compile(r"(?<![\w-])--(no-)?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """What runs inside was called by the command line: messages keep their flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def in_keyword_terms(message: str, switches: frozenset[str] = frozenset()) -> str:
    """``message`` as a Python caller reads it: each ``--flag`` becomes the keyword argument that
    sets it — ``--calib-tokens`` → ``calib_tokens``, ``--force`` → ``force=True`` (a name in
    ``switches``, the call's on/off options), ``--no-pit-correction`` → ``pit_correction=False``."""
    def keyword(match: re.Match[str]) -> str:
        name = match.group(2).replace("-", "_")
        if match.group(1):
            return f"{name}=False"
        return f"{name}=True" if name in switches else name

    return _FLAG.sub(keyword, message)


def speak_python(exc: PitError, switches: frozenset[str] = frozenset()) -> None:
    """Put ``exc``'s message in keyword terms (:func:`in_keyword_terms`) unless the command line
    called: the same error reads ``pass --force`` in a terminal and ``pass force=True`` in Python."""
    if not _COMMAND_LINE.get() and exc.args and isinstance(exc.args[0], str):
        exc.args = (in_keyword_terms(exc.args[0], switches), *exc.args[1:])


class PitError(Exception):
    """A user mistake or unusable input; the CLI prints ``error: <message>`` and exits 2."""

    exit_code: int = 2


class BoundError(PitError):
    """A result that ran and missed a bound the tool documents (a conversion that lost too much
    held-out loss): ``error: <message>`` with the figures, exit 1 like a failed verification,
    and nothing written. ``figures`` carries the measured values for a program."""

    exit_code: int = 1

    def __init__(self, message: str, **figures: float):
        super().__init__(message)
        self.figures = figures


class WriteError(PitError, OSError):
    """A write that failed for a reason outside pit-deploy (full disk, file size limit, quota,
    permissions, read-only file system). A :class:`PitError` (exit 2, one line) and still an
    ``OSError`` with its ``errno``, so code that already tolerates unwritable locations (the
    GGUF cache) keeps doing so."""

    def __init__(self, message: str, err: int | None = None, path: str | os.PathLike | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.errno, self.filename, self.message = err, None if path is None else str(path), message
        self.detail = detail or message  #: the cause and what to do, without the path

    def naming(self, path: str | os.PathLike) -> "WriteError":
        """The same failure, said of ``path`` (the target whose temporary sibling failed)."""
        return WriteError(f"cannot write {path}: {self.detail}", self.errno, path, self.detail)

    def __str__(self) -> str:
        return self.message


def as_write_error(exc: BaseException, path: str | os.PathLike | None = None,
                   under: str | os.PathLike | None = None) -> WriteError | None:
    """``exc`` as a :class:`WriteError`, or ``None`` when it is not the failure of a write the
    user can fix. It names ``path`` (the target an atomic writer was writing), else the path the
    error names, else the directory ``under`` which the work was writing.

    The CLI's last-resort handler calls this before treating an exception as an internal error,
    so a full disk is ``error: …: no space left on device …`` (exit 2), not a traceback."""
    if isinstance(exc, WriteError):
        return exc
    if isinstance(exc, PitError) or not isinstance(exc, Exception):
        return None
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain and len(chain) < 8:
        chain.append(link)
        link = link.__cause__ or link.__context__
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno in WRITE_ERRNOS), None)
    named = next((e.filename for e in chain if isinstance(e, OSError) and e.filename), None)
    if code is None:
        quoted = [int(m.group(1)) for e in chain for m in [_QUOTED_ERRNO.search(str(e))] if m]
        code = next((c for c in quoted if c in WRITE_ERRNOS), None)
    where = path if path is not None else named if named is not None else under
    # an atomic writer knows it was writing ``path``; elsewhere (a read may fail the same way) the
    # message names the path the error names, without claiming it was a write
    subject = (f"cannot write {path}" if path is not None else str(named) if named is not None else
               f"a write under {under} failed" if under is not None else "a write failed")
    if code is None:
        if not any(_STREAM_WRITER.search(str(e)) for e in chain):
            return None
        code = _probable_cause(where)
    if code is None:  # a stream writer failed and neither the disk nor a limit explains it
        detail = f"the write failed ({exc}); check the disk, or choose another --out"
        return WriteError(f"{subject}: {detail}", errno.EIO, where, detail)
    cause, todo = WRITE_ERRNOS[code]
    detail = f"{cause} ({errno.errorcode.get(code, code)}); {todo}"
    return WriteError(f"{subject}: {detail}", code, where, detail)


def _probable_cause(path: str | os.PathLike | None) -> int | None:
    """Why a write whose errno was lost (torch's zip writer) failed: a (nearly) full disk under
    ``path``, else a file size limit on this process, else unknown."""
    if path is not None:
        probe = Path(path).absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            if shutil.disk_usage(probe).free < 16 * 2**20:
                return errno.ENOSPC
        except OSError:
            pass
    try:
        import resource

        if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            return errno.EFBIG
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        pass
    return None
