"""elastic_hvd against TensorFlow's own MultiWorkerMirroredStrategy (issue 23).

    python bench/vs_mwms.py [--runs 3] [--kill-runs 3]        (make bench-mwms)

What a TensorFlow user picks on TF >= 2.16, where Horovod does not install:
``tf.distribute.MultiWorkerMirroredStrategy`` (MWMS; ``TF_CONFIG`` on loopback ports,
its default collective implementation), with ``BackupAndRestore`` against failures.
Both train the same Keras models in ``model.fit`` (bench/mwms_worker.py): MobileNetV2
(alpha 0.35, 64x64 synthetic images, 10 classes) and an MLP of 100 Dense layers (200
variables), 16 samples per process and step, one intra-op and one inter-op thread per
process.  MWMS gets its batches from ``distribute_datasets_from_function`` (16 per
worker): a dataset batched to the global size and auto-sharded would have each worker
train half the images and MWMS look 1.5x faster than it is.  elastic_hvd runs with
``DistributedOptimizer`` under elastic-hvd-run.

1. Throughput, no failure: the job's samples/s (img/s; steps/s for the MLP) on 2 and 4
   processes, and one process alone with no communication (the ideal is N times that;
   4 processes share this machine's 2 cores).  MWMS's ``model.fit`` with a distributed
   dataset fails on Keras 3 (tried once, its error printed), so the comparison is on
   tf_keras (``TF_USE_LEGACY_KERAS=1``); ours also runs on Keras 3.  The variants run
   interleaved, round after round, so the noise of a shared machine falls on each alike;
   ratios are taken within a round, then the median over ``--runs`` rounds.
2. One worker SIGKILLed from outside once ``--kill-at`` steps are done (MobileNetV2,
   ``--kill-np`` processes, ``--kill-steps`` steps in one epoch, tf_keras): elastic_hvd
   goes on in place without it; MWMS with ``BackupAndRestore(save_freq=--save-freq)``
   under the restart loop TF's docs describe (the other workers fail; when all have
   exited, all are launched again and resume from the backup; one that does not fail
   within ``--grace`` s is killed).  From the step logs: seconds from the kill to the
   next completed step, steps redone, *time lost* (the kill to the first step past the
   last one done before it, minus one normal step), and the job's wall time.

The load average (1 min) is read before each job and reported beside the results.
Last line: ``vs MWMS: throughput ours/MWMS = X (2 workers), Y (4 workers); time lost per
SIGKILL MWMS/ours = Z``.
"""

import argparse
import glob
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import worker_result  # bench/, this script's directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from mpijob import JOB_MARKER, job_ranks, kill_tree  # noqa: E402

WORKER = os.path.join(ROOT, "bench", "mwms_worker.py")
RUN = os.path.join(os.path.dirname(sys.executable), "elastic-hvd-run")
BATCH = 16
LOADS = []  # 1-minute load average before each job


def flavour_env(flavour):
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    if flavour == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Job:
    """The processes of one job, each in its own session, with its output in files;
    ``stop()`` kills whatever of it is left (MWMS workers, mpirun and its ranks)."""

    def __init__(self, impl, np_, flavour, worker_args, tmp):
        LOADS.append(os.getloadavg()[0])
        self.impl, self.tmp, self.marker = impl, tmp, uuid.uuid4().hex
        self.started = time.time()
        cmd = [sys.executable, WORKER, "--impl", impl, *worker_args]
        env = {**flavour_env(flavour), JOB_MARKER: self.marker}
        if impl == "elastic":
            self.procs = [self._popen([RUN, "-np", str(np_), "python", *cmd[1:]], env, "job")]
        elif impl == "single":
            self.procs = [self._popen(cmd, env, "job")]
        else:
            hosts = [f"127.0.0.1:{port}" for port in free_ports(np_)]
            self.procs = [self._popen(cmd, {**env, "TF_CONFIG": json.dumps({
                "cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})},
                f"worker{i}") for i in range(np_)]

    def _popen(self, cmd, env, name):
        with open(os.path.join(self.tmp, f"{name}-{uuid.uuid4().hex[:6]}.out"), "w") as out:
            return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def output(self):
        texts = []
        for path in sorted(glob.glob(os.path.join(self.tmp, "*.out"))):
            with open(path) as f:
                texts.append(f.read())
        return "\n".join(texts)

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def stop(self):
        for proc in self.procs:
            kill_tree(proc, self.marker if self.impl == "elastic" else None)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def throughput_job(impl, np_, flavour, args, extra=()):
    """``{"mobilenet": img/s, "mlp": samples/s, ...}`` of one job, or ``{"error": line}``."""
    worker_args = ["--steps", str(args.steps), "--mlp-steps", str(args.mlp_steps), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(impl, np_, flavour, worker_args, tmp)
        try:
            job.wait(args.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            job.stop()
        output = job.output()
    result = worker_result.parse(output)
    return result if result is not None else {"error": last_error(output)}


def last_error(output):
    """The last exception's message, on one line, a PerReplica value's dump elided."""
    found = list(re.finditer(r"^\w+(?:\.\w+)*(?:Error|Exception): ", output, re.M))
    text = output[found[-1].start():] if found else output[-300:] or "no output"
    text = re.sub(r"PerReplica:\{.*\}\)", "PerReplica:{...})", " ".join(text.split()))
    return text[:300]


def step_rows(directory):
    rows = []
    for path in glob.glob(os.path.join(directory, "steps-*.txt")):
        pid = int(path.rsplit("-", 1)[1][:-4])
        with open(path) as f:
            rows += [(float(t), int(s), int(n), pid) for t, s, n in map(str.split, f) if s]
    return sorted(rows)


def kill_job(impl, args, tmp):
    """One MobileNetV2 job that loses a worker to a SIGKILL from outside; the step log
    analysed, with the job's wall time and (MWMS) how it went."""
    logs = os.path.join(tmp, "steps")
    os.makedirs(logs)
    worker_args = ["--models", "mobilenet", "--warmup", "0", "--steps", str(args.kill_steps),
                   "--log", logs]
    if impl == "mwms":
        worker_args += ["--backup", os.path.join(tmp, "backup"), "--save-freq",
                        str(args.save_freq)]
    started = time.time()
    deadline = time.monotonic() + args.timeout
    killed = survivors_s = None
    attempts, victim_pids = 0, set()
    while True:
        attempts += 1
        job = Job(impl, args.kill_np, "tf_keras", worker_args, tmp)
        try:
            while time.monotonic() < deadline:
                running = [p.poll() is None for p in job.procs]
                if impl == "mwms" and killed and attempts == 1 and survivors_s is None \
                        and not all(running[:-1]):
                    survivors_s = time.time() - killed  # the first survivor gave up
                if not any(running):
                    break
                if killed is None and len(step_rows(logs)) >= args.kill_at * args.kill_np:
                    pid = (job_ranks(job.marker)[args.kill_np - 1] if impl == "elastic"
                           else job.procs[-1].pid)
                    os.kill(pid, signal.SIGKILL)
                    killed, victim_pids = time.time(), {pid}
                if impl == "mwms" and killed and attempts == 1 and \
                        time.time() - killed > args.grace:
                    break  # a survivor that never fails: the restart loop kills it
                time.sleep(0.01)
        finally:
            job.stop()
        codes = [p.returncode for p in job.procs]
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{impl}: no end after {args.timeout} s\n{job.output()[-3000:]}")
        if killed is None:
            raise RuntimeError(f"{impl}: ended (exit {codes}) before {args.kill_at} steps\n"
                               + job.output()[-3000:])
        if all(code == 0 for code in codes):
            break
        if impl != "mwms" or attempts > 3:
            raise RuntimeError(f"{impl}: exit {codes}\n{job.output()[-3000:]}")
    wall = time.time() - started
    rows = [r for r in step_rows(logs) if r[3] not in victim_pids]
    first_pids = {r[3] for r in rows if r[0] <= killed}
    before = [r for r in rows if r[0] <= killed]
    last_before = max(r[1] for r in before)
    # The new generation: the processes MWMS started after the kill, or ours at the new size.
    after = [r for r in rows if r[0] > killed and (r[3] not in first_pids if impl == "mwms"
                                                    else r[2] < args.kill_np)]
    first_new = next(r for r in after if r[1] > last_before)
    ends = sorted({s: t for t, s, _, _ in reversed(before)}.items())  # each step's first end
    step_s = statistics.median(b[1] - a[1] for a, b in zip(ends[-11:-1], ends[-10:]))
    return {"first_step_s": rows[0][0] - started, "next_step_s": after[0][0] - killed,
            "redone": max(0, last_before - (after[0][1] - 1)),
            "lost_s": first_new[0] - killed - step_s, "wall_s": wall, "step_s": step_s,
            "survivors_fail_s": survivors_s, "attempts": attempts, "killed_after": last_before}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def same_round_ratio(ours, theirs, model, factor=1):
    """Median over rounds of ours/(factor x theirs), each pair from the same round."""
    return median(a[model] / (factor * b[model]) for a, b in zip(ours, theirs)
                  if model in a and model in b)


def throughput_table(results, runs):
    names = {"single": "one process, no communication", "mwms": "MWMS",
             "elastic": "elastic_hvd"}
    lines = ["", "| model | Keras | processes | implementation | samples/s: median (runs) "
             "| at the median step | steps/s | ours/MWMS | scaling efficiency "
             "| CPU s per step, rank 0 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, label in (("mobilenet", "MobileNetV2 (img/s)"), ("mlp", "MLP, 200 variables")):
        paced = model + "_at_median_step"
        for (impl, np_, flavour), rows in results.items():
            values = [r[model] for r in rows if model in r]
            if not values:
                errors = {r.get("error", "no result") for r in rows}
                lines.append(f"| {label} | {flavour} | {np_} | {names[impl]} | failed: "
                             f"{'; '.join(errors)} | | | | | |")
                continue
            ratio = efficiency = "–"
            if impl == "elastic" and ("mwms", np_, flavour) in results:
                theirs = results["mwms", np_, flavour]
                ratio = (f"{same_round_ratio(rows, theirs, model):.2f}; "
                         f"{same_round_ratio(rows, theirs, paced):.2f}")
            if impl != "single":
                single = results["single", 1, flavour]
                efficiency = (f"{same_round_ratio(rows, single, model, np_):.2f}; "
                              f"{same_round_ratio(rows, single, paced, np_):.2f}")
            med = median(values)
            lines.append(
                f"| {label} | {flavour} | {np_} | {names[impl]} | {med:.0f} ("
                + ", ".join(f"{v:.0f}" for v in values) + ") | "
                + f"{median(r[paced] for r in rows if model in r):.0f} | "
                + f"{med / (BATCH * np_):.1f} | {ratio} | {efficiency} | "
                + f"{median(r[model + '_cpu_per_step'] for r in rows if model in r):.3f} |")
    lines.append(f"\nMedians of {runs} interleaved rounds. samples/s: over all timed steps; "
                 "at the median step: batch x processes / the median step's duration. "
                 "ours/MWMS and scaling efficiency (against N x one process of the same Keras): "
                 "medians of ratios taken within a round, of samples/s; of the median-step pace.")
    return lines


def cell(rows, key, fmt):
    """``median (run, run, ...)`` of ``key``; "–" where a run has none."""
    values = [r[key] for r in rows]
    if any(v is None for v in values):
        return "–"
    return fmt.format(median(values)) + " (" + ", ".join(fmt.format(v) for v in values) + ")"


def kill_table(kills, args):
    lines = ["", f"SIGKILL of one of {args.kill_np} workers from outside after {args.kill_at} "
             f"of {args.kill_steps} MobileNetV2 steps (tf_keras):", "",
             "| implementation | runs | kill → next completed step | steps redone | time lost "
             "| wall time, whole job | launch → first step | normal step | survivors fail after "
             "| launches |", "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"elastic": "elastic_hvd, in place",
             "mwms": f"MWMS + BackupAndRestore(save_freq={args.save_freq}), restart all"}
    for impl, rows in kills.items():
        if not rows:
            lines.append(f"| {names[impl]} | 0 | failed | | | | | | | |")
            continue
        lines.append(f"| {names[impl]} | {len(rows)} | {cell(rows, 'next_step_s', '{:.2f} s')} "
                     f"| {cell(rows, 'redone', '{:.0f}')} | {cell(rows, 'lost_s', '{:.2f} s')} "
                     f"| {cell(rows, 'wall_s', '{:.1f} s')} "
                     f"| {cell(rows, 'first_step_s', '{:.1f} s')} "
                     f"| {cell(rows, 'step_s', '{:.3f} s')} "
                     f"| {cell(rows, 'survivors_fail_s', '{:.1f} s')} "
                     f"| {cell(rows, 'attempts', '{:.0f}')} |")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3, help="interleaved throughput rounds")
    p.add_argument("--steps", type=int, default=60, help="timed MobileNetV2 steps per job")
    p.add_argument("--mlp-steps", type=int, default=150, help="timed MLP steps per job")
    p.add_argument("--keras3-np", type=int, nargs="*", default=[2],
                   help="sizes at which ours also runs on Keras 3")
    p.add_argument("--kill-runs", type=int, default=3)
    p.add_argument("--kill-np", type=int, default=2)
    p.add_argument("--kill-steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=15, help="steps done before the SIGKILL")
    p.add_argument("--save-freq", type=int, default=10, help="MWMS BackupAndRestore, steps")
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=300.0, help="per job, seconds")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "vs_mwms.md"))
    args = p.parse_args()
    # SIGTERM ends the bench like Ctrl-C: the finally blocks stop every job's processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    lines = [f"load average (1 min) before the first job: {os.getloadavg()[0]:.2f}, "
             f"cores: {os.cpu_count()}"]
    print(lines[0], flush=True)

    variants = [("single", 1, "tf_keras"), ("mwms", 2, "tf_keras"), ("elastic", 2, "tf_keras"),
                ("mwms", 4, "tf_keras"), ("elastic", 4, "tf_keras"), ("single", 1, "keras3"),
                *(("elastic", np_, "keras3") for np_ in args.keras3_np)]
    one_step = argparse.Namespace(steps=1, mlp_steps=1, timeout=args.timeout)
    for input_ in ("per-worker", "global"):  # MWMS's model.fit on Keras 3, both inputs
        outcome = throughput_job("mwms", 2, "keras3", one_step,
                                 ["--models", "mlp", "--input", input_])
        lines.append(f"MWMS model.fit on Keras 3, 2 workers, {input_} input: "
                     + ("ran" if "mlp" in outcome else f"failed: {outcome['error']}"))
        print(lines[-1], flush=True)
    results = {v: [] for v in variants}
    for round_ in range(args.runs):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for variant in order:
            started = time.monotonic()
            results[variant].append(throughput_job(*variant, args))
            print(round_, variant, results[variant][-1], f"load {LOADS[-1]:.2f}",
                  f"{time.monotonic() - started:.0f} s", flush=True)
    lines += throughput_table(results, args.runs)
    ours_over_mwms = {np_: same_round_ratio(results["elastic", np_, "tf_keras"],
                                            results["mwms", np_, "tf_keras"], "mobilenet")
                      for np_ in (2, 4)}
    loads = LOADS[:]

    kills = {"elastic": [], "mwms": []}
    for _ in range(args.kill_runs):
        for impl in kills:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    kills[impl].append(kill_job(impl, args, tmp))
                except (RuntimeError, ValueError, StopIteration) as exc:
                    print(f"{impl} kill run failed: {exc}", flush=True)
            if kills[impl]:
                print(impl, kills[impl][-1], f"load {LOADS[-1]:.2f}", flush=True)
    lines += kill_table(kills, args)
    lines.append(f"\nload average (1 min) before each job: throughput {min(loads):.1f}–"
                 f"{max(loads):.1f} (median {median(loads):.1f}); SIGKILL runs "
                 f"{min(LOADS[len(loads):] or [0]):.1f}–{max(LOADS[len(loads):] or [0]):.1f}")
    lost = {impl: median(r["lost_s"] for r in kills[impl]) for impl in kills}
    ratio = lost["mwms"] / lost["elastic"] if lost["mwms"] and lost["elastic"] else float("nan")

    def shown(x):
        return "n/a" if x is None else f"{x:.2f}"

    lines.append(f"vs MWMS: throughput ours/MWMS = {shown(ours_over_mwms[2])} "
                 f"(2 workers), {shown(ours_over_mwms[4])} (4 workers); "
                 f"time lost per SIGKILL MWMS/ours = {ratio:.0f}")
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
