"""The failure-free cost of a step in two source trees of elastic_hvd, interleaved (issue 22:
a restructuring must not cost speed).

    python bench/ab_trees.py --trees /path/to/before /path/to/after --runs 3

For each round and each tree, in turn: a 2-rank MobileNetV2 ``model.fit`` (images/s)
and a 2-rank 200-variable MLP ``fit`` (steps/s), both by this tree's
``bench/tf_worker.py``, with the library under test first on ``PYTHONPATH`` (it wins
over this venv's editable install; each job's result says which library it imported).
Prints the medians and the ratio after/before.  The machine must be otherwise idle:
the trees share it in turns, so a load that comes and goes shows up as noise, not as
a bias.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker_result  # noqa: E402

WORKLOADS = {"MobileNetV2 fit img/s": ["--model", "mobilenet", "--steps", "20"],
             "200-variable MLP fit steps/s": ["--model", "mlp", "--steps", "100"]}


def run(tree, args):
    launcher = Path(sys.executable).parent / "elastic-hvd-run"
    cmd = [str(launcher), "-np", "2", "-x", f"PYTHONPATH={tree}", sys.executable,
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_worker.py"),
           "--impl", "elastic", "--what", "fit", *args]
    # In the tree: a rank runs ``python -m``, which puts its working directory first.
    result = worker_result.run(cmd, timeout=900, cwd=tree, env={**os.environ, "PYTHONPATH": tree})
    if not str(result["library"]).startswith(str(Path(tree) / "elastic_hvd")):
        raise RuntimeError(f"the job imported {result['library']}, not the library of {tree}")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", choices=["mobilenet", "mlp"], help="one workload only")
    p.add_argument("--mlp-steps", type=int, default=100, help="timed steps of the MLP")
    args = p.parse_args()
    WORKLOADS["200-variable MLP fit steps/s"][-1] = str(args.mlp_steps)
    workloads = {w: a for w, a in WORKLOADS.items() if args.only in (None, a[1])}
    trees = [str(Path(t).resolve()) for t in args.trees]
    seen = {(w, t): [] for w in workloads for t in trees}
    for r in range(args.runs):
        for workload, worker_args in workloads.items():
            for tree in trees if r % 2 == 0 else trees[::-1]:
                result = run(tree, worker_args)
                value = result["fit_img_per_s"] if "img" in workload else 1e3 / result["step_ms"]
                seen[workload, tree].append(value)
                print(f"round {r + 1}: {workload}: {tree}: {value:.2f}", flush=True)
    print(f"\n| workload | before ({trees[0]}) | after ({trees[1]}) | after/before of the "
          "medians |")
    print("|---|---|---|---|")
    for workload in workloads:
        before, after = (statistics.median(seen[workload, t]) for t in trees)
        ratios = [a / b for b, a in zip(seen[workload, trees[0]], seen[workload, trees[1]])]
        print(f"| {workload} | {before:.2f} | {after:.2f} | {after / before:.3f} "
              f"(per round: {', '.join(f'{x:.3f}' for x in ratios)}) |")


if __name__ == "__main__":
    main()
