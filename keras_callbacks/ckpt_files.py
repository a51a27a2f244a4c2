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
takes the newest one whose files are all there.

What it does NOT guarantee: two writers at once (a writer that was declared dead
but still runs, e.g. after SIGSTOP, can still commit or delete); storage that
loses fsynced data, or files changed behind its back beyond a size check (no
content hashes are kept); a directory shared by two jobs.  What is saved is the
caller's business (``parts``); this module knows only file names.
"""

import json
import os
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

META = "checkpoint.json"
_OURS = re.compile(r"^ckpt-\d+-e\d+(-\d+)?\.|^\.checkpoint\.json\..*\.tmp$")


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name


class CheckpointFiles:
    """Committed checkpoints in ``directory``; the newest ``keep`` are kept."""

    def __init__(self, directory: str, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.directory, self.keep = directory, keep

    @property
    def meta_path(self) -> str:
        return os.path.join(self.directory, META)

    def entries(self) -> list[dict[str, Any]]:
        """The committed checkpoints, newest first ([] when there is none).

        ``ValueError`` naming checkpoint.json if it is not what ``write`` commits,
        e.g. a file name with a directory in it: reading or deleting it would reach
        outside the directory."""
        try:
            with open(self.meta_path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            return []
        except (ValueError, RecursionError) as exc:  # not JSON (or not UTF-8)
            raise ValueError(f"{self.meta_path}: not valid JSON ({exc})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("older", []), list):
            raise ValueError(f"{self.meta_path}: not checkpoint metadata")
        newest = {k: v for k, v in meta.items() if k != "older"}
        entries = [newest, *meta.get("older", [])]
        for entry in entries:
            files = entry.get("files") if isinstance(entry, dict) else None
            if not isinstance(files, list):
                raise ValueError(f"{self.meta_path}: a checkpoint without its list of files "
                                 "(not this layout: written by another version?)")
            if not all(map(_plain_name, files)):
                raise ValueError(f"{self.meta_path}: a checkpoint's files are not plain file "
                                 f"names in the directory: {files!r}")
        return entries

    @staticmethod
    def next_seq(entries: Iterable[dict[str, Any]]) -> int:
        """The sequence number after every committed one (a restarted job goes on from it)."""
        return max((e.get("seq", -1) for e in entries), default=-1) + 1

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

        ``parts`` maps a role to ``(suffix, write)``: ``write(path)`` creates the
        file ``<name>.<suffix>``; the entry records its name under the role.
        ``info``: more JSON-able fields of the entry (e.g. the epoch).
        """
        os.makedirs(self.directory, exist_ok=True)
        entries = self.entries()
        name = self.new_name(seq, epoch, entries)
        entry: dict[str, Any] = {"name": name, "seq": seq, **info, "files": []}
        for role, (suffix, write) in parts.items():
            entry[role] = f"{name}.{suffix}"
            entry["files"].append(entry[role])
            write(os.path.join(self.directory, entry[role]))
            self.reached(f"wrote {role}")
        entry["sizes"] = {}
        for f in entry["files"]:
            path = os.path.join(self.directory, f)
            _fsync(path)
            entry["sizes"][f] = os.path.getsize(path)
        _fsync(self.directory, directory=True)
        self.reached("synced")
        kept = [entry, *entries[:self.keep - 1]]
        tmp = os.path.join(self.directory, f".{META}.{name}.tmp")
        with open(tmp, "w") as f:
            json.dump({**entry, "older": kept[1:]}, f)
            f.flush()
            os.fsync(f.fileno())
        self.reached("before commit")
        os.replace(tmp, self.meta_path)  # the commit point
        _fsync(self.directory, directory=True)
        self.reached("committed")
        self._clean(kept, entries[self.keep - 1:])
        return entry

    def _clean(self, kept: Iterable[dict[str, Any]], dropped: Iterable[dict[str, Any]]) -> None:
        """Delete the dropped checkpoints and the leftovers of saves that never committed."""
        needed = {f for e in kept for f in e["files"]}
        doomed = {f for e in dropped for f in e["files"]}
        doomed |= {f for f in os.listdir(self.directory) if _OURS.match(f)}
        for f in sorted(doomed - needed):
            try:
                os.remove(os.path.join(self.directory, f))
            except FileNotFoundError:
                pass
            self.reached("removed a file")
        _fsync(self.directory, directory=True)

    def load(self, read: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
        """``read(entry)`` the newest committed checkpoint whose files are all there
        (older ones if it fails); returns the entry read, None when there is none."""
        entries, error = self.entries(), None
        for entry in entries:
            try:
                for f in entry["files"]:
                    size = os.path.getsize(os.path.join(self.directory, f))
                    if size != entry.get("sizes", {}).get(f, size):
                        raise ValueError(f"{f} has {size} bytes, not {entry['sizes'][f]}")
                read(entry)
                return entry
            except Exception as exc:  # noqa: BLE001 -- any unreadable file: try the older one
                error = exc
                warnings.warn(f"checkpoint {entry.get('name', entry['files'])} unreadable "
                              f"({type(exc).__name__}: {exc}); trying an older one",
                              stacklevel=2)
        if error is not None:
            raise error
        return None

    def reached(self, point: str) -> None:
        """Called at each step of ``write``: a crash point for tests; does nothing."""
