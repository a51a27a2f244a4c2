"""tf.data input over :class:`elastic_hvd.sharding.ElasticSampler`, loaded ahead.

The sampler draws each batch when the training step asks for it, and the
dataset's options forbid tf.data from prefetching, so no batch planned for an
old membership is ever trained (see the sharding module).  What costs time --
the user's ``load`` (decoding the files a batch names) -- is done ahead all the
same: a :class:`WorkAhead` asks the sampler what this rank's next steps will be
*if the membership stays as it is* (:meth:`~elastic_hvd.sharding.ElasticSampler.upcoming`,
which draws nothing) and loads them in threads while the current step trains.
When the step asks for a batch, the sampler draws it as before, and the batch
loaded ahead for exactly those sample ids (and epoch) is handed over; after a
membership change the draws differ from what was guessed, the guesses are thrown
away and the next ones are loaded for the new membership.  So the work-ahead is
a cache keyed by content: what is trained is decided by the draws alone, and
nothing planned for a membership that no longer exists is trained, nor lost.
It holds at most ``ahead`` batches (plus those its threads are still loading
when thrown away).

:class:`ElasticData` builds both from what a Keras user has already (arrays, a
file list and a loading function, a finite ``tf.data.Dataset``).
"""

import inspect
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Self

import numpy as np
import tensorflow as tf

from ..core import runtime
from ..sharding import ElasticSampler

#: Batches loaded ahead by default (``ElasticData(ahead=)``).
AHEAD = 4


def _nbytes(batch: Any) -> int:
    total = 0
    for part in tf.nest.flatten(batch):
        if isinstance(part, np.ndarray):
            total += part.nbytes
        elif isinstance(part, tf.Tensor) and part.dtype != tf.string:
            total += int(np.prod(part.shape)) * part.dtype.size
        else:
            total += np.asarray(part).nbytes
    return total


class WorkAhead:
    """Loads, in ``workers`` threads, the batches that this rank's next ``ahead`` steps
    will draw if the membership does not change; hands over the one a step drew.

    ``make(ids, weights, epoch)`` builds a batch; it runs in the threads (and on the
    training thread for a batch that was not loaded ahead).  ``peak_bytes``: the most
    bytes of loaded batches that waited for their step at once."""

    def __init__(self, make: Callable[[np.ndarray, np.ndarray, int], Any], ahead: int = AHEAD,
                 workers: int | None = None) -> None:
        self.make, self.ahead = make, max(0, int(ahead))
        self.workers = workers or max(1, min(self.ahead, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._loads: dict[tuple, Future] = {}  # (epoch, ids, weights) -> its batch
        self._lock = threading.Lock()
        self._live: set[int] = set()  # id() of the futures in _loads
        self._ready: dict[int, int] = {}  # id(future) -> bytes of a loaded, waiting batch
        self.peak_bytes = 0
        self.hits = self.misses = self.discarded = 0

    @staticmethod
    def _key(ids: np.ndarray, weights: np.ndarray, epoch: int) -> tuple:
        return (epoch, ids.tobytes(), weights.tobytes())

    def plan(self, upcoming: Sequence[tuple[np.ndarray, np.ndarray]], epoch: int) -> None:
        """Load ``upcoming`` (``(ids, weights)`` of the next steps, nearest first); loads
        that are no longer upcoming are thrown away."""
        if not self.ahead:
            return
        wanted = [(self._key(ids, weights, epoch), ids, weights)
                  for ids, weights in upcoming[:self.ahead + 1]]
        keep = {key for key, _, _ in wanted}
        for key in [k for k in self._loads if k not in keep]:
            self._drop(self._loads.pop(key))
            self.discarded += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="elastic_hvd-data")
            _cancel_at_exit(self._pool)
        for key, ids, weights in wanted:
            if key not in self._loads:
                future = self._pool.submit(self.make, ids, weights, epoch)
                with self._lock:
                    self._live.add(id(future))
                self._loads[key] = future
                future.add_done_callback(self._loaded)

    def take(self, ids: np.ndarray, weights: np.ndarray, epoch: int) -> Any:
        """The batch of ``ids`` (drawn for this step): loaded ahead, or now."""
        future = self._loads.pop(self._key(ids, weights, epoch), None)
        if future is None:
            self.misses += 1
            return self.make(ids, weights, epoch)
        self.hits += 1
        try:
            return future.result()
        finally:
            self._drop(future)

    def clear(self) -> None:
        """Throw every load away (an epoch starts or ends)."""
        for future in self._loads.values():
            self._drop(future)
        self._loads.clear()

    def _loaded(self, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        size = _nbytes(future.result())
        with self._lock:
            if id(future) in self._live:
                self._ready[id(future)] = size
                self.peak_bytes = max(self.peak_bytes, sum(self._ready.values()))

    def _drop(self, future: Future) -> None:
        future.cancel()
        with self._lock:
            self._live.discard(id(future))
            self._ready.pop(id(future), None)


def _cancel_at_exit(pool: ThreadPoolExecutor) -> None:
    """When the interpreter ends, ``pool``'s loads not yet started are cancelled: a
    program that returns with batches queued ahead (``stop_training`` mid-epoch) ends
    after the loads in progress, not after all of them.  (Python joins a pool's threads
    before ``atexit`` runs; ``threading._register_atexit`` runs before that join.)"""
    ref = weakref.ref(pool)

    def cancel() -> None:
        live = ref()
        if live is not None:
            live.shutdown(wait=False, cancel_futures=True)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(cancel)
        except RuntimeError:  # the interpreter is already ending
            pass


def elastic_dataset(sampler: ElasticSampler, load: Callable[..., Any],
                    output_signature: Any, ahead: int | WorkAhead = 0) -> Any:
    """A dataset of one epoch per iteration: ``load(ids, weights)`` makes each batch.

    ``load`` returns what Keras expects, e.g. ``(x, y, weights)``; ``weights`` are 0
    for the padding sample a rank gets when an epoch ends with fewer samples than ranks.
    ``ahead``: batches loaded ahead in threads (a number, or a :class:`WorkAhead`);
    ``load`` then also runs for batches that a membership change throws away before
    they are trained (it must not count what it loads as trained), and in threads.
    """
    if isinstance(ahead, WorkAhead):
        work = ahead
    else:
        work = WorkAhead(lambda ids, weights, _epoch: load(ids, weights), ahead)

    def generate() -> Iterator[Any]:
        sampler.start_epoch()
        work.clear()
        try:
            while True:
                epoch = max(sampler.epoch, 0)
                work.plan(sampler.upcoming(work.ahead + 1), epoch)  # this step's, and on
                batch = sampler.next_batch()
                if batch is None:
                    return
                yield work.take(*batch, epoch)
        finally:
            work.clear()

    dataset = tf.data.Dataset.from_generator(generate, output_signature=output_signature)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options)


def _spec(array: Any) -> Any:
    if isinstance(array, tf.Tensor):
        return tf.TensorSpec([None, *array.shape[1:]], array.dtype)
    array = np.asarray(array)
    dtype = tf.string if array.dtype.kind in "USO" else tf.as_dtype(array.dtype)
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

    ``ahead``: batches loaded ahead, in ``workers`` threads (default: as many as
    CPUs, at most ``ahead``), while the current step trains; 0 loads each batch
    when its step asks for it.  ``load`` then runs in those threads, and also for
    batches that a membership change throws away before they are trained (they go
    back into the epoch: see the module doc), so it must not count what it loads
    as trained.  ``prefetch_peak_bytes``: the most bytes loaded ahead at once.

    ``map`` (instead of ``load``): a per-sample function of TensorFlow ops (one row of
    each array in, e.g. ``decode(path), label`` out), run as ``tf.data``'s
    ``map(num_parallel_calls=AUTOTUNE)`` over each batch: in TensorFlow's threads, not
    Python's, for a ``load`` whose Python per image is the cost.
    """

    def __init__(self, samples: Any, batch_size: int, load: Callable[..., Any] | None = None,
                 seed: int = 0, shuffle: bool = True, ahead: int = AHEAD,
                 workers: int | None = None, map: Callable[..., Any] | None = None) -> None:
        self.arrays = tuple(np.asarray(a) for a in (
            samples if isinstance(samples, tuple) else (samples,)))
        sizes = {len(a) for a in self.arrays}
        if len(sizes) != 1:
            raise ValueError(f"the sample arrays differ in length: {sorted(sizes)}")
        if map is not None and load is not None:
            raise ValueError("give ElasticData load= (a batch) or map= (a sample), not both")
        self.load = load if map is None else _per_sample(map, self.arrays)
        self._with_epoch = load is not None and "epoch" in inspect.signature(load).parameters
        self.sampler = ElasticSampler(runtime.current("ElasticData"), sizes.pop(), batch_size,
                                      seed=seed, shuffle=shuffle)
        self.work = WorkAhead(self._batch, ahead, workers)
        first = self._batch(np.array([0]), np.ones(1, np.float32), 0)  # its structure, once
        self.dataset = elastic_dataset(self.sampler, self._batch,
                                       tuple(_spec(part) for part in first), ahead=self.work)

    @classmethod
    def from_dataset(cls, dataset: Any, batch_size: int, **kwargs: Any) -> Self:
        """From a finite ``tf.data.Dataset`` of single samples (e.g. ``(x, y)`` tuples).

        Its elements are not read into memory: a dataset that supports random access
        (``tf.data.experimental.at``: ``from_tensor_slices``, ``range``, ``map``,
        ``zip``...) is kept and read by element index, a batch at a time; any other
        (files read in order, e.g. ``TFRecordDataset``) is copied once, element by
        element, into a file of serialized elements (``spill_dir``, default the
        temporary directory; removed when the process ends) and read back by index.
        A ``load`` given too gets the batch's elements."""
        spill_dir = kwargs.pop("spill_dir", None)
        rows = DatasetRows(dataset, spill_dir)
        load = kwargs.pop("load", None)
        with_epoch = load is not None and "epoch" in inspect.signature(load).parameters

        def read(ids: np.ndarray, epoch: int = 0) -> Any:
            elements = rows.batch(ids)
            if load is None:
                return elements
            parts = elements if isinstance(elements, tuple) else (elements,)
            return load(*parts, **({"epoch": epoch} if with_epoch else {}))

        return cls(np.arange(len(rows)), batch_size, load=read, **kwargs)

    @property
    def prefetch_peak_bytes(self) -> int:
        """The most bytes of batches loaded ahead that waited for their step at once."""
        return self.work.peak_bytes

    def _batch(self, ids: np.ndarray, weights: np.ndarray, epoch: int) -> tuple[Any, ...]:
        parts = tuple(a[ids] for a in self.arrays)
        if self.load is not None:
            parts = self.load(*parts, **({"epoch": epoch} if self._with_epoch else {}))
            parts = parts if isinstance(parts, tuple) else (parts,)
        return (*parts, weights)

    def __len__(self) -> int:
        return self.sampler.num_samples


def _per_sample(fn: Callable[..., Any], arrays: Sequence[np.ndarray]) -> Callable[..., Any]:
    """A batch ``load`` that maps ``fn`` over the rows with tf.data's parallel map."""
    def load(*parts: Any) -> Any:
        rows = tf.data.Dataset.from_tensor_slices(parts).map(
            fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        out = rows.batch(tf.cast(tf.shape(parts[0])[0], tf.int64)).get_single_element()
        return tuple(out) if isinstance(out, (tuple, list)) else out

    return tf.function(load, input_signature=[_spec(a) for a in arrays])


class DatasetRows:
    """The elements of a finite ``tf.data.Dataset`` by index, without holding them:
    through random access, or from a file of serialized elements written once."""

    def __init__(self, dataset: Any, spill_dir: str | None = None) -> None:
        self.spec = dataset.element_spec
        self.count = int(dataset.cardinality())
        if self.count == tf.data.INFINITE_CARDINALITY:
            raise ValueError("the dataset is infinite (a .repeat()?): ElasticData needs a "
                             "finite one, every sample once")
        self._file: Any = None
        try:
            tf.data.experimental.at(dataset, 0)
            random_access = self.count >= 0
        except Exception:  # noqa: BLE001 -- TF raises various kinds for "not supported"
            random_access = False
        if random_access:
            self._dataset = dataset
            signature = [tf.TensorSpec([None], tf.int64)]
            self._fetch = tf.function(self._fetch_by_index, input_signature=signature)
        else:
            self._spill(dataset, spill_dir)
        if self.count <= 0:
            raise ValueError("the dataset is empty")

    def __len__(self) -> int:
        return self.count

    def _fetch_by_index(self, ids: Any) -> Any:
        rows = tf.data.Dataset.from_tensor_slices(ids).map(
            lambda i: tf.data.experimental.at(self._dataset, i),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return rows.batch(tf.cast(tf.size(ids), tf.int64)).get_single_element()

    def _spill(self, dataset: Any, spill_dir: str | None) -> None:
        import shutil
        import tempfile
        directory = tempfile.mkdtemp(prefix="elastic_hvd-rows-", dir=spill_dir)
        weakref.finalize(self, shutil.rmtree, directory, True)
        specs = tf.nest.flatten(self.spec)

        def serialize(*element: Any) -> Any:
            parts = tf.nest.flatten(element)
            return tf.io.serialize_tensor(tf.stack([tf.io.serialize_tensor(p) for p in parts]))

        offsets = [0]
        path = os.path.join(directory, "rows")
        with open(path, "wb") as f:
            records = dataset.map(serialize if isinstance(self.spec, tuple)
                                  else lambda e: serialize(e), num_parallel_calls=tf.data.AUTOTUNE)
            for record in records.as_numpy_iterator():
                f.write(record)
                offsets.append(offsets[-1] + len(record))
        self.count = len(offsets) - 1
        self._offsets = np.array(offsets, dtype=np.int64)
        self._file = open(path, "rb")  # noqa: SIM115 -- read until the process ends
        weakref.finalize(self, self._file.close)

        def parse(record: Any) -> Any:
            parts = tf.io.parse_tensor(record, tf.string)
            values = [tf.ensure_shape(tf.io.parse_tensor(parts[k], s.dtype), s.shape)
                      for k, s in enumerate(specs)]
            return tf.nest.pack_sequence_as(self.spec, values)

        def fetch(records: Any) -> Any:
            rows = tf.data.Dataset.from_tensor_slices(records).map(
                parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return rows.batch(tf.cast(tf.size(records), tf.int64)).get_single_element()

        parse_batch = tf.function(fetch, input_signature=[tf.TensorSpec([None], tf.string)])
        fd = self._file.fileno()

        def by_index(ids: Any) -> Any:
            ids = np.asarray(ids)
            start, end = self._offsets[ids], self._offsets[ids + 1]
            return parse_batch(np.array([os.pread(fd, int(e - s), int(s))
                                         for s, e in zip(start, end)], dtype=object))

        self._fetch = by_index

    def batch(self, ids: np.ndarray) -> Any:
        """The elements ``ids``, stacked (a tuple of arrays for tuple elements)."""
        out = self._fetch(np.asarray(ids, dtype=np.int64))
        return tuple(out) if isinstance(out, (tuple, list)) else out


def validation_shard(validation_data: Sequence[Any], batch_size: int,
                     load: Callable[..., Any] | None = None, ahead: int = AHEAD) -> Any:
    """``validation_data`` (a tuple of arrays) as a dataset of this rank's share:
    rows ``rank::size`` of the membership at the moment Keras evaluates, so the
    live ranks split the work and ``MetricAverageCallback`` averages their results.
    ``load``: as :class:`ElasticData`'s (e.g. ``(paths, labels)`` decoded a batch at a
    time); ``ahead`` batches are loaded ahead in threads."""
    arrays = tuple(np.asarray(a) for a in validation_data)
    comm = runtime.current("validation_shard")

    def make(ids: np.ndarray) -> tuple[Any, ...]:
        parts = tuple(a[ids] for a in arrays)
        if load is not None:
            parts = load(*parts)
            parts = parts if isinstance(parts, tuple) else (parts,)
        return parts

    first = make(np.array([0]))
    work = WorkAhead(lambda ids, _weights, _epoch: make(ids), ahead)
    nothing = np.zeros(0, np.float32)

    def generate() -> Iterator[tuple[Any, ...]]:
        mine = np.arange(comm.rank, len(arrays[0]), comm.size)
        batches = [mine[start:start + batch_size] for start in range(0, len(mine), batch_size)]
        work.clear()
        try:
            for k, ids in enumerate(batches):
                work.plan([(b, nothing) for b in batches[k:k + work.ahead + 1]], 0)
                yield work.take(ids, nothing, 0)
        finally:
            work.clear()

    return tf.data.Dataset.from_generator(
        generate, output_signature=tuple(_spec(a) for a in first))
