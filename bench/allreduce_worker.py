"""One benchmark job: our allreduce against raw mpi4py Allreduce, in the same job.

Prints one JSON line (rank 0) with the median time per size for both.  The two
alternate call by call so that machine noise hits both alike.
"""

import json
import sys
import time

import numpy as np

from elastic_hvd import core

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]


def iterations(nbytes):
    return max(10, min(400, int(2e8 // max(nbytes, 1))))


def main():
    comm = core.init()
    MPI = comm.MPI
    raw = MPI.COMM_WORLD.Dup()
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, dtype=np.float32)
        out_raw, out_ours = np.empty_like(x), np.empty_like(x)
        for _ in range(3):  # warm-up, and lets our signature prediction settle
            raw.Allreduce(x, out_raw)
            comm.allreduce(x, out=out_ours)
        t_raw, t_ours = [], []
        for _ in range(iterations(nbytes)):
            raw.Barrier()
            t = time.perf_counter()
            raw.Allreduce(x, out_raw)
            t_raw.append(time.perf_counter() - t)
            raw.Barrier()
            t = time.perf_counter()
            comm.allreduce(x, out=out_ours)
            t_ours.append(time.perf_counter() - t)
        assert np.array_equal(out_raw, out_ours)
        rows.append({"bytes": nbytes, "raw_s": float(np.median(t_raw)),
                     "ours_s": float(np.median(t_ours))})
    if comm.rank == 0:
        print("RESULT " + json.dumps({"np": comm.size, "elastic": comm.elastic, "rows": rows}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
