"""Liveness scenarios: busy ranks (GIL held, pure Python), hung ranks, stalls.

    python liveness.py <scenario> <rank> <seconds> [calls]

Every rank allreduces ``calls`` times (default 6); between call 3 and call 4 the
chosen original rank does the scenario's thing for ``seconds``.  Each surviving
rank reports its membership events, a digest of its last result and timings.
"""

import ctypes
import hashlib
import sys
import threading
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import heartbeat


def hold_gil(seconds):
    """One C call that keeps the GIL the whole time (PyDLL does not release it)."""
    ctypes.PyDLL(None).usleep(ctypes.c_uint(int(seconds * 1e6)))


def spin_with_ticks(seconds):
    """Pure-Python work without collectives, telling elastic_hvd it progresses."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for i in range(20000):
            x += i * i
        heartbeat.progress()
    return x


def hang(seconds):
    """No collective, no progress tick (a deadlock, as far as anyone can tell)."""
    time.sleep(seconds)


def raise_beside_a_thread(seconds):
    """An uncaught exception while a non-daemon thread still runs for ``seconds``
    (the interpreter joins such threads before its atexit handlers run)."""
    threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()
    raise ValueError("an application error")


SCENARIOS = {"gil": hold_gil, "tick": spin_with_ticks, "hang": hang, "none": lambda s: None,
             "raise": raise_beside_a_thread}


def main(scenario, rank, seconds, calls="6"):
    comm = core.init()
    rank, seconds, calls = int(rank), float(seconds), int(calls)
    x = (np.arange(1024) % 13 + 100 * (comm.original_id + 1)).astype(np.float32)
    busy = None
    for call in range(calls):
        if call == 3 and (rank < 0 or comm.original_id == rank):
            started = time.monotonic()
            SCENARIOS[scenario](seconds)
            busy = time.monotonic() - started
        result = comm.allreduce(x)
    expected = sum((np.arange(1024) % 13 + 100 * (i + 1)).astype(np.float32) for i in comm.ids)
    report.write(comm.original_id, ids=list(comm.ids), events=[e.as_dict() for e in comm.events],
                 equals_survivor_sum=bool(np.array_equal(result, expected)), busy_s=busy,
                 digest=hashlib.sha256(result.tobytes()).hexdigest())


if __name__ == "__main__":
    main(*sys.argv[1:])
