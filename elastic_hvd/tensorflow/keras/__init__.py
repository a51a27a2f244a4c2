"""Horovod's ``horovod.tensorflow.keras`` API for Keras 3, tf_keras and Keras 2.

    import elastic_hvd.tensorflow.keras as hvd
    # instead of: import horovod.tensorflow.keras as hvd

``tf.keras`` decides which Keras this targets: Keras 3 on TF >= 2.16, tf_keras with
``TF_USE_LEGACY_KERAS=1``, Keras 2 on TF 2.15.
"""

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import tensorflow as tf

from ... import tensorflow as _tf_api
from ...basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,  # noqa: F401
                       elastic_enabled, gloo_built, gloo_enabled, init, is_homogeneous,
                       is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                       mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from .. import (Adasum, Average, SyncBatchNormalization, Compression, Max, Min, Product, ProcessSet,  # noqa: F401
                Sum, add_process_set, allgather_object, broadcast_object, global_process_set,
                remove_process_set, start_timeline, stop_timeline)
from ..gradients import distribute_in_place
from ...common.util import is_version_greater_equal_than  # noqa: F401
from ..data import ElasticData  # noqa: F401
from . import callbacks, elastic  # noqa: F401
from .elastic_fit import fit  # noqa: F401

if TYPE_CHECKING:  # (not public names of this module)
    import os

    from ..compression import Compressor


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "",
                         compression: "type[Compressor]" = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that ``model.fit`` averages gradients over the live ranks."""
    return _tf_api.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "",
                                compression: "type[Compressor]" = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                groups: int | Sequence[Sequence[Any]] | None = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Iterable[Any] | None = None,
                                scale_local_gradients: bool = True) -> Any:
    """A DistributedOptimizer whose ``local_layers`` keep their gradients local."""
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                   sparse_as_dense, gradient_predivide_factor, op,
                                   backward_passes_per_step, average_aggregated_gradients,
                                   0, groups, process_set, scale_local_gradients)
    for layer in local_layers or []:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: int | None = None,
              compression: "type[Compressor]" = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """:func:`elastic_hvd.tensorflow.allreduce` of ``value`` (anything a tensor can be
    made of); default op Average over the live ranks."""
    return _tf_api.allreduce(tf.convert_to_tensor(value), average=average, op=op, name=name,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             compression=compression, process_set=process_set)


def allgather(value: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """:func:`elastic_hvd.tensorflow.allgather` of ``value``."""
    return _tf_api.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """:func:`elastic_hvd.tensorflow.broadcast` of ``value``."""
    return _tf_api.broadcast(tf.convert_to_tensor(value), root_rank, name=name,
                             process_set=process_set)


def reducescatter(value: Any, name: str | None = None, op: int = Average,
                  process_set: ProcessSet = global_process_set) -> Any:
    """:func:`elastic_hvd.tensorflow.reducescatter` of ``value``."""
    return _tf_api.reducescatter(tf.convert_to_tensor(value), op=op, name=name,
                                 process_set=process_set)


def broadcast_global_variables(root_rank: int) -> NoReturn:
    """Always raises RuntimeError: it is for TF1 sessions; with Keras use
    ``callbacks.BroadcastGlobalVariablesCallback``."""
    raise RuntimeError("broadcast_global_variables is for TF1 sessions; with Keras use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")


def load_model(filepath: "str | os.PathLike[str]", custom_optimizers: Any = None,
               custom_objects: dict[str, Any] | None = None,
               compression: "type[Compressor]" = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a Keras model and wrap its optimizer in a DistributedOptimizer."""
    model = tf.keras.models.load_model(filepath, custom_objects=custom_objects)
    if getattr(model, "optimizer", None) is not None:
        distribute_in_place(model.optimizer, compression)
    return model
