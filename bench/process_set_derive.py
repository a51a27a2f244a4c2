"""Issue 13 decision data: time to derive k process-set communicators (Split, Create_group)
on the survivors after a shrink (4 ranks, one killed).

    mpirun --with-ft ulfm -np 4 --oversubscribe python bench/process_set_derive.py
"""

import os
import signal
import time
import json
import numpy as np
from mpi4py import MPI

w = MPI.COMM_WORLD.Dup()
w.Set_errhandler(MPI.ERRORS_RETURN)
if w.rank == 3:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    w.Barrier()
except MPI.Exception:
    pass
w.Revoke()
t0 = time.perf_counter()
s = w.Shrink()
t_shrink = time.perf_counter() - t0
s.Set_errhandler(MPI.ERRORS_RETURN)
s.Agree(0)
res = {"shrink_ms": t_shrink * 1e3}
for k in (1, 4):
    times_split, times_cg = [], []
    for _ in range(20):
        s.Barrier()
        t = time.perf_counter()
        comms = [s.Split(0 if (s.rank + j) % 2 == 0 else 1, s.rank) for j in range(k)]
        times_split.append(time.perf_counter() - t)
        for c in comms:
            c.Free()
        s.Barrier()
        t = time.perf_counter()
        g = s.Get_group()
        comms = []
        for j in range(k):
            members = [r for r in range(s.size) if (r + j) % 2 == 0] or [0]
            sub = g.Incl(members)
            c = s.Create_group(sub, tag=j)
            comms.append(c)
            sub.Free()
        times_cg.append(time.perf_counter() - t)
        for c in comms:
            if c != MPI.COMM_NULL:
                c.Free()
        g.Free()
    res[f"split_k{k}_ms"] = float(np.median(times_split)) * 1e3
    res[f"create_group_k{k}_ms"] = float(np.median(times_cg)) * 1e3
all_res = s.gather(res, root=0)
if s.rank == 0:
    print(json.dumps({key: round(max(r[key] for r in all_res), 3) for key in res}))
