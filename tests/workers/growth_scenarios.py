"""A training loop on the bare core that grows back (no TensorFlow: fast).

    python growth_scenarios.py <steps> [--die-before-join]

Every step allreduces each rank's contribution into a running total (the
"model"), after a short sleep (the "compute"), with ``GrowthPolicy.step`` at each
step boundary; the step that adopts joiners hands them the total and the step
number.  Every rank, joiners too, reports its view at the end.  With
``--die-before-join`` the first joiner kills itself while starting up.
"""

import os
import signal
import socket
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import faults
from elastic_hvd.growth_policy import GrowthPolicy


def main(steps, die_before_join=False):
    comm = core.init()
    policy = GrowthPolicy.from_env()
    policy.retry_steps = 5
    started_at = time.time()
    if comm.joining and die_before_join:
        try:  # only the first joiner of the job dies
            os.close(os.open(os.path.join(os.environ["TEST_OUT_DIR"], "died"),
                             os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGKILL)
        except FileExistsError:
            pass
    step, total, joined_at, sizes = 0, np.zeros(4, dtype=np.float64), None, []
    expected = 0.0  # what total[0] must be: the members' ids + 1, summed step by step
    while step < steps:
        event = policy.step(comm)
        if event is not None and event.gained:
            state = comm.broadcast_object(
                None if comm.original_id in event.gained else
                {"step": step, "total": total, "expected": expected, "policy": policy.state()})
            if comm.original_id in event.gained:
                step, total, joined_at = state["step"], state["total"], state["step"]
                expected = state["expected"]
                policy.load_state(state["policy"])
        step += 1
        faults.at_step(step)
        time.sleep(0.05)
        total += comm.allreduce(np.full(4, comm.original_id + 1.0))
        expected += sum(i + 1.0 for i in comm.ids)  # who the allreduce counted
        sizes.append(comm.size)
    report.write(comm.original_id, ids=list(comm.ids), size=comm.size, total=total.tolist(),
                 expected=expected,
                 joined_at=joined_at, sizes=sizes, pid=os.getpid(), started_at=started_at,
                 host=socket.gethostname(),
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    main(int(sys.argv[1]), "--die-before-join" in sys.argv)
