"""Multi-rank scenarios for process sets (elastic_hvd/core/process_sets.py) on the core
alone; each rank reports JSON (see report.py).

    python process_sets.py <scenario> [args...]
"""

import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import process_sets as ps

MIB = 1024 * 1024


def contribution(original_id, count):
    """Small integers as float32: any summation order is exact."""
    return ((np.arange(count) % 13) + 100 * (original_id + 1)).astype(np.float32)


def set_events(registry, set_id):
    return [[e.during, e.old_size, e.new_size, list(e.lost)] for e in registry.events(set_id)]


def common(comm, registry):
    return dict(ids=list(comm.ids), global_events=[list(e.lost) for e in comm.events],
                ids_and_ranks={str(k): v for k, v in registry.ids_and_ranks(comm).items()})


def kill_in_set(comm, mib="16", calls_a="5", calls_b="10"):
    """Sets A = ranks {0, 1} and B = {2, 3}; the fault plan kills rank 1 inside A's
    allreduce (its collective 4: the first that the call history predicts, so that it
    goes straight to the transfer; the first three take the slow path).  B's members
    reduce meanwhile; then every survivor calls a global allreduce (the global repair
    and the sets' derivation), then one more allreduce on its set, on the derived
    communicator."""
    registry = comm.process_sets
    ids = ps.register(comm, registry, [[0, 1], [2, 3]])
    mine = ids[0] if comm.original_id in (0, 1) else ids[1]
    sc = ps.SetComm(comm, registry, mine)
    count = int(float(mib) * MIB) // 4
    x = contribution(comm.original_id, count)
    windows = []
    calls = int(calls_a) if mine == ids[0] else int(calls_b)
    for _ in range(calls):
        started = time.time()
        result = sc.allreduce(x)
        windows.append([started, time.time()])
    live_in_set = list(sc.ids)
    exact_in_set = bool(np.array_equal(result, sum(contribution(i, count) for i in live_in_set)))
    retries_in_set, why = sc.retries, set_events(registry, mine)
    total = comm.allreduce(contribution(comm.original_id, 1024))
    exact_global = bool(np.array_equal(total, sum(contribution(i, 1024) for i in comm.ids)))
    again = sc.allreduce(x)
    exact_again = bool(np.array_equal(again, sum(contribution(i, count) for i in sc.ids)))
    report.write(comm.original_id, **common(comm, registry), set_ids=ids, mine=mine,
                 calls=calls, retries_in_set=retries_in_set, why=why, live_in_set=live_in_set,
                 exact_in_set=exact_in_set, exact_global=exact_global, exact_again=exact_again,
                 windows=windows,
                 events={str(i): [[e.during, e.old_size, e.new_size, list(e.lost), e.wall_time,
                                   e.repair_s] for e in registry.events(i)] for i in ids},
                 sizes={str(i): registry.size(comm, i) for i in ids},
                 included={str(i): registry.included(comm, i) for i in ids})


def emptied(comm):
    """Set A = {1} alone, B = {0, 2, 3}; the plan kills rank 1 at its first collective.
    The survivors reduce on B, then globally (the repair empties A); then A is used,
    removed, and a new set added in its place (dynamic sets, agreed by the ranks)."""
    registry = comm.process_sets
    a, b = ps.register(comm, registry, [[1], [0, 2, 3]])
    if comm.original_id == 1:
        ps.SetComm(comm, registry, a).allreduce(np.ones(4, np.float32))
        raise AssertionError("rank 1 should have been killed")
    on_b = ps.SetComm(comm, registry, b).allreduce(contribution(comm.original_id, 64))
    exact_b = bool(np.array_equal(on_b, sum(contribution(i, 64) for i in (0, 2, 3))))
    comm.allreduce(np.ones(4, np.float32))  # the global repair: A is emptied here
    out = dict(exact_b=exact_b, size_a=registry.size(comm, a),
               included_a=registry.included(comm, a), events_a=set_events(registry, a))
    try:
        ps.SetComm(comm, registry, a).allreduce(np.ones(4, np.float32))
        out["use_a"] = "no error"
    except ps.EmptiedProcessSetError as exc:
        out["use_a"] = f"{type(exc).__name__}: {exc}"
    try:  # ranks that disagree: ValueError on every rank, nothing registered
        ps.add(comm, registry, [0, 1] if comm.rank == 0 else [0, 2])
        out["disagreeing_add"] = "no error"
    except ValueError as exc:
        out["disagreeing_add"] = f"{type(exc).__name__}: {exc}"
    out["removed_a"] = ps.remove(comm, registry, a)
    out["removed_again"] = ps.remove(comm, registry, a)
    out["removed_global"] = ps.remove(comm, registry, ps.GLOBAL_ID)
    new = ps.add(comm, registry, [0, 1])  # the current ranks 0 and 1: original ids 0 and 2
    try:
        ps.add(comm, registry, [1, 0])
        out["duplicate_add"] = "no error"
    except ps.DuplicateProcessSetError as exc:
        out["duplicate_add"] = f"{type(exc).__name__}: {exc}"
    out["new_id"] = new
    if registry.included(comm, new):
        sc = ps.SetComm(comm, registry, new)
        got = sc.allreduce(contribution(comm.original_id, 64))
        out["exact_new"] = bool(np.array_equal(got, sum(contribution(i, 64) for i in (0, 2))))
        out["new_rank"] = registry.rank(comm, new)
        # a broadcast's root is a rank of the set: the set's rank 1 is original id 2
        out["broadcast"] = sc.broadcast(np.array([comm.original_id]), root_rank=1).tolist()
    else:
        try:
            registry.rank(comm, new)
        except ps.NotInProcessSetError as exc:
            out["new_rank"] = f"{type(exc).__name__}"
    report.write(comm.original_id, **common(comm, registry), **out)


def mismatch(comm):
    """Set A = {0, 1} calls allreduce with shapes that differ between its members; B =
    {2, 3} reduces meanwhile, untouched."""
    registry = comm.process_sets
    a, b = ps.register(comm, registry, [[0, 1], [2, 3]])
    out = {}
    if comm.original_id in (0, 1):
        sc = ps.SetComm(comm, registry, a)
        sc.allreduce(np.ones(8, np.float32))  # learned: the next call is predicted alike
        try:
            sc.allreduce(np.ones(4 if comm.original_id == 0 else 6, np.float32))
            out["error"] = "no error"
        except core.MismatchError as exc:
            out["error"] = type(exc).__name__
        got = sc.allreduce(np.ones(8, np.float32))  # the set works on
        out["after"] = got.tolist()
    else:
        sc = ps.SetComm(comm, registry, b)
        for _ in range(3):
            got = sc.allreduce(np.ones(8, np.float32))
        out["after"] = got.tolist()
    total = comm.allreduce(np.ones(2, np.float32))
    report.write(comm.original_id, **common(comm, registry), **out, total=total.tolist(),
                 retries=sc.retries)


def step(comm, mib="4"):
    """Set A = {0, 1, 2}, B = {3}.  A's members run steps of two allreduces as one step
    transaction (ps.consistent); the plan kills rank 1 inside the second allreduce of the
    first step (after its transfer, before the agreement): both results of that step must
    come from the survivors {0, 2}."""
    registry = comm.process_sets
    a, b = ps.register(comm, registry, [[0, 1, 2], [3]])
    count = int(float(mib) * MIB) // 4
    x = contribution(comm.original_id, count)
    y = contribution(comm.original_id + 10, count)
    out = {}
    if comm.original_id in (0, 1, 2):
        sc = ps.SetComm(comm, registry, a)
        runs = []

        def attempt():
            runs.append(list(sc.ids))
            return sc.allreduce(x), sc.allreduce(y)

        rx, ry = ps.consistent([sc], attempt)
        out["runs"] = runs
        out["exact"] = bool(np.array_equal(rx, sum(contribution(i, count) for i in sc.ids))
                            and np.array_equal(ry, sum(contribution(i + 10, count)
                                                       for i in sc.ids)))
        out["live"] = list(sc.ids)
    comm.allreduce(np.ones(2, np.float32))
    report.write(comm.original_id, **common(comm, registry), **out)


def static(comm):
    """Horovod's static and multi-communicator registration (test_process_sets_static.py,
    test_process_sets_multi_comm.py): duplicates get None, ids in Horovod's order."""
    from mpi4py import MPI
    registry = comm.process_sets
    size = comm.size
    sub = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2, MPI.COMM_WORLD.rank)
    first = ps.register(comm, registry, [sub, MPI.COMM_WORLD.Dup(), sub.Dup(),
                                         list(range(0, size, 2)), [0]])
    second = ps.register(comm, registry, [sub, [0]])
    report.write(comm.original_id, **common(comm, registry), first=first, second=second,
                 rank_in_sub=registry.rank(comm, second[0]), size_of_0=registry.size(comm, 3))


def overlap(comm, calls="6"):
    """Overlapping sets S = {0, 1} and T = {0, 2}; rank 3 in neither.  Rank 0 reduces on T,
    then on S; the plan kills rank 2 inside T's 4th allreduce while rank 1 waits for rank 0
    in S's.  (A repair of the *global* communicator started from T's collective would wait
    for rank 1 in its shrink while rank 1 waits for rank 0 in S: docs/process-sets.md.)"""
    registry = comm.process_sets
    s, t = ps.register(comm, registry, [[0, 1], [0, 2]])
    out = {}
    x = contribution(comm.original_id, MIB)
    if comm.original_id in (0, 2):
        on_t = ps.SetComm(comm, registry, t)
        for _ in range(int(calls)):
            got = on_t.allreduce(x)
        out["t_exact"] = bool(np.array_equal(got, sum(contribution(i, MIB) for i in on_t.ids)))
        out["t_live"], out["t_retries"] = list(on_t.ids), on_t.retries
    if comm.original_id in (0, 1):
        on_s = ps.SetComm(comm, registry, s)
        got = on_s.allreduce(x)
        out["s_exact"] = bool(np.array_equal(got, sum(contribution(i, MIB) for i in (0, 1))))
        out["s_retries"] = on_s.retries
    total = comm.allreduce(contribution(comm.original_id, 16))
    out["global_exact"] = bool(np.array_equal(total, sum(contribution(i, 16) for i in comm.ids)))
    report.write(comm.original_id, **common(comm, registry), **out,
                 t_events=set_events(registry, t), s_events=set_events(registry, s))


def main():
    scenario, args = sys.argv[1], sys.argv[2:]
    comm = core.init()
    globals()[scenario](comm, *args)


if __name__ == "__main__":
    main()
