"""mpirun itself crashing (issue 41's follow-up to CI: PRRTE 3.0.14's heap damage).

prterun aborts at a random later allocation once a rank died inside a connect with a
hot spare (workarounds.TABLE ``prrte_connect_release``).  The ranks go with it: the
launcher must say so, with its own exit status, and start the job again from the
state it keeps.  The crash is sent from outside, as a real SIGSEGV to the real mpirun
(prterun catches SIGABRT to pass it on to the ranks, so a SIGABRT from outside is no
crash; glibc's abort() raises it again with the default action and kills it), at a
moment the test does not choose within the steps.
"""

import json
import os
import random
import signal

import pytest

from elastic_hvd.runner import relaunch
from elastic_hvd.runner.job import Ended
from mpijob import assert_resumed_from_the_kept_copy, job_ranks, parent_of, run_job, until

def crash_mpirun(after_lines):
    """A watcher: once rank 0 logged ``after_lines`` steps (and up to 0.3 s more),
    SIGSEGV the job's mpirun -- the parent of its ranks on this host."""
    def watch(out, job):
        steps = out / "steps0.jsonl"
        until(lambda: steps.exists() and len(steps.read_text().splitlines()) >= after_lines,
              120, f"rank 0 logged {after_lines} steps", every=0.02)
        ranks = until(lambda: job_ranks(job), 10, "the job's ranks")
        mpirun = parent_of(ranks[min(ranks)])
        with open(f"/proc/{mpirun}/comm") as f:
            assert f.read().strip() == "prterun", "the ranks' parent is not mpirun"
        os.kill(mpirun, signal.SIGSEGV)
        (out / "crashed").write_text(json.dumps(mpirun))
    return watch


@pytest.mark.multirank
def test_a_crashed_mpirun_is_relaunched_from_the_state_kept_in_memory(tmp_path):
    job = run_job("elastic_fit.py", 3, np=4, tmp_path=tmp_path,
                  env={"TEST_STEP_SLEEP": "0.1", "ELASTIC_HVD_REPLICA_BUDGET": "1"},
                  timeout=300, watcher=crash_mpirun(8 + random.randrange(4)))
    out = tmp_path / "out"
    assert (out / "crashed").exists()
    assert ("exit status 7: the MPI runtime crashed: mpirun died of SIGSEGV while the ranks "
            "trained") in job.output, job.output[-4000:]
    assert "relaunching (4 ranks; relaunch 1 of 3)" in job.output, job.output[-4000:]
    assert_resumed_from_the_kept_copy(job, out)


@pytest.mark.multirank
def test_a_crashed_mpirun_not_relaunched_ends_the_job_with_its_own_status(tmp_path):
    job = run_job("elastic_fit.py", 3, np=2, tmp_path=tmp_path, launcher=["--max-relaunches", "0"],
                  env={"TEST_STEP_SLEEP": "0.1"}, timeout=180, expect_rc=None,
                  watcher=crash_mpirun(5))
    assert job.returncode == relaunch.EXIT_RUNTIME_CRASHED, job.output[-4000:]
    assert "relaunching" not in job.output


def _outcome(rank, members, code=0):
    return {"process": f"vm-{100 + rank}", "id": rank, "code": code, "final": True,
            "members": members}


@pytest.mark.parametrize("sig, finished, status, words", [
    (signal.SIGABRT, False, relaunch.EXIT_RUNTIME_CRASHED, "mpirun died of SIGABRT while"),
    (signal.SIGSEGV, False, relaunch.EXIT_RUNTIME_CRASHED, "mpirun died of SIGSEGV while"),
    (signal.SIGABRT, True, 0, "mpirun crashed (SIGABRT: an Open MPI bug"),
    (signal.SIGKILL, False, 137, "mpirun exit status 137"),  # sent by someone: no relaunch
])
def test_the_verdict_on_mpiruns_own_death(sig, finished, status, words):
    outcomes = [_outcome(0, [0, 1]), _outcome(1, [0, 1])] if finished else []
    code, why, cause = relaunch.verdict(Ended(128 + sig, outcomes, b"", sig))
    assert (code, cause is not None) == (status, status == relaunch.EXIT_RUNTIME_CRASHED)
    assert words in why
