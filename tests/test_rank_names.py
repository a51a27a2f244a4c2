"""One naming of ranks in every message, and announcements on lines of their own
(issue 42, findings 7 and 4).

A rank is named by its number now (a lost one's when it was lost) and, once ranks were
renumbered, its stable id: ``rank 1 (id 3)`` (``announce.who``).  Before, the
announcement named ids as ranks ("lost rank 2" then "gained rank 3 ... 2 -> 3 ranks"),
a plain script's spare "starts the script as rank 2" while the announcement said
"gained rank 3", and the launcher wrote "rank 0 (original id 1) raised the same at the
same place as rank 0".  The announcement was also glued to the end of a half-drawn
Keras progress bar when the launcher's output was not a terminal (Keras draws its bar
without ending the line wherever stdout goes).
"""

import io
import os
import re
import signal
import sys

import pytest

from elastic_hvd.core import announce
from elastic_hvd.core.membership import MembershipEvent
from elastic_hvd.runner import outcome, reports
from mpijob import job_ranks, run_job, until


def test_a_rank_is_named_by_its_number_and_its_id_where_they_differ():
    assert announce.who(2, 2) == "rank 2"
    assert announce.who(1, 2) == "rank 1 (id 2)"
    assert announce.who(0, 0, with_id=True) == "rank 0 (id 0)"
    assert announce.who(None, 3) == "id 3"  # a lost process whose rank is not known


class Job:
    """What ``announce.describe`` reads of the communicator: one host, the ids now."""
    spares_left = 0

    def __init__(self, ids):
        self.ids = tuple(ids)

    def hosts(self):
        return ["a"] * len(self.ids)

    def host_of(self, i):
        return "a"


def test_the_announcement_names_the_lost_by_their_rank_then_and_the_gained_by_theirs_now():
    # -np 3: id 2 is lost, then a spare joins in its place with the next free id, 3.
    lost = MembershipEvent(3, 2, lost=(2,))
    assert announce.describe(lost, Job([0, 1]), before=(0, 1, 2)).startswith("lost rank 2: 3 -> 2")
    gained = MembershipEvent(2, 3, gained=(3,))
    assert announce.describe(gained, Job([0, 1, 3]), before=(0, 1)).startswith(
        "gained rank 2 (id 3): 2 -> 3 ranks")
    # Renumbered: id 1 was lost, then the process of id 3 (rank 2 then) and id 0.
    twice = MembershipEvent(3, 1, lost=(0, 3))
    assert announce.describe(twice, Job([2]), before=(0, 2, 3)).startswith(
        "lost ranks 0, 2 (id 3): 3 -> 1 ranks")


def raised(i, rank, text="RuntimeError: the end"):
    return {"process": f"h-{i}", "id": i, "rank": rank, "code": None, "raised": text,
            "stack": ["train.py:40"], "traceback": f"Traceback ...\n{text}\n"}


def test_the_launchers_reports_name_ranks_as_the_announcement_does():
    out = io.StringIO()
    reporter = reports.Reporter(out=out)
    # id 0 raised as rank 0 and left; id 1, rank 0 after that, raised the same.
    reporter.news([raised(0, 0)])
    reporter.news([raised(1, 0), raised(3, 1)])
    assert out.getvalue().splitlines()[-2:] == [
        "elastic-hvd-run: rank 0 (id 1) raised the same at the same place as rank 0 (id 0)",
        "elastic-hvd-run: rank 1 (id 3) raised the same at the same place as rank 0"]
    finished = [{"process": "h-0", "id": 0, "rank": 0, "code": 0},
                {"process": "h-3", "id": 3, "rank": 1, "code": 7}]
    assert outcome.exit_status(0, finished)[1] == (
        "exit status 7: the program exited non-zero on 1 of the 2 ranks that finished "
        "(rank 1 (id 3): 7; mpirun exit status 0)")


def test_an_announcement_after_a_half_drawn_line_starts_a_line_of_its_own(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    announce.watch_stdout()
    assert not announce.mid_line()
    sys.stdout.write("\x08\x08\r\x1b[1m2/6\x1b[0m ━━━━━━ - loss: 2.3045")  # Keras's bar
    assert announce.mid_line()
    print("the bar's end")
    assert not announce.mid_line() and sys.stdout.isatty() is False  # the rest: the stream's
    assert stream.getvalue().endswith("loss: 2.3045the bar's end\n")


# -- a job ---------------------------------------------------------------------------------
#: Where the library names a rank: rank 0's announcement, a process's line, the launcher's.
OURS = re.compile(r"^(\[elastic_hvd [0-9:]+\] |elastic_hvd: |elastic-hvd-run: )", re.M)
RANK = re.compile(r"(?<!world )\branks? ((?:\d+(?: \(id \d+\))?(?:, )?)+)")  # not MPI's world
NAME = re.compile(r"(\d+)(?: \(id (\d+)\))?")


def kill_when_drawing(world_rank):
    """A watcher: SIGKILL ``world_rank`` once rank 0's progress bar is half-drawn."""
    def watch(out, marker):
        until((out / "drawing").exists, 150, "rank 0's progress bar is half-drawn", every=0.02)
        os.kill(job_ranks(marker)[world_rank], signal.SIGKILL)
    return watch


@pytest.fixture(scope="module")
def spare_job(tmp_path_factory):
    """-np 3 --spares 1, a plain Horovod-style script with Keras's bar on rank 0: world
    rank 1 is SIGKILLed mid-bar; the spare takes its place (rank 1, id 3); at the end
    every rank raises the same, which the launcher reports."""
    return run_job("rank_names.py", 5, np=3, launcher=["--spares", "1"],
                   tmp_path=tmp_path_factory.mktemp("spare_job"), timeout=240, expect_rc=1,
                   env={"TEST_STEP_SLEEP": "0.1", "TEST_RAISE_AT_END": "1"},
                   watcher=kill_when_drawing(1))


@pytest.mark.multirank
def test_an_announcement_after_a_half_drawn_progress_bar_starts_at_column_0(spare_job):
    output = spare_job.output
    starts = [m.start() for m in re.finditer(r"\[elastic_hvd ", output)]
    assert len(starts) == 2, output[-6000:]
    glued = [output[max(0, s - 80):s + 40] for s in starts if s and output[s - 1] != "\n"]
    assert not glued, glued
    # The loss came mid-bar: the bar's line, ended by the announcement, comes just before.
    before_loss = output[:starts[0]].rstrip("\n").rsplit("\n", 1)[-1]
    assert "━" in before_loss and "/step - loss: " in before_loss, before_loss


@pytest.mark.multirank
def test_a_spare_job_names_every_rank_one_way(spare_job):
    # Every mention of a rank is "rank R" or "rank R (id I)", of a rank the 3-rank job
    # has; the lost one, the spare's place and the gainer agree.
    lines = [line.rsplit("\x08", 1)[-1] for line in spare_job.output.splitlines()]
    lines = [line[line.index("[elastic_hvd "):] if "[elastic_hvd " in line else line
             for line in lines]  # an announcement glued to a bar (see the test above)
    lines = [line for line in lines if OURS.match(line)]
    assert not [line for line in lines if "original" in line], lines
    names = []
    for line in lines:
        for group in RANK.findall(line):
            for rank, i in NAME.findall(group):
                assert int(rank) < 3, line
                # An id equal to the rank is said only where one line names two processes
                # of one number.
                assert i != rank or line.count(f"rank {rank} (id ") == 2, line
                names.append((int(rank), int(i) if i else int(rank)))
    [loss] = [line for line in lines if " lost rank" in line and line.startswith("[")]
    assert "] lost rank 1 " in loss, loss
    [claim] = [line for line in lines if line.startswith("elastic_hvd: a hot spare")]
    assert "takes the place of the lost rank 1: it starts the script as rank 1 " in claim, claim
    [gain] = [line for line in lines if "] gained " in line]
    assert "] gained rank 1 (id 3) " in gain, gain
    reported = [line for line in lines if "raised" in line and "same place" in line]
    assert reported and all(re.match(r"elastic-hvd-run: rank \d+( \(id \d\))? raised the same "
                                     r"at the same place as rank \d+( \(id \d\))?$", line)
                            for line in reported), reported
    assert (1, 3) in names and (3, 3) not in names, names  # id 3 is never "rank 3"


@pytest.mark.multirank
def test_a_waiting_spare_says_what_it_is_and_the_announcement_names_it_by_its_place(tmp_path):
    # -np 3 --spares 1 with a growth point (the core's growth worker): id 1 is killed at
    # step 10; the spare (world rank 3) joins last, as rank 2 with id 3.  Before, the
    # spare's script saw "rank 3 of 4" unexplained, and the announcement said "gained
    # rank 3 ... 2 -> 3 ranks".
    job = run_job("growth_scenarios.py", 60, np=3, faults="rank=1,step=10",
                  launcher=["--spares", "1"], tmp_path=tmp_path, timeout=120)
    lines = [line for line in job.output.splitlines() if OURS.match(line)]
    assert ("elastic_hvd: world rank 3 is a hot spare, waiting to replace a lost rank: until it "
            "joins it reports rank 3 of 4 (as if it had joined last) and has no id; it gets the "
            "next free id when it joins") in lines, job.output[-4000:]
    changes = [line.split("] ", 1)[1] for line in lines if line.startswith("[elastic_hvd ")]
    assert [re.split(" after |: ", c)[0] for c in changes] == [
        "lost rank 1", "gained rank 2 (id 3)"], changes
