"""A rank ends cleanly (SIGTERM -> ``sys.exit(0)``) while a join is pending.

    python leave_while_join_pends.py <steps>

Shaped like a Keras step: ``poll_join`` at the step's start (the growth
callback), the gradient allreduce, then Python work after it (callbacks,
the state copy of rank 0: here a sleep), where a SIGTERM handler runs.  So a
rank that gets SIGTERM leaves while the others are already inside the next
step's ``poll_join``.  The spawned process never joins (it idles until the job
gives it up).  Each rank writes its step to ``<out>/step<id>`` and its pid to
``<out>/pid<id>``, so the test can time the signal; the survivors report their
membership at the end.
"""

import os
import signal
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import runtime


def main(steps):
    comm = core.init()
    out = os.environ["TEST_OUT_DIR"]
    if comm.joining:  # never joins: JoinAbandoned ends it once the job gives it up
        while True:
            time.sleep(0.1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(os.path.join(out, f"pid{comm.original_id}"), "w") as f:
        f.write(str(os.getpid()))
    growth = runtime.growth()
    growth.spawn(1)
    for step in range(steps):
        growth.poll()
        comm.allreduce(np.ones(4))
        with open(os.path.join(out, f"step{comm.original_id}"), "w") as f:
            f.write(str(step))
        time.sleep(0.05)
    report.write(comm.original_id, ids=list(comm.ids),
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    main(int(sys.argv[1]))
