"""Benchmark of the resilient core (issue 2): prints markdown tables.

    python bench/core_bench.py [--runs 5] [--out bench/results/core.md]

* allreduce 4 KiB .. 64 MiB on 2 and 4 ranks: ours vs raw mpi4py ``Allreduce`` in the
  same job (median time, bus bandwidth 2(n-1)/n * bytes / t, ratio), FT on and off;
* crash-to-recovered: SIGKILL of one of 4 ranks to the next completed collective
  (median of ``--runs`` jobs).
"""

import argparse
import os
import statistics
import sys
import tempfile

import worker_result  # bench/, this script's directory

HERE = os.path.dirname(os.path.abspath(__file__))


def job(np_, script, *args, ft=True):
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(np_)]
    cmd += [] if ft else ["--no-ft"]
    cmd += ["python", os.path.join(HERE, script), *map(str, args)]
    return worker_result.run(cmd, timeout=600)


def human(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def allreduce_table():
    lines = ["| ranks | FT | size | raw mpi4py | ours | ours/raw time "
             "| raw bus GB/s | ours bus GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for np_ in (2, 4):
        for ft in (True, False):
            result = job(np_, "allreduce_worker.py", ft=ft)
            for row in result["rows"]:
                factor = 2 * (np_ - 1) / np_ * row["bytes"] / 1e9
                lines.append(
                    f"| {np_} | {'on' if ft else 'off'} | {human(row['bytes'])} "
                    f"| {row['raw_s'] * 1e6:.1f} µs | {row['ours_s'] * 1e6:.1f} µs "
                    f"| {row['ours_s'] / row['raw_s']:.3f} | {factor / row['raw_s']:.2f} "
                    f"| {factor / row['ours_s']:.2f} |")
    return "\n".join(lines)


def recovery_table(runs):
    results = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(job(4, "recovery_worker.py", 2, os.path.join(tmp, "stamp")))
    med = {k: statistics.median(r[k] for r in results)
           for k in ("recovery_s", "detect_s", "repair_s")}
    return ("| ranks | runs | SIGKILL → next collective done (median) | detection (median) "
            "| revoke+shrink (median) | all runs (ms) |\n|---|---|---|---|---|---|\n"
            f"| 4 → 3 | {runs} | {med['recovery_s'] * 1e3:.1f} ms | {med['detect_s'] * 1e3:.1f} ms "
            f"| {med['repair_s'] * 1e3:.2f} ms | "
            + ", ".join(f"{r['recovery_s'] * 1e3:.1f}" for r in results) + " |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "results", "core.md"))
    args = p.parse_args()
    text = "\n\n".join([allreduce_table(), recovery_table(args.runs)])
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
