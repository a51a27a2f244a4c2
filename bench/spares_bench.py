"""Hot spares against respawn (issue 20): MobileNetV2 ``hvd.fit`` on 4 ranks, world
rank 2 SIGKILLed from outside once training runs.

    python bench/spares_bench.py [--runs 3]

Four kinds of job, interleaved, ``--runs`` times each (bench/spares_worker.py):
``spares`` (``--spares 1``), ``respawn`` (``--respawn``), ``shrink`` (neither: the
job goes on at 3 ranks) and ``refill`` (``--spares 1 --respawn``: world rank 2 is
killed first, the spare replaces it and a spawned spare refills the pool; once that
one waits, world rank 1 is killed -- the loss measured).  Measured from outside and
from each process's step log:

* *kill -> replacement's first step*: from the SIGKILL to the end of the first step
  the new process trained;
* *longest step / median*: the survivors' longest step from 1 s before the kill to
  3 s after the replacement's first step (or the kill, for ``shrink``), over their
  median step (first, compiling step left out);
* *spare CPU*: the waiting spare's CPU time (``/proc/<pid>/stat``, all threads) over
  3 s before the kill, as a share of one core;
* *refill step / median* (``refill``): the survivors' longest step between the two
  kills (the first adoption and the refill's spawn) over their median step.

Medians over runs; a table, then the last line ``spares: kill -> training X s
(respawn Y s); survivors' longest step Z x median; waiting spare W % of a core; a
refilled spare V s``.
"""

import argparse
import glob
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from mpijob import JOB_MARKER, job_ranks, spawned_processes  # noqa: E402  (by marker)
RUN = os.path.join(os.path.dirname(sys.executable), "elastic-hvd-run")
KILL_AFTER_STEPS = 25


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steps(path):
    with open(path) as f:
        return [tuple(float(x) for x in line.split()) for line in f if line.strip()]


def waiting_spawned_spare(marker, deadline):
    """The pid of the job's spawned process once it waits (uses < 5 % of a core over 1 s)."""
    while time.monotonic() < deadline:
        for pid in spawned_processes(marker):
            try:
                before = cpu_seconds(pid)
                time.sleep(1.0)
                if cpu_seconds(pid) - before < 0.05:
                    return pid
            except OSError:
                pass  # gone
        time.sleep(0.1)
    raise SystemExit("refill: no spawned spare waited within the deadline")


def job(kind, out):
    marker = uuid.uuid4().hex
    extra = {"spares": ["--spares", "1"], "respawn": ["--respawn"], "shrink": [],
             "refill": ["--spares", "1", "--respawn"]}[kind]
    cmd = [RUN, "-np", "4", *extra, "python", os.path.join(ROOT, "bench", "spares_worker.py"),
           "--out", out, "--steps", "450" if kind == "refill" else "200", "--epochs", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, JOB_MARKER: marker},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = [len(steps(p)) for p in glob.glob(os.path.join(out, "steps-*.txt"))]
            if done and max(done) >= KILL_AFTER_STEPS:
                break
            time.sleep(0.05)
        ranks = job_ranks(marker)
        spare_cpu = first_kill = None
        if kind == "spares":
            before, started = cpu_seconds(ranks[4]), time.monotonic()
            time.sleep(3.0)
            spare_cpu = (cpu_seconds(ranks[4]) - before) / (time.monotonic() - started)
        victim, gone = ranks[2], set()
        if kind == "refill":
            first_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            waiting_spawned_spare(marker, deadline)
            victim, gone = ranks[1], {os.path.join(out, f"steps-{victim}.txt")}
        old = set(glob.glob(os.path.join(out, "steps-*.txt"))) - gone - {
            os.path.join(out, f"steps-{victim}.txt")}
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: exit {proc.returncode}\n{err[-3000:]}")
    new = set(glob.glob(os.path.join(out, "steps-*.txt"))) - old - gone - {
        os.path.join(out, f"steps-{victim}.txt")}
    first = min((steps(p)[0][0] for p in new if steps(p)), default=None)
    row = {"spare_cpu": spare_cpu, "refill_over_median": None,
           "kill_to_train_s": None if first is None else first - killed}
    window_end = (first if first is not None else killed) + 3.0
    ratios = []
    for path in old:
        record = steps(path)[1:]  # the first step compiles
        median = statistics.median(d for _, d, _ in record)
        around = [d for end, d, _ in record if killed - 1.0 <= end <= window_end + d]
        ratios.append(max(around) / median if around else float("nan"))
        if first_kill is not None:
            between = [d for end, d, _ in record if first_kill <= end <= killed - 1.0]
            row["refill_over_median"] = max(row["refill_over_median"] or 0.0,
                                            max(between, default=0.0) / median)
    row["longest_over_median"] = max(ratios)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", default="spares,respawn,shrink,refill",
                   help="the kinds of job to run (a comma-separated subset)")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    rows = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind in kinds:  # interleaved: the machine's noise falls on each alike
            with tempfile.TemporaryDirectory() as out:
                rows[kind].append(job(kind, out))
            print(kind, rows[kind][-1], flush=True)

    def median(kind, key):
        values = [r[key] for r in rows.get(kind, []) if r[key] is not None]
        return statistics.median(values) if values else None

    def shown(value, scale=1.0, digits=1):
        return "-" if value is None else f"{scale * value:.{digits}f}"

    print("\n| job | kill -> replacement's first step (s) | survivors' longest step / median "
          "| waiting spare (% of a core) | refill's longest step / median |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        kill, ratio, cpu, refill = (median(kind, k) for k in (
            "kill_to_train_s", "longest_over_median", "spare_cpu", "refill_over_median"))
        print(f"| {kind} | {shown(kill, digits=2)} | {shown(ratio)} | {shown(cpu, 100, 2)} "
              f"| {shown(refill)} |")
    def seconds(value):
        return "never" if value is None else f"{value:.2f} s"

    print(f"spares: kill -> training {seconds(median('spares', 'kill_to_train_s'))} (respawn "
          f"{seconds(median('respawn', 'kill_to_train_s'))}); survivors' longest step "
          f"{shown(median('spares', 'longest_over_median'))} x median; waiting spare "
          f"{shown(median('spares', 'spare_cpu'), 100, 2)} % of a core; a refilled spare "
          f"{seconds(median('refill', 'kill_to_train_s'))}")

if __name__ == "__main__":
    main()
