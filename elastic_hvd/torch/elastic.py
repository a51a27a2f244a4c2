"""Horovod's ``horovod.torch.elastic`` (``hvd.elastic``), on a job that recovers in place.

Elastic Horovod restarts the training function from the last ``commit()`` after a
failure.  elastic_hvd's collectives survive the failure where it happens, so ``run``
restarts nothing for a failure; the state keeps Horovod's meaning (``commit`` saves a
copy in memory, ``restore`` goes back to it, ``sync`` makes rank 0's the state of every
rank) for scripts that use it.

Growing (``elastic-hvd-run --respawn`` / ``--max-np``) follows Horovod's model for added
hosts, as on the TF side (:mod:`elastic_hvd.tensorflow.elastic`): ``commit()`` runs the
growth policy; the commit at which new processes are adopted raises
:class:`HostsUpdatedInterrupt` on the running ranks, and ``run`` calls the reset
callbacks, syncs the state (the new processes receive it) and calls the training
function again from the committed state, which is the current one.

:class:`ElasticSampler` is Horovod 0.28's: the epoch's permutation less the samples
processed so far (``record_batch``), split over the ranks when it is reset (``set_epoch``,
``load_state_dict``, a state's ``sync``).  A rank lost during an epoch is not re-split
then: its part of the epoch goes untrained until the next ``set_epoch`` (the change's
announcement says so), as for a plain Horovod TF script.
"""

import copy
import dataclasses
import functools
import math
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..common.elastic_state import StateBasics
from ..basics import init, rank, shutdown, size  # noqa: F401 (hvd.elastic.*, as Horovod's)
from ..core import announce, process, runtime
from ..core.membership import MembershipEvent
from ..growth_policy import GrowthPolicy, mark_growth_point
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import HorovodInternalError  # noqa: F401

_R = TypeVar("_R")


@dataclasses.dataclass
class _Layer:
    """The torch layer's state for the process (``process.runtime().layers``)."""

    #: ``hvd.elastic.run``'s growth policy, made when first asked for.
    policy: GrowthPolicy | None = None


def growth_policy() -> GrowthPolicy:
    """This process's growth policy (from elastic-hvd-run's flags)."""
    layer = process.runtime().layers.get(_Layer)
    if layer.policy is None:
        layer.policy = GrowthPolicy.from_env()
    return layer.policy


class HostsUpdatedInterrupt(Exception):
    """Raised by ``State.commit()`` when new processes joined: ``run`` restarts training."""


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorator for the training function ``func(state, ...)``: syncs the state and calls
    it; again after processes joined (see the module doc)."""
    return run_fn(func, _no_reset)


def _no_reset() -> None:
    """Horovod re-initializes itself here; elastic_hvd's communicator already includes
    the processes that joined."""


def run_fn(func: Callable[..., _R], reset: Callable[[], Any]) -> Callable[..., _R]:
    """``run`` with the step taken when processes joined: ``reset()``, then the state's
    reset callbacks, before syncing and calling ``func`` again."""
    @functools.wraps(func)
    def wrapper(state: "TorchState", *args: Any, **kwargs: Any) -> _R:
        comm = runtime.current("hvd.elastic.run")
        mark_growth_point()  # state.commit() grows
        if comm.joining:
            growth_policy().step(runtime.growth("hvd.elastic.run"))  # a joiner's first step joins
        while True:
            state.sync()
            policy = growth_policy()
            policy.load_state(comm.broadcast_object(policy.state()))
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                reset()
                state.on_reset()
    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's elastic sampler: this rank's share of the epoch's samples not yet
    processed (see the module doc).  Call ``record_batch`` after each batch and
    ``set_epoch`` at the end of each epoch; keep it in a :class:`TorchState`."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.reset()
        announce.effect("data", self._announced)  # the membership line says what it does
        announce.effect("when", lambda _event: f"epoch {self.epoch + 1}")

    def _announced(self, event: MembershipEvent) -> str:
        if event.lost:
            whose = "ranks'" if len(event.lost) > 1 else "rank's"
            return (f"the lost {whose} part of this epoch is not trained; ElasticSampler "
                    f"splits the next epoch over {event.new_size} "
                    f"rank{'s' if event.new_size != 1 else ''}")
        return f"ElasticSampler splits what is left over {event.new_size} ranks at its reset"

    def set_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` (call it at the end of the previous one): a new permutation,
        nothing processed."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed a batch of ``batch_size`` samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch over the live ranks."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        padded += padded[:self.total_size - len(padded)]  # every rank the same count
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class TorchState(StateBasics):
    """Horovod's ``TorchState``: a model, an optimizer and named values (epoch, batch,
    an :class:`ElasticSampler`, any picklable object) kept in sync across ranks.

    ``commit``/``save`` keep a copy in memory, ``restore`` goes back to it, ``sync``
    makes rank 0's the state of every rank (the parameters, the optimizer's state and
    options, each value; a sampler's progress).  Nothing is written to a file."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self._model, self._optimizer = model, optimizer
        self._values = dict(kwargs)
        self._reset_callbacks: list[Callable[[], Any]] = []
        self.save()  # restore() before any commit goes back to the start

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    def check_host_updates(self) -> None:
        """Failures need nothing here (they are handled inside the collectives); this is
        where the job grows: see the module doc."""
        policy = growth_policy()
        if policy:
            event = policy.step(runtime.growth("state.commit()"))
            if event is not None and event.gained:
                raise HostsUpdatedInterrupt(f"rank(s) {list(event.gained)} joined")

    def _value_states(self) -> dict[str, Any]:
        return {k: v.state_dict() if isinstance(v, ElasticSampler) else v
                for k, v in self._values.items()}

    def save(self) -> None:
        self._saved = copy.deepcopy((
            None if self._model is None else self._model.state_dict(),
            None if self._optimizer is None else self._optimizer.state_dict(),
            self._value_states()))

    def restore(self) -> None:
        model, optimizer, values = copy.deepcopy(self._saved)
        if self._model is not None and model is not None:
            self._model.load_state_dict(model)
        if self._optimizer is not None and optimizer is not None:
            self._optimizer.load_state_dict(optimizer)
        self._load_values(values)

    def _load_values(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            current = self._values.get(k)
            if isinstance(current, ElasticSampler):
                current.load_state_dict(v)
            else:
                self._values[k] = v

    def sync(self) -> None:
        if self._model is not None:
            broadcast_parameters(self._model.state_dict(), root_rank=0)
        if self._optimizer is not None:
            broadcast_optimizer_state(self._optimizer, root_rank=0)
        self._load_values(broadcast_object(self._value_states(), 0, name="HorovodElasticState"))
        self.save()
