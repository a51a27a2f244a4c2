"""Run a command beside a CPU hog and say what load it ran under (issue 18).

Failures that appear only on a busy machine (a 2-rank job's first allreduce, the
init-shrink race) need the test suite run at a known load, not at whatever the machine
happens to carry.  The hog is ``--hogs`` busy-looping processes at normal priority (a
niced hog would raise the load average without taking CPU from the tests).  The 1-minute
load average is sampled every ``--every`` seconds; its median, minimum and maximum are
printed at the end, and the command's exit status is this program's.

    python bench/under_load.py --hogs 6 -- make test
"""

import argparse
import multiprocessing
import signal
import statistics
import subprocess
import sys
import threading
import time


def spin():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=6, help="busy processes beside the command")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between load samples")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")

    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    samples, done = [], threading.Event()

    def sample():
        while not done.wait(args.every):
            samples.append(load_average())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    try:
        status = subprocess.call(command)
    finally:
        done.set()
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()
    minutes = (time.monotonic() - start) / 60
    load = (f"1-min load average over {len(samples)} samples: median "
            f"{statistics.median(samples):.1f}, min {min(samples):.1f}, max {max(samples):.1f}"
            if samples else "no load sample (ended within one period)")
    print(f"under_load: {' '.join(command)!r} beside {args.hogs} hogs, {minutes:.1f} min, "
          f"exit {status}; {load}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
