"""The resilient-communicator core of elastic_hvd (MPI + ULFM, no TensorFlow).

    from elastic_hvd import core
    comm = core.init()
    total = comm.allreduce(np.ones(4), op=core.Sum)   # survives rank loss

See :mod:`.comm` for how a collective gets one outcome on every survivor.
"""

from .comm import ResilientComm
from .errors import (ElasticHvdError, FaultInjected, MismatchError, NotInitializedError,
                     RanksBelowMinimumError, RemoteCollectiveError)
from .membership import MembershipEvent
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runtime import current, init, is_initialized, shutdown

__all__ = [
    "ResilientComm", "ElasticHvdError", "FaultInjected", "MismatchError",
    "NotInitializedError", "RanksBelowMinimumError", "RemoteCollectiveError",
    "MembershipEvent", "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "is_initialized", "current", "shutdown",
]
