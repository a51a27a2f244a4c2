"""Growing back (issue 6) on the bare core: real spawns, real kills, hard timeouts.

The worker (workers/growth_scenarios.py) trains a running total with one
allreduce per step; the step that adopts a joiner hands it the total.  Every
rank alive at the end must hold the same total, which equals the sum of what
the live members contributed step by step -- a joiner that started from a wrong
state, or a step it missed or repeated, changes it.
"""

import os
import random
import signal
import time

import pytest

import known_failures
from elastic_hvd.runner import relaunch
from mpijob import job_ranks, killed_at_the_end, run_job, spawned_processes, until

pytestmark = pytest.mark.multirank

STEPS = 120


#: The workarounds.TABLE entry of a daemon that aborts after growth across hosts: Open MPI
#: 5.0.11 damages the heap of the daemons involved (docs/openmpi-quirks.md).
DAEMON_ABORT = "cross_host_daemon_abort"


def record_node_loss(job, hosts=True):
    """Record the daemon abort (tests/known_failures.py) where a job on simulated ``hosts``
    whose test touches no daemon ended in a node loss: the launcher's exit status says so
    (``--max-relaunches 0``), not its words."""
    if hosts and job.returncode == relaunch.EXIT_NODE_LOST:
        known_failures.record(job.out_dir, DAEMON_ABORT, launcher_exit_status=job.returncode)


def grow(tmp_path, faults, *args, launcher=("--respawn",), timeout=180, env=None, watcher=None,
         np_=4, hosts=None):
    """Run the growth worker and check it trained correctly: ``(job, results, ids)``."""
    job = run_job("growth_scenarios.py", STEPS, *args, np=np_, faults=faults, launcher=launcher,
                  tmp_path=tmp_path, timeout=timeout, env=env, watcher=watcher, hosts=hosts,
                  expect_rc=None)
    return (job, *grown(job, hosts))


def grown(job, hosts=None):
    """``(results, final ids)`` of a growth job that must have trained correctly:
    exit 0, every rank alive at the end holding the same total, no step lost or
    repeated."""
    record_node_loss(job, hosts)
    assert job.returncode == 0, f"exit status {job.returncode}\n{job.output[-6000:]}"
    results = job.results
    final_ids = results[min(results)]["ids"]
    assert sorted(results) == sorted(final_ids), job.output[-4000:]
    assert len({tuple(r["total"]) for r in results.values()}) == 1, "ranks disagree"
    for r in results.values():  # no step lost or repeated, joiners started from the live total
        assert r["total"][0] == r["expected"], (r["total"][0], r["expected"])
    assert_every_departure_reported(results[final_ids[0]]["events"], final_ids)
    return results, final_ids


def assert_every_departure_reported(events, final_ids):
    """Every rank that was a member (the starting ones, and each one gained) and is not
    among ``final_ids`` is the ``lost`` of exactly one event: a loss that no event
    reports was announced to nobody and rescaled no learning rate."""
    if not events:
        return
    members = set(range(events[0]["old_size"])) | {i for e in events for i in e["gained"]}
    lost = sorted(i for e in events for i in e["lost"])
    assert lost == sorted(members - set(final_ids)), ("a departure that no event reports",
                                                      final_ids, events)


def check_history(results, final_ids):
    events = results[final_ids[0]]["events"]
    for r in results.values():
        assert [(e["lost"], e["gained"]) for e in r["events"]] == \
            [(e["lost"], e["gained"]) for e in events]
    size = 4
    for e in events:
        assert e["old_size"] == size
        size = e["new_size"]
        assert size == e["old_size"] - len(e["lost"]) + len(e["gained"])
    assert size == len(final_ids) == 4
    return events


@pytest.mark.check
def test_respawn_replaces_a_killed_rank(tmp_path):
    job, results, ids = grow(tmp_path, "rank=2,step=10")
    assert job.returncode == 0
    events = check_history(results, ids)
    assert [(e["lost"], e["gained"]) for e in events] == [([2], []), ([], [4])]
    assert ids == [0, 1, 3, 4]  # survivors keep their order, the joiner comes last
    assert results[4]["joined_at"] > 10
    assert results[0]["sizes"][-1] == 4 and 3 in results[0]["sizes"]
    # Before it joined, the joiner had no id at all (not a made-up one).
    assert results[4]["before_join"] == {"original_id": None, "ids": []}


def test_a_stopped_joiner_is_killed_by_a_rank_on_its_host(tmp_path):
    # Rank 2 dies at step 10 and a respawned process (id 4) joins; a watcher outside the
    # job SIGSTOPs it at a random moment once it is a member.  Open MPI's detector never
    # watches a spawned process (test_liveness.py), so every rank waited for it for ever
    # (the soak sent such stops as kills).  Now the lowest rank of its host kills it
    # after 1.5 heartbeat timeouts (3 s here), the others repair, and a second respawned
    # process (id 5) refills the job: 4 ranks, totals exact.
    stopped = []

    def watch(out, marker):
        until(lambda: list(out.glob("joined-*")), 60, "a respawned process joined")
        [joiner] = spawned_processes(marker)
        assert (out / f"joined-{joiner}").exists()
        time.sleep(random.uniform(0, 0.5))
        stopped.append(joiner)
        os.kill(joiner, signal.SIGSTOP)

    with killed_at_the_end(stopped):
        job = run_job("growth_scenarios.py", 400, np=4, faults="rank=2,step=10",
                      launcher=["--respawn", "--heartbeat-period", "0.5",
                                "--heartbeat-timeout", "2"],
                      tmp_path=tmp_path, timeout=180, expect_rc=None, watcher=watch)
        results, ids = grown(job)
        assert stopped, job.output[-4000:]
        killed = [line for line in job.output.splitlines()
                  if f"pid {stopped[0]} has been stopped for" in line]
        assert len(killed) == 1 and "killing it" in killed[0], job.output[-4000:]
        events = check_history(results, ids)
        assert [(e["lost"], e["gained"]) for e in events] == \
            [([2], []), ([], [4]), ([4], []), ([], [5])]
        assert ids == [0, 1, 3, 5]
        assert 2.5 < events[2]["detect_s"] < 30, events[2]  # not before 1.5 x 2 s


def test_a_joiner_stopped_before_it_joins_is_killed_and_another_one_joins(tmp_path):
    # Rank 2 dies at step 10 and a respawned process starts up (4 s, as one importing
    # TensorFlow); a watcher outside the job SIGSTOPs it at a random moment of that
    # start-up, after its merge.  It could never say it is ready: the join stayed
    # pending for good and the job ended at 3 ranks.  Now its hello told the ranks its
    # pid, the lowest rank of its host kills it after 1.5 heartbeat timeouts, the join
    # breaks, and a second respawned process takes the place: 4 ranks, totals exact.
    stopped = []

    def watch(out, marker):
        joiners = until(lambda: [p for p in spawned_processes(marker)
                                 if (out / f"started-{p}").exists()], 60,
                        "a respawned process started")
        time.sleep(random.uniform(0, 2))
        stopped.append(joiners[0])
        os.kill(joiners[0], signal.SIGSTOP)

    with killed_at_the_end(stopped):
        job = run_job("growth_scenarios.py", 800, "--joiner-delay", 4, np=4,
                      faults="rank=2,step=10",
                      launcher=["--respawn", "--heartbeat-period", "0.5",
                                "--heartbeat-timeout", "2"],
                      tmp_path=tmp_path, timeout=180, expect_rc=None, watcher=watch)
        results, ids = grown(job)
        assert stopped, job.output[-4000:]
        killed = [line for line in job.output.splitlines() if line.startswith(
            f"elastic_hvd: process {stopped[0]}, spawned to join the job, has been stopped for")]
        assert len(killed) == 1 and "killing it" in killed[0], job.output[-4000:]
        events = check_history(results, ids)
        assert [(e["lost"], e["gained"]) for e in events] == [([2], []), ([], [4])]
        assert ids == [0, 1, 3, 4]


def test_joiner_killed_after_joining_and_two_lost_at_once(tmp_path):
    # Ranks 1 and 2 die together; replacements join one by one (ids 4, 5);
    # then replacement 4 dies and id 6 replaces it.
    job, results, ids = grow(tmp_path, "rank=1,step=10;rank=2,step=10;rank=4,step=60")
    events = check_history(results, ids)
    assert [(e["lost"], e["gained"]) for e in events] == \
        [([1, 2], []), ([], [4]), ([], [5]), ([4], []), ([], [6])]
    assert ids == [0, 3, 5, 6]


def test_rank_dies_during_the_spawn_itself(tmp_path):
    # Rank 1 dies in the middle of the first respawn (between spawn and merge).
    job, results, ids = grow(tmp_path, "rank=2,step=10;rank=1,spawn=1,delay=0.05")
    events = check_history(results, ids)
    assert sorted(i for e in events for i in e["lost"]) == [1, 2]
    assert len([e for e in events if e["gained"]]) == 2
    assert job.returncode == 0  # the survivors completed: elastic-hvd-run says so


@pytest.mark.parametrize("how", ["--die-before-join", "--raise-before-join"])
def test_joiner_dies_before_joining(tmp_path, how):
    job, results, ids = grow(tmp_path, "rank=2,step=10", how)
    events = check_history(results, ids)
    # The first replacement died while starting: the join was abandoned and retried.
    assert [(e["lost"], e["gained"]) for e in events] == [([2], []), ([], [4])]
    assert (tmp_path / "out" / "died").exists()  # the first joiner did die
    assert job.returncode == 0
    if how == "--raise-before-join":  # ended like a crash: the ranks saw it die
        assert "JoinOrderError" in job.output
        assert "elastic-hvd-run: a process spawned to join the job (" in job.output
        assert ") raised an uncaught exception and left the job:" in job.output


#: What Open MPI printed around a joiner the job gave up: its failed non-blocking
#: barrier, libevent, and mpirun aborting the job for a process that exited 0
#: without MPI_Finalize.
OPEN_MPI_NOISE = ("NBC_Progress", "Epoll ADD", "LAUNCHER JOB OBJECT NOT FOUND",
                  "exiting improperly", "PRTE ERROR")
#: What a process says when its MPI_Finalize hung and its deadline ended it.
FINALIZE_CUT = "MPI_Finalize did not return within"
GIVEN_UP = ("spawned to join the running job, exits without joining: the running job gave it "
            "up before adopting it")


CHANGED = "the job's ranks changed while it started"
ENDED = "training ended before it was ready"


@pytest.mark.parametrize("faults, steps, survivors, reasons", [
    # rank 1 dies while the replacement of rank 2 starts up; the second one is still
    # starting when training ends
    ("rank=2,step=10;rank=1,step=30", 120, [0, 3], [CHANGED, ENDED]),
    ("rank=2,step=10", 40, [0, 1, 3], [ENDED]),  # training ends while it starts up
], ids=["ranks_change", "training_ends_first"])
def test_joiner_given_up_leaves_at_once_in_one_line(tmp_path, faults, steps, survivors,
                                                    reasons):
    # Joiners start up for longer than the test waits: only one that leaves as
    # soon as the job gives it up lets the job end by itself.
    job = run_job("growth_scenarios.py", steps, "--joiner-delay", 600, np=4, faults=faults,
                  launcher=("--respawn",), tmp_path=tmp_path, timeout=120)
    assert sorted(job.results) == survivors
    assert not any(e["gained"] for r in job.results.values() for e in r["events"])
    lines = [line for line in job.output.splitlines() if GIVEN_UP in line]
    assert len(lines) == len(reasons), job.output[-4000:]
    assert all(line.startswith("elastic_hvd: process ") for line in lines), lines
    # Each says which of the two causes it was (the running ranks' verdict).
    assert [line.split(GIVEN_UP + ": ")[1][:len(r)] for line, r in zip(lines, reasons)] == reasons
    noise = OPEN_MPI_NOISE
    if FINALIZE_CUT in job.output:
        # The finalize race after a spawn (docs/openmpi-quirks.md), said by the process
        # it cut short (seen under load): prterun then misses that process's job object.
        noise = tuple(n for n in noise if n != "LAUNCHER JOB OBJECT NOT FOUND")
    for line in noise:
        assert line not in job.output, job.output[-4000:]
    assert "mpirun still waits" not in job.output  # elastic-hvd-run did not have to end it


def test_joiner_given_up_inside_a_long_c_call_ends_itself_loudly(tmp_path):
    # Seen in the soak: a given-up joiner stayed 16 minutes (the exception that ends
    # it waits for Python code to run, and its main thread was in a call that never
    # came back) and kept mpirun from ending.  Here the joiner sleeps in one C call.
    job = run_job("growth_scenarios.py", 40, "--joiner-blocked", 600, np=4,
                  faults="rank=2,step=10", launcher=("--respawn",), tmp_path=tmp_path,
                  timeout=120)
    assert sorted(job.results) == [0, 1, 3]
    assert f"{GIVEN_UP}: {ENDED}" in job.output, job.output[-4000:]
    assert "did not exit within 10s" in job.output, job.output[-4000:]
    assert "time.sleep(joiner_blocked)" in job.output  # its main thread's stack, said
    assert "mpirun still waits" not in job.output  # it ended itself
    assert job.returncode == 0


@pytest.mark.parametrize("signal", ["HANG", "KILL"])
def test_spawn_that_never_completes_is_given_up(tmp_path, signal):
    # The first replacement hangs in start-up (HANG, as one stuck in MPI_Init) or dies
    # before MPI_Init (KILL): either way MPI_Comm_spawn never returns in the spawning
    # root.  After ELASTIC_HVD_SPAWN_TIMEOUT the ranks give that spawn up, train on,
    # and the next spawn brings the job back to 4 ranks.
    job, results, ids = grow(tmp_path, f"rank=2,step=10;joiner=1,signal={signal}",
                             env={"ELASTIC_HVD_SPAWN_TIMEOUT": "5"})
    events = check_history(results, ids)
    assert [(e["lost"], e["gained"]) for e in events] == [([2], []), ([], [4])]
    assert ids == [0, 1, 3, 4]
    assert "not done after 5s (ELASTIC_HVD_SPAWN_TIMEOUT)" in job.output
    assert job.returncode == 0


def _term_rank_zero_at(step):
    """A watcher: SIGTERM original rank 0 once it reported ``step``."""
    def reached(out_dir):
        try:
            return int((out_dir / "step0").read_text() or -1) >= step
        except (OSError, ValueError):  # not written yet, or being written
            return False

    def watch(out_dir, marker):
        until(lambda: reached(out_dir), 90, f"original rank 0 reported step {step}", every=0.01)
        os.kill(int((out_dir / "pid0").read_text()), signal.SIGTERM)
    return watch


def test_rank_that_leaves_while_a_join_pends_does_not_hang(tmp_path):
    # Seen in the soak: SIGTERM of rank 0 after a step (it was copying the state) while
    # a joiner started up; the others were in poll_join's allreduce, which mpi4py's
    # pickled allreduce ran on a hidden duplicate communicator that the leaving rank's
    # revoke does not reach: every rank spun at 100 % CPU for ever.
    job = run_job("leave_while_join_pends.py", 200, np=3, launcher=("--respawn",),
                  tmp_path=tmp_path, timeout=90, watcher=_term_rank_zero_at(20))
    assert sorted(job.results) == [1, 2], job.output[-4000:]
    for r in job.results.values():
        assert r["ids"] == [1, 2]
        assert [e["lost"] for e in r["events"]] == [[0]]
    assert "leaves the job; the other ranks go on without it" in job.output


def _kill_a_rank_inside_the_spawn(out_dir, marker):
    """A watcher: SIGKILL world rank 1 as soon as a spawned process appears (the
    ranks then wait inside MPI_Comm_spawn for its MPI_Init, ~1 s)."""
    until(lambda: spawned_processes(marker), 60, "a spawned process appeared", every=0.005)
    os.kill(job_ranks(marker)[1], signal.SIGKILL)


def test_rank_killed_inside_the_spawn_is_seen_at_once(tmp_path):
    # Soak finding (b): a rank SIGKILLed while the others were inside MPI_Comm_spawn
    # stalled everyone until the spawn timeout (60 s; 20 s in the tests), because
    # the spawn does not fail by itself when a member dies.
    job, results, ids = grow(tmp_path, "rank=2,step=10", watcher=_kill_a_rank_inside_the_spawn)
    events = check_history(results, ids)
    [loss] = [e for e in events if e["lost"] == [1]]
    assert loss["detect_s"] < 5.0, events
    assert "not done after" not in job.output, job.output[-3000:]


def test_strict_mode_anomaly_in_a_spawned_process_ends_the_whole_job(tmp_path):
    # MPI_Abort in a process spawned into the job ends only the spawned job (seen in the
    # soak); the launcher ends the rest, with strict mode's exit status.
    started = time.monotonic()
    job = run_job("growth_scenarios.py", 400, np=3, faults="rank=1,step=10",
                  launcher=["--respawn", "--strict"], tmp_path=tmp_path, timeout=180,
                  env={"TEST_ANOMALY_IN_JOINER": "1"}, expect_rc=70)
    assert "elastic_hvd: ANOMALY #1" in job.output, job.output[-3000:]
    assert "strict mode: a process met an anomaly; ending the whole job" in job.output
    assert not job.results  # nobody finished the 400 steps (~25 s)
    assert time.monotonic() - started < 60
