"""Many small tensors (issue 23): steps per second of a 200-variable MLP (100 Dense
layers of 64, batch 16 per rank) in ``model.fit`` with ``DistributedOptimizer`` on 2
ranks, fusion on (the default threshold) and off (``HOROVOD_FUSION_THRESHOLD=0``:
one collective per variable, the worst case): the real Horovod 0.28.1 on TF 2.15
(plain ``mpirun``), elastic_hvd on the same TF 2.15 venv and on the project's TF 2.21
(``elastic-hvd-run``, fault tolerance on).

    python bench/small_tensors.py [--runs 3]     (needs .venv-horovod: bench/build_horovod.sh)

The variants interleaved per round; medians over rounds; ratios ours / Horovod.
"""

import argparse
import os
import statistics

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "tf_worker.py")
VARIANTS = {  # name -> (implementation, venv)
    "Horovod 0.28.1, TF 2.15": ("horovod", ".venv-horovod"),
    "elastic_hvd, TF 2.15": ("elastic", ".venv-horovod"),
    "elastic_hvd, TF 2.21": ("elastic", ".venv"),
}


def steps_per_s(impl, venv, fusion, args):
    bin_dir = os.path.join(ROOT, venv, "bin")
    threshold = [] if fusion else ["-x", "HOROVOD_FUSION_THRESHOLD=0"]
    if impl == "horovod":
        cmd = [os.path.join(bin_dir, "mpirun"), "-np", "2", "--allow-run-as-root", *threshold,
               os.path.join(bin_dir, "python")]
    else:
        cmd = [os.path.join(bin_dir, "elastic-hvd-run"), "-np", "2", *threshold, "python"]
    cmd += [WORKER, "--impl", impl, "--what", "fit", "--model", "mlp", "--batch", "16",
            "--steps", str(args.steps), "--warmup", "10"]
    return 1e3 / worker_result.run(cmd, cwd=ROOT)["step_ms"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    cells = {(name, fusion): [] for fusion in (True, False) for name in VARIANTS}
    for round_ in range(args.runs):
        for (name, fusion), values in cells.items():
            values.append(steps_per_s(*VARIANTS[name], fusion, args))
            print(f"round {round_ + 1}: {name}, fusion {'on' if fusion else 'off'}: "
                  f"{values[-1]:.1f} steps/s", flush=True)
    median = {key: statistics.median(values) for key, values in cells.items()}
    horovod = next(iter(VARIANTS))
    print("\n| fusion | " + " | ".join(VARIANTS)
          + " | ours/Horovod (TF 2.15) | ours/Horovod (TF 2.21) |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    ratios = {}
    for fusion in (True, False):
        row = [median[(name, fusion)] for name in VARIANTS]
        ratios[fusion] = [value / median[(horovod, fusion)] for value in row[1:]]
        print(f"| {'on' if fusion else 'off'} | " + " | ".join(f"{v:.1f}" for v in row) + " | "
              + " | ".join(f"{r:.2f}" for r in ratios[fusion]) + " |")
    print(f"small tensors: ours/Horovod steps/s = {ratios[True][0]:.2f} fused, "
          f"{ratios[False][0]:.2f} unfused (TF 2.15); {ratios[True][1]:.2f}, "
          f"{ratios[False][1]:.2f} (ours on TF 2.21)")


if __name__ == "__main__":
    main()
