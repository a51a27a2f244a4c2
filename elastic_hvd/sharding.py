"""Elastic data sharding: every sample trained on exactly once per epoch, whatever dies.

Each epoch is one global seeded permutation, consumed batch by batch: a step
takes the next ``size * batch_size`` samples of the epoch's queue and splits
them over the live ranks in rank order.  Every rank computes the same schedule
(same seed, same membership events, which are agreed), so all ranks run the
same number of steps and the epoch ends on the same step everywhere.

A slice drawn by a rank stays *pending* until an optimizer step commits (see
:mod:`elastic_hvd.core.session`): the commit names the ranks whose gradients the
step holds, the same on every survivor.  Their pending slices are done; the
pending slices of every other rank (lost before or during the step, including
all micro-batches of ``backward_passes_per_step``) go back at the end of the
queue.  Batches are drawn when a step starts (no read-ahead), so prefetching
cannot hand out slices planned for a membership that no longer exists; the TF
adapter keeps it that way.  What it loads ahead it learns from :meth:`upcoming`,
which draws nothing: the draws alone decide what is trained, and a batch loaded
for a guess that a membership change made wrong is thrown away, never trained.

The last step of an epoch may hold fewer samples than ranks: ranks left without
one get a single sample with weight 0 (no gradient), so no batch is empty.

Not covered: a slice is "trained" when its gradients were reduced; a step that
fails after its commit (in the optimizer's update itself) is not redone.
"""

import collections
import itertools
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .core import announce, runtime

if TYPE_CHECKING:
    from .core.comm import ResilientComm
    from .core.membership import MembershipEvent


def _split(take: list[int], ids: tuple[int, ...]) -> dict[int, list[int]]:
    """A step's ``take`` split over the ranks ``ids`` in their order, as evenly as can be."""
    base, extra = divmod(len(take), len(ids))
    slices, start = {}, 0
    for position, original_id in enumerate(ids):
        count = base + (1 if position < extra else 0)
        slices[original_id] = take[start:start + count]
        start += count
    return slices


def _mine(take: list[int], mine: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A rank's ``(ids, weights)`` of a step; one weightless sample if it has none (more
    ranks than samples left)."""
    if not mine:
        return np.array([take[0]]), np.zeros(1, dtype=np.float32)
    return np.array(mine), np.ones(len(mine), dtype=np.float32)


class ElasticSampler:
    """Hands each rank its sample ids, step by step, for ``num_samples`` samples."""

    def __init__(self, comm: "ResilientComm", num_samples: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True, epoch: int = 0) -> None:
        self.comm = comm
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.seed, self.shuffle = seed, shuffle
        self.epoch = epoch - 1  # start_epoch() moves to `epoch`
        self.queue: collections.deque[int] = collections.deque()
        self.step = 0
        self._pending: dict[int, list[int]]
        self._pending = {}  # original id -> ids drawn since the last committed step
        self._resume: dict[str, Any] | None
        self._resume = None  # a checkpointed, unfinished epoch to continue
        self.requeued = 0
        runtime.session("ElasticSampler").commits.add(self._on_commit)
        announce.effect("data", self._announced)
        announce.effect("when", lambda _event: f"epoch {self.epoch + 1}, step {self.step}"
                        if self.epoch >= 0 else None)

    def start_epoch(self, epoch: int | None = None) -> None:
        """Begin ``epoch`` (default: the next one): a fresh permutation, or the rest of
        that epoch if a checkpoint of it was loaded."""
        self.epoch = self.epoch + 1 if epoch is None else int(epoch)
        if self._resume is not None and self._resume["epoch"] == self.epoch:
            self.queue = collections.deque(self._resume["queue"])
            self.step, self._resume = self._resume["step"], None
            return
        order = np.arange(self.num_samples)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        self.queue = collections.deque(order.tolist())
        self.step = 0

    def steps_left(self) -> int:
        """Steps this epoch still needs at the current size (it changes with the membership)."""
        return -(-len(self.queue) // (self.comm.size * self.batch_size))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(ids, weights)`` for this rank's next step, or None when the epoch is done."""
        if not self.queue:
            return None
        ids = self.comm.ids
        take = [self.queue.popleft() for _ in range(min(len(self.queue),
                                                        len(ids) * self.batch_size))]
        slices = _split(take, ids)
        for original_id, taken in slices.items():
            self._pending.setdefault(original_id, []).extend(taken)
        self.step += 1
        return _mine(take, slices[self.comm.original_id])  # type: ignore[index]

    def upcoming(self, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """What ``next_batch()`` will return on this rank in the next ``steps`` steps of
        this epoch if the membership and the batch size stay as they are now; draws
        nothing.  A work-ahead loads these early: whatever happens to the membership,
        the draws themselves decide what is trained (a change makes the next draws
        differ from this, and the early loads are thrown away), so looking ahead
        cannot break exactly-once."""
        ids, me = self.comm.ids, self.comm.original_id
        if me is None or me not in ids:
            return []
        per_step = len(ids) * self.batch_size
        head = list(itertools.islice(self.queue, steps * per_step))
        return [_mine(take, _split(take, ids)[me])
                for take in (head[start:start + per_step]
                             for start in range(0, len(head), per_step))]

    def _announced(self, event: "MembershipEvent") -> str:
        """What the data does about a membership change, for the line on the console."""
        shared = (f"the rest of the epoch is split over {event.new_size} "
                  f"rank{'s' if event.new_size != 1 else ''}")
        if event.lost:
            whose = "ranks" if len(event.lost) > 1 else "rank"
            return f"the samples the lost {whose} had not trained go back into the epoch; {shared}"
        return shared

    def uncommitted(self) -> bool:
        """True while drawn samples wait for a step to commit them."""
        return any(self._pending.values())

    def _on_commit(self, ids: Collection[int]) -> None:
        """A step committed with the gradients of ``ids``: their slices are trained,
        everyone else's go back into the queue."""
        for original_id, taken in self._pending.items():
            if original_id not in ids:
                self.queue.extend(taken)
                self.requeued += len(taken)
        self._pending = {}

    def state(self) -> dict[str, Any]:
        """Position in the epoch (for checkpoints and for ranks that join later).
        Samples drawn for a step that never committed count as not trained."""
        queue = list(self.queue) + [i for taken in self._pending.values() for i in taken]
        return {"epoch": self.epoch, "queue": queue, "step": self.step}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue the checkpointed epoch: the next ``start_epoch()`` resumes it."""
        self._resume = dict(state)
        self.epoch = state["epoch"] - 1
