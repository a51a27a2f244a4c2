"""Liveness: busy ranks stay, hung ranks go (real processes, real signals).

Failure detection must not depend on the GIL (a rank inside a long C call that
holds it is alive), a stopped rank is evicted after the heartbeat timeout, and the
stall watchdog (``--stall-timeout``) counts progress, not only collectives.
"""

import os
import signal

import pytest

from mpijob import run_job, until

pytestmark = pytest.mark.multirank

# The fast setting documented in docs/liveness.md.
FAST = ["--heartbeat-period", "0.5", "--heartbeat-timeout", "2"]


def assert_uniform(job, survivors):
    assert sorted(job.results) == survivors, job.output[-4000:]
    assert len({r["digest"] for r in job.results.values()}) == 1, job.output[-4000:]
    assert all(r["equals_survivor_sum"] for r in job.results.values())


def test_rank_holding_the_gil_for_30s_is_not_evicted(tmp_path):
    # Default heartbeat settings; rank 1 keeps the GIL inside one C call for 30 s.
    job = run_job("liveness.py", "gil", 1, 30, tmp_path=tmp_path, timeout=150)
    assert_uniform(job, [0, 1, 2, 3])
    assert job.results[1]["busy_s"] >= 29.5
    for r in job.results.values():
        assert r["ids"] == [0, 1, 2, 3] and r["events"] == [], r


def _stopped_rank_evicted(tmp_path, launcher):
    job = run_job("liveness.py", "none", -1, 0, "8", faults="rank=2,coll=4,signal=STOP",
                  launcher=launcher, tmp_path=tmp_path, timeout=120)
    assert_uniform(job, [0, 1, 3])
    [event] = job.results[0]["events"]
    assert event["lost"] == [2]
    return event["detect_s"]


def test_stopped_rank_is_evicted_with_defaults(tmp_path):
    # Default timeout 10 s (docs/liveness.md): evicted after it, never before.  The
    # upper bound only says that eviction comes: the detector's threads run late on a
    # loaded machine (22.4 s at a load average of 14-33 on 2 cores).
    detect = _stopped_rank_evicted(tmp_path, [])
    assert 8.0 < detect < 30.0, detect


@pytest.mark.check
def test_stopped_rank_is_evicted_fast_with_fast_setting(tmp_path):
    detect = _stopped_rank_evicted(tmp_path, FAST)
    assert 1.0 < detect < 4.5, detect


def test_busy_rank_that_ticks_progress_is_not_killed_by_stall_watchdog(tmp_path):
    # Rank 1 computes in pure Python (no collectives) for 8 s > stall timeout 3 s,
    # calling heartbeat.progress(); the others wait for it in an allreduce.
    job = run_job("liveness.py", "tick", 1, 8, launcher=["--stall-timeout", "3"],
                  tmp_path=tmp_path, timeout=120)
    assert_uniform(job, [0, 1, 2, 3])
    assert "no progress" not in job.output


def test_hung_rank_is_killed_with_a_message_and_the_others_go_on(tmp_path):
    job = run_job("liveness.py", "hang", 1, 600, launcher=["--stall-timeout", "3"],
                  tmp_path=tmp_path, timeout=120)
    assert_uniform(job, [0, 2, 3])
    lines = [line for line in job.output.splitlines() if "no progress" in line]
    assert len(lines) == 1 and "rank 1, pid " in lines[0], job.output[-4000:]
    [event] = job.results[0]["events"]
    assert event["lost"] == [1] and event["detect_s"] < 12.0


def test_whole_job_stall_kills_nobody_and_says_so(tmp_path):
    # Every rank computes without progress for longer than the stall timeout: no
    # rank waits for another, so killing would only end the job.  Nobody dies;
    # each rank prints one warning.
    job = run_job("liveness.py", "hang", -1, 6, launcher=["--stall-timeout", "2"],
                  tmp_path=tmp_path, timeout=120)
    assert_uniform(job, [0, 1, 2, 3])
    warnings = [line for line in job.output.splitlines() if "no progress" in line]
    assert warnings and all("not killing" in line for line in warnings), job.output[-4000:]


def _stop_after_merge(victim):
    """A watcher: once all 3 processes of spawned_stop.py are merged, SIGSTOP
    ``victim`` (2: the spawned one) and tell the others; SIGKILL it once they reported."""
    def watch(out_dir, marker):
        until(lambda: all((out_dir / f"pid{i}").exists() for i in range(3)), 100,
              "all 3 processes merged")
        pid = int((out_dir / f"pid{victim}").read_text())
        os.kill(pid, signal.SIGSTOP)
        (out_dir / "stopped").touch()
        until(lambda: all((out_dir / f"rank{i}.json").exists() for i in range(3) if i != victim),
              60, "the live processes reported")
        os.kill(pid, signal.SIGKILL)
    return watch


# Plain mpi4py, no elastic_hvd: under load (a load average of 14-33) the child's
# MPI_Init_thread fails in Open MPI's dynamic process management, and there is no spawned
# process to observe (docs/openmpi-quirks.md): the worker records it (report.upstream).
@pytest.mark.upstream("spawn_given_up")
@pytest.mark.parametrize("victim, seen", [(1, True), (2, False)], ids=["world_rank", "spawned"])
def test_open_mpi_detector_sees_a_frozen_spawned_process_never(tmp_path, victim, seen):
    # Open MPI 5.0.11's heartbeat detector runs one ring per MPI_COMM_WORLD
    # (ompi_comm_failure_detector_start observes ompi_mpi_comm_world only), and a
    # spawned process is a world of its own: nobody observes it.  A joined rank
    # that freezes (SIGSTOP) is never evicted and the job waits for ever (soak
    # finding (a)); issue 20 replaces respawn by hot spares inside mpirun's job.
    # When this fails for "spawned", Open MPI began to observe spawned processes.
    job = run_job("spawned_stop.py", np=2, launcher=[*FAST, "--mpi-args=--oversubscribe"],
                  tmp_path=tmp_path, timeout=120,
                  expect_rc=None, watcher=_stop_after_merge(victim))
    live = [i for i in range(3) if i != victim]
    assert sorted(job.results) == live, job.output[-4000:]
    for i in live:
        detected = job.results[i]["detected_s"]
        if seen:
            assert detected is not None and detected < 6.0, job.results
        else:
            assert detected is None, job.results  # waited 15 s: no error at all
