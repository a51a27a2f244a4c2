"""elastic_hvd against the real Horovod 0.28.1, same workloads (issue 3).

    python bench/vs_horovod.py [--runs 3]     (needs .venv-horovod: bench/build_horovod.sh)

Horovod runs on TF 2.15 (the last it supports) with plain mpirun; elastic_hvd runs on
the same TF 2.15 venv (apples to apples) and on the project's current TF, with
fault tolerance on.  Each cell is the median over --runs jobs.
"""

import argparse
import os
import statistics
import sys

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "tf_worker.py")
HVD_VENV = os.path.join(ROOT, ".venv-horovod", "bin")


def launch(impl, venv_bin, np_, what, extra=()):
    if impl == "horovod":
        cmd = [os.path.join(venv_bin, "mpirun"), "-np", str(np_), "--allow-run-as-root"]
        cmd += ["--oversubscribe"] if np_ > (os.cpu_count() or 1) else []
        cmd += [os.path.join(venv_bin, "python")]
    else:
        cmd = [os.path.join(venv_bin, "elastic-hvd-run"), "-np", str(np_), "python"]
    cmd += [WORKER, "--impl", impl, "--what", what, *extra]
    return worker_result.run(cmd)


def median_of(runs, impl, venv_bin, np_, what, key):
    values, tf_version = [], None
    for _ in range(runs):
        result = launch(impl, venv_bin, np_, what)
        tf_version = result["tf"]
        values.append(key(result))
    return statistics.median(values), tf_version


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    setups = [("horovod", HVD_VENV, "Horovod 0.28.1"), ("elastic", HVD_VENV, "elastic_hvd"),
              ("elastic", os.path.dirname(sys.executable), "elastic_hvd")]
    rows = ["| workload | ranks | implementation | TF | median | vs Horovod |",
            "|---|---|---|---|---|---|"]
    for what, np_, label, key, unit, better_high in [
        ("allreduce", 2, "allreduce 1 KiB", lambda r: r["allreduce"][0]["median_s"], "µs", False),
        ("allreduce", 2, "allreduce 64 MiB", lambda r: r["allreduce"][1]["median_s"], "ms", False),
        ("allreduce", 4, "allreduce 64 MiB", lambda r: r["allreduce"][1]["median_s"], "ms", False),
        ("fit", 2, "MobileNetV2 fit img/s", lambda r: r["fit_img_per_s"], "img/s", True),
    ]:
        base = None
        for impl, venv_bin, name in setups:
            value, tf_version = median_of(args.runs, impl, venv_bin, np_, what, key)
            base = value if base is None else base
            shown = {"µs": value * 1e6, "ms": value * 1e3, "img/s": value}[unit]
            ratio = value / base if better_high else base / value
            rows.append(f"| {label} | {np_} | {name} | {tf_version} | {shown:.1f} {unit} "
                        f"| {ratio:.2f}× {'throughput' if better_high else 'speed'} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "vs_horovod.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
