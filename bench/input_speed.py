"""Input speed: hvd.ElasticData against tf.data on the same JPEG files (issue 44).

    python bench/input_speed.py [--runs 5] [--np 1,4] [--images 2048] [--ahead 0]

The files: ``--images`` JPEGs of 100x100, generated once into ``--dir``.  Both
pipelines decode them with ``tf.io.decode_jpeg`` and resize to 96x96:

* ElasticData, as a user writes it: ``ElasticData((paths, labels), 64,
  load=load)`` with a ``load(paths, labels)`` that decodes its batch image by
  image (eager TensorFlow, as docs/training.md shows);
* tf.data, as a Horovod user writes it: ``from_tensor_slices((paths, labels))
  .shard(size, rank).shuffle().map(decode, num_parallel_calls=AUTOTUNE)
  .batch(64).prefetch(AUTOTUNE)``.

Two consumers: one that takes batches as fast as it can, and one that spends
20 ms per batch of 64 (an accelerator's step: its own ceiling is 3200 img/s a
rank).  A trial is 2 epochs of one (pipeline, consumer) pair; the pairs
alternate within a run so that both meet the same load on the machine, and
``--runs`` runs give medians.  Each ``--np`` is one job (elastic-hvd-run); a
trial's rate is the images of all ranks over the slowest rank's time.  The
ratio is ElasticData / tf.data, per run, then its median.

``--ahead 0`` adds ElasticData without work-ahead (what it was before issue
44) as a pipeline; ``--map`` adds ElasticData with ``map=`` (the same decode per
sample, run by tf.data's parallel map over each batch).  ElasticData reports the
most bytes its work-ahead held at once (batches loaded and not yet trained,
``prefetch_peak_bytes``).
Writes ``bench/results/input_speed.json`` (``--out``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SIZE, EPOCHS, STEP = 64, 96, 2, 0.020
CONSUMERS = {"fast": 0.0, "20ms": STEP}


def make_files(directory, count):
    """``count`` 100x100 JPEGs (noise over gradients), once; returns the paths."""
    import numpy as np
    from PIL import Image
    marker = os.path.join(directory, f".complete-{count}")
    paths = [os.path.join(directory, f"{i:06d}.jpg") for i in range(count)]
    if os.path.exists(marker):
        return paths
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 100)
    for i, path in enumerate(paths):
        base = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (100, 1)),
                         np.full((100, 100), 40.0 * (i % 6))], axis=-1)
        pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, quality=90)
    open(marker, "w").close()
    return paths


# -- one rank of a job ----------------------------------------------------------------
def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    import elastic_hvd.tensorflow.keras as hvd
    from elastic_hvd.core import runtime

    hvd.init()
    comm = runtime.current()
    paths = np.array(make_files(args.dir, args.images)) if comm.rank == 0 else None
    comm.allgather_object(None)
    paths = np.array(make_files(args.dir, args.images))
    labels = np.arange(len(paths)) % 10

    def decode(path):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        return tf.image.resize(image, (SIZE, SIZE)) / 255.0

    def load(batch_paths, batch_labels):  # what a user writes for ElasticData's load=
        return tf.stack([decode(p) for p in batch_paths]), batch_labels

    def tf_data():
        return (tf.data.Dataset.from_tensor_slices((paths, labels))
                .shard(comm.size, comm.rank).shuffle(len(paths), seed=0)
                .map(lambda p, y: (decode(p), y), num_parallel_calls=tf.data.AUTOTUNE)
                .batch(BATCH).prefetch(tf.data.AUTOTUNE))

    pipelines = {}
    elastic = hvd.ElasticData((paths, labels), BATCH, load=load, seed=0)
    pipelines["ElasticData"] = (elastic.dataset, elastic)
    if args.ahead is not None:
        plain = hvd.ElasticData((paths, labels), BATCH, load=load, seed=0, ahead=args.ahead)
        pipelines[f"ElasticData ahead={args.ahead}"] = (plain.dataset, plain)
    if args.map:
        mapped = hvd.ElasticData((paths, labels), BATCH, seed=0,
                                 map=lambda p, y: (decode(p), y))
        pipelines["ElasticData map="] = (mapped.dataset, mapped)
    pipelines["tf.data"] = (tf_data(), None)

    def trial(dataset, pause):
        images = 0
        comm.allgather_object(None)  # every rank starts together
        started = time.perf_counter()
        for _ in range(EPOCHS):
            for batch in dataset:
                images += int(batch[0].shape[0])
                if pause:
                    time.sleep(pause)
        return images, time.perf_counter() - started

    for dataset, _ in pipelines.values():  # warm-up: tracing, the page cache
        trial(dataset, 0.0)
    records = []
    for run in range(args.runs):
        for consumer, pause in CONSUMERS.items():
            for name, (dataset, data) in pipelines.items():
                images, seconds = trial(dataset, pause)
                everyone = comm.allgather_object((images, seconds))
                peak = getattr(data, "prefetch_peak_bytes", None)
                records.append({"run": run, "consumer": consumer, "pipeline": name,
                                "np": comm.size,
                                "img_s": sum(i for i, _ in everyone) / max(s for _, s in everyone),
                                "peak_bytes": comm.allgather_object(peak)})
    if comm.rank == 0:
        with open(args.records, "w") as f:
            json.dump(records, f)


# -- the driver -----------------------------------------------------------------------
def run_job(np_, args):
    records = os.path.join(ROOT, "bench", "results", f".input_speed-np{np_}.json")
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(np_), sys.executable,
           os.path.abspath(__file__), "--worker", "--runs", str(args.runs), "--images",
           str(args.images), "--dir", args.dir, "--records", records]
    if args.ahead is not None:
        cmd += ["--ahead", str(args.ahead)]
    if args.map:
        cmd += ["--map"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3600)
    with open(records) as f:
        result = json.load(f)
    os.remove(records)
    return result


def summarize(records):
    rows = []
    for np_ in sorted({r["np"] for r in records}):
        for consumer in CONSUMERS:
            mine = [r for r in records if r["np"] == np_ and r["consumer"] == consumer]
            names = list(dict.fromkeys(r["pipeline"] for r in mine))
            rate = {n: statistics.median(r["img_s"] for r in mine if r["pipeline"] == n)
                    for n in names}
            runs = sorted({r["run"] for r in mine})

            def ratio(name, mine=mine, runs=runs):
                per_run = []
                for run in runs:
                    of = {r["pipeline"]: r["img_s"] for r in mine if r["run"] == run}
                    per_run.append(of[name] / of["tf.data"])
                return statistics.median(per_run)
            peaks = [max(p for p in r["peak_bytes"] if p is not None) for r in mine
                     if r["pipeline"] == "ElasticData" and any(r["peak_bytes"])]
            rows.append({"np": np_, "consumer": consumer, "img_s": rate,
                         "ratio": {n: ratio(n) for n in names if n != "tf.data"},
                         "ceiling_img_s": np_ * BATCH / STEP if consumer == "20ms" else None,
                         "prefetch_peak_mb": max(peaks) / 2**20 if peaks else None})
    return rows


def print_table(rows):
    names = list(rows[0]["img_s"])
    print("| ranks | consumer | " + " | ".join(f"{n} img/s" for n in names)
          + " | " + " | ".join(f"{n} / tf.data" for n in names if n != "tf.data")
          + " | of the step's ceiling | work-ahead peak |")
    print("|" + "---|" * (4 + 2 * len(names) - 1))
    for row in rows:
        ceiling = (f"{row['img_s']['ElasticData'] / row['ceiling_img_s']:.2f}"
                   if row["ceiling_img_s"] else "")
        peak = f"{row['prefetch_peak_mb']:.1f} MB" if row["prefetch_peak_mb"] else ""
        print(f"| {row['np']} | {row['consumer']} | "
              + " | ".join(f"{row['img_s'][n]:.0f}" for n in names) + " | "
              + " | ".join(f"{row['ratio'][n]:.2f}" for n in names if n != "tf.data")
              + f" | {ceiling} | {peak} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--np", default="1,4")
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--dir", default=os.path.join(ROOT, "data", "input-speed-jpegs"))
    p.add_argument("--ahead", type=int, default=None,
                   help="also ElasticData with this work-ahead (0: none, as before issue 44)")
    p.add_argument("--map", action="store_true",
                   help="also ElasticData with map= (a per-sample decode, tf.data's parallel map)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "input_speed.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    make_files(args.dir, args.images)
    load_before = os.getloadavg()
    records = [r for np_ in args.np.split(",") for r in run_job(int(np_), args)]
    rows = summarize(records)
    print_table(rows)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1 min; {os.cpu_count()} CPUs)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "records": records, "load": [load_before, load_after],
                   "cpus": os.cpu_count(), "runs": args.runs, "images": args.images}, f, indent=1)


if __name__ == "__main__":
    main()
