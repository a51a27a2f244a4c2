"""``make soak``: a chaos soak of elastic_hvd, run from outside the job.

    python tests/soak/driver.py --minutes 30 [--interval 15] [--seed N]

Why: the test suite kills ranks at a few chosen points; a long job meeting faults
of every kind at random moments (``chaos.py``) finds what no chosen point does.
The driver starts ``job.py`` on 4 ranks under ``elastic-hvd-run --spares 2 --respawn``
(strict mode, fast heartbeat: a lost rank is replaced by a hot spare while one is
left, then by a spawned process; ``--max-relaunches 0``: the soak judges recovery in
place, so a job that Open MPI broke on every rank ends it, with exit status 5,
instead of starting again), injects a fault every ``--interval`` seconds on
average, checks the invariants (``invariants.py``) while the job runs, and
watches for a hang: no step committed for ``HANG_S`` seconds, or the job still
running ``END_GRACE_S`` after its deadline.  At the end the job's whole session
and every process marked as the job's is killed (nothing is left behind), and the
driver writes into ``runs/soak/<time>/`` the log, the faults and violations as
JSON lines, and ``timeline.png``.  Its last line is always
``soak: F faults injected, S survived, V invariant violations``; the exit status
is non-zero if V > 0 or a fault was not survived.
"""

import argparse
import dataclasses
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: mpijob

from mpijob import JOB_MARKER, ROOT, job_processes, kill_tree  # noqa: E402

import summary  # noqa: E402
from chaos import Chaos, process_state, running  # noqa: E402
from invariants import Invariants  # noqa: E402
from records import JobRecords  # noqa: E402

NP = 4
SAMPLES, BASE_LR = 1024, 2.0 ** -6  # as job.py
#: No step committed for this long while the job runs: a hang.  Above the longest
#: stall the library bounds itself (a spawn given up after ELASTIC_HVD_SPAWN_TIMEOUT,
#: 60 s), so that such a stall is reported as a step over the bound, and the soak
#: goes on to see whether the job recovers.
HANG_S = 150.0
#: The first step may take this long (4 ranks importing TensorFlow on 2 cores).
START_S = 180.0
#: The job must have ended this long after its deadline (an epoch, then MPI_Finalize).
END_GRACE_S = 120.0
#: No fault this close to the deadline: the last ones must be seen to be survived.
QUIET_S = 20.0
WARMUP_S = 10.0  # after the first committed step, before the first fault
RSS_EVERY_S = 5.0
ANOMALY = "elastic_hvd: ANOMALY"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=15.0,
                        help="mean seconds between faults (uniform in 0.3-1.7 x this)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--spares", type=int, default=2,
                        help="hot spares (elastic-hvd-run --spares); 0: refill by respawn only")
    parser.add_argument("--out", default=None, help="default: runs/soak/<time>")
    return parser.parse_args()


class Soak:
    def __init__(self, args):
        self.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
        self.rng = random.Random(self.seed)
        self.minutes, self.interval, self.spares = args.minutes, args.interval, args.spares
        self.out = Path(args.out or ROOT / "runs" / "soak" / time.strftime("%Y%m%d-%H%M%S"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.deadline = self.start + 60 * args.minutes
        self.marker = uuid.uuid4().hex
        self.log_file = open(self.out / "driver.log", "a")
        self.records = JobRecords(self.out / "job")
        self.invariants = Invariants(self.records, SAMPLES, BASE_LR, self.log)
        self.chaos = Chaos(self.rng, self.records, self.marker, self.log)
        self.lines = queue.Queue()
        self.exit_status = None

    def log(self, message):
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.start:8.3f}s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def launch(self):
        cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(NP), "--respawn",
               "--spares", str(self.spares), "--max-relaunches", "0",
               "--heartbeat-period", "0.5", "--heartbeat-timeout", "2",
               "-x", "ELASTIC_HVD_STRICT=1", "-x", "TF_CPP_MIN_LOG_LEVEL=3",
               "python", str(HERE / "job.py"), "--out", str(self.records.out),
               "--deadline", str(self.deadline), "--samples", str(SAMPLES)]
        self.log(f"seed {self.seed}; {self.minutes} min; a fault every ~{self.interval} s; "
                 f"out {self.out}")
        self.log("job: " + " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, cwd=ROOT,
                                env={**os.environ, JOB_MARKER: self.marker})
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return proc

    def _read(self, proc):
        with open(self.out / "job.log", "w") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if ANOMALY in line:
                    self.lines.put(line)

    def run(self):
        proc = self.launch()
        next_fault = next_rss = 0.0
        try:
            while proc.poll() is None:
                now = time.time()
                self.check(now)
                last = self.records.last_commit()
                if last is None:
                    if now - self.start > START_S:
                        self.invariants.violate("no hang", f"no step within {START_S:.0f} s")
                        break
                    time.sleep(0.2)
                    continue
                if now - last > HANG_S:
                    self.invariants.violate("no hang", f"no step committed for {now - last:.0f} s "
                                            f"(last: step {max(self.records.commit_time)}); "
                                            f"{self._processes()}")
                    self._stacks()
                    break
                if now > self.deadline + END_GRACE_S:
                    self.invariants.violate("no hang", f"the job still runs {END_GRACE_S:.0f} s "
                                            f"after its deadline; {self._processes()}")
                    break
                if now < self.deadline:
                    self.invariants.vanished(self.chaos.touched)
                if now >= next_rss:
                    self.invariants.sample_rss(self.chaos.alive())
                    next_rss = now + RSS_EVERY_S
                if not next_fault:
                    next_fault = last + WARMUP_S
                if next_fault <= now < self.deadline - QUIET_S:
                    if self.chaos.inject() is False:
                        next_fault = now + 0.5  # at the minimum: wait for respawns
                    else:
                        next_fault = now + self.rng.uniform(0.3, 1.7) * self.interval
                time.sleep(0.2)
            else:
                self.exit_status = proc.returncode
        finally:
            kill_tree(proc, self.marker)
            proc.wait()
        self.log(f"job ended: exit status {self.exit_status}")
        self._strays()
        self.check(time.time(), final=True)
        self.invariants.final_reports()
        if self.exit_status not in (0, None):  # None: ended for a hang, said already
            tail = (self.out / "job.log").read_text(errors="replace").splitlines()[-5:]
            self.invariants.violate("job exit status", f"{self.exit_status}: " + " | ".join(tail))
        self._completed()
        return self.report()

    def check(self, now, final=False):
        self.invariants.on_steps(self.records.poll())
        self.invariants.settle(now, final)
        self.invariants.victims(self.chaos.faults, now)
        while not self.lines.empty():
            self.invariants.anomaly(self.lines.get())

    def _completed(self):
        """The job trained to its deadline: some rank finished ``hvd.fit`` (an exit status
        of 0 alone does not say so: ranks lost on the way do not count), and the last
        epoch ended after the deadline -- the ranks stop at the first epoch's end that
        some rank reports past it, so the last *step* may be committed just before it
        (seed 1211: 78 ms before, the epoch's end 0.14 ms before the deadline on rank 0,
        which judged it past a moment later; job.py now judges with the time it reports)."""
        ended = [info["end"]["step"] for info in self.records.procs.values() if "end" in info]
        last = self.records.last_epoch_end
        self.invariants.checks["job completes"] += 1
        if not ended or last is None or last < self.deadline:
            self.invariants.violate(
                "job completes", f"exit status {self.exit_status}, {len(ended)} rank(s) finished "
                f"training; the last epoch ended {(last or self.start) - self.deadline:+.3f} s "
                "from the deadline")

    def _stacks(self):
        """Evidence of a hang: every live rank prints its threads' stacks (SIGUSR2, see
        job.py) into job.log before the job is killed."""
        for pid in self.records.latest:
            if running(pid) and self.chaos.is_rank(pid):
                os.kill(pid, signal.SIGUSR2)
        time.sleep(3)
        self.log("stacks of the ranks still running: see job.log (SIGUSR2)")

    def _processes(self):
        """The job's processes now (evidence for a hang): pid, state, command."""
        rows = []
        for pid in job_processes(self.marker):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            rows.append(f"{pid} {process_state(pid)} {b' '.join(argv[:4]).decode()[:80]}")
        return "processes: " + "; ".join(rows)

    def _strays(self):
        """Nothing of the job may outlive it: report (and kill again) what does."""
        deadline = time.time() + 10
        while time.time() < deadline and job_processes(self.marker):
            time.sleep(0.2)
        left = job_processes(self.marker)
        if left:
            self.invariants.violate("nothing left behind", f"after the kill: {left}")
            for pid in left:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass

    def report(self):
        faults = self.chaos.faults
        with open(self.out / "faults.jsonl", "w") as f:
            for fault in faults:
                f.write(json.dumps(dataclasses.asdict(fault)) + "\n")
        with open(self.out / "violations.jsonl", "w") as f:
            for v in self.invariants.violations:
                f.write(json.dumps(dataclasses.asdict(v)) + "\n")
        if self.records.commit_time:
            summary.plot(self.records, faults, self.out / "timeline.png", self.start)
        table = summary.table(self.records, faults, self.invariants, self.exit_status,
                              time.time() - self.start)
        self.log("summary\n" + table + f"\n(seed {self.seed}; files in {self.out})")
        survived = summary.survived(self.records, faults)
        violations = self.invariants.count()
        last = (f"soak: {len(faults)} faults injected, {survived} survived, "
                f"{violations} invariant violations")
        self.log_file.write(last + "\n")
        print(last, flush=True)
        return 0 if violations == 0 and survived == len(faults) else 1


if __name__ == "__main__":
    sys.exit(Soak(parse_args()).run())
