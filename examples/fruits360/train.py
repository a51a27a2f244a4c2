"""Train a Keras Applications model on Fruits 360, data-parallel, through rank loss.

    elastic-hvd-run -np 4 --faults rank=2,step=40 python examples/fruits360/train.py
    elastic-hvd-run -np 4 --respawn --faults rank=2,step=40 python examples/fruits360/train.py
    mpirun --with-ft ulfm -np 4 python examples/fruits360/train.py --data-dir /data/fruits-360

(``--faults`` kills rank 2 at step 40 for real, to show the recovery; plain
``mpirun`` takes it as ``-x ELASTIC_HVD_FAULTS=rank=2,step=40``.)

Without ``--data-dir`` a procedurally drawn stand-in dataset in the Fruits 360
layout is generated on first use (``data/fruits360-standin``): the real dataset
cannot be downloaded on the machines this project is developed on; with
``--standin-full``, one as large as the real training and test splits
(``data/fruits360-standin-full``: 131 classes, ~67,700 + ~22,700 images; drawn in
processes, minutes; ``python examples/fruits360/stand_in.py --full-size`` draws it
beforehand).  Training images are decoded from their files a batch at a time, in
ElasticData's work-ahead threads while the step before trains.  Point
``--data-dir`` at an unpacked Fruits 360 (the folder holding ``Training/`` and
``Test/``) to train on the real thing; ``--classes`` picks a subset.

A second run with the same ``--out`` resumes from its checkpoint (rank 0 says at which
epoch, and how many are left); once all ``--epochs`` are trained it says that nothing is
left and exits 0 without training: raise ``--epochs`` or give another ``--out``.
"""

import argparse
import inspect
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # INFO off, warnings on
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import report  # noqa: E402
import stand_in  # noqa: E402

import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402

DEFAULT_DATA = os.path.join("data", "fruits360-standin")
FULL_DATA = os.path.join("data", "fruits360-standin-full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--model", default="MobileNetV2",
                   help="any keras.applications model (default MobileNetV2)")
    p.add_argument("--alpha", type=float, default=0.35, help="width of MobileNet-style models")
    p.add_argument("--weights", default=None, help="local weights file (default: random init)")
    p.add_argument("--data-dir", default=None,
                   help=f"Fruits 360 root (default: the stand-in in {DEFAULT_DATA})")
    p.add_argument("--stand-in", action="store_true",
                   help="generate the stand-in into --data-dir if it is not there yet")
    p.add_argument("--classes", default=None,
                   help="a number (the first N classes) or comma-separated class names")
    p.add_argument("--standin-full", action="store_true",
                   help=f"a stand-in as large as the real dataset (default dir: {FULL_DATA})")
    p.add_argument("--standin-train", type=int, default=100, help="stand-in images per class")
    p.add_argument("--standin-test", type=int, default=34)
    p.add_argument("--image-size", type=int, default=64,
                   help="model input size (images are 100x100)")
    p.add_argument("--bn-momentum", type=float, default=0.9,
                   help="BatchNormalization momentum (Keras' 0.999 needs thousands of steps "
                        "before its moving statistics are usable)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.001, help="per-rank rate (x size at start)")
    p.add_argument("--lr-policy", default="linear", choices=kc.lr.POLICIES)
    p.add_argument("--min-np", type=int, default=None)
    p.add_argument("--out", default=os.path.join("runs", "fruits360"))
    p.add_argument("--progress", action="store_true", help="show Keras' progress bar (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, classes):
    constructor = getattr(tf.keras.applications, args.model, None)
    if constructor is None:
        raise SystemExit(f"--model {args.model}: no such keras.applications model")
    kwargs = {"input_shape": (args.image_size, args.image_size, 3), "weights": args.weights,
              "classes": classes}
    if "alpha" in inspect.signature(constructor).parameters:
        kwargs["alpha"] = args.alpha
    if args.weights:  # local pretrained weights: a new classifier head on top
        base = constructor(include_top=False, pooling="avg",
                           **{k: v for k, v in kwargs.items() if k != "classes"})
        model = tf.keras.Sequential([base, tf.keras.layers.Dense(classes, activation="softmax")])
    else:
        model = constructor(**kwargs)
    for layer in _all_layers(model):
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = args.bn_momentum
    return model


def _all_layers(layer):
    yield layer
    for inner in getattr(layer, "layers", ()):  # a model inside a model (--weights)
        yield from _all_layers(inner)


def training_data(paths, labels, args):
    """The training samples: ``hvd.ElasticData`` over the files, each batch decoded (in
    its work-ahead threads) and augmented per (sample, epoch)."""
    images = data.Images(paths, args.image_size)

    def load(ids, labels, epoch):
        return data.augment(images.batch(ids), ids, epoch, args.seed), labels

    return hvd.ElasticData((np.arange(len(paths)), labels), args.batch_size, load=load,
                           seed=args.seed)


def main(argv=None):
    args = parse_args(argv)
    hvd.init(min_np=args.min_np)
    root = args.data_dir or (FULL_DATA if args.standin_full else DEFAULT_DATA)
    if args.standin_full:
        stand_in.generate(root, **stand_in.FULL_SIZE)
    elif args.data_dir is None or args.stand_in:
        stand_in.generate(root, args.standin_train, args.standin_test)
    classes = args.classes
    if classes is not None:
        classes = int(classes) if classes.isdigit() else classes.split(",")
    names = data.class_names(root, classes)
    train_paths, train_labels = data.list_split(root, "Training", names)
    test_paths, test_labels = data.list_split(root, "Test", names)
    os.makedirs(args.out, exist_ok=True)
    if hvd.rank() == 0:
        print(f"Fruits 360 from {root}: {len(names)} classes, {len(train_paths)} training and "
              f"{len(test_paths)} test images; {args.model} on {hvd.size()} ranks", flush=True)

    tf.keras.utils.set_random_seed(args.seed)
    samples = training_data(train_paths, train_labels, args)
    model = build_model(args, len(names))
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(args.lr * hvd.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    checkpoint_dir = os.path.join(args.out, "checkpoint")
    events_path = os.path.join(args.out, "events.jsonl")
    resuming = os.path.exists(os.path.join(checkpoint_dir, "checkpoint.json"))
    if hvd.rank() == 0 and not resuming and os.path.exists(events_path):
        os.remove(events_path)  # a fresh run's log (a resumed run appends)
    log = kc.MembershipEventLog(events_path, log_dir=os.path.join(args.out, "tensorboard"))
    epoch_report = report.EpochReport(data.Images(test_paths, args.image_size), test_labels,
                                      len(train_paths))
    hvd.fit(model, samples, args.epochs, callbacks=[log, epoch_report], lr_policy=args.lr_policy,
            checkpoint_dir=checkpoint_dir, verbose=1 if args.progress else 0)

    if hvd.rank() == 0 and epoch_report.epochs:
        plot_path = os.path.join(args.out, "training.png")
        report.plot(plot_path, epoch_report.steps, log.records, epoch_report.started,
                    args.batch_size)
        report.summary(os.path.join(args.out, "result.json"), epoch_report, log.records,
                       plot_path, events_path)
    return epoch_report


if __name__ == "__main__":
    main()
