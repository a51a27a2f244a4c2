"""Issue 13 decision data: 1 MiB float32 Allreduce against a plain recursive-doubling
Adasum (full-vector pairwise exchange, power-of-2 ranks only).

    mpirun -np 4 --oversubscribe python bench/adasum_estimate.py
"""

import json
import time
import numpy as np
from mpi4py import MPI

c = MPI.COMM_WORLD
n = (1 << 20) // 4
x = np.random.default_rng(c.rank).normal(size=n).astype(np.float32)


def adasum(a):
    a = a.copy()
    other = np.empty_like(a)
    d = 1
    while d < c.size:
        c.Sendrecv(a, c.rank ^ d, 0, other, c.rank ^ d, 0)
        lo, hi = (a, other) if c.rank < (c.rank ^ d) else (other, a)  # same order on both
        dot = float(lo @ hi)
        na, nb = float(lo @ lo), float(hi @ hi)
        a = ((1 - dot / (2 * na)) * lo + (1 - dot / (2 * nb)) * hi).astype(np.float32)
        d <<= 1
    return a


out = np.empty_like(x)
res = {}
for name, fn in (
    ("allreduce", lambda: c.Allreduce(x, out)),
    ("adasum_recursive_doubling", lambda: adasum(x)),
):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(30):
        c.Barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    res[name + "_ms"] = round(float(np.median(ts)) * 1e3, 3)
r = c.gather(res, root=0)
if c.rank == 0:
    print(json.dumps({k: max(q[k] for q in r) for k in res}))
