"""The soak's own bookkeeping (tests/soak): a process is (pid, start time), never a pid.

Why: pids are reused once ``pid_max`` (32768) wraps, and a 30-minute soak makes them
wrap (every TensorFlow thread takes one).  Seen in the soak of seed 1219: processes
that got the pids of two ranks killed earlier were counted as already given a fault,
so no fault was sent in the last 165 s, and their records went into the dead ranks'.
"""

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "soak"))
from chaos import Chaos, running, start_of  # noqa: E402
from invariants import Invariants  # noqa: E402
from records import JobRecords  # noqa: E402


def _write(out, name, text):
    with open(out / name, "a") as f:
        f.write(text)


def _step(out, pid, start, step, original_id):
    record = {"step": step, "epoch": 0, "batch": step, "t": 1000.0 + step, "pid": pid,
              "start": start, "id": original_id, "rank": 0, "size": 2, "lr": 0.1}
    _write(out / "steps", f"{pid}-{start}.jsonl", json.dumps(record) + "\n")


def test_a_pid_taken_by_a_later_process_is_another_process(tmp_path):
    records = JobRecords(tmp_path)
    me, now = os.getpid(), start_of(os.getpid())
    earlier = now - 1000  # a process that had this pid before, and ended
    _step(tmp_path, me, earlier, 1, 7)
    _write(tmp_path / "procs", f"{me}-{earlier}.json", json.dumps({"pid": me, "joining": False}))
    _write(tmp_path / "procs", f"{me}-{earlier}.end",
           json.dumps({"id": 7, "anomalies": ["an anomaly at its end"], "step": 1}))
    _write(tmp_path / "procs", f"{me}-{now}.json", json.dumps({"pid": me, "joining": True}))
    _write(tmp_path / "procs", f"{me}-{now}.ready", "")
    records.poll()
    assert records.joiners_waiting() == [me]  # the later process: ready, not a member yet
    _step(tmp_path, me, now, 2, 9)
    records.poll()
    assert records.latest[me]["id"] == 9 and records.joiners_waiting() == []
    assert running(me, now) and not running(me, earlier)
    chaos = Chaos(random.Random(0), records, "no-marker", lambda _: None)
    chaos.touched.add((me, earlier))  # the earlier process was given a fault
    assert chaos.alive() == [me]  # the later one is an untouched member
    chaos.touched.add((me, now))
    assert chaos.alive() == []
    invariants = Invariants(records, 4, 0.1, lambda _: None)
    invariants.vanished(chaos.touched)  # both given a fault: neither vanished unexplained
    invariants.final_reports()  # the earlier process's report is read too
    assert [v.invariant for v in invariants.violations] == ["no anomaly"]
