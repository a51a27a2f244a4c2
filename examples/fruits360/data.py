"""Fruits 360's directory layout, decoded and augmented for ``hvd.ElasticData``.

``<root>/Training/<Class>/*.jpg`` and ``<root>/Test/<Class>/*.jpg`` (the real
dataset and the stand-in alike).  Training batches come from ``hvd.ElasticData``
(exactly once per epoch, whatever dies); each batch's images are decoded from
their files when it is loaded, in ElasticData's work-ahead threads (PIL decodes and
resizes without holding the GIL), while the step before it trains: nothing is
cached, so the real dataset's size costs no memory.
"""

import collections
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def class_names(root, classes=None):
    """Sorted class folders of ``root/Training``; ``classes`` is a list of names or a count."""
    names = sorted(d for d in os.listdir(os.path.join(root, "Training"))
                   if os.path.isdir(os.path.join(root, "Training", d)))
    if classes is None:
        return names
    if isinstance(classes, int):
        return names[:classes]
    missing = sorted(set(classes) - set(names))
    if missing:
        raise ValueError(f"no such classes in {root}/Training: {missing}")
    return list(classes)


def list_split(root, split, names):
    """(paths, labels) of ``split`` ("Training" or "Test") for the classes ``names``."""
    paths, labels = [], []
    for label, name in enumerate(names):
        folder = os.path.join(root, split, name)
        for file in sorted(os.listdir(folder)):
            if file.lower().endswith(IMAGE_SUFFIXES):
                paths.append(os.path.join(folder, file))
                labels.append(label)
    return paths, np.array(labels, dtype=np.int64)


class Images:
    """Decodes images from their files to float32 [0, 1] at ``size`` x ``size``."""

    def __init__(self, paths, size):
        self.paths, self.size = paths, size

    def __call__(self, index):
        with Image.open(self.paths[index]) as image:
            array = np.asarray(image.convert("RGB").resize((self.size, self.size),
                                                            Image.BILINEAR), dtype=np.float32)
        return array / 255.0

    def batch(self, indices):
        return np.stack([self(i) for i in indices])

    def batches(self, chunks, ahead=4):
        """``batch(c)`` for each of ``chunks``, in order, decoded ``ahead`` in threads."""
        with ThreadPoolExecutor(min(ahead, os.cpu_count() or 1)) as pool:
            pending = collections.deque(pool.submit(self.batch, c) for c in chunks[:ahead])
            for k in range(len(chunks)):
                if k + ahead < len(chunks):
                    pending.append(pool.submit(self.batch, chunks[k + ahead]))
                yield pending.popleft().result()


def augment(images, ids, epoch, seed):
    """Light, reproducible augmentation: flips and brightness jitter per (sample, epoch)."""
    out = images.copy()
    for k, sample in enumerate(ids):
        rng = np.random.default_rng([seed, epoch, int(sample)])
        if rng.random() < 0.5:
            out[k] = out[k, :, ::-1]
        if rng.random() < 0.5:
            out[k] = out[k, ::-1]
        out[k] = np.clip(out[k] * rng.uniform(0.85, 1.15), 0.0, 1.0)
    return out
