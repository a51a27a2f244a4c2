"""A final checkpoint on SIGUSR1 (what Slurm's ``--signal=B:USR1@N`` sends the batch
script, ``elastic-hvd-run`` when it ``exec``s it): the launcher passes it on to mpirun
and every rank; the ranks agree on one step boundary, write a committed checkpoint of
the last step trained there and exit with EXIT_PREEMPTED (8); the job started again
resumes from it with no step redone and every sample of every epoch trained once
across both runs.  tests/slurm/test_slurm.py does the same under a real Slurm."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from elastic_hvd import state_format
from elastic_hvd.runner.outcome import EXIT_PREEMPTED
from elastic_hvd.runner.command import find_mpirun
from mpijob import (WORKERS, assert_same_weights_every_step, job_processes, kill_tree,
                    proc_entries, run_job, until)
from test_elastic_fit import read_lines, trained_ids

pytestmark = pytest.mark.multirank

EPOCHS, SAMPLES = 3, 100  # elastic_fit.py: 100 samples, 4 a rank: 13 steps an epoch on 2


def launcher_pid(marker):
    for pid in job_processes(marker):
        if b"elastic_hvd.runner.launch" in proc_entries(pid, "cmdline"):
            return pid
    return None


def signal_after(steps, signum=signal.SIGUSR1, target=launcher_pid):
    """A watcher: once rank 0 logged ``steps`` steps, send ``signum`` to the launcher
    (``target(marker)``) and note when (``signalled.json``)."""
    def watcher(out, marker):
        until(lambda: len(read_lines(out / "steps0.jsonl")) >= steps, 240, f"{steps} steps")
        pid = until(lambda: target(marker), 10, "the launcher's pid")
        sent = time.time()
        os.kill(pid, signum)
        (out / "signalled.json").write_text(json.dumps({"time": sent}))
    return watcher


def check_final_checkpoint(out, output):
    """The final checkpoint is of the last step every rank trained; returns (its step,
    its state)."""
    ckpt = out / "ckpt"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    state = state_format.load(ckpt / meta["state"])
    last = {p.name: max(s["step"] for s in read_lines(p)) for p in out.glob("steps*.jsonl")}
    assert len(last) == 2 and set(last.values()) == {meta["step"]}, (last, meta)
    assert state["session"]["step"] == meta["step"]
    assert (f"exit status {EXIT_PREEMPTED}: preempted: final checkpoint at step {meta['step']}; "
            "requeue resumes from it") in output, output[-4000:]
    return meta["step"], state


def test_sigusr1_to_the_launcher_writes_a_final_checkpoint_and_the_next_run_resumes_from_it(
        tmp_path):
    out, run0 = tmp_path / "out", tmp_path / "run0"
    first = run_job("elastic_fit.py", EPOCHS, np=2, tmp_path=tmp_path, timeout=300,
                    env={"TEST_STEP_SLEEP": "0.2", "TEST_FINAL_ON_SIGNAL": "1"},
                    expect_rc=EXIT_PREEMPTED,
                    watcher=signal_after(17))  # mid-epoch 2
    step, state = check_final_checkpoint(out, first.output)
    assert "SIGUSR1 received: stopping at the end of step" in first.output
    sent = json.loads((out / "signalled.json").read_text())["time"]
    written = (out / "ckpt" / "checkpoint.json").stat().st_mtime
    steps0 = read_lines(out / "steps0.jsonl")
    assert_same_weights_every_step(out)
    digest = next(s["digest"] for s in steps0 if s["step"] == step)
    print(f"SIGUSR1 -> final checkpoint committed {written - sent:.2f} s; job took "
          f"{first.seconds:.1f} s; stopped at step {step}")
    run0.mkdir()
    for path in out.glob("*.jsonl"):
        shutil.move(path, run0 / path.name)

    second = run_job("elastic_fit.py", EPOCHS, np=2, tmp_path=tmp_path, timeout=300)
    restored = second.results[0]["restored"]
    assert restored == {"step": step, "digest": digest}, (restored, step)
    steps1 = read_lines(out / "steps0.jsonl")
    assert min(s["step"] for s in steps1) == step + 1  # nothing redone
    assert_same_weights_every_step(out)
    # exactly once across both runs: the epochs before the interrupted one from run 0,
    # the interrupted one's samples trained by run 0 (all but the checkpoint's queue, which
    # holds those drawn for a step that did not commit) and then by run 1, the rest run 1's
    stopped, queue = state["sampler"]["epoch"], state["sampler"]["queue"]
    assert len(queue) == len(set(queue)) and 0 < len(queue) < SAMPLES, state["sampler"]
    per_epoch = {e: ids for e, ids in trained_ids(run0, []).items() if e < stopped}
    logged = trained_ids(run0, [])[stopped]
    assert not set(logged) & set(queue)  # what run 0 trained is not in the queue
    per_epoch[stopped] = sorted(set(range(SAMPLES)) - set(queue))
    for epoch, ids in trained_ids(out, []).items():
        per_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not exactly once"

def test_plain_mpirun_passes_sigusr1_on_to_the_ranks(tmp_path):
    # No launcher: Open MPI's mpirun passes SIGUSR1 on to every rank itself.
    out = tmp_path / "out"
    out.mkdir()
    cmd = [find_mpirun(), "-np", "2", "--with-ft", "ulfm", "--allow-run-as-root",
           "-x", f"TEST_OUT_DIR={out}", "-x", "TEST_STEP_SLEEP=0.2", "-x", "TEST_FINAL_ON_SIGNAL=1",
           sys.executable, str(WORKERS / "elastic_fit.py"), str(EPOCHS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        until(lambda: len(read_lines(out / "steps0.jsonl")) >= 17 or proc.poll() is not None,
              240, "17 steps")
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == EXIT_PREEMPTED, output[-4000:]
    assert "SIGUSR1 received: stopping at the end of step" in output
    meta = json.loads((out / "ckpt" / "checkpoint.json").read_text())
    last = {p.name: max(s["step"] for s in read_lines(p)) for p in out.glob("steps*.jsonl")}
    assert len(last) == 2 and set(last.values()) == {meta["step"]}, (last, meta)
