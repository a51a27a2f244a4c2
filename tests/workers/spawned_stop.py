"""Does Open MPI's heartbeat detector see a *spawned* process freeze?  (plain mpi4py)

    python spawned_stop.py            (2 ranks under elastic-hvd-run, fast heartbeat)

Why plain mpi4py and not elastic_hvd: to show what Open MPI itself does, under the
same MCA settings (``mpi_env.load_mpi``).  The 2 ranks spawn 1 process and merge
with it; every process writes ``<out>/pid<id>`` (its world rank; 2 for the spawned one)
and waits for ``<out>/stopped``, which the test writes after it SIGSTOPped one of
them from outside.  Then each live process waits in a non-blocking barrier on the
merged communicator for ``WAIT_S`` seconds, driving progress, and reports whether
and when an error said that a member failed.  Then it exits without finalizing
(the test kills what is left).
"""

import os
import sys
import time

import report
from elastic_hvd.core import mpi_env

#: Open MPI 5.0.11 under load: a spawned child's MPI_Init_thread fails ("Server not
#: available in file dpm.c"), and the parents' MPI_Comm_spawn with it.  Either is
#: recorded (report.upstream), so that the test may count it as that known failure.
UPSTREAM = "spawn_given_up"
try:
    MPI = mpi_env.load_mpi()
except Exception as exc:
    if sys.argv[1:2] == ["child"]:
        report.upstream(UPSTREAM, sys.argv[2], call="MPI_Init_thread", who="child",
                        error=repr(exc))
    raise
WAIT_S = 15.0


def main(who, out):
    if who == "child":
        who = 2
        inter = MPI.Comm.Get_parent()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=True)
    else:
        world = MPI.COMM_WORLD
        world.Set_errhandler(MPI.ERRORS_RETURN)
        info = MPI.Info.Create()
        info.Set("map_by", ":OVERSUBSCRIBE")
        try:
            inter = world.Spawn(sys.executable, [os.path.abspath(__file__), "child", out],
                                maxprocs=1, info=info)
        except MPI.Exception as exc:
            report.upstream(UPSTREAM, out, call="MPI_Comm_spawn", who=world.rank,
                            error_class=exc.Get_error_class(), error=exc.Get_error_string())
            sys.stdout.flush()
            os._exit(1)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=False)
        who = world.rank
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    merged.Barrier()  # every pair connected
    with open(os.path.join(out, f"pid{who}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(out, "stopped")):
        time.sleep(0.01)
    started = time.monotonic()
    request, detected, error = merged.Ibarrier(), None, None
    while time.monotonic() - started < WAIT_S:
        try:
            if request.Test():
                break
        except MPI.Exception as exc:
            detected, error = time.monotonic() - started, exc.Get_error_string()
            break
        time.sleep(0.01)
    os.environ["TEST_OUT_DIR"] = out  # for report
    report.write(who, detected_s=detected, error=error)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    # A spawned process gets mpirun's environment, not ours: its output directory
    # comes on its command line.
    main(*(sys.argv[1:] or ["world", os.environ["TEST_OUT_DIR"]]))
