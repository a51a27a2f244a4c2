"""How a rank's job ends, for the exit-status table (tests/test_exit_paths.py).

    python exit_status.py <case> [exit code]

Every rank runs a few resilient collectives, then ends as the case says.  Ranks that
get through the collectives report their view (see report.py); the faults that kill a
rank mid-job come from ELASTIC_HVD_FAULTS (the test's plan).
"""

import os
import signal
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import runtime

COLLECTIVES = 6

case = sys.argv[1]
comm = core.init()
if case == "stall":  # every rank: no progress for longer than --stall-timeout, nobody waits
    time.sleep(6)
if case == "stall_one" and comm.original_id == 1:  # the others wait for it in a collective
    time.sleep(60)
if case == "run_on":  # say who it is, then train on for a minute (mpirun is killed meanwhile)
    report.write(comm.original_id, pid=os.getpid())
    end = time.monotonic() + 60
    while time.monotonic() < end:
        comm.allreduce(np.ones(1024, dtype=np.float32))
        time.sleep(0.01)
    sys.exit(0)
try:
    for _ in range(COLLECTIVES):
        comm.allreduce(np.ones(1024, dtype=np.float32))
except core.RanksBelowMinimumError:
    runtime.exit_with(int(sys.argv[2]))  # as keras_callbacks' ElasticCheckpoint does
report.write(comm.original_id, ids=list(comm.ids), pid=os.getpid())
if case == "exit":
    sys.exit(int(sys.argv[2]))
if case == "one_exits" and comm.original_id == 1:
    sys.exit(int(sys.argv[2]))
if case == "all_killed":
    comm.barrier()  # everyone is done, then every rank dies
    os.kill(os.getpid(), signal.SIGKILL)
if case == "left_then_others_lost":
    if comm.original_id == 3:
        sys.exit(0)  # leaves early (as a SIGTERM handler does): the others train on ...
    for _ in range(COLLECTIVES):
        comm.allreduce(np.ones(1024, dtype=np.float32))
    os.kill(os.getpid(), signal.SIGKILL)  # ... and are all lost
if case == "all_killed_one_stopped":
    comm.barrier()  # everyone is done; then one rank freezes and the others die
    if comm.original_id == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
