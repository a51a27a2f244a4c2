"""What an agreement returns when it meets another rank's ``MPI_Comm_shrink`` (plain mpi4py).

Why: the soak saw one anomaly with ``got=0x1`` (issue 18).  Every rank but the last
calls ``MPI_Comm_shrink`` on a healthy communicator, the last calls
``MPI_Comm_agree`` with a stamped value: the shrink's own agreement takes the
place of the last rank's, which then returns ``0x1`` -- not its value, not an
error -- and the shrinking ranks never finish, not even once that rank died
(measured; their memory grows by ~350 MB a second meanwhile, so the shrinking
ranks end themselves after :data:`WAIT` seconds).  A rank whose protocol is one
step behind the others' repair therefore reads ``0x1``; elastic_hvd's stamps
recognise it (see ``elastic_hvd/core/freshness.py``), and a rank interrupted
inside the protocol leaves as a crash (``ResilientComm._in_mpi``).

    python bench/era_meets_shrink.py          # runs itself under mpirun, 3 ranks
"""

import os
import signal
import subprocess
import sys

VALUE = 0x7747dd6b
#: Seconds to wait for the shrinking ranks before ending the job.
WAIT = 5


def rank_main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.Agree(1)
    if comm.rank == comm.size - 1:
        print(f"MPI_Comm_agree({VALUE:#x}) beside the others' MPI_Comm_shrink returned "
              f"{comm.Agree(VALUE):#x}", flush=True)
        print(f"the next MPI_Comm_agree({VALUE:#x}) returned {comm.Agree(VALUE):#x}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the shrink waits for this rank for ever otherwise
    else:
        signal.alarm(WAIT)  # SIGALRM's default action ends a rank stuck in the shrink
        new = comm.Shrink()
        print(f"rank {comm.rank}: the shrink ended with {new.size} ranks", flush=True)


if __name__ == "__main__":
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank_main()
        sys.exit(0)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    out = subprocess.run([mpirun, "--with-ft", "ulfm", *root, "--oversubscribe", "-np", "3",
                          sys.executable, __file__], capture_output=True, text=True,
                         timeout=WAIT + 60)
    print("".join(line + "\n" for line in out.stdout.splitlines() if line.strip()), end="")
    if "the shrink ended" not in out.stdout:
        print(f"the shrinking ranks never finished: ended by SIGALRM after {WAIT} s")
