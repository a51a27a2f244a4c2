"""Is the Fruits 360 example input-bound at the real dataset's size? (issue 44)

    python bench/fruits360_input.py [--np 1] [--runs 3] [--steps 40] [--data-dir DIR]

Trains the example's model (examples/fruits360/train.py's ``build_model``, its
defaults: MobileNetV2 width 0.35, 64x64, batch 16 a rank, Adam) with ``hvd.fit`` on
two inputs, alternating within each run:

* files: the example's own ``training_data`` -- ``hvd.ElasticData`` over every
  training file of the full-size stand-in (``stand_in.py --full-size``: 131
  classes, 67,727 images; generated if missing), each batch decoded by PIL and
  augmented in ElasticData's work-ahead threads, nothing cached;
* memory: the same model on in-memory arrays -- the first ``--memory`` training
  images decoded beforehand, the same augmentation in the same ``load``.

A trial trains ``--warmup`` + ``--steps`` steps; its rate is the images of the last
``--steps`` steps (all ranks) over their time.  Prints the medians and files /
memory (target: within 10 %), the load average; writes
``bench/results/fruits360_input.json`` (``--out``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "fruits360")


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, EXAMPLE)
    import numpy as np
    import tensorflow as tf

    import data
    import stand_in
    import train
    import elastic_hvd.tensorflow.keras as hvd
    from elastic_hvd.core import runtime

    hvd.init()
    comm = runtime.current()
    stand_in.generate(args.data_dir, **stand_in.FULL_SIZE)
    names = data.class_names(args.data_dir)
    paths, labels = data.list_split(args.data_dir, "Training", names)
    example = train.parse_args(["--data-dir", args.data_dir])
    files = train.training_data(paths, labels, example)
    decoded = np.stack(list(data.Images(paths[:args.memory], example.image_size)
                            .batches([[i] for i in range(args.memory)], ahead=8)))[:, 0]
    in_memory_labels = labels[:args.memory]

    def load(ids, batch_labels, epoch):  # the example's load, from memory
        return data.augment(decoded[ids], ids, epoch, example.seed), batch_labels

    memory = hvd.ElasticData((np.arange(args.memory), in_memory_labels), example.batch_size,
                             load=load, seed=example.seed)
    tf.keras.utils.set_random_seed(example.seed)
    model = train.build_model(example, len(names))
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(example.lr)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    class Timer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps, self.started, self.seconds = 0, None, None

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == args.warmup:
                self.started = time.perf_counter()
            elif self.steps == args.warmup + args.steps:
                self.seconds = time.perf_counter() - self.started
                self.model.stop_training = True

    records = []
    for run in range(args.runs + 1):  # run 0: compiles, warms the page cache
        for name, samples in (("files", files), ("memory", memory)):
            timer = Timer()
            hvd.fit(model, samples, 1, callbacks=[timer], verbose=0, lr_policy="none")
            rate = args.steps * example.batch_size * comm.size / timer.seconds
            if run:
                records.append({"run": run, "input": name, "img_s": rate,
                                "peak_bytes": samples.prefetch_peak_bytes})
            if comm.rank == 0:
                print(f"run {run} {name}: {rate:.1f} img/s", flush=True)
    if comm.rank == 0:
        with open(args.records, "w") as f:
            json.dump({"records": records, "train_images": len(paths),
                       "model": f"{example.model} alpha {example.alpha}, "
                                f"{example.image_size}x{example.image_size}, "
                                f"batch {example.batch_size} a rank"}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--memory", type=int, default=2048, help="images decoded into memory")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "data", "fruits360-standin-full"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                 "fruits360_input.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, EXAMPLE)
    import stand_in
    started = time.perf_counter()
    stand_in.generate(args.data_dir, **stand_in.FULL_SIZE)
    print(f"full-size stand-in in {args.data_dir} ({time.perf_counter() - started:.0f} s)",
          flush=True)
    load_before = os.getloadavg()
    records = os.path.join(ROOT, "bench", "results", ".fruits360_input.json")
    subprocess.run([sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(args.np),
                    sys.executable, os.path.abspath(__file__), "--worker", "--runs",
                    str(args.runs), "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--memory", str(args.memory), "--data-dir", args.data_dir,
                    "--records", records], check=True, cwd=ROOT, timeout=7200)
    with open(records) as f:
        result = json.load(f)
    os.remove(records)
    rows = result["records"]
    median = {name: statistics.median(r["img_s"] for r in rows if r["input"] == name)
              for name in ("files", "memory")}
    ratios = [next(r["img_s"] for r in rows if r["run"] == run and r["input"] == "files")
              / next(r["img_s"] for r in rows if r["run"] == run and r["input"] == "memory")
              for run in sorted({r["run"] for r in rows})]
    peak = max(r["peak_bytes"] for r in rows if r["input"] == "files")
    load_after = os.getloadavg()
    print(f"{result['model']}, {args.np} rank(s), {result['train_images']} training files: "
          f"files {median['files']:.1f} img/s, in memory {median['memory']:.1f} img/s, "
          f"files / memory {statistics.median(ratios):.2f} (per run: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); work-ahead peak {peak / 2**20:.1f} MB; "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} ({os.cpu_count()} CPUs)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**result, "np": args.np, "median": median, "ratios": ratios,
                   "load": [load_before, load_after]}, f, indent=1)


if __name__ == "__main__":
    main()
