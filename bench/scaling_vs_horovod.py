"""Scaling efficiency at 2 ranks, ours and the real Horovod's, on the same machine
(issue 23: target 0.95).  The ideal is twice the images per second of one process with
the same threads and no communication; efficiency = throughput of 2 ranks / that ideal.
Horovod's says what this machine allows a data-parallel library at all.

A fourth variant splits what is missing from the ideal in two: two processes of the
one-process job, side by side and never talking (their timed steps start together), give
what 2 processes reach on this machine without any communication: the machine's share
(cores shared with the processes' other threads, memory bandwidth).  Ours against it is
the communication's share.

MobileNetV2 alpha 0.35, 64x64, batch 16 per process, one thread per process,
``model.fit`` on TF 2.15 / Keras 2 (``.venv-horovod``, the newest TF Horovod runs on):
plain Keras alone (``bench/tf_worker.py --impl keras``), Horovod 0.28.1 on 2 ranks
(plain ``mpirun``), elastic_hvd on 2 ranks (``elastic-hvd-run``, fault tolerance on).
Each round runs the four once; each round's efficiencies use that round's one-process
run; medians over rounds.

    python bench/scaling_vs_horovod.py [--runs 5]  (needs .venv-horovod: bench/build_horovod.sh)

Last line: ``scaling efficiency at 2 ranks: ours X, Horovod Y, two processes without
communication Z (medians of N rounds)``.
"""

import argparse
import os
import statistics
import subprocess
import tempfile

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".venv-horovod", "bin")
WORKER = [os.path.join(ROOT, "bench", "tf_worker.py"), "--what", "fit", "--model", "mobilenet",
          "--size", "64", "--batch", "16", "--threads", "1"]
ALONE, SIDE_BY_SIDE = "one process, no communication", "two processes, no communication"
HOROVOD, OURS = "Horovod 0.28.1, 2 ranks", "elastic_hvd, 2 ranks"
VARIANTS = {  # name -> command before the worker's arguments
    ALONE: [os.path.join(BIN, "python")],
    SIDE_BY_SIDE: [os.path.join(BIN, "python")],
    HOROVOD: [os.path.join(BIN, "mpirun"), "-np", "2", "--allow-run-as-root",
              os.path.join(BIN, "python")],
    OURS: [os.path.join(BIN, "elastic-hvd-run"), "-np", "2", "python"],
}
IMPL = {ALONE: "keras", SIDE_BY_SIDE: "keras", HOROVOD: "horovod", OURS: "elastic"}


def side_by_side(cmd, count=2):
    """The images per second of ``count`` copies of the one-process job whose timed steps
    start together, and how much of the timed span all of them ran at once."""
    with tempfile.TemporaryDirectory() as meet:
        procs = [subprocess.Popen([*cmd, "--start-together", f"{meet}:{count}"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(count)]
        outputs = [proc.communicate(timeout=900) for proc in procs]
    results = [worker_result.parse(out) for out, _ in outputs]
    if None in results:
        raise RuntimeError("no result from a side-by-side process:\n"
                           + "\n".join(err[-2000:] for _, err in outputs))
    starts, ends = zip(*(r["timed_wall"] for r in results))
    overlap = (min(ends) - max(starts)) / (max(ends) - min(starts))
    return sum(r["fit_img_per_s"] for r in results), overlap


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    throughput = {name: [] for name in VARIANTS}
    for round_ in range(args.runs):
        for name, launcher in VARIANTS.items():
            cmd = [*launcher, *WORKER, "--impl", IMPL[name], "--steps", str(args.steps),
                   "--warmup", "5"]
            note = ""
            if name == SIDE_BY_SIDE:
                value, overlap = side_by_side(cmd)
                note = f" (timed steps side by side for {overlap:.0%} of their span)"
            else:
                value = worker_result.run(cmd, cwd=ROOT)["fit_img_per_s"]
            throughput[name].append(value)
            print(f"round {round_ + 1}: {name}: {value:.0f} img/s{note}", flush=True)
    efficiency = {name: [value / (2 * one) for value, one in zip(values, throughput[ALONE])]
                  for name, values in throughput.items() if name != ALONE}
    print("\n| variant | img/s: median (rounds) | scaling efficiency: median (rounds) |")
    print("|---|---|---|")
    for name, values in throughput.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        cell = "–"
        if name in efficiency:
            cell = (f"{statistics.median(efficiency[name]):.2f} ("
                    + ", ".join(f"{e:.2f}" for e in efficiency[name]) + ")")
        print(f"| {name} | {statistics.median(values):.0f} ({rounds}) | {cell} |")
    against_machine = [ours / both for ours, both in
                       zip(throughput[OURS], throughput[SIDE_BY_SIDE])]
    print(f"\nours / two processes without communication (the communication's share): "
          f"{statistics.median(against_machine):.2f} ("
          + ", ".join(f"{r:.2f}" for r in against_machine) + ")")
    ours, theirs, machine = (statistics.median(efficiency[name])
                             for name in (OURS, HOROVOD, SIDE_BY_SIDE))
    print(f"scaling efficiency at 2 ranks: ours {ours:.2f}, Horovod {theirs:.2f}, two processes "
          f"without communication {machine:.2f} (medians of {args.runs} rounds)")


if __name__ == "__main__":
    main()
