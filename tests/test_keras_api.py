"""The Keras-shaped elastic API (``hvd.ElasticData`` + ``hvd.fit``), through the README's
example script itself, on 4 ranks with a rank SIGKILLed from outside."""

import json
import os
import random
import signal
import time

import pytest

from mpijob import ROOT, run_job, until

pytestmark = pytest.mark.multirank

EXAMPLE = ROOT / "examples" / "elastic_keras.py"


def ranks_of(marker):
    """PIDs of the ranks whose command line holds ``marker`` (the job's own --out)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in argv and b"elastic_hvd.runner.program" in argv:
            pids.append(int(entry))
    return sorted(pids)


def kill_one_rank_mid_training(marker, seed):
    """A watcher: once epoch 2 has started (epoch 1's checkpoint is committed),
    SIGKILL one random rank at a random moment, by PID."""
    def watch(out, _job):
        rng = random.Random(seed)
        committed = os.path.join(marker, "checkpoint", "checkpoint.json")
        until(lambda: os.path.exists(committed), 200, "epoch 1's checkpoint committed")
        time.sleep(rng.uniform(0.0, 0.5))
        pids = ranks_of(marker)
        victim = rng.choice(pids)
        os.kill(victim, signal.SIGKILL)
        (out / "victim").write_text(str(pids.index(victim)))
    return watch


@pytest.mark.check
def test_readme_example_trains_through_a_rank_killed_from_outside(tmp_path):
    out = str(tmp_path / "example")
    job = run_job(str(EXAMPLE), "--epochs", 4, "--samples", 4096, "--out", out, np=4,
                  tmp_path=tmp_path, timeout=400, watcher=kill_one_rank_mid_training(out, 7))
    assert job.returncode == 0, job.output[-4000:]
    assert "final accuracy" in job.output and "on 3 ranks" in job.output, job.output[-3000:]
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
    assert [(e["old_size"], e["new_size"], len(e["lost"])) for e in events] == [(4, 3, 1)]
    assert events[0]["lr_after"] == pytest.approx(0.03, rel=1e-5)  # 0.01 x size, rescaled
    assert events[0]["epoch"] >= 2
    meta = json.loads(open(os.path.join(out, "checkpoint", "checkpoint.json")).read())
    assert meta["epoch"] == 4  # the last epoch's checkpoint, written by whoever was rank 0
    assert "val_accuracy" in job.output or "val_loss" in job.output, job.output[-2000:]
    # Restarted on 4 ranks for a fifth epoch: it resumes the checkpoint written on 3, at
    # the rate the script sets for 4, and the event log says so.
    again = run_job(str(EXAMPLE), "--epochs", 5, "--samples", 4096, "--out", out, np=4,
                    tmp_path=tmp_path, timeout=300)
    assert again.returncode == 0 and "on 4 ranks" in again.output, again.output[-3000:]
    assert "resuming at epoch 5" in again.output and "now 4" in again.output
    resumed = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))][-1]
    assert (resumed["during"], resumed["old_size"], resumed["new_size"]) == ("resume", 3, 4)
    assert resumed["lr_before"] == pytest.approx(0.03, rel=1e-5)
    assert resumed["lr_after"] == pytest.approx(0.04, rel=1e-5)
