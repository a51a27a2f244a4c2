"""Fruits 360's directory layout, decoded and augmented for ``hvd.ElasticData``.

``<root>/Training/<Class>/*.jpg`` and ``<root>/Test/<Class>/*.jpg`` (the real
dataset and the stand-in alike).  Training batches come from ``hvd.ElasticData``
(exactly once per epoch, whatever dies); images are decoded on demand and cached
when the dataset is small.
"""

import os

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
    """Decodes images to float32 [0, 1] at ``size`` x ``size``; caches up to ``cache`` of them."""

    def __init__(self, paths, size, cache=20000):
        self.paths, self.size = paths, size
        self._cache = {} if len(paths) <= cache else None

    def __call__(self, index):
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        with Image.open(self.paths[index]) as image:
            array = np.asarray(image.convert("RGB").resize((self.size, self.size),
                                                            Image.BILINEAR), dtype=np.float32)
        array /= 255.0
        if self._cache is not None:
            self._cache[index] = array
        return array

    def batch(self, indices):
        return np.stack([self(i) for i in indices])


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
