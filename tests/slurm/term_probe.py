"""A rank that notes when SIGTERM or SIGUSR1 reaches it and then goes on sleeping (test_slurm.py:
who signals the ranks when Slurm ends a job, and when SIGKILL follows)."""

import json
import os
import signal
import socket
import sys
import time

out = sys.argv[1]
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")


def noted(signum, frame):
    name = signal.Signals(signum).name
    with open(os.path.join(out, f"{name}{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), "host": socket.gethostname(),
                            "pid": os.getpid(), "rank": rank, "signal": name}) + "\n")


for signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(signum, noted)
with open(os.path.join(out, f"ready{rank}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
