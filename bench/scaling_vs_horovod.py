"""Scaling efficiency at 2 ranks, ours and the real Horovod's, on the same machine
(issue 23: target 0.95).  The ideal is twice the images per second of one process with
the same threads and no communication; efficiency = throughput of 2 ranks / that ideal.
Horovod's says what this machine allows a data-parallel library at all.

MobileNetV2 alpha 0.35, 64x64, batch 16 per process, one thread per process,
``model.fit`` on TF 2.15 / Keras 2 (``.venv-horovod``, the newest TF Horovod runs on):
plain Keras alone (``bench/tf_worker.py --impl keras``), Horovod 0.28.1 on 2 ranks
(plain ``mpirun``), elastic_hvd on 2 ranks (``elastic-hvd-run``, fault tolerance on).
Each round runs the three once; each round's efficiencies use that round's one-process
run; medians over rounds.

    python bench/scaling_vs_horovod.py [--runs 5]  (needs .venv-horovod: bench/build_horovod.sh)

Last line: ``scaling efficiency at 2 ranks: ours X, Horovod Y (medians of N rounds)``.
"""

import argparse
import os
import statistics

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".venv-horovod", "bin")
WORKER = [os.path.join(ROOT, "bench", "tf_worker.py"), "--what", "fit", "--model", "mobilenet",
          "--size", "64", "--batch", "16", "--threads", "1"]
VARIANTS = {  # name -> command before the worker's arguments
    "one process, no communication": [os.path.join(BIN, "python")],
    "Horovod 0.28.1, 2 ranks": [os.path.join(BIN, "mpirun"), "-np", "2", "--allow-run-as-root",
                                os.path.join(BIN, "python")],
    "elastic_hvd, 2 ranks": [os.path.join(BIN, "elastic-hvd-run"), "-np", "2", "python"],
}
IMPL = {"one process, no communication": "keras", "Horovod 0.28.1, 2 ranks": "horovod",
        "elastic_hvd, 2 ranks": "elastic"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    throughput = {name: [] for name in VARIANTS}
    for round_ in range(args.runs):
        for name, launcher in VARIANTS.items():
            cmd = [*launcher, *WORKER, "--impl", IMPL[name], "--steps", str(args.steps),
                   "--warmup", "5"]
            throughput[name].append(worker_result.run(cmd, cwd=ROOT)["fit_img_per_s"])
            print(f"round {round_ + 1}: {name}: {throughput[name][-1]:.0f} img/s", flush=True)
    alone = throughput["one process, no communication"]
    efficiency = {name: [value / (2 * one) for value, one in zip(values, alone)]
                  for name, values in throughput.items() if name != "one process, no communication"}
    print("\n| variant | img/s: median (rounds) | scaling efficiency: median (rounds) |")
    print("|---|---|---|")
    for name, values in throughput.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        cell = "–"
        if name in efficiency:
            cell = (f"{statistics.median(efficiency[name]):.2f} ("
                    + ", ".join(f"{e:.2f}" for e in efficiency[name]) + ")")
        print(f"| {name} | {statistics.median(values):.0f} ({rounds}) | {cell} |")
    ours = statistics.median(efficiency["elastic_hvd, 2 ranks"])
    theirs = statistics.median(efficiency["Horovod 0.28.1, 2 ranks"])
    print(f"scaling efficiency at 2 ranks: ours {ours:.2f}, Horovod {theirs:.2f} "
          f"(medians of {args.runs} rounds)")


if __name__ == "__main__":
    main()
