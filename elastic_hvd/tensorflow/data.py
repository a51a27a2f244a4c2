"""tf.data input over :class:`elastic_hvd.sharding.ElasticSampler`.

The generator draws each batch when the training step asks for it, and the
dataset's options forbid tf.data from prefetching, so no batch planned for an
old membership is ever trained (see the sharding module).
:class:`ElasticData` builds both from what a Keras user has already (arrays, a
file list and a loading function, a finite ``tf.data.Dataset``).
"""

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import numpy as np
import tensorflow as tf

from ..core import runtime
from ..sharding import ElasticSampler


def elastic_dataset(sampler: ElasticSampler, load: Callable[..., Any],
                    output_signature: Any) -> Any:
    """A dataset of one epoch per iteration: ``load(ids, weights)`` makes each batch.

    ``load`` returns what Keras expects, e.g. ``(x, y, weights)``; ``weights`` are 0
    for the padding sample a rank gets when an epoch ends with fewer samples than ranks.
    """
    def generate() -> Iterator[Any]:
        sampler.start_epoch()
        while True:
            batch = sampler.next_batch()
            if batch is None:
                return
            yield load(*batch)

    dataset = tf.data.Dataset.from_generator(generate, output_signature=output_signature)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options)


def _spec(array: Any) -> Any:
    array = np.asarray(array)
    dtype = tf.string if array.dtype.kind in "US" else tf.as_dtype(array.dtype)
    return tf.TensorSpec([None, *array.shape[1:]], dtype)


class ElasticData:
    """Training samples that the live ranks share, each exactly once per epoch.

    ``samples``: an array, or a tuple of arrays (or lists) with one row per sample
    (``(x, y)``, ``(paths, labels)``); every live rank holds the same ones.  Each step gives a
    rank ``batch_size`` of them as ``(*arrays, weights)``, or ``(*load(*arrays),
    weights)`` with ``load`` -- e.g. decoding the image files a batch names; a
    ``load`` with an ``epoch`` keyword also gets the epoch (per-epoch augmentation).
    ``weights`` (Keras' sample weights) are 0 for the padding sample a rank gets when
    an epoch ends with fewer samples than ranks.  Use ``.dataset`` with
    :func:`~elastic_hvd.tensorflow.keras.fit` (or ``keras_callbacks.fit_elastic``);
    ``.sampler`` is the :class:`~elastic_hvd.sharding.ElasticSampler`.
    """

    def __init__(self, samples: Any, batch_size: int, load: Callable[..., Any] | None = None,
                 seed: int = 0, shuffle: bool = True) -> None:
        self.arrays = tuple(np.asarray(a) for a in (
            samples if isinstance(samples, tuple) else (samples,)))
        sizes = {len(a) for a in self.arrays}
        if len(sizes) != 1:
            raise ValueError(f"the sample arrays differ in length: {sorted(sizes)}")
        self.load = load
        self._with_epoch = load is not None and "epoch" in inspect.signature(load).parameters
        self.sampler = ElasticSampler(runtime.current("ElasticData"), sizes.pop(), batch_size,
                                      seed=seed, shuffle=shuffle)
        first = self._batch(np.array([0]), np.ones(1, np.float32))  # its structure, once
        self.dataset = elastic_dataset(self.sampler, self._batch,
                                       tuple(_spec(part) for part in first))

    @classmethod
    def from_dataset(cls, dataset: Any, batch_size: int, **kwargs: Any) -> Self:
        """From a finite ``tf.data.Dataset`` of single samples (e.g. ``(x, y)`` tuples),
        read into memory once."""
        rows = list(dataset.as_numpy_iterator())
        if not rows:
            raise ValueError("the dataset is empty")
        if isinstance(rows[0], tuple):
            return cls(tuple(np.stack(part) for part in zip(*rows)), batch_size, **kwargs)
        return cls(np.stack(rows), batch_size, **kwargs)

    def _batch(self, ids: np.ndarray, weights: np.ndarray) -> tuple[Any, ...]:
        parts = tuple(a[ids] for a in self.arrays)
        if self.load is not None:
            epoch = {"epoch": max(self.sampler.epoch, 0)} if self._with_epoch else {}
            parts = self.load(*parts, **epoch)
            parts = parts if isinstance(parts, tuple) else (parts,)
        return (*parts, weights)

    def __len__(self) -> int:
        return self.sampler.num_samples


def validation_shard(validation_data: Sequence[Any], batch_size: int) -> Any:
    """``validation_data`` (a tuple of arrays) as a dataset of this rank's share:
    rows ``rank::size`` of the membership at the moment Keras evaluates, so the
    live ranks split the work and ``MetricAverageCallback`` averages their results."""
    arrays = tuple(np.asarray(a) for a in validation_data)
    comm = runtime.current("validation_shard")

    def generate() -> Iterator[tuple[Any, ...]]:
        mine = np.arange(comm.rank, len(arrays[0]), comm.size)
        for start in range(0, len(mine), batch_size):
            yield tuple(a[mine[start:start + batch_size]] for a in arrays)

    return tf.data.Dataset.from_generator(
        generate, output_signature=tuple(_spec(a) for a in arrays))
