"""Growing back (issue 6): how fast a killed rank is replaced, and ranks are added.

    python bench/growth_bench.py [--runs 3]

Three jobs, each ``--runs`` times, through ``elastic-hvd-run``:

* ``core respawn``: tests/workers/growth_scenarios.py (bare core, 50 ms steps), 4
  ranks, ``--respawn``, rank 2 SIGKILLed at step 10;
* ``keras respawn``: tests/workers/elastic_fit.py (Keras 3 ``model.fit``, 0.4 s steps),
  same kill;
* ``keras grow 2->4``: the same worker started on 2 ranks with ``--max-np 4`` and a
  discovery script offering 4 slots.

From the rank-0 event log: *kill -> replacement trains* = wall time from the loss
event to the join event (the join happens at a step boundary and that step
already includes the new rank); *spawn stall* = how long the running ranks
waited inside the spawn (the only time training stops, besides the hand-over);
*join* = spawn to adoption (the joiner's start-up, while training goes on).
Medians over runs; printed as a table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(os.path.dirname(sys.executable), "elastic-hvd-run")
WORKERS = os.path.join(ROOT, "tests", "workers")


def job(kind, out):
    env = ["-x", f"TEST_OUT_DIR={out}", "-x", "TF_CPP_MIN_LOG_LEVEL=3"]
    if kind == "core respawn":
        cmd = [RUN, "-np", "4", "--respawn", "--faults", "rank=2,step=10", *env,
               "python", os.path.join(WORKERS, "growth_scenarios.py"), "150"]
    elif kind == "keras respawn":
        cmd = [RUN, "-np", "4", "--respawn", "--faults", "rank=2,step=5", *env,
               "-x", "TEST_STEP_SLEEP=0.4", "python", os.path.join(WORKERS, "elastic_fit.py"), "6"]
    else:
        script = os.path.join(out, "discover.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\necho localhost:4\n")
        os.chmod(script, 0o755)
        cmd = [RUN, "-np", "2", "--max-np", "4", "--host-discovery-script", script,
               "--discovery-interval", "1", "-x", "ELASTIC_HVD_DISCOVERY_CHECK_EVERY=1", *env,
               "-x", "TEST_STEP_SLEEP=0.4", "python", os.path.join(WORKERS, "elastic_fit.py"), "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=WORKERS)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "rank0.json")) as f:
        report = json.load(f)
    events, size = report["events"], len(report["ids"])
    losses = [e for e in events if e["lost"]]
    joins = [e for e in events if e["gained"]]
    if not joins:
        raise SystemExit(f"{kind}: nobody joined\n{proc.stderr[-3000:]}")
    row = {"size": size, "joins": len(joins),
           "spawn_s": max(seconds(e, "spawn") for e in joins),
           "join_s": max(seconds(e, "repair") for e in joins)}
    if losses:
        row["kill_to_train_s"] = seconds(joins[0], "time") - seconds(losses[0], "time")
    else:
        row["all_joined_s"] = sum(seconds(e, "repair") for e in joins)
    return row


def seconds(event, name):
    """A time from either kind of record: core events (``spawn_s``, ``wall_time``) or
    the Keras event log (``spawn_ms``, ``time``)."""
    if name == "time":
        return event.get("wall_time", event.get("time"))
    return event[f"{name}_s"] if f"{name}_s" in event else event[f"{name}_ms"] / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    kinds = ["core respawn", "keras respawn", "keras grow 2->4"]
    rows = {}
    for kind in kinds:
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as out:
                runs.append(job(kind, out))
        rows[kind] = runs
        print(kind, runs, flush=True)
    print("\n| job | final size | kill -> replacement trains (s) | spawn stall (s) "
          "| spawn -> adopted (s) |")
    print("|---|---|---|---|---|")
    for kind, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        kill = f"{med['kill_to_train_s']:.2f}" if "kill_to_train_s" in med else \
            f"(+2 ranks: {med['all_joined_s']:.2f} in all)"
        print(f"| {kind} | {med['size']:.0f} | {kill} | {med['spawn_s']:.2f} "
              f"| {med['join_s']:.2f} |")


if __name__ == "__main__":
    main()
