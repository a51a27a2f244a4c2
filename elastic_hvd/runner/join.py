"""What a process spawned into a running job runs: ``python -m elastic_hvd.runner.join
<environment> <program...>``.

The running ranks wait inside ``MPI_Comm_spawn`` until this process has merged
with them, so it merges first -- before the program imports TensorFlow and
builds its model, which happens while the running ranks go on training -- and
only then runs the program, exactly as the original ranks ran it.  The
environment comes along base64-encoded: a spawned process gets ``mpirun``'s
environment, not the spawning rank's (``-x`` variables would be missing).
"""

import base64
import json
import os
import sys

from .program import run


def main():
    environ = json.loads(base64.b64decode(sys.argv[1]))
    program = sys.argv[2:]
    for name, value in environ.items():  # the spawner left out the MPI runtime's own
        os.environ.setdefault(name, value)
    os.environ["ELASTIC_HVD_PROGRAM"] = json.dumps(program)

    from elastic_hvd.core import faults, growth, mpi_env  # read ELASTIC_HVD_*: after
    with growth.start_up_deadline():
        faults.at_joiner_start()  # a fault planned for this process (tests)
        growth.merge_with_parent(mpi_env.load_mpi())
    run(program)


if __name__ == "__main__":
    main()
