"""File-system helpers every stage shares: one atomic writer for files and one for
directories, sha256 digests, the ``--out`` checks and the run-directory lock. Standard library
only.

Atomicity: a file is written to a temporary sibling and renamed over its target
(``os.replace`` is atomic on POSIX and Windows); a directory is built in a temporary sibling
and renamed into place when complete. A crash therefore never leaves a half-written file or a
directory that looks complete (``docs/conventions.md``). The temporary siblings are named
``.NAME.partial-PID-XXXX``: a process killed before it could remove its own is recognised by its
PID, and the next write of the same target removes it (never one of a live process). A write
that fails for a reason the user can fix (full disk, file size limit, read-only target) ends as
a :class:`~pit_deploy.errors.WriteError` naming the target and the cause.

A directory that replaces another (``--force``) is swapped in one step where the system allows
it (``renameat2(RENAME_EXCHANGE)`` on Linux): no reader ever finds the path missing, and the old
directory, now under the temporary name, is removed. Elsewhere it takes two renames, the old one
parked under a partial name of this process (so that a crash in between leaves nothing the next
write does not clean up). Commands that replace a directory or rewrite its manifest take
:func:`lock_target`, a lock beside the directory that outlives its replacement.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..errors import PitError, WriteError, as_write_error

log = logging.getLogger(__name__)
PARTIAL = ".partial-"  #: ``.NAME.partial-PID-XXXX``: a temporary sibling of ``NAME`` being written by PID
LOCK_NAME = ".pit-deploy.lock"  #: the lock file :func:`lock_directory` holds inside a directory
LOCK_SUFFIX = ".pit-deploy.lock"  #: ``.NAME.pit-deploy.lock``: the lock :func:`lock_target` holds beside ``NAME``


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_output_dir(out: str | os.PathLike, force: bool, protect: tuple[str | os.PathLike, ...] = (),
                     owned: bool = False) -> Path:
    """Refuse to overwrite an existing non-empty directory unless ``force``, and refuse an
    ``--out`` that ``--force`` could turn into data loss (:func:`check_replaceable`): with
    ``force`` an existing directory is replaced only when it is a pit-deploy output
    (:func:`pit_deploy_output`) and not a folder inside an export, unless the caller ``owned``
    it (a checkpoint or cache entry of its own).

    Also checks, before any slow work, that ``--out`` can be created: not under a file, and
    in a writable directory.
    """
    out = Path(out)
    if out.is_symlink():
        raise PitError(f"--out {out} is a symbolic link; pass the real directory (pit-deploy never "
                       "replaces a link or what it points to)")
    if out.exists() and not out.is_dir():
        raise PitError(f"--out {out} exists and is not a directory; choose another path")
    check_replaceable(out, protect)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise PitError(f"--out {out} exists and is not empty; pass --force to replace it")
        if not owned:
            check_forceable(out)
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise PitError(f"--out {out} lies under {parent}, which is a file; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PitError(f"--out {out}: {parent} is not writable; choose another path")
    return out


RUN_FORMAT = "pit-deploy-run"  #: the ``format`` of a run directory's ``run.json``
#: the files that mark a directory as pit-deploy's own output, and what they make it
OUTPUT_MARKERS = (("manifest.json", "an export"), ("run.json", "a run or training run"),
                  ("state.json", "a training checkpoint"))


def pit_deploy_output(directory: str | os.PathLike) -> str | None:
    """What pit-deploy output ``directory`` is (``"an export"``, ``"a PIT checkpoint"``, …), or
    ``None`` when it is none: no export manifest, run or training record, and no ``config.json``
    carrying a PIT section (what ``convert`` writes)."""
    directory = Path(directory)
    for name, what in OUTPUT_MARKERS:
        if (directory / name).is_file():
            return what
    return "a PIT checkpoint" if isinstance(_json_object(directory / "config.json").get("pit"), dict) else None


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when there is none (no file, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def check_forceable(out: Path) -> None:
    """Refuse to replace (``--force``) the existing directory ``out`` unless it is a pit-deploy
    output that stands on its own: never a folder nobody can tell is pit-deploy's (the user's
    data), a folder inside an export (an artifact whose export would then fail its digest
    check), or a mount point (which cannot be renamed away)."""
    if os.path.ismount(out):
        raise PitError(f"--out {out} is a mount point, which --force cannot replace (pit-deploy swaps in a new "
                       "directory by renaming); choose a directory inside it")
    parents = Path(out).absolute().parents
    for parent in parents:
        if isinstance(_json_object(parent / "manifest.json").get("artifacts"), list):
            raise PitError(f"--out {out} lies inside the export {parent}; --force would replace a folder of "
                           "that export — choose a directory outside it")
    in_run = any(_json_object(parent / "run.json").get("format") == RUN_FORMAT for parent in parents)
    if pit_deploy_output(out) is None and not in_run:  # a run's own stage folders are the run's
        raise PitError(f"--out {out} exists and is not a pit-deploy output (no manifest.json, run.json or PIT "
                       "config.json); --force replaces only pit-deploy's own outputs — choose a new directory, "
                       "or empty this one yourself")


def check_replaceable(out: str | os.PathLike, protect: tuple[str | os.PathLike, ...] = ()) -> None:
    """Refuse an ``--out`` that is, contains or lies inside a protected path: the current
    directory, the home directory, a filesystem root, or any of ``protect`` (the source model).
    ``--force`` replaces only the directory the user named, never something they did not."""
    target = Path(out).expanduser().resolve()
    if target == Path(target.anchor):
        raise PitError(f"--out {out} is a filesystem root; choose a directory of its own")
    check_apart(out, [("the current directory", Path.cwd()), ("your home directory", Path.home())],
                "refusing to replace it (choose a new directory)", inside_ok=True)
    check_apart(out, [(f"the source {p}", p) for p in protect], "refusing to replace it (choose a new directory)")


def check_apart(out: str | os.PathLike, guarded: Iterable[tuple[str, str | os.PathLike]], refusal: str,
                inside_ok: bool = False, flag: str = "--out") -> None:
    """Refuse an ``out`` (given as ``flag``) that is or contains one of ``guarded`` (``(what,
    path)`` pairs; a path that does not exist, such as ``default`` or a hub id, guards nothing)
    or — unless ``inside_ok`` — lies inside one: what a command reads is never where it writes."""
    target = Path(out).expanduser().resolve()
    for what, raw in guarded:
        if not raw or not Path(raw).expanduser().exists():
            continue
        path = Path(raw).expanduser().resolve()
        if target == path:
            raise PitError(f"{flag} {out} is {what}; {refusal}")
        if path.is_relative_to(target):
            raise PitError(f"{flag} {out} contains {what}; {refusal}")
        if not inside_ok and target.is_relative_to(path):
            raise PitError(f"{flag} {out} lies inside {what}; write the output elsewhere")


def check_output_file(out: str | os.PathLike, flag: str, overwrite: bool = True,
                      inputs: Iterable[str | os.PathLike] = (), make_parents: bool = False) -> Path:
    """Refuse, before any slow work, an output file (given as ``flag``) that cannot or must not
    be written: a directory, one whose directory does not exist (unless ``make_parents``: the
    writer creates it), an existing file unless ``overwrite`` (``--force``), or a path that is,
    contains or lies inside one of ``inputs`` (the export directories a command reads: their
    own files are never overwritten)."""
    path = Path(out)
    if path.is_dir():
        raise PitError(f"{flag} {out} is a directory; name the file to write")
    parent = path.absolute().parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PitError(f"cannot write {out}: its directory {'is a file' if parent.exists() else 'does not exist'}")
    check_apart(out, [(f"the input {p}", p) for p in inputs], "write the output elsewhere", flag=flag)
    if path.exists() and not overwrite:
        raise PitError(f"{flag} {out} exists; pass --force to replace it, or choose another path")
    return path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine). Unknown counts as alive: a temporary
    directory is removed only when its writer is certainly gone."""
    if pid == os.getpid():
        return True
    if os.name == "nt" or pid <= 0:  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def remove_stale_partials(directory: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove the ``.NAME.partial-PID…`` siblings in ``directory`` (of ``name`` only, or of any
    name) whose writer PID is no longer alive: what a killed command left behind (and the
    ``.NAME.old-PID`` directories that replacements by earlier versions could leave). Returns
    what was removed; a partial of a live process is never touched."""
    directory = Path(directory)
    stem = re.escape(name) if name is not None else r".+"
    pattern = re.compile(rf"^\.{stem}(?:{re.escape(PARTIAL)}|\.old-)(\d+)(?:-[^/]*)?$")
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
            log.info("removed %s, left by a process (pid %s) that no longer runs", entry, match.group(1))
        except OSError:  # someone else's, or already gone: never worth failing a command for
            continue
    return removed


@contextlib.contextmanager
def lock_directory(directory: str | os.PathLike, what: str = "run") -> Iterator[Path]:
    """Hold an exclusive lock on ``directory`` (an OS lock on its ``.pit-deploy.lock`` file, which
    records the holder's PID) for the duration of the block. The OS releases it when the process
    exits, however it exits, so a crashed holder never blocks a later one.

    Raises:
        PitError: another process holds the lock (named with its PID).
    """
    path = Path(directory) / LOCK_NAME
    fd = open_lock_file(path)
    try:
        if not _try_lock(fd, path):
            holder = _read_pid(path)
            raise PitError(f"another pit-deploy {what} (pid {holder or 'unknown'}) is using {directory}; wait for it "
                           "to finish, or choose another --out")
        with contextlib.suppress(OSError):  # the PID is for the message of a refused run; the lock holds without it
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


#: flags of a lock file's ``open``: never through a symbolic link (a link planted where the lock
#: goes would make the pid be written into whatever it points to), never inherited by children
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_lock_file(path: Path) -> int:
    """Open (creating it) the lock file ``path`` for :func:`lock_directory` and
    :func:`lock_target`, which truncate it and write their pid into it: so it must be a file of
    this process's own. A symbolic link there (``O_NOFOLLOW``), a directory, a special file, a
    file with other hard links, or one another user owns is refused, untouched: in a shared
    folder (``/tmp``, a group directory, a CI workspace) someone may have planted it to make
    pit-deploy overwrite the file it leads to.

    Raises:
        PitError: ``path`` is not a lock file this process may use (exit 2, naming it).
        WriteError: it cannot be created (permissions, read-only or full file system).
    """
    refusal = (f"{path} is {{what}}, not a pit-deploy lock file; refusing to use it (someone may have put it "
               "there to make pit-deploy overwrite another file): remove it, or choose another --out")
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and path.is_symlink()):
            raise PitError(refusal.format(what="a symbolic link")) from None
        if exc.errno == errno.EISDIR or path.is_dir():
            raise PitError(refusal.format(what="a directory")) from None
        raise as_write_error(exc, path) or exc
    info = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(info.st_mode) else
               f"a file with {info.st_nlink} hard links" if info.st_nlink > 1 else
               f"owned by another user (uid {info.st_uid})"
               if hasattr(os, "geteuid") and info.st_uid != os.geteuid() else None)
    if problem is not None:
        os.close(fd)
        raise PitError(refusal.format(what=problem))
    return fd


def target_lock_path(target: str | os.PathLike) -> Path:
    """The lock file of ``target`` (an export directory): ``.NAME.pit-deploy.lock`` beside it
    (symbolic links resolved, so that every path to one directory names one lock)."""
    target = Path(target).resolve()
    return target.with_name(f".{target.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def lock_target(target: str | os.PathLike, what: str, wait: float = 0.0) -> Iterator[Path | None]:
    """Hold an exclusive lock on ``target`` (a directory that may not exist yet, or may be
    replaced while the lock is held) for the block: an OS lock on the file
    :func:`target_lock_path` beside it, which records the holder's PID and is removed when the
    block ends. The OS releases the lock when the process exits, however it exits; a lock file
    left by a killed holder is taken over.

    ``wait`` seconds: how long to wait for another holder to finish (0: refuse at once). A
    directory whose parent cannot be written (a read-only export) is used without a lock, with a
    warning: nothing can replace it then.

    Raises:
        PitError: another process holds the lock (named with its PID and ``what`` it runs)
            after ``wait`` seconds.
    """
    path = target_lock_path(target)
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = open_lock_file(path)
        except WriteError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                log.warning("cannot lock %s (%s); another command writing it at once would not be detected",
                            target, os.strerror(exc.errno))
                yield None
                return
            raise
        if _try_lock(fd, path):
            if _same_file(fd, path):
                break
            os.close(fd)  # its last holder removed that file: lock the one that replaced it
            continue
        holder = _read_pid(path)
        os.close(fd)
        if time.monotonic() >= deadline:
            raise PitError(f"another pit-deploy command (pid {holder or 'unknown'}) is writing {target}; wait for it "
                           f"to finish, then run the {what} again")
        time.sleep(0.1)
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {what}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the release: a waiter that opened it sees it is gone and retries
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _try_lock(fd: int, path: Path) -> bool:
    """Take an exclusive, non-blocking lock on ``fd``: ``False`` when another process holds it.
    A file system without locks (some network mounts) is used without one, with a warning."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        log.warning("cannot lock %s (%s); two runs into it at once would not be detected", path, exc)
    return True


def _read_pid(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    pid, _, what = text.partition(" ")
    if not pid.isdigit():
        return None
    return f"{pid}, {what}" if what else pid


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, force: bool = False,
                     protect: tuple[str | os.PathLike, ...] = (), lock: str | None = None,
                     owned: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and ``out`` is untouched; a write that
    failed for a reason the user can fix (full disk, file size limit, read-only target) is
    raised as a :class:`~pit_deploy.errors.WriteError` naming ``out``. With ``force`` an
    existing ``out`` is replaced only after the new one is complete, in one step where the
    system allows it (:func:`replace_directory`). Partial directories of ``out`` left by killed
    processes are removed first.

    ``lock`` (the command's name, e.g. ``"export"``): hold :func:`lock_target` on ``out`` for the
    whole block, so that a second command writing ``out`` at the same time is refused (exit 2,
    naming the first) instead of replacing or losing its work; ``out`` is checked again under it.
    ``owned`` (default): the caller decided that ``out`` is its to replace (a checkpoint, a cache
    entry, a folder a command checked with :func:`check_output_dir` before its slow work);
    ``False`` checks again, under the lock, that ``force`` replaces only a pit-deploy output.
    """
    if lock is None:
        with _atomic_directory(out, force, protect, owned) as tmp:
            yield tmp
        return
    out = check_output_dir(out, force, protect, owned).absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _raise_as_write_error(exc, out)
        raise
    with lock_target(out, lock), _atomic_directory(out, force, protect, owned) as tmp:
        yield tmp


@contextlib.contextmanager
def _atomic_directory(out: str | os.PathLike, force: bool, protect: tuple[str | os.PathLike, ...],
                      owned: bool) -> Iterator[Path]:
    out = check_output_dir(out, force, protect, owned).absolute()
    tmp: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out.parent, out.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{PARTIAL}{os.getpid()}-", dir=out.parent))
        yield tmp
        if out.exists():
            replace_directory(tmp, out)
        else:
            tmp.rename(out)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_as_write_error(exc, out, tmp)
        raise


def replace_directory(new: Path, out: Path) -> None:
    """Put the directory ``new`` at ``out`` (which exists) and remove the old ``out``.

    One step where the system can exchange two paths (:func:`exchange_paths`): ``out`` is never
    missing, and the old directory, now at ``new``'s temporary name, is removed. Otherwise two
    renames, the old directory parked as a partial of this process (``.NAME.partial-PID-old``,
    removed here, or by the next write of ``out`` if this process dies in between); a failure of
    the second rename puts the old one back."""
    if exchange_paths(new, out):
        shutil.rmtree(new, ignore_errors=True)
        return
    trash = out.with_name(f".{out.name}{PARTIAL}{os.getpid()}-old")
    if trash.exists():
        shutil.rmtree(trash)
    out.rename(trash)
    try:
        new.rename(out)
    except BaseException:
        with contextlib.suppress(OSError):
            trash.rename(out)
        raise
    shutil.rmtree(trash, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    ``False`` where the system or the file system cannot (then nothing was changed).

    Raises:
        OSError: the exchange was possible but failed (e.g. permissions).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_text_atomic(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; a failed
    write leaves ``path`` as it was and raises a :class:`~pit_deploy.errors.WriteError` naming
    it when the user can fix the cause (full disk, file size limit, read-only target)."""
    path = Path(path)
    tmp: str | None = None
    try:
        remove_stale_partials(path.parent, path.name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{PARTIAL}{os.getpid()}-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        _raise_as_write_error(exc, path)
        raise
    return path


def _raise_as_write_error(exc: BaseException, target: Path, tmp: Path | None = None) -> None:
    """Raise ``exc`` as a :class:`~pit_deploy.errors.WriteError` naming ``target`` when it is a
    write the user can fix; one raised for a file inside ``target``'s temporary sibling ``tmp``
    is said of ``target`` (the partial name means nothing to the user). Returns otherwise."""
    if isinstance(exc, WriteError):
        if tmp is not None and exc.filename and Path(exc.filename).is_relative_to(tmp):
            raise exc.naming(target) from exc
        return
    mapped = as_write_error(exc, target)
    if mapped is not None:
        raise mapped from exc


def finite_or_null(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, ±infinity) replaced by ``None`` and tuples as
    lists, recursively: what a strict JSON parser accepts."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite_or_null(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_null(value) for value in data]
    return data


def json_text(data: Any, **kwargs: Any) -> str:
    """``data`` as strict JSON (RFC 8259): a non-finite float (a figure that could not be
    measured) is ``null``, never the ``NaN``/``Infinity`` that Python's ``json`` writes by default
    and other parsers reject. Every JSON the package prints or writes goes through here."""
    return json.dumps(finite_or_null(data), allow_nan=False, **kwargs)


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """:func:`write_text_atomic` of ``data`` as indented strict JSON (:func:`json_text`) with a
    final newline."""
    return write_text_atomic(path, json_text(data, indent=2) + "\n")


def confined(root: str | os.PathLike, relative: str, what: str) -> Path:
    """``root / relative``, refusing (as a tampered artifact) a path that resolves — after
    following symlinks — outside ``root``."""
    if not isinstance(relative, str) or not relative:
        raise PitError(f"{what}: expected a relative path, got {relative!r}; the manifest is malformed or tampered")
    base = Path(root).resolve()
    path = (base / relative).resolve()
    if not path.is_relative_to(base):
        raise PitError(f"{what} {relative!r} points outside {root}; the artifact was tampered with "
                       "(paths in a manifest must stay inside its directory)")
    return path
