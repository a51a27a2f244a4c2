"""How the resilient core's costs grow with the number of ranks (issue 18).

    python bench/scale.py [--sizes 2,4,8,16,32,64] [--runs 3] [--yield-check 8]
    python bench/scale.py --replot runs/scale/raw.jsonl     # tables, fits, plot only

Why: issue 18 asks whether detection + repair and the agreement grow no faster than
log N.  Each job (``elastic-hvd-run -np N``, core only, no TensorFlow) measures, on
``runtime.init()``'s communicator, the median time per call of a resilient 1 KiB
allreduce and of ``comm.agree(1)``, then SIGKILLs one rank from a helper thread in
it (as ``ELASTIC_HVD_FAULTS=rank=V,coll=K,delay=d`` would, but stamping the moment
of the kill) in the middle of a loop of such allreduces; the survivors report their
MembershipEvent (detect_s, repair_s) and the time from the kill to their next
completed collective.  Jobs are repeated (``--runs``, sizes interleaved) and the
load average is recorded beside each.  Medians per N are fitted with a + b*log2(N)
and a + b*N, plotted (docs/scale.png) and printed as markdown.

On a 2-core machine every N > 2 is oversubscribed: N processes share 2 cores, so
each collective step also waits for descheduled processes.  ``--yield-check N``
repeats one size with ``OMPI_MCA_mpi_yield_when_idle`` 0 (busy poll) and 1 (yield;
Open MPI's default once oversubscribed) to show how much of that is scheduling.
Every job has a hard timeout; on it every process of the job (found by a token in
its command line) is killed by pid.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

import worker_result  # bench/, this script's directory

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METRICS = [("allreduce_us", "1 KiB allreduce (µs/call)"), ("agree_us", "agree(1) (µs/call)"),
           ("detect_ms", "detection (ms)"), ("repair_ms", "revoke+shrink (ms)"),
           ("recovery_ms", "kill → next collective done (ms)")]


# -- the job (every rank) ------------------------------------------------------------
def worker(calls, stamp):
    import numpy as np

    from elastic_hvd.core import runtime

    comm = runtime.init()
    n = comm.size
    x, out = np.ones(256, dtype=np.float32), np.empty(256, dtype=np.float32)

    def timed(call):
        for _ in range(max(10, calls // 5)):  # warm-up
            call()
        comm.barrier()
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    allreduce_us = timed(lambda: comm.allreduce(x, out=out))
    agree_us = timed(lambda: comm.agree(1))
    comm.barrier()
    if comm.original_id == n - 1:  # the victim: killed while the loop below runs
        def kill():
            time.sleep(0.002)
            with open(stamp + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.replace(stamp + ".tmp", stamp)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
    while not comm.events:  # every survivor sees the event after the same call
        comm.allreduce(x, out=out)
    done = time.time()
    with open(stamp) as f:
        recovery = done - float(f.read())
    everyone = comm.allgather_object(recovery)
    if comm.rank == 0:
        e = comm.events[-1]
        print("RESULT " + json.dumps({
            "n": n, "survivors": comm.size, "allreduce_us": allreduce_us, "agree_us": agree_us,
            "detect_ms": e.detect_s * 1e3, "repair_ms": e.repair_s * 1e3,
            "recovery_ms": recovery * 1e3, "recovery_max_ms": max(everyone) * 1e3}), flush=True)


# -- the driver ----------------------------------------------------------------------
def kill_job(token):
    """SIGKILL every process whose command line holds ``token`` (this job's only)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def load():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def job(n, env_extra, timeout, tmp):
    """One job of ``n`` ranks: its RESULT dict (with load and wall time), or None."""
    token = f"scale-{uuid.uuid4().hex[:12]}"
    stamp = os.path.join(tmp, token)
    calls = min(2000, max(60, 4000 // n))
    cmd = [os.path.join(ROOT, ".venv", "bin", "elastic-hvd-run"), "-np", str(n)]
    for name, value in env_extra.items():
        cmd += ["-x", f"{name}={value}"]
    cmd += ["python", os.path.abspath(__file__), "--worker", str(calls), stamp, token]
    before, started = load(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_job(token)
        proc.communicate()
        print(f"  n={n}: TIMEOUT after {timeout}s", file=sys.stderr, flush=True)
        return None
    finally:
        kill_job(token)  # a straggler, if any, must not outlive its job
    result = worker_result.parse(out)
    if result is None:
        print(f"  n={n}: no result (exit {proc.returncode}):\n{out[-1500:]}", file=sys.stderr)
        return None
    result.update(load_before=before, load_after=load(), wall_s=time.time() - started,
                  env=env_extra, when=time.strftime("%Y-%m-%d %H:%M:%S"))
    return result


def fit(ns, ys):
    """Least squares of a + b*log2(N) and of a + b*N: {law: (a, b, rms residual)}."""
    import numpy as np
    ns, ys = np.asarray(ns, float), np.asarray(ys, float)
    laws = {}
    for law, xs in (("log", np.log2(ns)), ("lin", ns)):
        design = np.column_stack([np.ones_like(xs), xs])
        (a, b), *_ = np.linalg.lstsq(design, ys, rcond=None)
        laws[law] = (a, b, float(np.sqrt(np.mean((design @ [a, b] - ys) ** 2))))
    return laws


def predict(law, a, b, n):
    import math
    return a + b * (math.log2(n) if law == "log" else n)


def report(rows, plot_path):
    """Markdown: per-N medians, the yield comparison, fits and extrapolations; the plot."""
    main_rows = [r for r in rows if not r["env"]]
    sizes = sorted({r["n"] for r in main_rows})
    med = {n: {k: statistics.median(r[k] for r in main_rows if r["n"] == n)
               for k, _ in METRICS + [("recovery_max_ms", ""), ("load_before", "")]}
           for n in sizes}
    out = ["| ranks | jobs | 1 KiB allreduce (µs/call) | agree(1) (µs/call) | detection (ms) "
           "| revoke+shrink (ms) | kill → next collective, rank 0 (ms) | … slowest survivor (ms) "
           "| load avg (1 min) at start |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        mine = [r for r in main_rows if r["n"] == n]
        m = med[n]
        out.append(f"| {n} | {len(mine)} | {m['allreduce_us']:.1f} | {m['agree_us']:.1f} "
                   f"| {m['detect_ms']:.1f} | {m['repair_ms']:.2f} | {m['recovery_ms']:.1f} "
                   f"| {m['recovery_max_ms']:.1f} | "
                   + ", ".join(f"{r['load_before']:.1f}" for r in mine) + " |")
    checks = [r for r in rows if r["env"]]
    if checks:
        out += ["", "| ranks | OMPI_MCA_mpi_yield_when_idle | jobs | allreduce (µs) | agree (µs) "
                "| detection (ms) | kill → next collective (ms) | load avg at start |",
                "|---|---|---|---|---|---|---|---|"]
        for key in sorted({(r["n"], json.dumps(r["env"], sort_keys=True)) for r in checks}):
            mine = [r for r in checks if (r["n"], json.dumps(r["env"], sort_keys=True)) == key]
            m = {k: statistics.median(r[k] for r in mine) for k, _ in METRICS}
            out.append(f"| {key[0]} | {mine[0]['env'].get('OMPI_MCA_mpi_yield_when_idle')} "
                       f"| {len(mine)} | {m['allreduce_us']:.1f} | {m['agree_us']:.1f} "
                       f"| {m['detect_ms']:.1f} | {m['recovery_ms']:.1f} | "
                       + ", ".join(f"{r['load_before']:.1f}" for r in mine) + " |")
    # Fitted twice: over every size, and over the oversubscribed sizes only (N = 2 runs
    # one process per core with busy polling: a different regime from N >= 4).
    fits = {}
    for span in (sizes, [n for n in sizes if n > (os.cpu_count() or 2)]):
        if len(span) < 3:
            continue
        out += ["", f"Fits to the medians over N = {span[0]}..{span[-1]} (least squares; rms = "
                "root-mean-square residual; the better law has the smaller rms). 1 024 and "
                "16 384 ranks: **EXTRAPOLATION** from an oversubscribed 2-core machine, not a "
                "prediction for a real cluster.", "",
                f"| metric | a + b·log2 N | rms | a + b·N | rms | better "
                f"| t({span[-1]})/t({span[0]}) | log-fit @1 024 | lin-fit @1 024 "
                "| log-fit @16 384 | lin-fit @16 384 |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, label in METRICS:
            ys = [med[n][key] for n in span]
            f = fit(span, ys)
            fits.setdefault(key, f)  # the plot shows the fits over every size
            better = "log" if f["log"][2] <= f["lin"][2] else "linear"
            ratio = ys[-1] / ys[0] if ys[0] else float("nan")
            cells = [f"{predict(law, *f[law][:2], big):.4g}" for big in (1024, 16384)
                     for law in ("log", "lin")]
            out.append(f"| {label} | {f['log'][0]:.3g} + {f['log'][1]:.3g}·log2 N "
                       f"| {f['log'][2]:.3g} | {f['lin'][0]:.3g} + {f['lin'][1]:.3g}·N "
                       f"| {f['lin'][2]:.3g} | {better} | {ratio:.1f} | "
                       + " | ".join(cells) + " |")
    plot(rows, sizes, med, fits, plot_path)
    return "\n".join(out)


def plot(rows, sizes, med, fits, path):
    """One panel per metric (jobs, medians, both fits; log-x) and one of every metric's
    growth t(N)/t(smallest N) on log-log axes beside log2 N and N."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    axes = axes.ravel()
    grid = np.geomspace(sizes[0], sizes[-1], 100)
    pts = [r for r in rows if not r["env"]]
    for ax, (key, label) in zip(axes, METRICS):
        ax.scatter([r["n"] for r in pts], [r[key] for r in pts], s=10, alpha=0.4, label="jobs")
        ax.plot(sizes, [med[n][key] for n in sizes], "o-", label="median")
        for law, style in (("log", "--"), ("lin", ":")):
            a, b, _ = fits[key][law]
            ax.plot(grid, [predict(law, a, b, g) for g in grid], style,
                    label="fit a+b·log2 N" if law == "log" else "fit a+b·N")
        ax.set_title(label, fontsize=10)
    growth = axes[len(METRICS)]
    for key, label in METRICS:
        growth.plot(sizes, [med[n][key] / med[sizes[0]][key] for n in sizes], "o-",
                    label=label, markersize=3)
    growth.plot(grid, np.log2(grid) / np.log2(sizes[0]), "k--", label="∝ log2 N")
    growth.plot(grid, grid / sizes[0], "k:", label="∝ N")
    growth.set_yscale("log")
    growth.set_title(f"growth: median / median at N={sizes[0]}", fontsize=10)
    growth.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("ranks (N > 2: oversubscribed, 2 cores)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle("elastic_hvd core vs ranks on a shared 2-core machine (issue 18)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,4,8,16,32,64")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--yield-check", type=int, default=8, help="size measured with "
                   "OMPI_MCA_mpi_yield_when_idle=0 and =1 (0: skip)")
    p.add_argument("--raw", default=os.path.join(ROOT, "runs", "scale", "raw.jsonl"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "scale.png"))
    p.add_argument("--replot", help="a raw.jsonl of earlier runs: report only")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(report(rows, args.plot))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    os.makedirs(os.path.dirname(args.raw), exist_ok=True)
    tmp = os.path.dirname(args.raw)
    plan = []
    for run in range(args.runs):  # interleaved: alternate directions, checks in between
        plan += [(n, {}) for n in (sizes if run % 2 == 0 else sizes[::-1])]
        if args.yield_check:
            plan += [(args.yield_check, {"OMPI_MCA_mpi_yield_when_idle": v})
                     for v in ((0, 1) if run % 2 == 0 else (1, 0))]
    rows, started = [], time.time()
    with open(args.raw, "a") as raw:
        for i, (n, env) in enumerate(plan):
            result = job(n, env, timeout=60 + 4 * n, tmp=tmp)
            if result is None:
                continue
            rows.append(result)
            raw.write(json.dumps(result) + "\n")
            raw.flush()
            print(f"[{i + 1}/{len(plan)} {time.time() - started:.0f}s] n={n} {env or ''} "
                  f"allreduce {result['allreduce_us']:.1f} µs, agree {result['agree_us']:.1f} µs, "
                  f"detect {result['detect_ms']:.1f} ms, recovery {result['recovery_ms']:.1f} ms, "
                  f"load {result['load_before']:.1f}, wall {result['wall_s']:.1f}s",
                  file=sys.stderr, flush=True)
    print(report(rows, args.plot))


if __name__ == "__main__":
    main()
