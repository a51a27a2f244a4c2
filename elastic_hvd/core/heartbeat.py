"""A background thread that keeps Open MPI's failure detector beating.

Open MPI's heartbeat detector only runs inside MPI progress.  Without help, a rank
that computes for longer than the heartbeat timeout outside MPI (a slow first
step, a long batch) is declared dead by peers waiting in a collective.  Open MPI's
own ``mpi_ft_detector_thread`` would fix that but, measured here with Open MPI
5.0.11, it crashed ``MPI_Init`` now and then and hung ``MPI_Finalize`` on 4 ranks.
So this thread drives MPI progress (a cheap ``Iprobe``) a few times per heartbeat
period instead, and stops before MPI is finalized.

It also hosts the optional stall watchdog: a process whose main thread stays
out of every collective for ``stall_timeout`` seconds (a deadlock, an endless
loop) kills itself, turning a silent hang into a crash that the survivors detect
in milliseconds.  SIGSTOP needs no watchdog: a stopped process stops beating.
"""

import atexit
import os
import signal
import sys
import threading
import time


class Heartbeat:
    def __init__(self, MPI, period, stall_timeout=0.0):
        self._comm = MPI.COMM_SELF.Dup()
        self._interval = period / 4
        self._stall_timeout = float(stall_timeout)
        self._stop = threading.Event()
        self._last_activity = time.monotonic()
        self._in_collective = 0
        self._thread = threading.Thread(target=self._loop, name="elastic_hvd-heartbeat",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def enter(self):
        """The main thread starts a collective."""
        self._in_collective += 1

    def leave(self):
        self._in_collective -= 1
        self._last_activity = time.monotonic()

    def _loop(self):
        while not self._stop.wait(self._interval):
            self._comm.Iprobe()
            if (self._stall_timeout and not self._in_collective
                    and time.monotonic() - self._last_activity > self._stall_timeout):
                print(f"elastic_hvd: process {os.getpid()} made no collective call for "
                      f"{self._stall_timeout:.0f}s (ELASTIC_HVD_STALL_TIMEOUT): assuming it "
                      "hangs and killing it so that the other ranks can go on",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def stop(self):
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
