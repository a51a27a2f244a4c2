"""Horovod's ``horovod.torch`` API, backed by the resilient core (no TensorFlow).

    import elastic_hvd.torch as hvd     # instead of: import horovod.torch as hvd

Under ``elastic-hvd-run --as-horovod`` an unchanged ``import horovod.torch as hvd`` gives
this module.
"""

import sys as _sys

if "tensorflow" in _sys.modules and "triton" not in _sys.modules:
    # TensorFlow is loaded and triton is not: loading triton now would segfault.  PyPI's
    # CUDA build of torch brings triton, and torch imports it when it first makes an
    # optimizer (torch._dynamo asks whether triton is installed); libtriton.so's LLVM
    # static constructors then run against TensorFlow's LLVM symbols (a free() of a bad
    # pointer in llvm::DebugCounter, _GLOBAL__sub_I_PassBuilder.cpp).  So torch is told
    # there is no triton here (an import of it raises ImportError): CPU tensors need none.
    _sys.modules["triton"] = None  # type: ignore[assignment]

from ..basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,  # noqa: F401
                      elastic_enabled, gloo_built, gloo_enabled, init, is_homogeneous,
                      is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from ..core.errors import (MismatchError, NotInitializedError,  # noqa: F401
                           RanksBelowMinimumError, RemoteCollectiveError)
from ..core.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from .compression import Compression  # noqa: F401
from .functions import (allgather_object, broadcast_object,  # noqa: F401
                        broadcast_optimizer_state, broadcast_parameters)
from .mpi_ops import (HorovodInternalError, ProcessSet, add_process_set,  # noqa: F401
                      allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                      broadcast_, broadcast_async, broadcast_async_, global_process_set,
                      grouped_allgather, grouped_allgather_async, grouped_allreduce,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter, grouped_reducescatter_async, join, poll,
                      reducescatter, reducescatter_async, remove_process_set,
                      sparse_allreduce_async, start_timeline, stop_timeline, synchronize)
from .data import ElasticDataLoader  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401
from . import elastic  # noqa: F401 (hvd.elastic)

from ..core import announce as _announce

#: What the announcement of a loss that no layer handled advises in a torch job, by topic.
_ADVICE = {"data": "hvd.ElasticDataLoader re-shares the data (every sample once)",
          "lr": "hvd.DistributedOptimizer rescales the learning rate (lr_policy=)"}
_announce.advise(_ADVICE)
