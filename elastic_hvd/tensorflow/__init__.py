"""Horovod's ``horovod.tensorflow`` API, backed by the resilient core.

    import elastic_hvd.tensorflow as hvd     # instead of: import horovod.tensorflow as hvd
"""

from typing import Any, NoReturn

from ..basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,  # noqa: F401
                      elastic_enabled, gloo_built, gloo_enabled, init, is_homogeneous,
                      is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from ..basics import when_replacing as _when_replacing
from ..horovod_alias import not_provided
from ..core.errors import (MismatchError, NotInitializedError,  # noqa: F401
                           RanksBelowMinimumError, RemoteCollectiveError)
from .compression import Compression  # noqa: F401
from . import elastic  # noqa: F401 (hvd.elastic)
from .collectives import (HorovodInternalError, allreduce, grouped_allreduce,  # noqa: F401
                          allgather, grouped_allgather, broadcast, broadcast_,
                          broadcast_variables, broadcast_global_variables,
                          broadcast_object, broadcast_object_fn, allgather_object,
                          alltoall, reducescatter, grouped_reducescatter, barrier,
                          join, BroadcastGlobalVariablesHook)
from .gradients import (DistributedGradientTape, DistributedOptimizer,  # noqa: F401
                        PartialDistributedGradientTape)
from ..core.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from .ops import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                  local_rank_op, local_size_op, process_set_included_op, rank_op,
                  remove_process_set, size_op)
from ..common.util import gpu_available, split_list  # noqa: F401
from ..common.util import num_rank_is_power_2 as check_num_rank_power_of_2  # noqa: F401
from .sync_batch_norm import SyncBatchNormalization  # noqa: F401
from .timeline import start_timeline, stop_timeline  # noqa: F401
from . import util  # noqa: F401 (Horovod's hvd.util)
from .util import (_executing_eagerly, handle_average_backwards_compatibility,  # noqa: F401
                   refs_to_vars, vars_to_refs)

def _install_replacement() -> None:
    """In a hot spare given a lost rank's number: its next ``model.fit`` joins first."""
    from .keras import replacement
    replacement.install()


_when_replacing(_install_replacement)  # the TF layer's part of init(), see basics

#: Horovod's modules that its ``horovod.tensorflow`` carries as attributes and
#: elastic_hvd does not provide.
_HOROVOD_INTERNAL_MODULES = ("functions", "gradient_aggregation", "gradient_aggregation_eager")


class _Basics:
    """What Horovod's process-set tests read of ``hvd.mpi_ops._basics``."""

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """``{process set id: current global ranks}`` of every registered set."""
        from ..core import runtime
        comm = runtime.current("hvd.mpi_ops._basics._get_process_set_ids_and_ranks()")
        return comm.process_sets.ids_and_ranks(comm)

    def __getattr__(self, name: str) -> NoReturn:
        not_provided("horovod.tensorflow.mpi_ops._basics")(name)


class _MpiOps:
    """Horovod's ``hvd.mpi_ops`` as far as its tests read it: ``_basics``."""

    _basics = _Basics()

    def __getattr__(self, name: str) -> Any:
        not_provided("horovod.tensorflow.mpi_ops")(name)


#: ``hvd.mpi_ops`` (see :class:`_MpiOps`).
mpi_ops = _MpiOps()


def __getattr__(name: str) -> NoReturn:
    if name in _HOROVOD_INTERNAL_MODULES:  # an error naming them, as for other internals
        not_provided("horovod.tensorflow")(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
