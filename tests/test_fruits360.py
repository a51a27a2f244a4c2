"""The Fruits 360 example, tiny: 4 classes of the stand-in, 32x32, 12 short epochs, 3 ranks,
one kill."""

import json
import re

import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


def test_tiny_fruits360_survives_a_kill(tmp_path):
    out = tmp_path / "run"
    job = run_job("../../examples/fruits360/train.py", "--data-dir", tmp_path / "data",
                  "--stand-in", "--standin-train", 80, "--standin-test", 12, "--classes", 4,
                  "--image-size", 32, "--epochs", 12, "--batch-size", 8, "--lr", 0.001,
                  "--out", out, np=3, faults="rank=2,step=8", tmp_path=tmp_path, timeout=400)
    result = json.loads((out / "result.json").read_text())
    final = result["epochs"][-1]
    assert final["ranks"] == 2
    assert final["test_acc"] > 0.45, result["epochs"]  # chance is 0.25; ~0.8 measured
    [event] = result["events"]
    assert event["lost"] == [2] and (event["old_size"], event["new_size"]) == (3, 2)
    assert [json.loads(line)["lost"] for line in open(out / "events.jsonl")] == [[2]]
    png = (out / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "final test accuracy" in job.output
    # One epoch numbering: the live line, the summary, the event log and the table's
    # first epoch on 2 ranks name the same epoch (the summary used to add one).
    live = re.search(r"\] lost rank 2 in epoch (\d+), step (\d+): 3 -> 2 ranks", job.output)
    summary = re.search(r"membership change +: epoch (\d+) step (\d+):", job.output)
    assert live.groups() == summary.groups() == (str(event["epoch"]), str(event["step"]))
    assert event["epoch"] == next(e["epoch"] for e in result["epochs"] if e["ranks"] == 2)
