"""A rank that ends as its case says, for tests/test_command_forms.py.

    python command_forms.py success|exit|crash|kill

Runnable as a script, as ``-m tests.workers.command_forms`` and as ``-c "<this
file's text>"`` (so it names no ``__file__``).  Every case joins the job first (a
resilient allreduce); ``kill`` writes this process's pid to
``$TEST_OUT_DIR/pid<world rank>`` and trains on until the test SIGKILLs it.
"""

import os
import sys
import time

import numpy as np

from elastic_hvd import core

case = sys.argv[1]
comm = core.init()
comm.allreduce(np.ones(4, dtype=np.float32))
if case == "exit":
    sys.exit(3)
if case == "crash":
    os.abort()
if case == "kill":
    world = os.environ["OMPI_COMM_WORLD_RANK"]
    with open(os.path.join(os.environ["TEST_OUT_DIR"], f"pid{world}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(f.name, f.name[:-len(".tmp")])
    end = time.monotonic() + 60
    while time.monotonic() < end:  # the test kills it long before
        comm.allreduce(np.ones(4, dtype=np.float32))
        time.sleep(0.05)
    sys.exit(9)  # not killed: the test fails on this status
