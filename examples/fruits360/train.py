"""Train a Keras Applications model on Fruits 360, data-parallel, through rank loss.

    elastic-hvd-run -np 4 python examples/fruits360/train.py --fail rank=2,step=40
    elastic-hvd-run -np 4 --respawn python examples/fruits360/train.py --fail rank=2,step=40
    mpirun --with-ft ulfm -np 4 python examples/fruits360/train.py --data-dir /data/fruits-360

Without ``--data-dir`` a procedurally drawn stand-in dataset in the Fruits 360
layout is generated on first use (``data/fruits360-standin``): the real dataset
cannot be downloaded on the machines this project is developed on.  Point
``--data-dir`` at an unpacked Fruits 360 (the folder holding ``Training/`` and
``Test/``) to train on the real thing; ``--classes`` picks a subset.
"""

import argparse
import inspect
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # INFO off, warnings on
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import report  # noqa: E402
import stand_in  # noqa: E402

import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import keras_callbacks as kc  # noqa: E402
from elastic_hvd.core import faults, runtime  # noqa: E402
from elastic_hvd.sharding import ElasticSampler  # noqa: E402

DEFAULT_DATA = os.path.join("data", "fruits360-standin")


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
    p.add_argument("--fail", action="append", default=[], metavar="SPEC",
                   help="inject a failure, e.g. rank=2,step=40,signal=KILL (repeatable; "
                        "see elastic_hvd.core.faults)")
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
    for layer in model._flatten_layers():
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = args.bn_momentum
    return model


def main(argv=None):
    args = parse_args(argv)
    hvd.init(min_np=args.min_np)
    comm = runtime.current()
    if args.fail:
        faults.configure(comm.original_id, ";".join(args.fail))
    root = args.data_dir or DEFAULT_DATA
    if (args.data_dir is None or args.stand_in) and not comm.joining:
        if comm.rank == 0:  # (a process joining later finds the data ready)
            stand_in.generate(root, args.standin_train, args.standin_test)
        comm.barrier()
    classes = args.classes
    if classes is not None:
        classes = int(classes) if classes.isdigit() else classes.split(",")
    names = data.class_names(root, classes)
    train_paths, train_labels = data.list_split(root, "Training", names)
    test_paths, test_labels = data.list_split(root, "Test", names)
    os.makedirs(args.out, exist_ok=True)
    if comm.rank == 0:
        print(f"Fruits 360 from {root}: {len(names)} classes, {len(train_paths)} training and "
              f"{len(test_paths)} test images; {args.model} on {comm.size} ranks", flush=True)

    tf.keras.utils.set_random_seed(args.seed)
    sampler = ElasticSampler(comm, len(train_paths), args.batch_size, seed=args.seed)
    dataset = data.training_dataset(sampler, data.Images(train_paths, args.image_size),
                                    train_labels, seed=args.seed)
    model = build_model(args, len(names))
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(args.lr * comm.size)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    checkpoint = kc.ElasticCheckpoint(os.path.join(args.out, "checkpoint"), sampler=sampler)
    initial_epoch = checkpoint.restore(model)
    events_path = os.path.join(args.out, "events.jsonl")
    if comm.rank == 0 and initial_epoch == 0 and os.path.exists(events_path):
        os.remove(events_path)
    rescaler = kc.LearningRateRescaler(args.lr_policy, sampler=sampler)
    log = kc.MembershipEventLog(events_path, rescaler=rescaler,
                                log_dir=os.path.join(args.out, "tensorboard"))
    epoch_report = report.EpochReport(data.Images(test_paths, args.image_size), test_labels,
                                      len(train_paths))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), kc.FaultInjection(),
                 rescaler, log, hvd.callbacks.MetricAverageCallback(), epoch_report, checkpoint,
                 kc.ElasticGrowth(sampler)]  # acts under elastic-hvd-run --respawn / --max-np
    if args.progress:
        callbacks.append(kc.RankZeroProgbar())
    with checkpoint.final_on_failure():
        kc.fit_elastic(model, dataset, args.epochs, initial_epoch=initial_epoch, verbose=0,
                       callbacks=callbacks)

    if comm.rank == 0 and epoch_report.epochs:
        plot_path = os.path.join(args.out, "training.png")
        report.plot(plot_path, epoch_report.steps, log.records, epoch_report.started,
                    args.batch_size)
        report.summary(os.path.join(args.out, "result.json"), epoch_report, log.records,
                       plot_path, events_path)
    return epoch_report


if __name__ == "__main__":
    main()
