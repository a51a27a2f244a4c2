"""The stall watchdog's waiting board trusts only what this job made (issue 41, finding 4).

A word on the board kills a rank (``--stall-timeout``), so the board must not take
another user's word: before, one fake file that a second user kept fresh in a
shared board killed both ranks of a healthy job, and a symlink planted at a rank's
board file made the job create a file wherever the link pointed.  The second user
is real: uid 65534 through ``setpriv`` (the tests run as root, as CI does).
"""

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from elastic_hvd.core.heartbeat import WaitingBoard
from mpijob import WORKERS, job_ranks, run_job, run_plain_mpirun, until
from second_user import AS_NOBODY, as_nobody, needs_root, reachable_dir



@pytest.fixture
def top():
    with reachable_dir("board_safety-") as path:
        yield path


def shared_board(top, mode, name="board"):
    board = top / name
    board.mkdir()
    board.chmod(mode)
    return board


def said_waiting(info):
    """Whether a board entry is a rank's file after it said that it waits (its
    files start at mtime 0)."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == 0 and info.st_mtime > 0


def refused_at_init(output, started, why):
    assert time.monotonic() - started < 45, output[-4000:]  # promptly, not a hang
    assert "UnsafePathError: waiting board (ELASTIC_HVD_WAITING_BOARD)" in output, output[-4000:]
    assert why in output, output[-4000:]


# -- which files count (one process, no MPI) -------------------------------------------

@needs_root
def test_only_fresh_regular_files_of_this_user_and_job_count(top, monkeypatch):
    monkeypatch.setenv(WaitingBoard.ENV, "")  # the board sets it: restored after the test
    monkeypatch.setenv("ELASTIC_HVD_SHARED_DIRS", "1")
    board = shared_board(top, 0o777)
    me = WaitingBoard.of_job(str(board), {"PMIX_NAMESPACE": "prterun-hostA-4242@1"})
    # A process spawned into the job has a namespace of its own: the same job all the same.
    assert me.prefix == f"{WaitingBoard.job_id({'PMIX_NAMESPACE': 'prterun-hostA-4242@2'})}."
    other_job = WaitingBoard.job_id({"PMIX_NAMESPACE": "prterun-hostA-4243@1"})
    assert me.prefix != f"{other_job}."
    [mine] = os.listdir(board)
    assert mine.startswith(me.prefix) and (board / mine).stat().st_mode & 0o777 == 0o600
    me.say_waiting()
    assert not me.others_waited_within(5)  # its own word only
    as_nobody("touch", board / f"{me.prefix}stranger")
    (board / f"{other_job}.hostB-1").touch()  # ours, fresh, another job's
    (board / f"{me.prefix}link").symlink_to(board / mine)  # fresh, ours, but a link
    os.mkfifo(board / f"{me.prefix}fifo")
    assert not me.others_waited_within(5)
    (board / f"{me.prefix}hostB-4243").touch()  # a peer of this job, this user
    assert me.others_waited_within(5)
    os.utime(board / f"{me.prefix}hostB-4243", (0, time.time() - 10))  # said 10 s ago
    assert not me.others_waited_within(5)
    me.leave()
    assert mine not in os.listdir(board)


# -- real jobs ----------------------------------------------------------------------------

@pytest.mark.multirank
@needs_root
def test_a_strangers_fresh_files_on_a_shared_board_kill_no_rank(top, tmp_path):
    # Both ranks compute for 6 s without progress, longer than the stall timeout; nobody
    # waits, so nobody may be killed.  Meanwhile the second user keeps a file "fake"
    # fresh on the board and, for each name there, one with the same prefix (the job's
    # id, once the ranks' files show it).  Before: both ranks killed themselves,
    # "exit status 1: no rank completed".
    board = shared_board(top, 0o1777)
    forge = ('while :; do for f in "$0"/*; do [ -e "$f" ] && n=${f##*/} && '
             'touch "$0/${n%%.*}.stranger"; done; touch "$0/fake"; sleep 0.2; done')
    stranger = subprocess.Popen([*AS_NOBODY, "sh", "-c", forge, str(board)],
                                start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        job = run_job("liveness.py", "hang", -1, 6, np=2, launcher=["--stall-timeout", "2"],
                      env={"ELASTIC_HVD_WAITING_BOARD": board, "ELASTIC_HVD_SHARED_DIRS": "1"},
                      tmp_path=tmp_path, timeout=120, expect_rc=None)
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()
    assert job.returncode == 0, job.output[-4000:]
    assert sorted(job.results) == [0, 1], job.output[-4000:]
    warnings = [line for line in job.output.splitlines() if "no progress" in line]
    assert warnings and all("not killing" in line for line in warnings), job.output[-4000:]
    forged = [p.name for p in board.iterdir() if re.fullmatch(r"[0-9a-f]{16}\.stranger", p.name)]
    assert forged, "the stranger never forged a file with the job's id"


@pytest.mark.multirank
@needs_root
def test_a_link_planted_at_a_ranks_board_file_is_not_written_through(top, tmp_path):
    # A board others may write without the sticky bit (shared, intended).  As the ranks
    # start, the second user plants a link at each one's board file name (<host>-<pid>
    # before) pointing into a directory only root may write.  Rank 0 then waits in a
    # collective while rank 1 computes (ticking progress): it says so on the board.
    # Before: that created <victim>/<pid> through the link.
    board = shared_board(top, 0o777)
    victim = top / "victim"
    victim.mkdir(mode=0o755)
    said = []

    def saying_waiting():
        with contextlib.suppress(OSError):  # a file gone meanwhile: look again
            said.extend(p.name for p in board.iterdir() if said_waiting(p.lstat()))
        return said

    def plant(_out_dir, marker):
        ranks = until(lambda: len(job_ranks(marker)) >= 2 and job_ranks(marker), 60,
                      "both ranks started", every=0.02)
        for pid in ranks.values():
            subprocess.run([*AS_NOBODY, "ln", "-s", str(victim / str(pid)),
                            str(board / f"{socket.gethostname()}-{pid}")], check=True)
        until(saying_waiting, 60, "a rank said on the board that it waits")

    job = run_job("liveness.py", "tick", 1, 4, np=2, launcher=["--stall-timeout", "2"],
                  env={"ELASTIC_HVD_WAITING_BOARD": board, "ELASTIC_HVD_SHARED_DIRS": "1"},
                  tmp_path=tmp_path, timeout=120, watcher=plant)
    assert sorted(job.results) == [0, 1], job.output[-4000:]
    assert list(victim.iterdir()) == [], "the job wrote through a planted link"
    assert said, "no rank ever said on the board that it waits"


@pytest.mark.multirank
def test_a_hung_process_spawned_into_the_job_hears_the_ranks_that_wait_for_it(tmp_path):
    # A spawned process has a PMIx namespace of its own (prterun-<host>-<pid>@2; the
    # ranks' is ...@1): its board files must carry the same job id as theirs, or its
    # watchdog hears nobody ("not killing it") and the job waits a minute for it.
    job = run_job("board_joiner.py", 100, np=2, faults="rank=1,step=3", tmp_path=tmp_path,
                  launcher=["--respawn", "--stall-timeout", "2", "--mpi-args=--oversubscribe"],
                  timeout=120)
    killed = [line for line in job.output.splitlines() if "killing it so that" in line]
    assert len(killed) == 1 and "rank 1 (id 2), pid " in killed[0], job.output[-4000:]
    assert 0 in job.results and 2 not in job.results and job.seconds < 50, job.output[-4000:]


@pytest.mark.multirank
@needs_root
def test_a_board_another_user_owns_is_refused_on_every_rank(top, tmp_path):
    board = shared_board(top, 0o1777, "public") / "board"  # as /tmp is
    as_nobody("mkdir", "-m", "755", board)
    started = time.monotonic()
    job = run_job("liveness.py", "none", -1, 0, np=2, launcher=["--stall-timeout", "2"],
                  env={"ELASTIC_HVD_WAITING_BOARD": board}, tmp_path=tmp_path, timeout=90,
                  expect_rc=1)
    refused_at_init(job.output, started, "belongs to uid 65534, not to this job's user (root)")
    assert re.search(r"world rank [01] raised the same at the same place as world rank [01]",
                     job.output), job.output[-4000:]
    assert "no rank completed: all 2 ranks raised an uncaught exception" in job.output
    assert list(board.iterdir()) == []


@pytest.mark.multirank
def test_a_board_others_may_write_is_refused_on_every_rank_under_plain_mpirun(top, tmp_path):
    board = shared_board(top, 0o777)
    started = time.monotonic()
    returncode, said = run_plain_mpirun(
        2, {"ELASTIC_HVD_WAITING_BOARD": board, "ELASTIC_HVD_STALL_TIMEOUT": 2,
            "TEST_OUT_DIR": tmp_path}, [sys.executable, WORKERS / "liveness.py", "none", "-1", "0"])
    refused_at_init(said, started, "is writable by group or others (mode 777): refused")
    assert said.count("UnsafePathError: waiting board") == 2, said  # each rank says it
    assert returncode != 0 and list(tmp_path.glob("rank*.json")) == [], said
    assert list(board.iterdir()) == []


@pytest.mark.multirank
def test_without_a_stall_timeout_there_is_no_board_to_refuse(top, tmp_path):
    board = shared_board(top, 0o777)
    job = run_job("liveness.py", "none", -1, 0, np=2, env={"ELASTIC_HVD_WAITING_BOARD": board},
                  tmp_path=tmp_path, timeout=90)
    assert sorted(job.results) == [0, 1] and "waiting board" not in job.output, job.output
    assert list(board.iterdir()) == []
