"""A process spawned into the job hangs; the ranks that wait for it must be heard.

    python board_joiner.py <steps>

Every step allreduces once, with ``GrowthPolicy.step`` at each step boundary (run
with ``--respawn`` and a fault plan that kills a rank).  The first process spawned
to replace it, once adopted, hangs for a minute without progress before its next
allreduce: the others wait for it there, and its stall watchdog must hear them on
the waiting board (a spawned process has a PMIx namespace of its own, yet is of the
same job) and kill it.  Every rank left at the end reports its view.
"""

import os
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import faults, runtime
from elastic_hvd.growth_policy import GrowthPolicy


def first_joiner():
    """Whether this is the first process of the job to get here (a marker file)."""
    try:
        os.close(os.open(os.path.join(os.environ["TEST_OUT_DIR"], "hung"),
                         os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def main(steps):
    comm = core.init()
    policy = GrowthPolicy.from_env()
    step, hang = 0, False
    while step < steps:
        event = policy.step(runtime.growth())
        if event is not None and event.gained:
            state = comm.broadcast_object(None if comm.original_id in event.gained else
                                          {"step": step, "policy": policy.state()})
            if comm.original_id in event.gained:
                step, hang = state["step"], first_joiner()
                policy.load_state(state["policy"])
        step += 1
        faults.at_step(step)
        if hang:
            time.sleep(60)
        comm.allreduce(np.ones(4))
        time.sleep(0.05)
    report.write(comm.original_id, ids=list(comm.ids), pid=os.getpid(),
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    main(int(sys.argv[1]))
