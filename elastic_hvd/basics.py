"""Horovod's framework-independent basics (init, rank, size, ...) over the core.

Every value is read from the *live* communicator, so after a rank is lost
``size()`` is the survivors' count and ``rank()`` may have changed.  What a
framework layer does in ``init()`` it registers here when imported
(:func:`when_replacing`): this module imports none.
"""

from collections.abc import Callable
from typing import Any

from . import growth_policy
from .core import process, runtime
from .core.comm import ResilientComm
from .core.process_set_api import init_process_sets
from .core.mpi_env import ft_enabled


#: What the framework layers do in a hot spare that takes a lost rank's place (see
#: :func:`when_replacing`); registered when they are imported, so kept with the module.
_replacing_hooks: list[Callable[[], None]] = []


def when_replacing(hook: Callable[[], None]) -> None:
    """Call ``hook()`` in ``init()`` when this process is a hot spare given a lost
    rank's number (e.g. the Keras layer makes the next ``model.fit`` join first);
    at once if that ``init()`` already ran."""
    _replacing_hooks.append(hook)
    if getattr(process.runtime().growth, "replacing", None) is not None:
        hook()


def init(comm: Any = None, process_sets: Any = None,
         min_np: int | None = None) -> ResilientComm:
    """Start elastic_hvd (idempotent).  ``comm``: mpi4py communicator or list of ranks.
    ``process_sets``: Horovod's (a list of ProcessSet, registered by every rank alike, or
    ``"dynamic"``; see :func:`.core.process_set_api.init_process_sets`)."""
    first = not runtime.is_initialized()
    started = runtime.init(comm, min_np=min_np,
                           has_growth_point=growth_policy.main_has_growth_point)
    growth = runtime.growth("hvd.init()")
    if first and growth.replacing is not None:  # a hot spare that runs the script as a lost rank
        for hook in _replacing_hooks:
            hook()
    if first:
        growth_policy.warn_if_cannot_grow(runtime.session(), started, growth)
    if not started.joining:  # a joiner takes the sets over when it joins (their book)
        init_process_sets(started, process_sets, comm)
    return started


def shutdown() -> None:
    """Meet the other ranks, then forget the communicator (MPI is finalized at exit).

    A rank that shuts down while the others still train leaves the job: they go
    on without it and this process exits at once."""
    runtime.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return runtime.is_initialized()


def _comm(what: str) -> ResilientComm:
    return runtime.current(what)


def size() -> int:
    """Number of live ranks: it drops when a rank is lost and grows when one joins."""
    return _comm("hvd.size()").size


def rank() -> int:
    """This process's rank among the live ranks; survivors are renumbered after a loss,
    so read it again instead of keeping it."""
    return _comm("hvd.rank()").rank


def _local_peers(comm: ResilientComm) -> tuple[list[int], list[str | None]]:
    hosts = comm.hosts()
    if comm.joining:  # a spare or spawned process, no member yet: alone on its host so far
        return [comm.rank], hosts
    mine = hosts[comm.rank]
    return [r for r, h in enumerate(hosts) if h == mine], hosts


def local_size() -> int:
    """Number of live ranks on this rank's host."""
    return len(_local_peers(_comm("hvd.local_size()"))[0])


def local_rank() -> int:
    """This rank's position among the live ranks on its host (in rank order)."""
    comm = _comm("hvd.local_rank()")
    return _local_peers(comm)[0].index(comm.rank)


def _local_ranks(comm: ResilientComm) -> list[int]:
    """Each rank's local rank: its position among the ranks on its host."""
    hosts = comm.hosts()
    return [hosts[:r].count(h) for r, h in enumerate(hosts)]


def cross_size() -> int:
    """Number of ranks that share this rank's local rank (one per host, as in Horovod)."""
    comm = _comm("hvd.cross_size()")
    if comm.joining:  # no member yet (see _local_peers)
        return 1
    local = _local_ranks(comm)
    return local.count(local[comm.rank])


def cross_rank() -> int:
    """This rank's position among the live ranks with its local rank (one per host,
    in rank order), as in Horovod."""
    comm = _comm("hvd.cross_rank()")
    if comm.joining:  # no member yet (see _local_peers)
        return 0
    local = _local_ranks(comm)
    return [r for r, lr in enumerate(local) if lr == local[comm.rank]].index(comm.rank)


def is_homogeneous() -> bool:
    """Whether every host runs the same number of live ranks (a loss can change it)."""
    comm = _comm("hvd.is_homogeneous()")
    hosts = comm.hosts()
    return len({hosts.count(h) for h in hosts}) == 1


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``: always True once ``init()``
    succeeded, which requires it (its heartbeat and spawn threads call MPI)."""
    MPI = _comm("hvd.mpi_threads_supported()").MPI
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


# What this build has, answered truthfully.
def mpi_built() -> bool:
    """True: every collective goes through MPI (mpi4py); see :func:`elastic_enabled` for ULFM."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is elastic_hvd's only transport."""
    return True


def gloo_built() -> bool:
    """False: no Gloo; elasticity comes from MPI ULFM, not from Gloo as in Horovod."""
    return False


def gloo_enabled() -> bool:
    """False: no Gloo (see :func:`gloo_built`)."""
    return False


def nccl_built() -> bool:
    """False: no NCCL; collectives run through MPI on host memory."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: collectives never run on GPU memory (GPU tensors go through the host)."""
    return False


def rocm_built() -> bool:
    """False: collectives never run on GPU memory (GPU tensors go through the host)."""
    return False


def elastic_enabled() -> bool:
    """True when the job survives rank loss (launched with ULFM fault tolerance)."""
    if runtime.is_initialized():
        return runtime.current().elastic
    return ft_enabled()
