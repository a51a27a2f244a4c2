"""Exactly-once data for PyTorch: a DataLoader whose samples are each trained once per
epoch, whatever ranks are lost or join, with ``num_workers`` and their prefetching.

    loader = ElasticDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)
    for epoch in range(epochs):
        for x, y in loader:            # a batch per step, this rank's share of it
            ...                        # forward, backward, optimizer.step() (DistributedOptimizer)

What is trained is decided by the core's sampler (:class:`elastic_hvd.sharding.ElasticSampler`,
the one of ``hvd.ElasticData``): each step draws its samples when it starts and splits them
over the live ranks; a step's commit (the end of ``DistributedOptimizer.step()``'s step
transaction) marks the samples of the ranks it reduced as trained and puts the others'
(a lost rank's) back into the epoch.  The workers only load *guesses*: the batches the
sampler says this rank's next steps will draw if the membership stays
(``ElasticSampler.upcoming``), in a ``torch.utils.data.DataLoader`` with the given workers
and prefetching.  A step uses a loaded batch only when its draw names exactly the
guessed samples; after a membership change the draw differs, the guesses still in flight
are thrown away (the DataLoader's workers are stopped), the drawn batch is loaded in
this process, and a new DataLoader loads the guesses for the new membership.  So a batch
drawn for a membership that then changed is neither trained twice nor lost.

The last step of an epoch may have fewer samples than ranks: a rank left without one
gets a single sample of weight 0, and ``DistributedOptimizer`` contributes zeros for it
(its gradients are not reduced), so that sample is not trained there.  (With
``backward_passes_per_step`` > 1, that holds when the filler is the step's last pass.)
"""

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, default_collate

from ..core import process, runtime
from ..sharding import ElasticSampler as _CoreSampler


@dataclasses.dataclass
class _DataState:
    """The torch data layer's state for the process (``process.runtime().layers``)."""

    #: This rank's current batch has no sample to train (one weightless filler):
    #: DistributedOptimizer contributes zeros for its step, then clears it.
    weightless_step: bool = False


def data_state() -> _DataState:
    return process.runtime().layers.get(_DataState)


class ElasticDataLoader:
    """Batches of ``dataset`` (a map-style dataset: ``len`` and ``dataset[i]``) for this
    rank, exactly once per epoch over the live ranks (see the module doc).

    ``batch_size``: samples per rank and step (the step takes ``size * batch_size``);
    ``shuffle``/``seed``: the epoch's permutation, the same on every rank; the other
    arguments (``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor``,
    ``worker_init_fn``, ...) are the DataLoader's that loads ahead.  Each iteration is
    one epoch; :meth:`set_epoch` picks the next one's number (default: the one after)."""

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = True,
                 seed: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 **loader_kwargs: Any) -> None:
        for refused in ("sampler", "batch_sampler", "drop_last"):
            if refused in loader_kwargs:
                raise ValueError(f"ElasticDataLoader chooses the samples: no {refused}=")
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.collate_fn = collate_fn or default_collate
        self.loader_kwargs = loader_kwargs
        self.sampler = _CoreSampler(runtime.current("ElasticDataLoader"), len(dataset),
                                    self.batch_size, seed=seed, shuffle=shuffle)
        self._epoch: int | None = None
        #: Batches loaded ahead and thrown away after a membership change (for tests
        #: and curiosity), and DataLoaders started.
        self.discarded = 0
        self.loaders_started = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        """Steps left in the epoch at the current size (it changes with the membership)."""
        return self.sampler.steps_left()

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is (samples not trained yet), for a checkpoint."""
        return self.sampler.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state(state)

    def _load_ahead(self) -> tuple[collections.deque, Iterator[Any] | None]:
        """The guesses of the rest of the epoch and a DataLoader iterator loading them."""
        guesses = collections.deque(ids.tolist() for ids, _ in
                                    self.sampler.upcoming(self.sampler.steps_left()))
        if not guesses:
            return guesses, None
        self.loaders_started += 1
        loader = DataLoader(self.dataset, batch_sampler=list(guesses),
                            collate_fn=self.collate_fn, **self.loader_kwargs)
        return guesses, iter(loader)

    def _load_now(self, ids: list[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in ids])

    def __iter__(self) -> Iterator[Any]:
        self.sampler.start_epoch(self._epoch)
        self._epoch = None
        guesses, loading = self._load_ahead()
        try:
            while True:
                drawn = self.sampler.next_batch()
                if drawn is None:
                    return
                ids, weights = drawn
                wanted = ids.tolist()
                data_state().weightless_step = not bool(weights.any())
                if guesses and guesses[0] == wanted and loading is not None:
                    guesses.popleft()
                    yield next(loading)
                    continue
                # the membership changed: what is loading was planned for another one
                self.discarded += len(guesses)
                _stop(loading)
                batch = self._load_now(wanted)
                guesses, loading = self._load_ahead()
                yield batch
        finally:
            _stop(loading)


def _stop(loading: Iterator[Any] | None) -> None:
    """Stop a DataLoader iterator's workers now (its prefetched batches are dropped)."""
    shutdown = getattr(loading, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def weightless_step() -> bool:
    """Whether this rank's current batch is a weightless filler (see the module doc)."""
    return runtime.is_initialized() and data_state().weightless_step
