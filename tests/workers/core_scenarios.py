"""Multi-rank scenarios for the resilient core; each rank reports JSON (see report.py).

    python core_scenarios.py <scenario> [args...]
"""

import hashlib
import os
import signal
import sys
import time

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import transaction

MIB = 1024 * 1024


def contribution(original_id, count):
    """A rank's input: small integers as float32, so any summation order is exact."""
    return ((np.arange(count) % 13) + 100 * (original_id + 1)).astype(np.float32)


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def events(comm):
    return [e.as_dict() for e in comm.events]


def kill_in_allreduce(comm, mib="64", calls="3"):
    """Collective number `calls` is the one the fault plan targets."""
    count = int(float(mib) * MIB) // 4
    x = contribution(comm.original_id, count)
    out = np.empty_like(x)
    times = []
    for _ in range(int(calls)):
        before = len(comm.events)
        started = time.perf_counter()
        result = comm.allreduce(x, out=out)
        times.append(time.perf_counter() - started)
    expected = sum(contribution(i, count) for i in comm.ids)
    report.write(comm.original_id, ids=list(comm.ids), size=comm.size, events=events(comm),
                 changed_in_last_call=len(comm.events) > before,
                 equals_survivor_sum=bool(np.array_equal(result, expected)),
                 digest=digest(result), times=times)


def kill_in_broadcast(comm, root="0", mib="16"):
    count = int(float(mib) * MIB) // 4
    x = contribution(comm.original_id, count)
    comm.barrier()  # collective 1; the plan kills the root at collective 2
    result = comm.broadcast(x, root_rank=int(root))
    lowest = min(comm.ids)
    report.write(comm.original_id, ids=list(comm.ids), events=events(comm),
                 equals_lowest_survivor=bool(np.array_equal(result, contribution(lowest, count))),
                 digest=digest(result))


def keep_going(comm, calls="6"):
    """Allreduce repeatedly; used for hangs (SIGSTOP) and repeated failures."""
    x = contribution(comm.original_id, 1024)
    for _ in range(int(calls)):
        result = comm.allreduce(x)
    expected = sum(contribution(i, 1024) for i in comm.ids)
    report.write(comm.original_id, ids=list(comm.ids), events=events(comm),
                 equals_survivor_sum=bool(np.array_equal(result, expected)), digest=digest(result))


def below_min(comm):
    errors = []
    x = np.ones(16, dtype=np.float32)
    for _ in range(4):
        try:
            comm.allreduce(x)
        except core.RanksBelowMinimumError as exc:
            errors.append([type(exc).__name__, exc.size, exc.min_np, list(exc.lost)])
    report.write(comm.original_id, ids=list(comm.ids), errors=errors, events=events(comm))


def mismatch(comm, when="first"):
    """Rank 1 passes a different shape: on the first call, after a steady state, or as
    the float64 one of a step's 12 unfused gradients (run with HOROVOD_FUSION_THRESHOLD=0)
    after steady steps -- the step's second call, after its 11 float32 ones: the
    others' calls are predicted and go on to its transfer."""
    from elastic_hvd.core.reducer import reduce_step
    shape = 9 if comm.original_id == 1 else 8

    def step(last):
        arrays = [np.ones(8, dtype=np.float32)] * 7 + [np.ones(last, dtype=np.float64)] \
            + [np.ones(8, dtype=np.float32)] * 4
        return reduce_step(comm, *arrays, sizes=[len(arrays)], op=core.ReduceOp.SUM,
                           prescale_factor=1.0, postscale_factor=1.0, commit=False)[7]
    if when == "steady":
        for _ in range(5):
            comm.allreduce(np.ones(8, dtype=np.float32))
    if when == "in_a_step":
        for _ in range(5):
            step(8)
    error = None
    started = time.perf_counter()
    try:
        step(shape) if when == "in_a_step" else comm.allreduce(np.ones(shape, dtype=np.float32))
    except core.MismatchError as exc:
        error = str(exc)
    seconds = time.perf_counter() - started
    # the communicator still works
    after = step(8) if when == "in_a_step" else comm.allreduce(np.ones(8, dtype=np.float32))
    report.write(comm.original_id, error=error, seconds=seconds, after=after.tolist(),
                 size=comm.size)


def application_error(comm):
    """Rank 1 gives alltoall impossible splits: it raises ValueError, the others learn why."""
    x = np.arange(8, dtype=np.int64)
    splits = [8, 0, 0, 1] if comm.original_id == 1 else [2, 2, 2, 2]
    error = None
    try:
        comm.alltoall(x, splits=splits)
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    after = comm.allreduce(np.ones(2, dtype=np.int64))
    report.write(comm.original_id, error=error, after=after.tolist())


def error_holder_dies(comm):
    """As application_error, but rank 1 is SIGKILLed once the ranks agreed that the
    call failed and before it could tell them why (its repair is where it dies)."""
    if comm.original_id == 1:
        comm.repair = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    application_error(comm)


def local_mpi_errors(comm):
    """An agreement and a shrink on a communicator freed under the core's feet fail
    with a non-failure MPI error (MPI_ERR_COMM): each must be a plain error here."""
    comm.mpi_comm.Free()
    errors = {}
    for name, call in (("agree", lambda: comm._agree(comm.mpi_comm, 1)), ("repair", comm.repair)):
        try:
            call()
            errors[name] = None
        except Exception as exc:
            errors[name] = [type(exc).__name__, str(exc)]
    report.write(comm.original_id, errors=errors)


def contradictory_agreement(comm):
    """The agreement on an allreduce's outcome says, on every rank, that it failed
    with an error that no rank holds -- as Open MPI's agreement did, rarely, with no
    rank lost.  Not a process failure, so no process is killed: the agreed value is
    replaced once.  The ranks must run the allreduce again and get the right sum."""
    real, forced = comm._agree, []

    def agree(mpi_comm, flag, timeout=None):
        value = real(mpi_comm, flag, timeout)
        if flag & transaction._POST and not forced:  # the allreduce's outcome
            forced.append(value)
            return transaction._POST
        return value

    comm._agree = agree
    total = comm.allreduce(contribution(comm.original_id, 1000))
    expected = sum(contribution(i, 1000) for i in range(comm.size))
    report.write(comm.original_id, right=bool(np.array_equal(total, expected)),
                 forced=forced, ids=list(comm.ids),
                 anomalies=[a["anomaly"] for a in comm.anomalies])


def foreign_agreement(comm, who="all"):
    """The agreement on an allreduce's outcome answers, on rank ``who`` (or on every
    rank), with the value of the previous agreement -- what Open MPI's agreement did
    when it met a reused agreement name (see ``mpi_env.retire``).  The ranks must
    recognise it, say it, and still get the right sum."""
    real, seen, forced = comm._agreement, [], []

    def agreement(mpi_comm, value, timeout):
        seen.append(real(mpi_comm, value, timeout))
        if (value & transaction._POST and len(seen) > 1 and not forced
                and who in ("all", str(comm.original_id))):
            forced.append(seen[-2])
            return seen[-2]
        return seen[-1]

    comm._agreement = agreement
    total = comm.allreduce(contribution(comm.original_id, 1000))
    expected = sum(contribution(i, 1000) for i in comm.ids)
    again = comm.allreduce(contribution(comm.original_id, 10))
    report.write(comm.original_id, right=bool(np.array_equal(total, expected)),
                 again=bool(np.array_equal(again, sum(contribution(i, 10) for i in comm.ids))),
                 ids=list(comm.ids), anomalies=list(comm.anomalies))


def retired_agreement_names(comm):
    """The one layout in which a freed communicator's last agreement answers a new
    one (see ``mpi_env.retire``): rank 2 made one communicator more than the others
    (that count sets the epoch), all agree 5 on a duplicate that is then retired,
    and a new communicator of ranks 0 and 1 agrees 3, rank 1 entering first while
    rank 0 makes MPI progress elsewhere.  A freed CID is reused with the same
    epoch and sequence number: rank 1 then got 5 and rank 0 hung (measured)."""
    MPI, world = comm.MPI, comm.mpi_comm
    if comm.original_id == 2:
        MPI.COMM_SELF.Dup().Free()
    old = world.Dup()
    old.Set_errhandler(MPI.ERRORS_RETURN)
    old.Agree(5)
    comm.retire(old)
    agreed = None
    if comm.original_id < 2:
        new = world.Create_group(world.Get_group().Incl([0, 1]))
        new.Set_errhandler(MPI.ERRORS_RETURN)
        if comm.original_id == 0:
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                MPI.COMM_SELF.Iprobe()
                time.sleep(0.001)
        agreed = new.Agree(3)
        comm.retire(new)
    report.write(comm.original_id, agreed=agreed)


def many_collectives(comm, count):
    """``count`` small allreduces, each result checked (ERA's 16-bit agreement
    sequence wraps every 65 536); the fault plan kills a rank after the wraps."""
    wrong, sizes = 0, set()
    for i in range(int(count)):
        x = np.array([i, comm.original_id + 1], dtype=np.int64)
        total = comm.allreduce(x)
        if total[0] != i * comm.size or total[1] != sum(j + 1 for j in comm.ids):
            wrong += 1
        sizes.add(comm.size)
    report.write(comm.original_id, wrong=wrong, sizes=sorted(sizes), ids=list(comm.ids),
                 anomalies=len(comm.anomalies), events=events(comm))


def step_pauses(comm, arrays="50", steps="4", layout="dtypes"):
    """``steps`` step transactions of ``arrays`` small arrays, unfused (run with
    HOROVOD_FUSION_THRESHOLD=0): how often per step the heartbeat's progress loop
    paused and the ranks agreed (``MPI_Comm_agree``), how many calls the transactions
    held, and whether every result is the sum.  ``layout`` "dtypes": float32 and
    float64 in turn, one group (two calls a step); "groups": float32 in groups of two
    (``groups=``, a call each), equal but for the last array (a run of equal calls)."""
    from elastic_hvd.core.reducer import reduce_step
    progress = comm._heartbeat._progress
    pauses, pause = [], progress.pause

    def counted():
        pauses.append(1)
        pause()
    progress.pause = counted
    agreements, agreement = [], comm._agreement

    def counted_agreement(*args):
        agreements.append(1)
        return agreement(*args)
    comm._agreement = counted_agreement
    calls, run_many = [], comm.run_many

    def counted_run_many(batch):
        calls.extend(1 for signature, _ in batch if signature is not None)
        return run_many(batch)
    comm.run_many = counted_run_many
    n = int(arrays)
    if layout == "dtypes":
        dtypes, lengths, sizes = (np.float32, np.float64), [16 + k for k in range(n)], [n]
    else:
        dtypes, lengths, sizes = (np.float32,), [16] * (n - 1) + [17], [2] * (n // 2)
    inputs = [contribution(comm.original_id, length).astype(dtypes[k % len(dtypes)])
              for k, length in enumerate(lengths)]
    right, per_step, agreed = True, [], []
    for _ in range(int(steps)):
        before, agreed_before = len(pauses), len(agreements)
        out = reduce_step(comm, *inputs, sizes=sizes, op=core.ReduceOp.SUM,
                          prescale_factor=1.0, postscale_factor=1.0, commit=False)
        per_step.append(len(pauses) - before)
        agreed.append(len(agreements) - agreed_before)
        right &= all(np.array_equal(o, sum(contribution(i, length) for i in comm.ids))
                     and o.dtype == dtypes[k % len(dtypes)]
                     for k, (o, length) in enumerate(zip(out, lengths)))
    report.write(comm.original_id, pauses_per_step=per_step, right=bool(right),
                 calls=len(calls), agreements_per_step=agreed)


def elastic_flag(comm):
    report.write(comm.original_id, elastic=comm.elastic)


def after_init(comm):
    """A rank died around init() (see TEST_DIE_IN_INIT): the survivors reduce together."""
    total = comm.allreduce(np.array([comm.original_id + 1], dtype=np.int64))
    report.write(comm.original_id, ids=list(comm.ids), events=events(comm),
                 total=int(total[0]), size=comm.size)


def _die_in_init():
    """TEST_DIE_IN_INIT=<rank>:<delay>: after MPI_Init, that rank is SIGKILLed ``delay``
    seconds into init() (0: before it starts), by a thread: init() does not choose when.
    True in the victim (see main)."""
    victim, _, delay = os.environ.get("TEST_DIE_IN_INIT", "").partition(":")
    if not victim:
        return False
    from elastic_hvd.core.mpi_env import load_mpi
    if load_mpi().COMM_WORLD.rank == int(victim):
        import threading
        kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        if float(delay or 0) <= 0:
            kill()
        threading.Timer(float(delay), kill).start()
        return True
    return False


def main():
    scenario, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("TEST_THREAD_LEVEL"):  # a script that initialised MPI itself first
        import mpi4py
        mpi4py.rc.thread_level = os.environ["TEST_THREAD_LEVEL"]
        from mpi4py import MPI  # noqa: F401
    victim = _die_in_init()
    comm = core.init()
    if victim:  # the timer came too late (a loaded machine): die before the first collective
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        globals()[scenario](comm, *args)
    except core.FaultInjected:
        if os.environ.get("TEST_DEADLOCK_ON_FAULT"):
            while True:  # a "deadlocked" rank: alive, beating, never calling again
                time.sleep(1)
        raise


if __name__ == "__main__":
    main()
