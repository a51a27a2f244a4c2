"""The file protocol of checkpoints: unique names, write + fsync, atomic commit, retention.

Why: the writer (the current lowest rank) can die at any instant, and the next
writer takes over with whatever it holds.  So a checkpoint's files never take a
name that exists already or that the committed metadata references: the name
comes from agreed values (a sequence number every rank counts, and the epoch),
and a name that is taken anyway (files left by a writer that died, a job
restarted from the directory) gets a suffix.  A save writes its files, fsyncs
them and the directory, and only then commits by renaming a new
``checkpoint.json`` over the old one (itself fsynced first).  The metadata lists
the newest ``keep`` committed checkpoints; older ones, and the leftovers of
saves that never committed, are deleted only after the commit.  So a crash at
any point leaves the last committed checkpoint, byte for byte, and ``load``
takes the newest one whose files are all there.  A save that fails (a full disk,
a read-only directory) removes what it wrote and raises: the committed
checkpoint is untouched.

The directory is trusted as :func:`~elastic_hvd.core.safe_files.checked_dir`
says (ours, 0700, unless shared directories are allowed); every file is created
0600, exclusively (never through a link), the new metadata under an
unpredictable temporary name; and what is read back must be a regular file of a
bounded size: a symlink, FIFO or device planted in its place is refused, not
followed or waited on.

What it does NOT guarantee: two writers at once (a writer that was declared dead
but still runs, e.g. after SIGSTOP, can still commit or delete); storage that
loses fsynced data, or files changed behind its back beyond a size check (no
content hashes are kept); a directory shared by two jobs.  What is saved is the
caller's business (``parts``); this module knows only file names.
"""

import contextlib
import json
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from elastic_hvd.core import config, safe_files

META = "checkpoint.json"
#: The most bytes checkpoint.json may have (a real one has a few kB).
META_MAX_BYTES = 16 << 20
#: The largest count (sequence number, epoch, step, size) checkpoint.json may hold:
#: far beyond any real one, and short enough for a file name.
COUNT_MAX = 10 ** 15
_OURS = re.compile(r"^ckpt-\d+-e\d+(-\d+)?\.|^\.checkpoint\.json\..*\.tmp$")


def _sync(path: str, directory: bool = False) -> int:
    """fsync ``path`` (not through a link); its size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= COUNT_MAX


class CheckpointFiles:
    """Committed checkpoints in ``directory``; the newest ``keep`` are kept.
    ``counts``: the fields of an entry (besides this module's) that must be
    counts or None, checked when the metadata is read."""

    def __init__(self, directory: str, keep: int = 3, counts: Iterable[str] = ()) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.directory, self.keep, self.counts = directory, keep, tuple(counts)

    @property
    def meta_path(self) -> str:
        return os.path.join(self.directory, META)

    @staticmethod
    def shared() -> bool:
        """Whether the directory may be shared (then only our own files are read)."""
        return bool(config.current().shared_dirs)

    def checked_dir(self) -> str:
        """The directory, created (0700) or checked: see ``safe_files.checked_dir``."""
        return safe_files.checked_dir(self.directory, "checkpoint directory", self.shared())

    def invalid(self, reason: str) -> ValueError:
        """The one error for a checkpoint.json that is not what ``write`` commits."""
        return ValueError(f"{self.meta_path}: {reason}")

    def entries(self) -> list[dict[str, Any]]:
        """The committed checkpoints, newest first ([] when there is none).

        ``ValueError`` naming checkpoint.json if it is not what ``write`` commits:
        not a regular file (a symlink, a FIFO), too large, not JSON, a value of
        another type or size, a file name with a directory in it (reading or
        deleting it would reach outside the directory).
        :class:`~elastic_hvd.core.safe_files.UnsafePathError` if the directory
        is not to be trusted."""
        self.checked_dir()
        try:
            meta = json.loads(safe_files.read_regular(self.meta_path, META_MAX_BYTES,
                                                      owned=self.shared()))
        except FileNotFoundError:
            return []
        except safe_files.UnsafePathError as exc:
            raise self.invalid(str(exc).removeprefix(f"{self.meta_path}: ")) from None
        except (ValueError, RecursionError) as exc:  # not JSON (or not UTF-8)
            raise self.invalid(f"not valid JSON ({exc})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("older", []), list):
            raise self.invalid("not checkpoint metadata")
        newest = {k: v for k, v in meta.items() if k != "older"}
        entries = [newest, *meta.get("older", [])]
        for entry in entries:
            self._check(entry)
        return entries

    def _check(self, entry: object) -> None:
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(files, list):
            raise self.invalid("a checkpoint without its list of files "
                               "(not this layout: written by another version?)")
        if not all(map(_plain_name, files)) or len(set(files)) != len(files):
            raise self.invalid(f"a checkpoint's files are not plain file names in the "
                               f"directory: {files!r}")
        sizes = entry.get("sizes")
        if not (_plain_name(entry.get("name")) and _count(entry.get("seq"))
                and isinstance(sizes, dict) and sorted(sizes) == sorted(files)
                and all(map(_count, sizes.values()))):
            raise self.invalid("a checkpoint's name, sequence number or file sizes are not "
                               f"a file name, a count (0 to {COUNT_MAX}) and one count per "
                               "file")
        for field in self.counts:
            if entry.get(field) is not None and not _count(entry[field]):
                raise self.invalid(f"a checkpoint's {field} is {entry[field]!r}, not a count "
                                   f"(0 to {COUNT_MAX})")

    @staticmethod
    def next_seq(entries: Iterable[dict[str, Any]]) -> int:
        """The sequence number after every committed one (a restarted job goes on from it)."""
        return max((e["seq"] for e in entries), default=-1) + 1

    def new_name(self, seq: int, epoch: int, entries: Iterable[dict[str, Any]]) -> str:
        """``ckpt-<seq>-e<epoch>``, with ``-<n>`` appended while that name is taken."""
        taken = set(os.listdir(self.directory)) | {f for e in entries for f in e["files"]}
        base = name = f"ckpt-{seq:06d}-e{epoch:04d}"
        n = 0
        while any(f.startswith(name + ".") for f in taken):
            n += 1
            name = f"{base}-{n}"
        return name

    def write(self, seq: int, epoch: int, parts: dict[str, tuple[str, Callable[[str], Any]]],
              info: dict[str, Any]) -> dict[str, Any]:
        """Write and commit a checkpoint; returns its entry (as ``entries()`` lists it).

        ``parts`` maps a role to ``(suffix, write)``: ``write(path)`` fills the
        file ``<name>.<suffix>`` (created empty, 0600, just before); the entry
        records its name under the role.  ``info``: more JSON-able fields of the
        entry (e.g. the epoch).  If anything fails before the commit, the files
        this save created are removed (as far as the directory lets us) and the
        error is raised: the committed checkpoint is as it was.
        """
        entries = self.entries()  # (checks the directory)
        name = self.new_name(seq, epoch, entries)
        entry: dict[str, Any] = {"name": name, "seq": seq, **info, "files": []}
        created: list[str] = []
        try:
            for role, (suffix, write) in parts.items():
                entry[role] = f"{name}.{suffix}"
                entry["files"].append(entry[role])
                path = os.path.join(self.directory, entry[role])
                safe_files.create_private(path).close()
                created.append(path)
                write(path)
                self.reached(f"wrote {role}")
            entry["sizes"] = {f: _sync(os.path.join(self.directory, f)) for f in entry["files"]}
            _sync(self.directory, directory=True)
            self.reached("synced")
            kept = [entry, *entries[:self.keep - 1]]
            tmp, path = safe_files.temp_file(self.directory, f".{META}.")
            created.append(path)
            with tmp:
                tmp.write(json.dumps({**entry, "older": kept[1:]}).encode())
                tmp.flush()
                os.fsync(tmp.fileno())
            self.reached("before commit")
            os.replace(path, self.meta_path)  # the commit point
        except BaseException:
            for path in created:
                with contextlib.suppress(OSError):
                    os.remove(path)
            raise
        try:
            _sync(self.directory, directory=True)
        except OSError:  # committed, but not known to be on disk: delete nothing yet
            return entry
        self.reached("committed")
        self._clean(kept, entries[self.keep - 1:])
        return entry

    def _clean(self, kept: Iterable[dict[str, Any]], dropped: Iterable[dict[str, Any]]) -> None:
        """Delete the dropped checkpoints and the leftovers of saves that never committed
        (as far as the directory lets us: the next save tries again)."""
        needed = {f for e in kept for f in e["files"]}
        doomed = {f for e in dropped for f in e["files"]}
        doomed |= {f for f in os.listdir(self.directory) if _OURS.match(f)}
        for f in sorted(doomed - needed):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.directory, f))
            self.reached("removed a file")
        with contextlib.suppress(OSError):
            _sync(self.directory, directory=True)

    def load(self, read: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
        """``read(entry)`` the newest committed checkpoint whose files are all there,
        regular files of the recorded sizes (older ones if it fails); returns the
        entry read, None when there is none.  If none can be read: the error of the
        oldest (a ``ValueError`` naming its file, unless ``read`` raised another)."""
        entries, error = self.entries(), None
        for entry in entries:
            try:
                for f in entry["files"]:
                    self._check_file(f, entry["sizes"][f])
                read(entry)
                return entry
            except Exception as exc:  # noqa: BLE001 -- any unreadable file: try the older one
                error = exc
                warnings.warn(f"checkpoint {entry['name']} unreadable "
                              f"({type(exc).__name__}: {exc}); trying an older one",
                              stacklevel=2)
        if error is not None:
            raise error
        return None

    def _check_file(self, name: str, size: int) -> None:
        path = os.path.join(self.directory, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise ValueError(f"{path}: missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file (a symbolic link, FIFO, device or "
                             "directory in its place)")
        if self.shared() and info.st_uid != os.geteuid():
            raise ValueError(f"{path}: belongs to another user")
        if info.st_size != size:
            raise ValueError(f"{path} has {info.st_size} bytes, not {size}")

    def reached(self, point: str) -> None:
        """Called at each step of ``write``: a crash point for tests; does nothing."""
