"""Reproducer: Open MPI's agreement (ERA) beside ``opal_progress`` in another thread.

    python bench/era_progress_race.py [--np 3] [--calls 300000] [--runs 2]

Each job runs ``--calls`` iterations of ``Allreduce`` + ``MPI_Comm_agree(v)`` on a
duplicate of COMM_WORLD (plain mpi4py: no elastic_hvd transaction), every rank
contributing the same ``v`` (a fresh stamp each time), so the agreed value must
be ``v``; it counts the iterations where it was not.  Three modes:

* ``alone``: nothing else drives MPI progress;
* ``thread``: elastic_hvd's GIL-free progress loop (``heartbeat.NativeProgress``)
  calls ``opal_progress`` every 0.1 ms from its own thread;
* ``paused``: the same loop, paused around each Allreduce + Agree (what
  ``Heartbeat.enter``/``leave`` do now).

Measured on Open MPI 5.0.11 (2 cores, 3 ranks): ``thread`` 5-6 wrong values in
3 x 10^5; ``alone`` and ``paused`` 0 (docs/benchmarks.md).
"""

import argparse
import os
import subprocess
import sys

JOB = r"""
import sys
import numpy as np
from elastic_hvd.core import freshness, mpi_env
MPI = mpi_env.load_mpi()
mode, calls = sys.argv[1], int(sys.argv[2])
loop = None
if mode != "alone":
    from elastic_hvd.core.heartbeat import NativeProgress
    loop = NativeProgress(0.0001)
comm = MPI.COMM_WORLD.Dup()
x, y = np.ones(2, np.int64), np.empty(2, np.int64)
wrong = 0
for i in range(1, calls + 1):
    if mode == "paused":
        loop.pause()
    comm.Allreduce(x, y)
    value = freshness.stamp(0, i) | 11
    wrong += comm.Agree(value) != value
    if mode == "paused":
        loop.resume()
assert loop is None or loop._thread.is_alive(), "the progress loop ended"
print("WRONG", comm.rank, wrong, flush=True)
"""


def job(np_, mode, calls):
    here = os.path.dirname(os.path.abspath(__file__))
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--with-ft", "ulfm", "--oversubscribe", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    out = subprocess.run([*cmd, sys.executable, "-c", JOB, mode, str(calls)], cwd=here,
                         capture_output=True, text=True, timeout=900).stdout
    counts = [int(line.split()[2]) for line in out.splitlines() if line.startswith("WRONG ")]
    return max(counts) if counts else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=3)
    p.add_argument("--calls", type=int, default=300000)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    print(f"| mode | wrong agreed values per job ({args.calls} agreements, {args.np} ranks) |")
    print("|---|---|")
    for mode in ("alone", "thread", "paused"):
        counts = [job(args.np, mode, args.calls) for _ in range(args.runs)]
        print(f"| {mode} | {', '.join(str(c) for c in counts)} |", flush=True)


if __name__ == "__main__":
    main()
