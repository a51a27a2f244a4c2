"""Liveness: MPI progress that needs no GIL, and a stall watchdog that counts progress.

**Heartbeats without the GIL.** Open MPI's heartbeat detector (``mpi_ft_detector``)
sends and checks heartbeats only while something drives MPI progress. A Python
thread calling ``Iprobe`` would need the GIL, so a rank inside a long C call that
holds the GIL (a big ``re`` match, a C extension that never releases it) would stop
beating and be evicted -- and SIGKILLed by the fence -- although alive (docs/liveness.md).
Open MPI's own ``mpi_ft_detector_thread`` is unusable in 5.0.11 (it crashes
``MPI_Init`` now and then and hangs ``MPI_Finalize``; see docs/liveness.md). So
:class:`NativeProgress` builds the progress loop out of native parts only: a private
libevent base with a persistent timer whose callback is ``opal_progress`` itself,
run by ``event_base_loop`` through ctypes. ctypes releases the GIL for the duration
of a foreign call, and that call only returns when we stop it: the loop sleeps in
``epoll_wait`` and calls ``opal_progress`` every ``period / 10`` without ever
touching Python. A stopped (SIGSTOP) or frozen process stops beating, which is what
the detector is for.

**Never beside a collective.**  The loop is paused while the main thread is inside
a collective (``with heartbeat:``, :class:`Heartbeat` as a context manager), which drives
progress itself.  Open MPI 5.0.11's agreement (ERA) is not safe against
``opal_progress`` running in two threads at once: now and then an agreement
returns a value that is not the AND of the values given (workarounds.TABLE
'paused_progress'; how often: docs/measurements.md).
Pausing is ``event_del``, which waits for a callback that is running (libevent's
pthreads locking is switched on for that), and ``event_add`` to resume.  Neither
may wake the loop's thread: libevent wakes it (a write to an eventfd, and on a busy
machine a context switch that preempts a rank) when an added timer becomes the
earliest one, which a lone progress timer always is.  So a second, persistent
timer of the same period that does nothing stays armed: the loop already wakes
within one period, the progress timer re-added at ``now + period`` is never the
earliest, and a pause and resume are two lock-protected heap operations.

**Stall watchdog** (``stall_timeout`` > 0, off by default): a rank that made no
*progress* -- no collective and no :func:`progress` tick -- for ``stall_timeout``
seconds while at least one other rank is waiting for it in a collective is
assumed to hang (a deadlock, an endless loop); it prints one line to stderr and
SIGKILLs itself, which the others detect in milliseconds and repair.  A rank
waiting inside a collective is never "stalled".  When *no* rank waits (the whole
job is busy, or the whole job hangs), killing would end the job without helping
anyone: the rank prints a warning instead and is not killed.  Ranks tell each
other that they wait on a :class:`WaitingBoard` -- files, not MPI: the watchdog
never drives MPI progress beside the main thread (see the board's doc).  The
watchdog is Python, so it needs the GIL: a rank that hangs *holding* the GIL
cannot be killed by its watchdog; its heartbeats go on.
"""

import atexit
import ctypes
import hashlib
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from . import config, mpi_env, process, safe_files, timings, workarounds
from .errors import ElasticHvdError
from ..log import get_logger

_log = get_logger(__name__)


def progress() -> None:
    """Tell the stall watchdog that this rank makes progress (cheap; any thread).

    Call it from a training loop that computes for longer than the stall timeout
    between collectives.  Collectives count as progress by themselves.
    """
    heartbeat = process.runtime().heartbeat
    if heartbeat is not None:
        heartbeat.tick()


def stop() -> None:
    """Stop this process's heartbeat, if one runs (before MPI_Finalize)."""
    heartbeat = process.runtime().heartbeat
    if heartbeat is not None:
        heartbeat.stop()


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


_EV_PERSIST = 0x10
_EVLOOP_NO_EXIT_ON_EMPTY = 0x04  # libevent >= 2.1.2


class NativeProgress:
    """Calls Open MPI's ``opal_progress`` every ``interval`` seconds from native code.

    Raises OSError/AttributeError where the libraries are not Open MPI's (the
    caller then falls back to a Python thread).
    """

    def __init__(self, interval: float) -> None:
        pal_path = mpi_env.loaded_library("libopen-pal.so")
        ev_path = mpi_env.loaded_library("libevent_core")
        if not pal_path or not ev_path:
            raise OSError("libopen-pal / libevent_core are not loaded (not Open MPI?)")
        pal, ev = ctypes.CDLL(pal_path), ctypes.CDLL(ev_path)
        threads = mpi_env.loaded_library("libevent_pthreads") or ev_path.replace(
            "libevent_core", "libevent_pthreads")
        if ctypes.CDLL(threads).evthread_use_pthreads() != 0:  # event_del then waits for
            raise OSError("evthread_use_pthreads failed")    # a running callback (pause)
        ev.event_base_new.restype = ctypes.c_void_p
        ev.event_new.restype = ctypes.c_void_p
        ev.event_new.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_short,
                                 ctypes.c_void_p, ctypes.c_void_p]
        ev.event_add.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timeval)]
        for name in ("event_base_loopbreak", "event_base_free", "event_free", "event_del"):
            getattr(ev, name).argtypes = [ctypes.c_void_p]
        self._ev = ev
        self._base = ev.event_base_new()
        if not self._base:
            raise OSError("event_base_new failed")
        # opal_progress(void) as the event callback (fd, events, arg): on the C ABIs
        # we run on, extra arguments in registers are simply ignored by the callee.
        callback = ctypes.cast(pal.opal_progress, ctypes.c_void_p)
        self._event = ev.event_new(self._base, -1, _EV_PERSIST, callback, None)
        # The timer that keeps the loop waking (module doc): its callback returns a
        # constant string and touches nothing.
        self._awake = ev.event_new(self._base, -1, _EV_PERSIST,
                                   ctypes.cast(ev.event_get_version, ctypes.c_void_p), None)
        seconds = max(float(interval), timings.PROGRESS_MIN_INTERVAL)
        self._tv = _Timeval(int(seconds), int((seconds - int(seconds)) * 1e6))
        self._tv_ref = ctypes.byref(self._tv)  # made once: resume() runs at every collective
        for event in (self._awake, self._event):  # the awake timer first: it leads
            if not event or ev.event_add(event, self._tv_ref) != 0:
                raise OSError("could not arm the progress timers")
        # The whole life of this thread is one foreign call: the GIL is released.
        # EVLOOP_NO_EXIT_ON_EMPTY: should the loop ever be left without an event, it
        # must wait for one, not return for good.
        ev.event_base_loop.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._thread = threading.Thread(target=ev.event_base_loop,
                                        args=(self._base, _EVLOOP_NO_EXIT_ON_EMPTY),
                                        name="elastic_hvd-progress", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """No ``opal_progress`` from this loop until :meth:`resume` (once a callback
        that is running has returned)."""
        self._ev.event_del(self._event)

    def resume(self) -> None:
        self._ev.event_add(self._event, self._tv_ref)

    def stop(self) -> None:
        if self._base is None:
            return
        self._ev.event_base_loopbreak(self._base)  # seen at the next timer at the latest
        self._thread.join(timings.PROGRESS_STOP_WAIT)
        if not self._thread.is_alive():
            self._ev.event_free(self._event)
            self._ev.event_free(self._awake)
            self._ev.event_base_free(self._base)
        self._base = None


class _PythonProgress:
    """Fallback for an MPI that is not Open MPI: Iprobe from a Python thread (needs the GIL)."""

    def __init__(self, MPI: Any, interval: float) -> None:
        self._comm = MPI.COMM_SELF.Dup()
        self._stop = threading.Event()
        self._paused = threading.Lock()  # held by the main thread during a collective
        self._thread = threading.Thread(target=self._loop, args=(interval,),
                                        name="elastic_hvd-progress", daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._paused:
                self._comm.Iprobe()

    def pause(self) -> None:
        self._paused.acquire()

    def resume(self) -> None:
        self._paused.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()


class WaitingBoard:
    """Where the processes of a job say that they wait inside a collective: one file
    each in a directory they share, its modification time the last time it said so.

    Files, not MPI messages: Open MPI 5.0.11's agreement is not safe beside
    ``opal_progress`` in a second thread (module doc), and the watchdog's own
    ``Iprobe``/``Isend`` on a communicator of its own were just that.  Strict mode
    caught it in the whole-job-stall test: all four ranks agreed ``0x44000c08`` where
    each had given ``0x66311d7b``.  With the board only the main thread, or the
    progress loop while the main thread is out of MPI, ever drives MPI.

    The directory (``path``): the setting ``ELASTIC_HVD_WAITING_BOARD`` if given --
    a process sets it for the processes it spawns, which therefore share the board --
    else ``waiting`` in elastic-hvd-run's status directory (shared by every host
    when ``$TMPDIR`` is, as the status files need), else mpirun's session directory
    on this host (plain mpirun; it goes with the job).  ``None``: no peers to tell
    (a process started without mpirun).

    A word on the board kills a rank, so the board trusts nothing it did not make
    (another user's fake file killed both ranks of a healthy job; a planted symlink
    made ``touch`` create files where the link pointed): the directory is a
    :func:`.safe_files.checked_dir`; this process's file has an unpredictable name,
    is created exclusively (never through a link) and refreshed through its open
    descriptor; and a file counts only if it is a regular file of this user whose
    name starts with the job's id (``job``, see :meth:`job_id`; without one, this
    process's own), so that two jobs sharing a board, or mpirun's own files in its
    session directory, never speak for each other.
    """

    ENV = config.env("waiting_board")

    def __init__(self, path: str | os.PathLike[str] | None, job: str = "") -> None:
        self.path = Path(path) if path else None
        me = f"{socket.gethostname()}-{os.getpid()}"
        self.prefix = f"{job or me}."
        self._mine: IO[bytes] | None = None  # this process's file, open
        self._mine_path = self._mine_name = ""
        if self.path is not None:
            what = f"waiting board ({self.ENV})"
            self.path = Path(safe_files.checked_dir(self.path, what))
            try:
                self._mine, self._mine_path = safe_files.temp_file(self.path,
                                                                   f"{self.prefix}{me}.")
            except OSError as exc:
                raise ElasticHvdError(f"{what} {self.path}: cannot create this process's "
                                      f"file there ({exc.strerror or exc})") from None
            self._mine_name = os.path.basename(self._mine_path)
            os.utime(self._mine.fileno(), (0, 0))  # it has said nothing yet
            os.environ[self.ENV] = str(self.path)  # for the processes this one spawns

    @staticmethod
    def job_id(environ: Mapping[str, str] = os.environ) -> str:
        """What every process of this job, spawned ones included, has in common: the
        PMIx namespace of mpirun's first job (a spawned job's is ``<same>@2``...), as
        a short hash (a name part of fixed length and characters); ``""`` without one."""
        namespace = environ.get("PMIX_NAMESPACE", "").rsplit("@", 1)[0]
        return hashlib.sha256(namespace.encode()).hexdigest()[:16] if namespace else ""

    @classmethod
    def of_job(cls, chosen: str | None = None,
               environ: Mapping[str, str] = os.environ) -> "WaitingBoard":
        """The board at ``chosen`` (the setting), else the job's (see above)."""
        job = cls.job_id(environ)
        if chosen:
            return cls(chosen, job)
        status_dir = config.read("status_dir", environ)
        if status_dir:
            return cls(Path(status_dir) / "waiting", job)
        return cls(environ.get("PMIX_SERVER_TMPDIR"), job)

    def say_waiting(self) -> None:
        if self._mine is not None:
            os.utime(self._mine.fileno())  # the file we made, whatever its name now is

    def others_waited_within(self, seconds: float) -> bool:
        """Whether another process of this job said in the last ``seconds`` that it
        waits (see the class doc for which files count)."""
        if self.path is None:
            return False
        since, me = time.time() - seconds, os.geteuid()
        with os.scandir(self.path) as entries:
            for entry in entries:
                if not entry.name.startswith(self.prefix) or entry.name == self._mine_name:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile: that process has ended
                    continue
                if stat.S_ISREG(info.st_mode) and info.st_uid == me and info.st_mtime >= since:
                    return True
        return False

    def leave(self) -> None:
        if self._mine is not None:
            self._mine.close()
            self._mine = None
            Path(self._mine_path).unlink(missing_ok=True)


class Heartbeat:
    """GIL-free MPI progress plus the optional stall watchdog (see module doc).

    ``board``: the directory where the watchdog says that this process waits, and
    hears that others do (``ELASTIC_HVD_WAITING_BOARD``; see :class:`WaitingBoard`).
    ``who``: what the watchdog's lines call this process ("rank R ..."), asked when it
    speaks; its owner knows the rank, the heartbeat does not.
    """

    def __init__(self, MPI: Any, period: float, stall_timeout: float | None = 0.0,
                 board: str | None = None,
                 who: Callable[[], str] = lambda: f"process {os.getpid()}") -> None:
        self._who = who
        self._stall_timeout = float(stall_timeout or 0.0)
        self._last_progress = time.monotonic()
        self._in_collective = 0
        # When the outermost collective started: set before _in_collective counts it,
        # so that the watchdog, which reads both, never sees a count without its start.
        self._entered = self._last_progress
        self._stop = threading.Event()
        # The board first: refused (UnsafePathError, one line), it raises before any
        # thread of ours runs, and init() fails on every rank rather than run unwatched.
        self._board = WaitingBoard.of_job(board) if self._stall_timeout > 0 else None
        interval = period / timings.PROGRESS_WAKEUPS_PER_PERIOD
        try:
            self._progress: NativeProgress | _PythonProgress = NativeProgress(interval)
            self.native = True
            workarounds.used("native_progress")
        except (OSError, AttributeError) as exc:
            _log.warning(f"elastic_hvd: no GIL-free MPI progress ({exc}); a rank that holds the "
                         "GIL longer than the heartbeat timeout will be declared dead")
            self._progress = _PythonProgress(MPI, interval)
            self.native = False
        workarounds.used("paused_progress")
        self._watchdog = None
        if self._board is not None:
            self._watchdog = threading.Thread(target=self._watch, args=(self._board,),
                                              name="elastic_hvd-watchdog", daemon=True)
            self._watchdog.start()
        atexit.register(self.stop)

    # -- what the main thread tells us --------------------------------------------
    # ``with heartbeat:`` -- a collective, or a transaction of several
    def __enter__(self) -> None:
        """The main thread starts a collective (that is progress); the progress loop
        pauses until the outermost one ends (see module doc)."""
        now = time.monotonic()
        if self._in_collective == 0:
            self._entered = now
            self._progress.pause()
        self._last_progress = now
        self._in_collective += 1

    def __exit__(self, *exc: object) -> None:
        self._in_collective -= 1
        self._last_progress = time.monotonic()
        if self._in_collective == 0:
            self._progress.resume()

    def tick(self) -> None:
        self._last_progress = time.monotonic()

    # -- the watchdog ---------------------------------------------------------------
    def _watch(self, board: WaitingBoard) -> None:
        last_told, warned = 0.0, False
        stall, say_after = self._stall_timeout, timings.STALL_SAY_AFTER
        poll = min(timings.STALL_POLL, stall / timings.STALL_POLLS)
        while not self._stop.wait(poll):
            now = time.monotonic()
            if (self._in_collective and now - self._entered > min(say_after, stall / 2)
                    and now - last_told >= min(say_after, stall / 3)):
                last_told = now
                board.say_waiting()
            idle = now - self._last_progress
            if self._in_collective or idle <= self._stall_timeout:
                warned = False
                continue
            who = self._who()
            # print, not logging: the main thread, hung, may hold a handler's lock
            if board.others_waited_within(timings.STALL_BOARD_POLLS * poll
                                          + timings.STALL_BOARD_SLACK):
                print(f"elastic_hvd: {who} made no progress (no collective, no "
                      f"heartbeat.progress()) for {idle:.1f}s > stall timeout "
                      f"{self._stall_timeout:g}s while other ranks wait for it: assuming it "
                      "hangs and killing it so that the others can go on",
                      file=sys.stderr, flush=True)
                time.sleep(timings.LAST_LINE_DELAY)  # the launcher forwards the line
                os.kill(os.getpid(), signal.SIGKILL)
            elif not warned:
                warned = True
                print(f"elastic_hvd: {who} made no progress for {idle:.1f}s > stall timeout "
                      f"{self._stall_timeout:g}s, but no other rank is waiting for it (the "
                      "whole job is busy or stalled): not killing it",
                      file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop the watchdog and the progress loop (before MPI is finalized)."""
        self._stop.set()
        if self._watchdog is not None and self._watchdog.is_alive() \
                and threading.current_thread() is not self._watchdog:
            self._watchdog.join()
        if self._board is not None:
            self._board.leave()
        self._progress.stop()
        rt = process.runtime()
        if rt.heartbeat is self:
            rt.heartbeat = None

