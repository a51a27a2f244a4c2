"""Where TF 2.21's step goes (issue 23): single-process MobileNetV2 ``fit`` on TF 2.21 /
Keras 3 (.venv) and TF 2.15 / Keras 2 (.venv-tf215, ``make test-tf215``), plain Keras
alone and under elastic_hvd on one rank (``elastic-hvd-run -np 1``, fault tolerance on).

    python bench/tf_versions.py [--runs 3] [--steps 40]

Same threads (1), data, batch and model in every cell; the four variants interleaved per
round, medians over rounds.  The difference *ours - alone* within one TF is what
elastic_hvd adds to a step there; *alone* across TFs is what Keras 3 costs by itself.
"""

import argparse
import os
import statistics
import sys

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "tf_worker.py")
VENVS = {"TF 2.21 / Keras 3": ".venv", "TF 2.15 / Keras 2": ".venv-tf215"}


def run(venv, impl, args):
    bin_dir = os.path.join(ROOT, venv, "bin")
    cmd = [os.path.join(bin_dir, "python")]
    if impl == "elastic":
        cmd = [os.path.join(bin_dir, "elastic-hvd-run"), "-np", "1", "python"]
    cmd += [WORKER, "--impl", impl, "--what", "fit", "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", "5", "--size", "64"]
    return worker_result.run(cmd, cwd=ROOT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    cells = {(tf_name, impl): [] for tf_name in VENVS for impl in ("keras", "elastic")}
    for round_ in range(args.runs):
        for (tf_name, impl), values in cells.items():
            result = run(VENVS[tf_name], impl, args)
            values.append(result["step_ms"])
            print(f"round {round_ + 1}: {tf_name} {impl}: {result['step_ms']:.1f} ms/step "
                  f"(TF {result['tf']})", flush=True)
    median = {key: statistics.median(values) for key, values in cells.items()}
    print("\n| TF | Keras alone (ms/step) | elastic_hvd, 1 rank (ms/step) | ours - alone (ms) |")
    print("|---|---|---|---|")
    for tf_name in VENVS:
        alone, ours = median[(tf_name, "keras")], median[(tf_name, "elastic")]
        print(f"| {tf_name} | {alone:.1f} | {ours:.1f} | {ours - alone:+.1f} |")
    new, old = (median[(name, "keras")] for name in VENVS)
    ours_new, ours_old = (median[(name, "elastic")] - median[(name, "keras")] for name in VENVS)
    print(f"tf versions: Keras 3 alone / Keras 2 alone = {new / old:.2f}; elastic_hvd adds "
          f"{ours_new:+.1f} ms/step on TF 2.21, {ours_old:+.1f} ms/step on TF 2.15")


if __name__ == "__main__":
    sys.exit(main())
