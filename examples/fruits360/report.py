"""What the example shows: a per-epoch table, test accuracy, throughput, and a plot."""

import json
import time

import numpy as np
import tensorflow as tf

import elastic_hvd.tensorflow.keras as hvd


class EpochReport(tf.keras.callbacks.Callback):
    """Per-step records (for the plot) and a per-epoch table row (printed by rank 0).

    Test accuracy is computed on a shard per rank and summed across the live ranks.
    """

    def __init__(self, test_images, test_labels, samples_per_epoch, batch_size=64):
        super().__init__()
        self.test_images, self.test_labels = test_images, test_labels
        self.samples_per_epoch, self.batch_size = samples_per_epoch, batch_size
        self.steps, self.epochs = [], []
        self.started = time.time()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.time()
        self._first_step = len(self.steps)
        self._last = time.time()
        if epoch == 0 and hvd.rank() == 0:
            print(f"{'epoch':>5} {'ranks':>5} {'loss':>8} {'train acc':>9} {'test acc':>8} "
                  f"{'img/s':>8} {'seconds':>8}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        now = time.time()
        size = hvd.size()
        self.steps.append({"t": now - self.started, "loss": float((logs or {}).get("loss", np.nan)),
                           "size": size, "step_s": now - self._last})
        self._last = now

    def test_accuracy(self):
        mine = np.arange(hvd.rank(), len(self.test_labels), hvd.size())
        correct = 0
        chunks = [mine[start:start + self.batch_size]
                  for start in range(0, len(mine), self.batch_size)]
        for ids, images in zip(chunks, self.test_images.batches(chunks)):
            predicted = np.argmax(self.model(images, training=False), axis=1)
            correct += int(np.sum(predicted == self.test_labels[ids]))
        total = hvd.allreduce(np.array([correct, len(mine)], dtype=np.int64), op=hvd.Sum).numpy()
        return total[0] / max(total[1], 1)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        seconds = time.time() - self._epoch_start
        row = {"epoch": epoch + 1, "ranks": hvd.size(), "loss": float(logs.get("loss", np.nan)),
               "train_acc": float(logs.get("accuracy", np.nan)), "test_acc": self.test_accuracy(),
               "img_per_s": self.samples_per_epoch / seconds, "seconds": seconds,
               "longest_step_s": max((s["step_s"] for s in self.steps[self._first_step:]),
                                     default=0.0),
               "t": time.time() - self.started}
        self.epochs.append(row)
        if hvd.rank() == 0:
            print(f"{row['epoch']:>5} {row['ranks']:>5} {row['loss']:>8.4f} "
                  f"{row['train_acc']:>9.3f} {row['test_acc']:>8.3f} {row['img_per_s']:>8.1f} "
                  f"{row['seconds']:>8.1f}",
                  flush=True)


def describe(event):
    """'lost rank(s) [2]' / 'gained rank(s) [4]' and how long it took."""
    if event["gained"]:
        return f"gained rank(s) {event['gained']}", \
            f"joined {event['repair_ms'] / 1e3:.1f} s after its spawn"
    return f"lost rank(s) {event['lost']}", \
        (f"failure agreed {event['detect_ms']:.0f} ms into the collective it interrupted, "
         f"repaired in {event['repair_ms']:.1f} ms")


def plot(path, steps, events, started, batch_size):
    """Loss and throughput against wall time, each membership change marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([s["t"] for s in steps])
    loss = np.array([s["loss"] for s in steps])
    rate = np.array([s["size"] * batch_size / max(s["step_s"], 1e-6) for s in steps])
    smooth = np.convolve(rate, np.ones(5) / 5, mode="same") if len(rate) >= 5 else rate
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, loss, lw=1)
    ax1.set_ylabel("training loss (rank 0's batch)")
    ax2.plot(t, smooth, lw=1, color="tab:green")
    ax2.set_ylabel("images / s (all ranks)")
    ax2.set_xlabel("wall time (s)")
    for event in events:
        x = event["time"] - started
        color = "tab:blue" if event["gained"] else "tab:red"
        for ax in (ax1, ax2):
            ax.axvline(x, color=color, ls="--", lw=1)
        what, took = describe(event)
        ax1.annotate(f"{what}\n{event['old_size']}→{event['new_size']} ranks, {took}",
                     (x, np.nanmax(loss)), fontsize=8, color=color, va="top",
                     xytext=(4, 0), textcoords="offset points")
    fig.suptitle("elastic_hvd: Fruits 360 training through membership changes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(result_path, report, events, plot_path, events_path):
    """The short summary that `make demo` ends with."""
    final = report.epochs[-1]
    lines = [
        "", "=" * 72, "Fruits 360 (elastic_hvd) -- summary", "=" * 72,
        f"final test accuracy : {final['test_acc']:.3f}  (epoch {final['epoch']}, "
        f"{final['ranks']} ranks at the end)",
        f"throughput          : {np.median([e['img_per_s'] for e in report.epochs]):.1f} img/s "
        "(median over epochs, all ranks)",
    ]
    for e in events:
        what, took = describe(e)
        lines.append(f"membership change   : epoch {e['epoch']} step {e['step']}: {what}, "
                     f"{e['old_size']} -> {e['new_size']} ranks, {took}, lr {e['lr_before']:.4g} "
                     f"-> {e['lr_after']:.4g}")
    if not events:
        lines.append("membership change   : none")
    lines += [f"event log           : {events_path}", f"plot                : {plot_path}",
              f"results             : {result_path}", "=" * 72]
    print("\n".join(lines), flush=True)
    with open(result_path, "w") as f:
        json.dump({"epochs": report.epochs, "events": events, "plot": plot_path}, f, indent=1)
