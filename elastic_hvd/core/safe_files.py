"""Files and directories the job did not create itself are hostile until checked.

Why: a job on a shared machine writes into directories another local user may
have made first (a predictable path in ``/tmp``, a shared board), and reads files
another user may have replaced (a symlink to ``/dev/zero``, a FIFO that blocks the
reader for ever, a file of 8 TiB).  Every directory the job creates or is pointed
at (waiting board, status directory, checkpoints) goes through :func:`checked_dir`;
every file it reads back through :func:`open_regular`; every file it writes
through :func:`create_private` or :func:`temp_file`.

What is checked: a directory is created 0700, and an existing one must be owned by
this process's user and not writable by group or others, unless the setting
``ELASTIC_HVD_SHARED_DIRS`` says a shared path is intended (then only files this
user owns are trusted there, and files are created exclusively, never through a
link).  A file read must be a regular file, not a symlink, and no larger than the
reader's cap.  What is not checked: root, or the same user, can do anything; a
file system that lies about owners (some network mounts squash them).
"""

import os
import stat
import tempfile
from typing import IO

from . import config
from .errors import ElasticHvdError

#: What the refusals tell a user who meant a shared path.
_SHARED_HINT = f"set {config.env('shared_dirs')}=1 if a shared path is intended"


class UnsafePathError(ElasticHvdError, PermissionError):
    """A directory or file the job was pointed at is not safe to use (one line: why)."""


def _owner_words(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


def checked_dir(path: str | os.PathLike[str], what: str, shared: bool | None = None) -> str:
    """``path`` as a directory this user may trust, created 0700 (parents as
    ``mkdir -p`` makes them) if missing; :class:`UnsafePathError` naming ``what``
    if it is not a directory, belongs to another user or is writable by group or
    others -- unless ``shared`` (default: the setting ``shared_dirs``)."""
    path = os.fspath(path)
    if shared is None:
        shared = bool(config.read("shared_dirs"))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UnsafePathError(f"{what} {path} is not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.stat(path)
    except OSError as exc:
        raise UnsafePathError(f"{what} {path}: cannot be created or used "
                              f"({exc.strerror or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{what} {path} is not a directory")
    if shared:
        return path
    me = os.geteuid()
    if info.st_uid != me:
        raise UnsafePathError(
            f"{what} {path} belongs to {_owner_words(info.st_uid)}, not to this job's user "
            f"({_owner_words(me)}): refused, another user could read or change what the job "
            f"keeps there ({_SHARED_HINT})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"refused, another user could plant or replace files there (chmod go-w it, or "
            f"{_SHARED_HINT})")
    return path


def open_regular(path: str | os.PathLike[str], max_bytes: int,
                 owned: bool = False) -> IO[bytes]:
    """``path`` opened for reading, if it is a regular file (not a symlink, FIFO,
    device or directory) of at most ``max_bytes``, owned by this user if
    ``owned``.  ``FileNotFoundError`` if missing; :class:`UnsafePathError` saying
    why otherwise.  Never blocks (a FIFO is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; EACCES; ENXIO...
        why = "a symbolic link" if os.path.islink(path) else (exc.strerror or str(exc))
        raise UnsafePathError(f"{path}: refused: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path}: refused: not a regular file")
        if owned and info.st_uid != os.geteuid():
            raise UnsafePathError(f"{path}: refused: it belongs to "
                                  f"{_owner_words(info.st_uid)}, not to this job's user")
        if info.st_size > max_bytes:
            raise UnsafePathError(f"{path}: refused: {info.st_size} bytes, more than the "
                                  f"{max_bytes} such a file may have")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], max_bytes: int, owned: bool = False) -> bytes:
    """The bytes of ``path``, checked as :func:`open_regular` does (and read no further
    than ``max_bytes``, should it grow meanwhile)."""
    with open_regular(path, max_bytes, owned) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePathError(f"{path}: refused: grew past {max_bytes} bytes while read")
    return data


def create_private(path: str | os.PathLike[str], mode: str = "wb") -> IO:
    """A new file at ``path``, 0600, created exclusively (never through a link, never
    over a file that exists: ``FileExistsError``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    return os.fdopen(fd, mode)


def temp_file(directory: str | os.PathLike[str], prefix: str) -> tuple[IO[bytes], str]:
    """A new 0600 file with an unpredictable name in ``directory`` (so that it can
    be renamed over its target atomically) and its path."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
    return os.fdopen(fd, "wb"), path
