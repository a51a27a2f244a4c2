"""growth_scenarios.py behind a look at the environment (tests/test_cmdline_secrets.py).

    python spawned_env.py <steps>

Every process first writes ``env-<pid>.json``: whether Open MPI spawned it, and
what it sees of ``MY_CLOUD_TOKEN`` and of the failure detector's timeout (set
before ``MPI_Init`` in a spawned process).  An original rank then puts
``MY_CLOUD_TOKEN`` into its own environment, as a program that fetched a credential
would (from ``$TEST_OUT_DIR/token``): mpirun never had it, so a spawned process
sees it only if its spawner handed it over.  A spawned process waits for
``$TEST_OUT_DIR/scanned`` (the test has read every command line of the job) for at
most 30 s, then trains as growth_scenarios.py does.
"""

import json
import os
import sys
import time

import growth_scenarios

TOKEN = "MY_CLOUD_TOKEN"
DETECTOR_TIMEOUT = "OMPI_MCA_mpi_ft_detector_timeout"


def main(steps):
    out = os.environ["TEST_OUT_DIR"]
    with open("/proc/self/cmdline", "rb") as f:
        spawned = b"elastic_hvd.runner.join" in f.read().split(b"\0")
    seen = {"pid": os.getpid(), "spawned": spawned, "token": os.environ.get(TOKEN),
            "detector_timeout": os.environ.get(DETECTOR_TIMEOUT)}
    path = os.path.join(out, f"env-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(path + ".tmp", path)
    if TOKEN not in os.environ:
        with open(os.path.join(out, "token")) as f:
            os.environ[TOKEN] = f.read()
    deadline = time.monotonic() + 30
    while spawned and not os.path.exists(os.path.join(out, "scanned")) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    growth_scenarios.main(steps)


if __name__ == "__main__":
    main(int(sys.argv[1]))
