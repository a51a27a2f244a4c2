"""Horovod's rank-0 idiom with spares and lost ranks (issue 42, findings 2 and 3).

A script that gives rank 0 alone a ``CSVLogger`` or ``ModelCheckpoint``
(workers/rank0_idiom.py), with a real spare and a real SIGKILL from outside: a
joiner need only share the job's elastic_hvd callbacks (a plain Keras one may
differ), a spare in rank 0's place takes over rank 0's files, and a loss of rank 0
that nobody replaces says what stopped with it.
"""

import csv
import os
import signal

import pytest

from mpijob import job_ranks, run_job, until

pytestmark = pytest.mark.multirank

FIT = {"TEST_STEP_SLEEP": "0.15"}
# One worker holds both kinds of script: the plain one is told where its spare waits
# (elastic-hvd-run finds that itself in a script without hvd.fit).
PLAIN = {"TEST_STEP_SLEEP": "0.05", "ELASTIC_HVD_SPARES_WAIT": "init"}


def kill_after_epochs(rank, epochs):
    """A watcher: SIGKILL world rank ``rank`` once ``epochs`` epochs have ended
    (training is under way, whatever the machine's load)."""
    def watch(out, marker):
        until((out / f"epoch-{epochs - 1}").exists, 90, f"{epochs} epochs ended")
        os.kill(job_ranks(marker)[rank], signal.SIGKILL)
    return watch


def idiom(tmp_path, mode, epochs, np_, spares, env, kill, *args):
    """Run the worker on ``np_`` ranks and ``spares`` spares; ``kill``: (rank, epochs)."""
    launcher = ["--spares", str(spares)] if spares else []
    return run_job("rank0_idiom.py", mode, epochs, *args, np=np_, launcher=launcher, env=env,
                   tmp_path=tmp_path, timeout=120, expect_rc=None,
                   watcher=kill_after_epochs(*kill))


def test_a_spare_joins_a_fit_whose_rank_0_alone_has_a_csv_logger(tmp_path):
    # Before: the spare died ("the same callbacks as the job (8 here, 9 there)") and
    # the job ended on 1 rank.
    job = idiom(tmp_path, "fit", 8, 2, 1, FIT, (1, 1))
    assert job.returncode == 0, job.output[-4000:]
    assert "same callbacks" not in job.output
    assert sorted(job.results) == [0, 2], job.output[-4000:]
    assert {tuple(r["ends_as"]) for r in job.results.values()} == {(0, 2), (1, 2)}
    assert [(e["lost"], e["gained"]) for e in job.results[0]["events"]] == [([1], []), ([], [2])]


def test_a_spare_in_rank_0s_place_takes_over_its_csv_and_checkpoints(tmp_path):
    # A plain script: rank 0 (CSVLogger and ModelCheckpoint its own) is SIGKILLed; the
    # spare starts the script as rank 0 and carries on both.  Before: its CSVLogger
    # started the file afresh, dropping the rows of the epochs before.
    epochs = 14
    job = idiom(tmp_path, "plain", epochs, 2, 1, PLAIN, (0, 2))
    assert job.returncode == 0, job.output[-4000:]
    assert sorted(job.results) == [1, 2], job.output[-4000:]
    spare = job.results[2]
    assert spare["started_as"] == [0, 2] and spare["ends_as"] == [0, 2]
    # Between the loss and the spare's adoption the survivor was rank 0: said so.
    assert "rank 0's own callbacks (CSVLogger, ModelCheckpoint) stopped with it" in job.output
    assert "until a spare takes rank 0's place" in job.output
    with open(tmp_path / "out" / "log.csv") as f:
        rows = [int(r["epoch"]) for r in csv.DictReader(f)]
    assert rows[0] == 0 and rows[-1] == epochs - 1, rows  # before the loss and after it
    assert len(rows) >= epochs - 3 and rows == sorted(set(rows)), rows
    assert (tmp_path / "out" / f"ckpt-{epochs:02d}.weights.h5").exists()


def test_a_lost_rank_0_says_which_of_its_callbacks_stopped(tmp_path):
    # A plain script, no spare: the survivors renumber, and the new rank 0 never ran
    # the script's `if hvd.rank() == 0`.  Before: only "lost rank 0".
    job = idiom(tmp_path, "plain", 6, 3, 0, PLAIN, (0, 2))
    assert job.returncode == 0, job.output[-4000:]
    assert "lost rank 0" in job.output
    assert ("rank 0's own callbacks (CSVLogger, ModelCheckpoint) stopped with it: the script "
            "gave them to rank 0 alone, and the new rank 0 did not create them; they stay "
            "stopped for the rest of this run") in job.output, job.output[-4000:]


def test_a_joiner_without_the_jobs_elastic_callback_is_told_which(tmp_path):
    # Rank 0 alone logs membership events (an elastic_hvd callback: its live state
    # travels to a joiner): the joiner must name it.  Before: "(8 here, 9 there)".
    job = idiom(tmp_path, "fit", 8, 2, 1, FIT, (1, 1), "events-on-rank-0")
    assert ("elastic_hvd callback #2 is missing here and MembershipEventLog in the job"
            in job.output), job.output[-4000:]
    assert "give these callbacks to every rank alike" in job.output
