"""Horovod's framework-independent basics (init, rank, size, ...) over the core.

Every value is read from the *live* communicator, so after a rank is lost
``size()`` is the survivors' count and ``rank()`` may have changed.
"""

from .core import runtime
from .core.mpi_env import ft_enabled


def init(comm=None, process_sets=None, min_np=None):
    """Start elastic_hvd (idempotent).  ``comm``: mpi4py communicator or list of ranks."""
    if process_sets not in (None, [], ()):
        raise NotImplementedError(
            "elastic_hvd supports only the global process set; process_sets= is not supported")
    return runtime.init(comm, min_np=min_np)


def shutdown():
    runtime.shutdown()


def is_initialized():
    return runtime.is_initialized()


def _comm(what):
    return runtime.current(what)


def size():
    return _comm("hvd.size()").size


def rank():
    return _comm("hvd.rank()").rank


def _local_peers(comm):
    hosts = comm.hosts()
    mine = hosts[comm.rank]
    return [r for r, h in enumerate(hosts) if h == mine], hosts


def local_size():
    return len(_local_peers(_comm("hvd.local_size()"))[0])


def local_rank():
    comm = _comm("hvd.local_rank()")
    return _local_peers(comm)[0].index(comm.rank)


def _local_ranks(comm):
    """Each rank's local rank: its position among the ranks on its host."""
    hosts = comm.hosts()
    return [hosts[:r].count(h) for r, h in enumerate(hosts)]


def cross_size():
    """Number of ranks that share this rank's local rank (one per host, as in Horovod)."""
    comm = _comm("hvd.cross_size()")
    local = _local_ranks(comm)
    return local.count(local[comm.rank])


def cross_rank():
    comm = _comm("hvd.cross_rank()")
    local = _local_ranks(comm)
    return [r for r, lr in enumerate(local) if lr == local[comm.rank]].index(comm.rank)


def is_homogeneous():
    comm = _comm("hvd.is_homogeneous()")
    hosts = comm.hosts()
    return len({hosts.count(h) for h in hosts}) == 1


def mpi_threads_supported():
    MPI = _comm("hvd.mpi_threads_supported()").MPI
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


# What this build has, answered truthfully.
def mpi_built():
    return True


def mpi_enabled():
    return True


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False


def elastic_enabled():
    """True when the job survives rank loss (launched with ULFM fault tolerance)."""
    if runtime.is_initialized():
        return runtime.current().elastic
    return ft_enabled()
