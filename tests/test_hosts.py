"""Jobs across several hosts, simulated on this machine (tests/hosts/): each host
has its own Open MPI daemon and hostname and the hosts talk TCP.  Needs root and
``unshare`` (CI runs as root)."""

import json
import os
import shutil
import signal
import time

import pytest

from mpijob import job_ranks, run_job

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                       reason="simulated hosts need root and unshare"),
]


def test_ranks_know_their_host_and_local_ranks(tmp_path):
    job = run_job("hosts.py", "layout", np=5, hosts="hostA:2,hostB:2,hostC:1",
                  tmp_path=tmp_path)
    results = [job.results[i] for i in range(5)]
    assert [r["host"] for r in results] == ["hostA", "hostA", "hostB", "hostB", "hostC"]
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1, 0]
    assert [r["local_rank"] for r in results] == [r["runtime_local_rank"] for r in results]
    assert [r["local_size"] for r in results] == [2, 2, 2, 2, 1]
    assert [(r["cross_rank"], r["cross_size"]) for r in results] == \
        [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert not any(r["homogeneous"] for r in results)
    assert {r["total"] for r in results} == {15}


def kill_ranks(host, after_step=20, signum=signal.SIGKILL, only=None):
    """A watcher: once every rank passed ``after_step``, send ``signum`` to the ranks
    on ``host`` (those of ``only``, original ids, if given), found by PID from outside."""
    def watch(out, job):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = [int(p.read_text() or 0) for p in out.glob("progress*")]
            if done and len(done) == len(job_ranks(job)) and min(done) >= after_step:
                break
            time.sleep(0.02)
        victims = {r: p for r, p in job_ranks(job, host).items() if only is None or r in only}
        for pid in victims.values():
            os.kill(pid, signum)
        (out / "victims").write_text(json.dumps(victims))
    return watch


def test_all_ranks_of_a_host_killed_the_others_go_on_and_the_job_ends(tmp_path):
    # hostB's daemon lives on, every rank on it is SIGKILLed from outside mid-loop.
    job = run_job("hosts.py", "steps", 120, np=6, hosts="hostA:2,hostB:2,hostC:2",
                  tmp_path=tmp_path, watcher=kill_ranks("hostB"), timeout=150)
    victims = json.loads((tmp_path / "out" / "victims").read_text())
    assert sorted(map(int, victims)) == [2, 3]
    assert sorted(job.results) == [0, 1, 4, 5], job.output[-3000:]
    for r in job.results.values():
        assert r["ids"] == [0, 1, 4, 5] and r["wrong"] == []
        assert sorted(i for e in r["events"] for i in e["lost"]) == [2, 3]
        assert r["hosts"] == ["hostA", "hostA", "hostC", "hostC"]
    assert [job.results[i]["local_rank"] for i in (0, 1, 4, 5)] == [0, 1, 0, 1]
    assert "MPI_Finalize did not return" not in job.output, job.output[-3000:]
