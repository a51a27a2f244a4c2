"""A spawned process until it joins the running job (the joiner's side of :mod:`.growth`):
its link to the job (:class:`Invitation`), watched by a thread that ends the process
once the job gives it up, and the ways such a process ends without joining
(:func:`leave_unjoined`); also the messages of the join protocol that both sides
send, with their tags.
"""

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
import traceback
from enum import IntEnum
from typing import Any, NoReturn

import numpy as np

from . import config, heartbeat, mpi_env, signals, timings

#: Tag of a joiner's "ready" message to the lowest rank, on the merged communicator.
READY = 1
#: Tag of the running ranks' verdict when they give a join up: one byte, the reason.
VERDICT = 2


class Verdict(IntEnum):
    """Why the running ranks gave a join up (sent to its joiners as one byte)."""
    ENDED = 1
    CHANGED = 2
    BROKE = 3


#: How the joiners say each verdict.
_REASONS = {Verdict.ENDED: "training ended before it was ready",
            Verdict.CHANGED: "the job's ranks changed while it started (the job starts another "
                             "process for them)",
            Verdict.BROKE: "another process joining with it failed"}
#: Running ranks (the lowest of the merged communicator) that send the verdict.
VERDICT_SENDERS = 3
#: Tag of a joiner's first message to every running rank: its host and identity (pid and
#: start time), right after its merge, so that a stop before it joins is seen (see
#: :func:`hello`).
HELLO = 4
#: Bytes of that message: the pid and the start time (8 each, little-endian), then the
#: host name (NUL-padded).
HELLO_BYTES = 16 + 256


def hello() -> np.ndarray:
    """This process's (identity, host) as a joiner's hello.  Why: Open MPI's detector
    never watches a spawned process, and a member only learns a joiner's pid when it
    joins; a joiner stopped (SIGSTOP) while it starts up would never be ready, and the
    job would stay below its size for good.  With the pid known, the members' watch of
    stopped processes (:mod:`.stopped_peers`) covers it too; with the start time, that
    watch never kills a later process that got the pid (:mod:`.signals`)."""
    message = np.zeros(HELLO_BYTES, dtype=np.uint8)
    message[:16] = np.array(signals.mine(), dtype="<i8").view(np.uint8)
    host = socket.gethostname().encode()[:HELLO_BYTES - 16]
    message[16:16 + len(host)] = np.frombuffer(host, dtype=np.uint8)
    return message


def read_hello(message: np.ndarray) -> tuple[str, signals.Identity]:
    """(host, identity) of a joiner's :func:`hello`."""
    pid, start = (int(v) for v in message[:16].view("<i8"))
    return (bytes(message[16:]).rstrip(b"\0").decode(errors="replace"),
            signals.Identity(pid, start))


class JoinAbandoned(SystemExit):
    """Raised in the main thread of a spawned process that the running job gave up
    before adopting it: the process ends as a program that exits 0 does."""


class Invitation:
    """A spawned process's link to the running job until it joins: the communicator
    merged with it, watched.

    Between its merge and :meth:`.growth.Growth.join` the process runs its program's
    start-up (imports, model, the rehearsal step), which takes seconds to
    minutes.  If the job gives the join up meanwhile (it revokes the
    communicator), a thread notices within ``timings.JOIN_WATCH_PERIOD`` and ends the
    process at once rather than at ``join()``, so that it does not use a host for
    nothing, and above all is gone before the running ranks create communicators
    again: Open MPI 5.0.11 segfaults in a rank that learns of a process's end while
    it activates a communicator (docs/measurements.md).
    The thread raises :class:`JoinAbandoned` in the main thread, at its next
    Python instruction, which then exits the ordinary way (``MPI_Finalize`` at
    exit); the thread never finalizes MPI itself, which the main thread may be
    using.  A main thread inside a call that does not come back to Python (a C
    library's wait) never gets the exception (such a joiner kept mpirun from ending:
    docs/measurements.md).  So a process still here
    ``ELASTIC_HVD_EXIT_GRACE`` seconds later prints its main thread's stack and ends
    itself with SIGKILL (a joiner that dies is no failure of the job).
    """

    def __init__(self, MPI: Any, merged: Any) -> None:
        self.MPI, self.merged = MPI, merged
        # The running ranks' verdict, if they give this process up (see _Pending.close):
        # posted now, so that it completes on arrival, before the revoke that follows it.
        self._verdicts = [np.zeros(1, dtype=np.int8) for _ in range(min(VERDICT_SENDERS,
                                                                         merged.rank))]
        self._verdict_requests = [merged.Irecv(buffer, source=sender, tag=VERDICT)
                                  for sender, buffer in enumerate(self._verdicts)]
        # Its hello to each running rank (the merged communicator's first ranks; the
        # processes of this spawn make up this process's world).  Small: sent eagerly.
        self._hello = hello()
        self._hello_requests = [merged.Isend(self._hello, dest=r, tag=HELLO)
                                for r in range(merged.size - MPI.COMM_WORLD.size)]
        self._stop = threading.Event()
        #: Set when the running job gave this process up (it then exits through JoinAbandoned).
        self.given_up = False
        self._thread = threading.Thread(target=self._watch, args=(MPI, threading.main_thread()),
                                        name="elastic_hvd-join-watch", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before MPI_Finalize (mpi4py's or runtime's)

    def _watch(self, MPI: Any, main: threading.Thread) -> None:
        while not self._stop.wait(timings.JOIN_WATCH_PERIOD):
            try:
                self.merged.Iprobe(0, READY)  # never matches; fails once revoked
            except MPI.Exception:
                if self._stop.is_set():  # join() took the communicator over
                    return
                # print, not logging: the main thread, maybe stuck, may hold a handler's lock
                print(_leaving_line(self._reason(MPI)), file=sys.stderr, flush=True)
                self.given_up = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(main.ident),  # type: ignore[arg-type]  # started: an int
                    ctypes.py_object(JoinAbandoned))
                grace = config.current().exit_grace
                time.sleep(grace)  # the process normally ends meanwhile
                _end_stuck(main, grace)

    def _reason(self, MPI: Any) -> str:
        """Why the job gave this process up: the first verdict received, else both causes."""
        for request, buffer in zip(self._verdict_requests, self._verdicts):
            with contextlib.suppress(MPI.Exception):  # not received: failed by the revoke
                if request.Test() and int(buffer[0]) in _REASONS:
                    return _GIVEN_UP_BECAUSE + _REASONS[Verdict(int(buffer[0]))]
        return GIVEN_UP

    @property
    def comm(self) -> Any:
        """The communicator that stands for the live one until the process joins."""
        return self.merged

    @property
    def initial_size(self) -> int:
        return self.merged.size

    def accept(self) -> Any:
        """Stop watching and hand the merged communicator over (in ``join()``)."""
        self.close()
        return self.merged

    def close(self) -> None:
        """Stop watching (local; idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            # It stops within a watch period, or it already told the main thread to go
            # and waits out ELASTIC_HVD_EXIT_GRACE (the process is exiting: leave it be).
            self._thread.join(timeout=timings.JOIN_WATCH_STOP)
        for request in self._verdict_requests:  # never sent once the job adopts it
            with contextlib.suppress(self.MPI.Exception):  # failed by a revoke: nothing to cancel
                if not request.Test():
                    request.Cancel()
                    request.Wait()
        self._verdict_requests = []
        for request in self._hello_requests:  # delivered long ago, or failed by a revoke
            with contextlib.suppress(self.MPI.Exception):
                request.Wait()
        self._hello_requests = []


_GIVEN_UP_BECAUSE = "the running job gave it up before adopting it: "
GIVEN_UP = (_GIVEN_UP_BECAUSE + "training ended first, or the "
            "job's ranks changed while it started (another process is started for them then)")
_SPAWNED = "spawned to join the running job"
SPARE = "a hot spare"
_leaving = threading.Lock()


def _end_stuck(main: threading.Thread, grace: float) -> None:
    """End a given-up process whose main thread did not stop within ``grace`` seconds,
    loudly: where its main thread is, then SIGKILL (see :class:`Invitation`)."""
    frame = sys._current_frames().get(main.ident)  # type: ignore[arg-type]  # started: an int
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
    # print, not logging: the main thread, stuck, may hold a handler's lock
    print(f"elastic_hvd: process {os.getpid()}, given up by the running job, did not exit within "
          f"{grace:.0f}s: its main thread is inside a call that does not return to Python; "
          f"ending it with SIGKILL.  Its main thread:\n{stack}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _leaving_line(why: str, who: str = _SPAWNED) -> str:
    return f"elastic_hvd: process {os.getpid()}, {who}, exits without joining: {why}"


def leave_unjoined(why: str, *comms: Any, finalize: bool = True,
                   who: str = _SPAWNED) -> NoReturn:
    """End a spawned process that will never join: one line that says why, then
    ``MPI_Finalize`` (after freeing ``comms``) and exit status 0.

    Never a bare ``os._exit(0)`` after ``MPI_Init``: mpirun takes a process that
    exits with status 0 without finalizing for an abnormal termination, prints a
    long notice and kills every process of the job, the running ranks included
    (docs/measurements.md).  ``finalize=False``
    is for a process stuck before its merge, which cannot finalize."""
    _leaving.acquire()  # once: the start-up watchdog's thread or the main thread
    # print, not logging: on the watchdog's thread the main thread may hold a handler's lock
    print(_leaving_line(why, who), file=sys.stderr, flush=True)
    if finalize:
        for comm in comms:
            with contextlib.suppress(Exception):
                comm.Free()
        heartbeat.stop()
        mpi_env.finalize(config.current().connected_finalize_deadline, lambda: os._exit(0))
    os._exit(0)
