"""A full or read-only checkpoint directory costs checkpoints, not the job (issue 41).

On a real tmpfs (mounted by the test, which runs as root; skipped where it cannot
mount one), filled up with a file or remounted read-only while the job trains:

* one process: a save that fails removes the files it created, leaves the last
  committed checkpoint byte for byte as it was and says which save failed and why;
  one that succeeds again resets the count; ELASTIC_HVD_MAX_FAILED_SAVES failures in
  a row end the process with exit status 6 and a final line;
* 2-rank ``model.fit`` jobs (tests/workers/elastic_fit.py): the disk fills at a random
  moment after the first commit -- the job finishes, rank 0 names each failed save, no
  partial file is left, and a job restarted from what is left resumes from the last
  committed checkpoint with every sample trained exactly once per epoch; the directory
  turns read-only -- after the allowed failures in a row every rank stops, and the
  launcher reports exit status 6.

Before issue 41 the writer's OSError (RuntimeError from h5py) ended it, the next
rank 0 died at its next save, and so on: ``exit status 1: no rank completed``.
"""

import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import time

import pytest

from mpijob import until
from test_checkpoint import committed_hashes

STATUS_SAVES_FAILED = 6  # keras_callbacks.checkpoint.EXIT_SAVES_FAILED


@contextlib.contextmanager
def tmpfs(path, size="1m"):
    """A real tmpfs of ``size`` mounted (0700) at ``path`` for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)], capture_output=True, text=True, timeout=30)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30)


def fill(directory):
    """Fill the file system of ``directory`` with one file (to ENOSPC); its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with open(path, "ab", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")  # the last partial block
    return path


def remount_read_only(directory):
    subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True, timeout=30)


FAULTS = {"full": fill, "read-only": remount_read_only}
REASONS = {"full": "No space left on device", "read-only": "Read-only file system"}


# -- one process -------------------------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
def test_failed_saves_keep_the_committed_checkpoint_then_stop(tmp_path, fault, capfd,
                                                                monkeypatch):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    from elastic_hvd.core import config, runtime
    from keras_callbacks import ElasticCheckpoint

    monkeypatch.setenv("ELASTIC_HVD_MAX_FAILED_SAVES", "3")
    config.load()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), verbose=0)
    with tmpfs(tmp_path / "ckpt") as directory:
        checkpoint = ElasticCheckpoint(str(directory))
        checkpoint.set_model(model)
        checkpoint.save(1)
        assert checkpoint.last_saved
        committed = committed_hashes(directory)
        FAULTS[fault](directory)
        present = sorted(os.listdir(directory))
        for seq in (1, 2):
            checkpoint.save(seq + 1)
            assert not checkpoint.last_saved
            err = capfd.readouterr().err
            assert f"the checkpoint of epoch {seq + 1} (save {seq}) failed: " in err, err
            assert REASONS[fault] in err and f"{seq} of ELASTIC_HVD_MAX_FAILED_SAVES=3" in err
            assert sorted(os.listdir(directory)) == present  # no partial file left
            assert committed_hashes(directory) == committed
        with pytest.raises(SystemExit) as stopped:
            checkpoint.save(4)
        assert stopped.value.code == STATUS_SAVES_FAILED
        runtime.set_exit_status(None)  # (what exit_with recorded for MPI's end: none here)
        err = capfd.readouterr().err
        assert "stopping: 3 checkpoint saves in a row failed (ELASTIC_HVD_MAX_FAILED_SAVES=3), " \
               "the last: the checkpoint of epoch 4 (save 3) failed: " in err, err
        assert committed_hashes(directory) == committed
        # Room again: the next save commits, and the count starts over.
        if fault == "full":
            os.remove(os.path.join(directory, "filler"))
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(directory)], check=True)
        checkpoint.failed_saves = 2
        checkpoint.save(5)
        assert checkpoint.last_saved and checkpoint.failed_saves == 0
        assert checkpoint.files.entries()[0]["epoch"] == 5
    config.load()


# -- 2-rank model.fit jobs -------------------------------------------------------------------
def after_first_commit(action, seen):
    """A watcher (see mpijob.run_job) that waits for the first committed checkpoint, then
    at a random moment within the next half second records its hashes in ``seen`` and runs
    ``action(directory)``.  Steps are slowed down (TEST_STEP_SLEEP) so that an epoch
    takes several seconds: the next save starts after it."""
    def watch(out_dir, marker):
        directory = out_dir / "ckpt"
        until((directory / "checkpoint.json").exists, 200, "the first checkpoint committed",
              every=0.01)
        time.sleep(random.uniform(0, 0.5))
        seen["hashes"] = committed_hashes(directory)
        seen["present"] = sorted(os.listdir(directory))
        action(directory)
        seen["done"] = True
    return watch


def epochs_trained(out):
    """Sample ids per epoch, from the ranks' logs (tests/workers/elastic_fit.py)."""
    per_epoch = {}
    for path in out.glob("ids*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            per_epoch.setdefault(entry["epoch"], []).extend(entry["ids"])
    return per_epoch


SLOW = {"TEST_STEP_SLEEP": "0.15"}  # 13 steps an epoch on 2 ranks: 2+ s


@pytest.mark.multirank
def test_a_disk_that_fills_mid_training_costs_checkpoints_not_the_job(tmp_path):
    from mpijob import run_job
    out = tmp_path / "out"
    seen = {}
    with tmpfs(out / "ckpt") as directory:
        job = run_job("elastic_fit.py", 3, np=2, tmp_path=tmp_path, timeout=240, env=SLOW,
                      watcher=after_first_commit(fill, seen))
        assert seen.get("done"), job.output[-3000:]
        assert sorted(job.results) == [0, 1], job.output[-3000:]
        for seq in (1, 2):
            line = f"the checkpoint of epoch {seq + 1} (save {seq}) failed: "
            assert job.output.count(line) == 1, job.output[-3000:]
        assert "No space left on device" in job.output
        assert committed_hashes(directory) == seen["hashes"]  # byte for byte
        assert sorted(os.listdir(directory)) == seen["present"] + ["filler"]
        first = epochs_trained(out)
        assert sorted(first) == [0, 1, 2]
        # Restart from what is left, with room again: it resumes after epoch 1.
        os.remove(directory / "filler")
        for path in [*out.glob("ids*.jsonl"), *out.glob("rank*.json")]:
            path.unlink()
        again = run_job("elastic_fit.py", 3, np=2, tmp_path=tmp_path, timeout=240)
        assert {r["initial_epoch"] for r in again.results.values()} == {1}
        second = epochs_trained(out)
        trained = {0: first[0], 1: second[1], 2: second[2]}
        assert sorted(second) == [1, 2]
        for epoch, ids in trained.items():
            assert sorted(ids) == list(range(100)), f"epoch {epoch}: not exactly once"
        assert json.loads((directory / "checkpoint.json").read_text())["epoch"] == 3


@pytest.mark.multirank
def test_a_directory_made_read_only_stops_the_job_with_status_6(tmp_path):
    from mpijob import run_job
    out = tmp_path / "out"
    seen = {}
    with tmpfs(out / "ckpt") as directory:
        job = run_job("elastic_fit.py", 4, np=2, tmp_path=tmp_path, timeout=240,
                      env={**SLOW, "ELASTIC_HVD_MAX_FAILED_SAVES": "2"}, expect_rc=None,
                      watcher=after_first_commit(remount_read_only, seen))
        assert seen.get("done"), job.output[-3000:]
        assert job.returncode == STATUS_SAVES_FAILED, job.output[-3000:]
        assert "stopping: 2 checkpoint saves in a row failed" in job.output
        assert "the checkpoint of epoch 2 (save 1) failed: " in job.output
        assert "Read-only file system" in job.output
        assert (f"exit status {STATUS_SAVES_FAILED}: the program exited non-zero on 2 of the "
                "2 ranks that finished") in job.output, job.output[-3000:]
        assert job.results == {}  # stopped before the end
        assert 3 not in epochs_trained(out)  # the 4th epoch never started
        assert committed_hashes(directory) == seen["hashes"]
        assert sorted(os.listdir(directory)) == seen["present"]
    shutil.rmtree(out / "ckpt", ignore_errors=True)
