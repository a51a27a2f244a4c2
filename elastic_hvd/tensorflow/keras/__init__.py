"""Horovod's ``horovod.tensorflow.keras`` API for Keras 3, tf_keras and Keras 2.

    import elastic_hvd.tensorflow.keras as hvd
    # instead of: import horovod.tensorflow.keras as hvd

``tf.keras`` decides which Keras this targets: Keras 3 on TF >= 2.16, tf_keras with
``TF_USE_LEGACY_KERAS=1``, Keras 2 on TF 2.15.
"""

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


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so that ``model.fit`` averages gradients over the live ranks."""
    return _tf_api.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer whose ``local_layers`` keep their gradients local."""
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                   sparse_as_dense, gradient_predivide_factor, op,
                                   backward_passes_per_step, average_aggregated_gradients,
                                   0, groups, process_set, scale_local_gradients)
    for layer in local_layers or []:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set):
    """:func:`elastic_hvd.tensorflow.allreduce` of ``value`` (anything a tensor can be
    made of); default op Average over the live ranks."""
    return _tf_api.allreduce(tf.convert_to_tensor(value), average=average, op=op, name=name,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             compression=compression, process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """:func:`elastic_hvd.tensorflow.allgather` of ``value``."""
    return _tf_api.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """:func:`elastic_hvd.tensorflow.broadcast` of ``value``."""
    return _tf_api.broadcast(tf.convert_to_tensor(value), root_rank, name=name,
                             process_set=process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """:func:`elastic_hvd.tensorflow.reducescatter` of ``value``."""
    return _tf_api.reducescatter(tf.convert_to_tensor(value), op=op, name=name,
                                 process_set=process_set)


def broadcast_global_variables(root_rank):
    """Always raises RuntimeError: it is for TF1 sessions; with Keras use
    ``callbacks.BroadcastGlobalVariablesCallback``."""
    raise RuntimeError("broadcast_global_variables is for TF1 sessions; with Keras use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a Keras model and wrap its optimizer in a DistributedOptimizer."""
    model = tf.keras.models.load_model(filepath, custom_objects=custom_objects)
    if getattr(model, "optimizer", None) is not None:
        distribute_in_place(model.optimizer, compression)
    return model
