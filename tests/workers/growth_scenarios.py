"""A training loop on the bare core that grows back (no TensorFlow: fast).

    python growth_scenarios.py <steps> [--die-before-join | --raise-before-join]
                               [--joiner-delay SECONDS] [--joiner-blocked SECONDS]
                               [--exit-on-sigterm]

Every step allreduces each rank's contribution into a running total (the
"model"), after a short sleep (the "compute"), with ``GrowthPolicy.step`` at each
step boundary; the step that adopts joiners hands them the total and the step
number.  Every rank, joiners too, reports its view at the end (a joiner also what
it was before it joined).  With ``--die-before-join`` the first joiner kills
itself while starting up; with ``--raise-before-join`` it calls a collective
before joining (JoinOrderError, uncaught).  ``--joiner-delay``: every joiner
spends that long starting up (as one that imports TensorFlow), so that its join
stays pending meanwhile; ``--joiner-blocked``: that long inside one C call;
``--exit-on-sigterm``: SIGTERM ends the program with ``sys.exit(0)``.
"""

import os
import signal
import socket
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import faults, runtime
from elastic_hvd.growth_policy import GrowthPolicy


def answer_with_a_foreign_agreement(comm):
    """From now on, this process's next agreement on a collective's outcome answers
    with the value of its previous one (an anomaly, see core_scenarios.py)."""
    real, seen = comm._agreement, []

    def agreement(mpi_comm, value, timeout):
        seen.append(real(mpi_comm, value, timeout))
        return seen[-2] if len(seen) == 2 else seen[-1]

    comm._agreement = agreement


def main(steps, fail_before_join=None, joiner_delay=0.0, joiner_blocked=0.0,
         exit_on_sigterm=False):
    if exit_on_sigterm:  # as a program that ends cleanly when its scheduler asks
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    comm = core.init()
    # Past MPI_Init (a process killed inside it hangs the job's start): a watcher may kill.
    open(os.path.join(os.environ["TEST_OUT_DIR"], f"started-{os.getpid()}"), "w").close()
    policy = GrowthPolicy.from_env()
    policy.retry_steps = 5
    started_at = time.time()
    before_join = waiting_as = None
    if comm.joining:
        before_join = {"original_id": comm.original_id, "ids": list(comm.ids)}
        waiting_as = [comm.rank, comm.size]
        until = time.monotonic() + joiner_delay
        while time.monotonic() < until:  # busy in Python, as a start-up is
            time.sleep(0.01)
        time.sleep(joiner_blocked)  # one call in C, as a library's wait: no Python runs
    if comm.joining and fail_before_join:
        try:  # only the first joiner of the job fails
            os.close(os.open(os.path.join(os.environ["TEST_OUT_DIR"], "died"),
                             os.O_CREAT | os.O_EXCL))
            if fail_before_join == "--raise-before-join":
                comm.allreduce(np.zeros(1))  # JoinOrderError: not joined yet
            os.kill(os.getpid(), signal.SIGKILL)
        except FileExistsError:
            pass
    step, total, joined_at, sizes = 0, np.zeros(4, dtype=np.float64), None, []
    expected = 0.0  # what total[0] must be: the members' ids + 1, summed step by step
    while step < steps:
        event = policy.step(runtime.growth())
        if event is not None and event.gained:
            state = comm.broadcast_object(
                None if comm.original_id in event.gained else
                {"step": step, "total": total, "expected": expected, "policy": policy.state()})
            if comm.original_id in event.gained:
                step, total, joined_at = state["step"], state["total"], state["step"]
                open(os.path.join(os.environ["TEST_OUT_DIR"], f"joined-{os.getpid()}"),
                     "w").close()  # a member now: a watcher may freeze it
                if os.environ.get("TEST_ANOMALY_IN_JOINER"):
                    answer_with_a_foreign_agreement(comm)
                expected = state["expected"]
                policy.load_state(state["policy"])
        step += 1
        faults.at_step(step)
        time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0.05")))
        total += comm.allreduce(np.full(4, comm.original_id + 1.0))
        expected += sum(i + 1.0 for i in comm.ids)  # who the allreduce counted
        sizes.append(comm.size)
    report.write(comm.original_id, ids=list(comm.ids), size=comm.size, total=total.tolist(),
                 expected=expected,
                 joined_at=joined_at, sizes=sizes, pid=os.getpid(), started_at=started_at,
                 host=socket.gethostname(), before_join=before_join, waiting_as=waiting_as,
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    args = sys.argv[2:]
    main(int(sys.argv[1]),
         next((a for a in args if a in ("--die-before-join", "--raise-before-join")), None),
         float(args[args.index("--joiner-delay") + 1]) if "--joiner-delay" in args else 0.0,
         float(args[args.index("--joiner-blocked") + 1]) if "--joiner-blocked" in args else 0.0,
         "--exit-on-sigterm" in args)
