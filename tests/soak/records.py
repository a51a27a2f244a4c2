"""What the soak job has reported so far, read from its files while it runs.

Why a reader of files: the driver must judge the job from outside, while ranks
die at any instant, so each process appends to files of its own (see ``job.py``)
and this module follows them by byte offset, taking only complete lines (a
process killed mid-write leaves a partial last line, which is never parsed).
"""

import json
import os
from pathlib import Path


class Tail:
    """The complete JSON lines appended to one file since the last ``read()``."""

    def __init__(self, path):
        self.path, self.offset = path, 0

    def read(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class JobRecords:
    """Steps, epoch ends, processes and membership events of one soak job (``out``)."""

    def __init__(self, out):
        self.out = Path(out)
        for sub in ("steps", "procs"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        self._tails = {}
        self.steps = {}  # step number -> [record of each rank that committed it]
        self.commit_time = {}  # step number -> earliest time a rank reported it
        self.epoch_ends = {}  # epoch -> earliest time a rank reported its end
        self.last_epoch_end = None  # latest time any rank reported an epoch's end
        # A process is (pid, start): pids are reused (see job.py's START).
        self.latest = {}  # pid -> the newest step record of the newest process with it
        self.procs = {}  # (pid, start) -> what it wrote when it started (+ "ready", "end")
        self.events = []  # the job's event log (membership changes)

    def _tail(self, path):
        if path not in self._tails:
            self._tails[path] = Tail(path)
        return self._tails[path].read()

    def poll(self):
        """Read what is new; returns the new step records."""
        new = []
        for path in sorted((self.out / "steps").glob("*.jsonl")):
            for record in self._tail(path):
                if "epoch_end" in record:
                    self.epoch_ends.setdefault(record["epoch_end"], record["t"])
                    self.last_epoch_end = max(self.last_epoch_end or 0.0, record["t"])
                    continue
                new.append(record)
                self.steps.setdefault(record["step"], []).append(record)
                step_t = self.commit_time.get(record["step"], record["t"])
                self.commit_time[record["step"]] = min(step_t, record["t"])
                known = self.latest.get(record["pid"])
                if known is None or known["start"] <= record["start"]:
                    self.latest[record["pid"]] = record
        for path in (self.out / "procs").iterdir():
            process, kind = tuple(map(int, path.stem.split("-"))), path.suffix
            info = self.procs.setdefault(process, {})
            if kind == ".json" and "t" not in info:
                try:
                    info.update(json.loads(path.read_text()))
                except ValueError:  # being written
                    continue
            elif kind == ".ready":
                info.setdefault("ready", os.path.getmtime(path))
            elif kind == ".end" and "end" not in info:
                try:
                    info["end"] = json.loads(path.read_text())
                except ValueError:
                    continue
        self.events += self._tail(self.out / "events.jsonl")
        return new

    def last_commit(self):
        return max(self.commit_time.values(), default=None)

    def first_commit_after(self, t):
        """Earliest time a step was committed after ``t`` (None: none yet)."""
        later = [c for c in self.commit_time.values() if c > t]
        return min(later) if later else None

    def rank_zero(self):
        """PID of whichever member reported rank 0 at the newest step."""
        if not self.latest:
            return None
        newest = max(r["step"] for r in self.latest.values())
        return next((pid for pid, r in self.latest.items()
                     if r["step"] == newest and r["rank"] == 0), None)

    def joiners_waiting(self):
        """PIDs of spawned processes that are about to join (built their model) and
        have not committed a step yet."""
        return [pid for (pid, start), info in self.procs.items()
                if info.get("joining") and "ready" in info
                and self.latest.get(pid, {}).get("start") != start]
