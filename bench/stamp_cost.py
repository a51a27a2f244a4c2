"""What the agreement stamp (elastic_hvd.core.freshness) costs per collective.

    python bench/stamp_cost.py [--base REV] [--runs 5] [--calls 20000]

Runs the same 2-rank job -- ``--calls`` resilient 1 KiB allreduces, timed on rank 0
after a warm-up -- against this tree and against ``--base`` (a git revision,
checked out into a temporary worktree and put first on PYTHONPATH), interleaved,
and prints the median microseconds per call of each and their ratio.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = r"""
import sys, time
import numpy as np
from elastic_hvd.core import runtime
comm = runtime.init()
x = np.ones(256, dtype=np.float32)
for _ in range(1000):
    comm.allreduce(x)
calls = int(sys.argv[1])
start = time.perf_counter()
for _ in range(calls):
    comm.allreduce(x)
if comm.rank == 0:
    print("US", (time.perf_counter() - start) / calls * 1e6, flush=True)
"""


def one_run(tree, calls, script):
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-m", "elastic_hvd.runner.launch", "-np", "2",
                          "python", script, str(calls)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tree)
    lines = [line for line in out.stdout.splitlines() if line.startswith("US ")]
    if not lines:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return float(lines[-1].split()[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD~2")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.base],
                       check=True, capture_output=True)
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        try:
            times = {"base": [], "this tree": []}
            for _ in range(args.runs):
                times["base"].append(one_run(base, args.calls, script))
                times["this tree"].append(one_run(ROOT, args.calls, script))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base],
                           capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"| tree | us per 1 KiB allreduce, 2 ranks (median of {args.runs}) | runs |")
    print("|---|---|---|")
    for k, v in times.items():
        print(f"| {k} ({args.base if k == 'base' else 'working tree'}) | {med[k]:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in v)} |")
    print(f"stamp cost: this tree / base = {med['this tree'] / med['base']:.3f}")


if __name__ == "__main__":
    main()
