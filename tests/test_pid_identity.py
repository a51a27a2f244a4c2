"""Signals only to the process meant (issue 41, finding 9): a pid the ranks learned from
each other names that process only while it lives; once reused, the kill is refused in
one line (``elastic_hvd.core.signals``)."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from elastic_hvd.core import config, invitation, process, signals
from elastic_hvd.core.stopped_peers import StoppedPeers, state_of
from mpijob import job_ranks, killed_at_the_end, run_job, until
from test_units import _Members

#: Where the kernel keeps the last pid it gave (root may set it: the next fork gets the one after).
LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def _sleep(seconds=60):
    return subprocess.Popen(["sleep", str(seconds)])


def test_kill_refuses_a_pid_whose_start_time_is_not_the_recorded_one(capfd):
    proc = _sleep()
    try:
        right = signals.Identity(proc.pid, signals.start_of(proc.pid))
        assert not signals.kill(right._replace(start=right.start - 1), "a test's sleep")
        time.sleep(0.2)
        assert proc.poll() is None  # it survived
        line = f"elastic_hvd: a test's sleep: not signalled: its pid {proc.pid} was reused"
        assert line in capfd.readouterr().err
        assert signals.kill(right, "a test's sleep")
        assert proc.wait(10) == -signal.SIGKILL
        assert not signals.kill(right, "a test's sleep")  # gone (a zombie reaped): no line
        assert capfd.readouterr().err == ""
    finally:
        proc.kill()
        proc.wait()


def test_kill_checks_the_start_time_without_pidfds_too(monkeypatch):
    # A kernel before 5.3 (or a seccomp filter) refuses pidfd_open: the check holds.
    def no_pidfds(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    proc = _sleep()
    try:
        right = signals.Identity(proc.pid, signals.start_of(proc.pid))
        assert not signals.kill(right._replace(start=right.start + 1), "a test's sleep")
        assert proc.poll() is None
        assert signals.kill(right, "a test's sleep")
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_process_tells_its_identity_in_a_joiners_hello():
    me = signals.mine()
    assert me.pid == os.getpid() and me.start == signals.start_of(os.getpid())
    assert invitation.read_hello(invitation.hello()) == (socket.gethostname(), me)


def test_the_stopped_peer_watch_leaves_a_reused_pid_alone():
    # Real stopped processes; a and the joiner j are who the members say they are, b and
    # the joiner k hold the pid of a member (a joiner) that ended: their start times
    # differ from the ones told.
    here = socket.gethostname()
    a, b, j, k = procs = [_sleep() for _ in range(4)]
    ident = {p.pid: signals.Identity(p.pid, signals.start_of(p.pid)) for p in procs}
    stale = {p.pid: ident[p.pid]._replace(start=ident[p.pid].start - 1) for p in (b, k)}
    settings = config.from_environ({"ELASTIC_HVD_HEARTBEAT_PERIOD": "0.5",
                                    "ELASTIC_HVD_HEARTBEAT_TIMEOUT": "2"})
    try:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while any(state_of(ident[p.pid]) != "T" for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state_of(stale[b.pid]) is None  # another process holds that pid now
        members = _Members({3: (here, signals.mine()), 7: (here, ident[a.pid]),
                            9: (here, stale[b.pid])},
                           joiners=[(here, ident[j.pid]), (here, stale[k.pid])])
        old = process.use(process.Runtime(settings=settings, comm=members, growth=members))
        try:
            watch = StoppedPeers()
            assert watch.look(100.0) == []  # first seen stopped
            assert watch.look(103.0) == [a.pid, j.pid]
            assert a.wait(10) == j.wait(10) == -signal.SIGKILL
            assert b.poll() is None and k.poll() is None
        finally:
            process.use(old)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _take_pid(pid, tries=50):
    """A ``sleep`` started with exactly ``pid`` (free now): the kernel is told that the
    last pid it gave is the one before.  Another process forking meanwhile may take it:
    tried again.  None if it never came."""
    for _ in range(tries):
        LAST_PID.write_text(str(pid - 1))
        proc = _sleep(600)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.multirank
@pytest.mark.serial  # it steers the next pid machine-wide: a test beside it would take it
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(LAST_PID, os.W_OK),
                    reason="choosing the next pid needs root")
def test_the_fence_spares_a_process_that_got_the_lost_ranks_pid(tmp_path):
    # Rank 0, the fencer of this host, is stopped; rank 2 is killed, and once it is
    # reaped its pid goes to a sleep.  Rank 0 goes on: its repair's fence targets rank 2's
    # pid, which names the sleep now.  It must survive (eb33c9b SIGKILLed it).
    placed = {}
    with killed_at_the_end([]) as leftovers:
        def watcher(out, marker):
            until(lambda: len(list(out.glob("progress*"))) >= 3, 60, "all 3 ranks train")
            ranks = job_ranks(marker)
            fencer, placed["pid"] = ranks[0], ranks[2]
            os.kill(fencer, signal.SIGSTOP)
            try:
                os.kill(placed["pid"], signal.SIGKILL)
                until(lambda: not Path(f"/proc/{placed['pid']}").exists(), 60,
                      "the killed rank reaped by its parent, the daemon", every=0.005)
                placed["sleep"] = sleep = _take_pid(placed["pid"])
                if sleep is not None:
                    leftovers.append(sleep.pid)
            finally:
                os.kill(fencer, signal.SIGCONT)

        job = run_job("hosts.py", "steps", 400, np=3, tmp_path=tmp_path, watcher=watcher,
                      timeout=120)
        sleep = placed.get("sleep")
        assert sleep is not None, f"pid {placed.get('pid')} went to another process first"
        assert sorted(job.results) == [0, 1], job.output[-3000:]
        assert all(r["wrong"] == [] and r["ids"] == [0, 1] for r in job.results.values())
        assert sleep.poll() is None, f"the fence killed process {sleep.pid} (a sleep)"
        assert (f"elastic_hvd: the lost id 2: not signalled: its pid {sleep.pid} "
                "was reused") in job.output
    sleep.wait()
