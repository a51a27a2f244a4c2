"""Each kind of failure, on simulated hosts: how it is survived and what it costs.

    python bench/failure_kinds.py [--runs 3]      (root: simulated hosts, tests/hosts/)

Keras training (tests/workers/elastic_fit.py: 3 epochs, 0.1 s steps, checkpoint
every epoch) on 4 ranks over hostA:2 and hostB:2, with a spare hostC:2 in the
allocation.  Once rank 0 has logged 10 steps (mid epoch 2) a watcher, from
outside, does one of:

* ``rank``: SIGKILL one rank of hostB;
* ``host ranks``: SIGKILL both ranks of hostB (its Open MPI daemon lives on);
* ``node``: SIGKILL hostB's daemon and its ranks (a node lost): the runtime ends the
  job and elastic-hvd-run relaunches it on hostA and hostC;
* ``frozen host``: SIGSTOP hostB's daemon and ranks (heartbeat 0.5 s / 2 s).

Reported, medians over ``--runs``: seconds from the failure to the next completed
training step (a normal step, the median interval before the failure, for
comparison), committed steps lost (trained again), ranks at the end, how.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mpijob import job_ranks, parent_of, run_job  # noqa: E402

HOSTS = "hostA:2,hostB:2,hostC:2"
FAST_DETECTION = ["--heartbeat-period", "0.5", "--heartbeat-timeout", "2"]


def watcher(kind):
    def watch(out, job):
        steps = out / "steps0.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if steps.exists() and len(steps.read_text().splitlines()) >= 10:
                break
            time.sleep(0.01)
        ranks = job_ranks(job, "hostB")
        daemons = {parent_of(p) for p in ranks.values()}
        victims = {"rank": list(ranks.values())[-1:], "host ranks": list(ranks.values()),
                   "node": [*daemons, *ranks.values()],
                   "frozen host": [*daemons, *ranks.values()]}[kind]
        signum = signal.SIGSTOP if kind == "frozen host" else signal.SIGKILL
        failed_at = time.time()
        for pid in victims:
            os.kill(pid, signum)
        (out / "failed_at").write_text(repr(failed_at))
    return watch


def measure(kind):
    with tempfile.TemporaryDirectory() as tmp:
        job = run_job("elastic_fit.py", 3, np=4, hosts=HOSTS, tmp_path=tmp, timeout=400,
                      env={"TEST_STEP_SLEEP": "0.1", "ELASTIC_HVD_FINALIZE_DEADLINE": "3"},
                      launcher=FAST_DETECTION if kind == "frozen host" else [],
                      watcher=watcher(kind), expect_rc=None)
        out = Path(tmp) / "out"
        if not (out / "failed_at").exists():
            raise SystemExit(f"{kind}: the failure was never injected:\n{job.output[-3000:]}")
        failed_at = float((out / "failed_at").read_text())
        entries = [json.loads(line) for path in out.glob("steps*.jsonl")
                   for line in path.read_text().splitlines()]
        rank0 = [json.loads(line)["time"] for line in (out / "steps0.jsonl").read_text()
                 .splitlines()]
        rank0 = [t for t in rank0 if t < failed_at]
        normal = statistics.median(b - a for a, b in zip(rank0, rank0[1:]))
        last_launch = max(e["launch"] for e in entries)
        if last_launch:  # relaunched: the first run's last step vs where the relaunch went on
            before = max(e["step"] for e in entries if e["launch"] < last_launch)
            first = min((e for e in entries if e["launch"] == last_launch),
                        key=lambda e: e["time"])
            lost = before - (first["step"] - 1)
        else:  # in place: the interrupted step is completed by the survivors
            before = max(e["step"] for e in entries if e["time"] < failed_at)
            first = min((e for e in entries if e["step"] > before), key=lambda e: e["time"])
            lost = 0
        sizes = {len(r["ids"]) for r in job.results.values()}
        return {"recovery_s": first["time"] - failed_at, "normal_s": normal, "lost": lost,
                "ranks": sizes.pop() if sizes else 0,
                "how": "relaunch" if last_launch else "in place", "rc": job.returncode}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("| failure | survived | failure -> next completed step, s (median; runs) | a normal "
          "step, s | steps lost | ranks after | exit |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("rank", "host ranks", "node", "frozen host"):
        runs = [measure(kind) for _ in range(args.runs)]
        recovery = statistics.median(r["recovery_s"] for r in runs)

        def each(key, form="{}", runs=runs):
            return ", ".join(form.format(r[key]) for r in runs)
        normal = statistics.median(r["normal_s"] for r in runs)
        print(f"| {kind} | {', '.join(sorted({r['how'] for r in runs}))} | {recovery:.3f} "
              f"({each('recovery_s', '{:.3f}')}) | {normal:.3f} | {each('lost')} | "
              f"{each('ranks')} | {each('rc')} |", flush=True)


if __name__ == "__main__":
    main()
