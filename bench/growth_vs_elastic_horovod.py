"""Adding ranks during Keras training: elastic_hvd vs Elastic Horovod (issue 6).

    python bench/growth_vs_elastic_horovod.py [--runs 3]   (needs .venv-horovod)

Both run bench/fit_recovery_worker.py (Horovod's elastic Keras API: ``hvd.elastic.run``,
``KerasState``, commit every 10 batches; MobileNetV2 alpha 0.35, 64x64, batch 16 per
rank) on 2 ranks, with ``--max-np 4`` and a host-discovery script that offers 2 more
slots once rank 0 has done 20 steps (``<out>/grow``).  Elastic Horovod: horovodrun
with Gloo on two pseudo-hosts (``localhost``, ``127.0.0.1``: it needs two hosts to
start), one slot each, then two each; elastic_hvd: elastic-hvd-run, 2 then 4 slots
on the same host.  Reported, medians over runs:
seconds from the offer to the first step at 3 and at 4 ranks; the longest pause of
rank 0 between two steps after the offer (how long training stood still); steps
redone (Elastic Horovod rolls back to its last commit).  A job still running after
TIMEOUT seconds is killed and analysed as far as it got.
"""

import argparse
import glob
import os
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "fit_recovery_worker.py")
HVD_BIN = os.path.join(ROOT, ".venv-horovod", "bin")
GROW_AT, STEPS, TIMEOUT = 20, 220, 540


def run(impl, out):
    script = os.path.join(out, "discover.sh")
    if impl == "horovod":  # Elastic Horovod needs two hosts from the start (NIC discovery)
        start, grown = "echo localhost:1; echo 127.0.0.1:1", "echo localhost:2; echo 127.0.0.1:2"
    else:
        start, grown = "echo localhost:2", "echo localhost:4"
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\nif [ -e {out}/grow ]; then {grown}; else {start}; fi\n")
    os.chmod(script, 0o755)
    if impl == "horovod":
        cmd = [os.path.join(HVD_BIN, "horovodrun"), "-np", "2", "--min-np", "2", "--max-np", "4",
               "--host-discovery-script", script, os.path.join(HVD_BIN, "python")]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "elastic-hvd-run"), "-np", "2",
               "--max-np", "4", "--host-discovery-script", script, "--discovery-interval", "1",
               "-x", "ELASTIC_HVD_DISCOVERY_CHECK_EVERY=1", "python"]
    cmd += [WORKER, "--impl", impl, "--out", out, "--kill-step", "0", "--grow-at", str(GROW_AT),
            "--steps", str(STEPS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # analyse what was logged up to here
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return proc.returncode, output[-3000:]


def analyse(out):
    with open(os.path.join(out, "grow")) as f:
        offered = float(f.read())
    steps = []  # (time, batch, size) of every rank
    for path in glob.glob(os.path.join(out, "steps*.txt")):
        with open(path) as f:
            steps += [tuple(float(v) for v in line.split()) for line in f if line.strip()]
    rank0 = sorted(tuple(float(v) for v in line.split())
                   for line in open(os.path.join(out, "steps0.txt")) if line.strip())
    after = [s for s in steps if s[0] > offered]
    first = {n: min((t for t, _, size in after if size >= n), default=float("nan")) - offered
             for n in (3, 4)}
    times = [t for t, _, _ in rank0 if t > offered]
    pause = max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")
    batches = [b for _, b, _ in rank0]
    redone = sum(1 for a, b in zip(batches, batches[1:]) if b <= a)
    return {"to_3": first[3], "to_4": first[4], "pause": pause, "redone": redone}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    rows = {}
    for impl in ("elastic", "horovod"):
        results = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as out:
                code, tail = run(impl, out)
                if not os.path.exists(os.path.join(out, "grow")):
                    raise SystemExit(f"{impl}: exit {code}, never grew\n{tail}")
                results.append(analyse(out))
                print(impl, code, results[-1], flush=True)
        rows[impl] = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print("\n| | offer -> 3 ranks train (s) | offer -> 4 ranks train (s) "
          "| longest stop of rank 0 (s) | steps redone |")
    print("|---|---|---|---|---|")
    for impl, name in (("elastic", "elastic_hvd"), ("horovod", "Elastic Horovod 0.28.1")):
        r = rows[impl]
        print(f"| {name} | {r['to_3']:.2f} | {r['to_4']:.2f} | {r['pause']:.2f} "
              f"| {r['redone']:.0f} |")


if __name__ == "__main__":
    main()
