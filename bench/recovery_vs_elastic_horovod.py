"""Recovery from a SIGKILL inside Keras training: elastic_hvd vs Elastic Horovod (issue 4).

    python bench/recovery_vs_elastic_horovod.py [--runs 3]   (needs .venv-horovod)

Both run bench/fit_recovery_worker.py (MobileNetV2 alpha 0.35, 64x64, batch 16 per
rank, 60 steps, commit every 10 steps, rank 3 SIGKILLed as step 30 starts) on 4
ranks.  Elastic Horovod uses Gloo with two pseudo-hosts (localhost:2, 127.0.0.1:2)
and --min-np 2, as Horovod's own elastic tests do; elastic_hvd uses elastic-hvd-run.
Reported (medians over --runs): (a) seconds from the kill to the next completed
step, and the time lost (that minus one normal step, which the step itself needs
anyway), (b) steps of work redone (rolled back), (c) images/s before and after.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "fit_recovery_worker.py")
HVD_BIN = os.path.join(ROOT, ".venv-horovod", "bin")
BATCH = 16


def run(impl, out):
    if impl == "horovod":
        discovery = os.path.join(out, "discover.sh")
        with open(discovery, "w") as f:
            f.write("#!/bin/sh\necho localhost:2\necho 127.0.0.1:2\n")
        os.chmod(discovery, 0o755)
        cmd = [os.path.join(HVD_BIN, "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4",
               "--host-discovery-script", discovery, os.path.join(HVD_BIN, "python")]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "elastic-hvd-run"), "-np", "4",
               "python"]
    cmd += [WORKER, "--impl", impl, "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-2000:]


def analyse(out):
    with open(os.path.join(out, "killed")) as f:
        killed = float(f.read())
    rows = []
    for name in os.listdir(out):
        if name.startswith("steps"):
            with open(os.path.join(out, name)) as f:
                rows += [tuple(float(v) for v in line.split()) for line in f if line.strip()]
    rows.sort()
    initial_size = int(rows[0][2])
    # Steps finished with the old membership (stragglers of the step before the kill may
    # finish just after it) versus the first step finished by the new membership.
    before = [r for r in rows if int(r[2]) == initial_size]
    after = [r for r in rows if int(r[2]) != initial_size and r[0] > killed]
    last_before = max(int(r[1]) for r in before)
    first_after = after[0]
    redone = max(0, last_before - (int(first_after[1]) - 1))

    def throughput(window):
        # one line per rank per step: count distinct steps, each of size*BATCH images
        steps = sorted({(int(r[1]), int(r[2])) for r in window})
        if len(steps) < 2:
            return float("nan")
        times = [min(r[0] for r in window if int(r[1]) == s) for s, _ in steps]
        images = sum(size * BATCH for _, size in steps[1:])
        return images / (times[-1] - times[0])

    steady_after = [r for r in after if int(r[1]) > int(first_after[1])]
    step_ends = sorted({int(r[1]): r[0] for r in before if r[0] < killed}.items())
    step_s = statistics.median(b[1] - a[1] for a, b in zip(step_ends[-11:], step_ends[-10:]))
    return {"recovery_s": first_after[0] - killed, "lost_s": first_after[0] - killed - step_s,
            "redone": redone,
            "before": throughput([r for r in before if int(r[1]) > last_before - 15
                                  and r[0] < killed]),
            "after": throughput(steady_after), "size_after": int(first_after[2])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    table = ["| implementation | runs | kill → next completed step (median) | time lost (that "
             "minus one normal step) | steps redone | ranks after | img/s before | img/s after "
             "| all runs: kill → next step (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    medians = {}
    for impl, label in (("elastic", "elastic_hvd"), ("horovod", "Elastic Horovod 0.28.1")):
        results = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as out:
                code, tail = run(impl, out)
                try:
                    results.append(analyse(out))
                except (OSError, ValueError, IndexError) as exc:
                    print(f"{impl}: run failed ({exc}), exit {code}:\n{tail}", flush=True)
        if not results:
            continue
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        medians[impl] = med
        table.append(f"| {label} | {len(results)} | {med['recovery_s']:.3f} s "
                     f"| {med['lost_s']:.3f} s | {med['redone']:.0f} "
                     f"| {med['size_after']:.0f} | {med['before']:.1f} | {med['after']:.1f} | "
                     + ", ".join(f"{r['recovery_s']:.3f}" for r in results) + " |")
        print(table[-1], flush=True)
    if len(medians) == 2:
        horovod, elastic = medians["horovod"], medians["elastic"]
        table.append(f"\nElastic Horovod / elastic_hvd: kill → next step "
                     f"{horovod['recovery_s'] / elastic['recovery_s']:.0f}x, "
                     f"time lost {horovod['lost_s'] / elastic['lost_s']:.0f}x")
    text = "\n".join(table)
    print(text)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "recovery_vs_elastic_horovod.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
