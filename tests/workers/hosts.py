"""Scenarios on simulated hosts (tests/test_hosts.py); each rank reports JSON.

    python hosts.py <scenario> [args...]
"""

import os
import socket
import sys
import time

import numpy as np

import report
from elastic_hvd import basics as hvd


def where(comm):
    return {"host": socket.gethostname(), "pid": os.getpid(), "rank": comm.rank,
            "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "homogeneous": hvd.is_homogeneous(), "hosts": comm.hosts()}


def layout(comm):
    """Where every rank runs, as the API says and as the runtime says."""
    total = comm.allreduce(np.array([comm.original_id + 1], dtype=np.int64))
    report.write(comm.original_id, **where(comm), total=int(total[0]),
                 runtime_local_rank=int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]))


def steps(comm, count="200", pause="0.02", leave=""):
    """``count`` allreduces ``pause`` s apart (a watcher kills ranks meanwhile); each
    step's sum must be the live ranks' own.  ``leave`` (``"<original id>:<step>"``):
    that rank's program returns at that step, while the others go on (it reports
    nothing, and takes back its progress file: watchers wait for the live ranks')."""
    wrong = []
    leaver, _, leave_at = leave.partition(":")
    for step in range(int(count)):
        if leaver and int(leaver) == comm.original_id and step == int(leave_at):
            os.remove(os.path.join(os.environ["TEST_OUT_DIR"], f"progress{comm.original_id}"))
            return
        ids = list(comm.ids)
        total = comm.allreduce(np.array([comm.original_id + 1], dtype=np.int64))
        if int(total[0]) != sum(i + 1 for i in comm.ids):
            wrong.append([step, int(total[0]), ids, list(comm.ids)])
        with open(os.path.join(os.environ["TEST_OUT_DIR"], f"progress{comm.original_id}"),
                  "w") as f:
            f.write(str(step))
        time.sleep(float(pause))
    report.write(comm.original_id, **where(comm), ids=list(comm.ids), wrong=wrong,
                 events=[e.as_dict() for e in comm.events])


def main():
    scenario, args = sys.argv[1], sys.argv[2:]
    comm = hvd.init()
    globals()[scenario](comm, *args)


if __name__ == "__main__":
    main()
