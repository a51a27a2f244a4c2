"""The Slurm tests (``make test-slurm``): one real cluster (cluster.py) for the session.

Not part of ``make test`` (but for test_launcher_units.py, which needs no cluster): the
cluster tests are collected only with ELASTIC_HVD_SLURM_TESTS=1, which the
Makefile's ``test-slurm`` target sets.  The cluster is stopped by the session's
finalizer, also when a test fails; each test then checks that nothing of its jobs is
left on any node.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cluster import Cluster  # noqa: E402

if os.environ.get("ELASTIC_HVD_SLURM_TESTS") != "1":
    collect_ignore_glob = ["test_slurm.py"]  # test_launcher_units.py: single-process, in make test

VENV_BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parent.parent / "workers"
#: What may run on a node between jobs: its slurmd (slurmstepd ends with its step).
NODE_DAEMONS = {"slurmd"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs on the test Slurm cluster")


@pytest.fixture(scope="session")
def cluster():
    needed = [tool for tool in ("slurmctld", "slurmd", "munged", "unshare", "nsenter", "ip")
              if not shutil.which(tool)]
    if os.geteuid() != 0 or needed:
        pytest.skip(f"the Slurm cluster needs root and {needed or 'nothing else'}")
    scratch = Path(os.environ.get("ELASTIC_HVD_SLURM_DIR") or
                   tempfile.mkdtemp(prefix="ehvd-slurm-"))
    cluster = Cluster(scratch).start()
    yield cluster
    strays = cluster.stop()
    if strays:
        print(f"\ncluster stop killed {len(strays)} processes of jobs: {strays}")


class Jobs:
    """sbatch/scontrol/scancel on the head node, as a user there would type them."""

    def __init__(self, cluster, tmp_path):
        self.cluster, self.tmp = cluster, tmp_path
        self.ids = []

    def env(self):
        return {"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    def sbatch(self, body, options=(), name="job"):
        """Submit a batch script (``#!/bin/sh``, ``#SBATCH`` lines from ``options``,
        then ``body``); its job id.  The job's output: ``<tmp>/<name>.out``, appended."""
        script = self.tmp / f"{name}.sh"
        script.write_text("#!/bin/sh\n" + "".join(f"#SBATCH {o}\n" for o in options) +
                          f"#SBATCH --output={self.tmp}/{name}.out --open-mode=append\n" +
                          f"export TMPDIR={self.tmp}\n" + body + "\n")
        done = self.cluster.sh(f"cd {self.tmp} && sbatch --parsable {script}", env=self.env())
        job = done.stdout.strip().split(";")[0]
        self.ids.append(job)
        return job

    def info(self, job):
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList...)."""
        out = self.cluster.sh(f"scontrol show job -o {job}", check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job):
        return self.info(job).get("JobState")

    def wait_state(self, job, states, timeout):
        """Wait until ``job`` is in one of ``states``; its info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} not {states} after {timeout} s: {info}\n"
                                     f"{self.output(job)[-3000:]}")
            time.sleep(0.3)

    def output(self, job, name="job"):
        path = self.tmp / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def scancel(self, job, *args):
        self.cluster.sh(f"scancel {' '.join(args)} {job}")


@pytest.fixture
def jobs(cluster, tmp_path):
    tmp_path.chmod(0o755)
    jobs = Jobs(cluster, tmp_path)
    yield jobs
    for job in jobs.ids:  # a failed test's job must not hold the nodes
        if jobs.state(job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                               "REQUEUED", "SUSPENDED"):
            jobs.scancel(job)
    left = wait_nodes_clean(cluster, 60)
    assert not left, f"processes of jobs left on the nodes: {left}"
    # every node idle again (a lost one revived) for the next test
    cluster.wait_for(lambda: cluster.idle() == set(cluster.nodes), 60, "every node idle")


def wait_nodes_clean(cluster, timeout):
    """Wait until only the node daemons run on every live node; what is left, killed."""
    deadline = time.monotonic() + timeout
    while True:
        left = {node: [p for p in cluster.processes_on(node) if p[1] not in NODE_DAEMONS]
                for node in cluster.nodes if cluster.ns.get(node)}
        left = {node: procs for node, procs in left.items() if procs}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for procs in left.values():
        for pid, _ in procs:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    return left


def results(out):
    """The ranks' reports (``rank<id>.json``) in ``out``, by original id."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(out).glob("rank*.json")}


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)
