"""``hvd.SyncBatchNormalization``: batch normalization whose training-mode statistics
are those of the batch of every live rank together.

Each rank sums, per channel, ``[count, count * mean, M2 + count * mean**2]`` of its own
batch (``M2``: sum of squared deviations from its own mean, computed in two passes in
the input's dtype), in float64, and one resilient Sum allreduce adds them up.  The
joint mean is ``sum / count`` and the joint variance ``sum_sq / count - mean**2``
(float64, so the subtraction does not cancel what float32 would):

* every rank is weighted by its own number of samples, so uneven per-rank batches
  (the elastic sampler's last batch, an empty one) give the statistics of the joint
  batch, unlike Horovod's, which averages the ranks' means;
* the allreduce runs over the ranks alive when it runs: a rank lost inside it leaves
  the statistics of the survivors' samples, and no size is traced into a graph;
* the allreduce is differentiable (its gradient is the Sum allreduce of the
  gradients), so the gradients are those of the joint batch's statistics: a rank's
  input gradient is what one process computing batch normalization on the joint
  batch would give for its rows, for the sum of the ranks' losses.

Inference mode (``training=False``, or a frozen layer) uses the moving statistics,
as the base class does.  It subclasses whichever ``tf.keras.layers.BatchNormalization``
is current: Keras 3, or tf_keras with ``TF_USE_LEGACY_KERAS=1`` (Keras 2 on TF 2.15).
"""

import inspect
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ..core.ops import Sum
from . import ops as _ops

_BatchNormalization = tf.keras.layers.BatchNormalization
#: Keras 3's BatchNormalization._moments(inputs, mask); tf_keras's and Keras 2's
#: take (inputs, reduction_axes, keep_dims, mask=None) and a ``fused`` argument.
_KERAS3 = "reduction_axes" not in inspect.signature(_BatchNormalization._moments).parameters


def sync_moments(inputs: Any, axes: Sequence[int], keepdims: bool = False, weights: Any = None,
                 name: str = "HorovodSyncBatchNorm") -> tuple[Any, Any]:
    """Mean and variance of ``inputs`` over ``axes`` and over the batches of every live
    rank, each rank weighted by its number of samples (of ``weights``' total weight,
    ``weights`` broadcastable to ``inputs``, when given); one Sum allreduce."""
    x = tf.convert_to_tensor(inputs)
    axes = [a % x.shape.rank for a in axes]
    if weights is None:
        shape = tf.shape(x)
        n = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), x.dtype)
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(x, axes, keepdims=True), n)
        m2 = tf.reduce_sum(tf.math.squared_difference(x, local_mean), axes, keepdims=True)
        n = tf.broadcast_to(n, tf.shape(local_mean))
    else:
        w = tf.broadcast_to(tf.cast(weights, x.dtype), tf.shape(x))
        n = tf.reduce_sum(w, axes, keepdims=True)
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(w * x, axes, keepdims=True), n)
        m2 = tf.reduce_sum(w * tf.math.squared_difference(x, local_mean), axes, keepdims=True)
    n, mean64, m2 = (tf.cast(t, tf.float64) for t in (n, local_mean, m2))
    local = tf.stack([n, n * mean64, m2 + n * tf.square(mean64)])
    [total] = _ops.allreduce_tensors([local], Sum, name=name)
    count, total_sum, total_sq = tf.unstack(total)
    mean = tf.math.divide_no_nan(total_sum, count)
    variance = tf.maximum(tf.math.divide_no_nan(total_sq, count) - tf.square(mean), 0.0)
    mean, variance = tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


class SyncBatchNormalization(_BatchNormalization):  # type: ignore[valid-type,misc]  # Keras 3 or 2
    """Synchronous batch normalization: in training, the mean and variance are those of
    the joint batch of all live ranks (see :mod:`elastic_hvd.tensorflow.sync_batch_norm`).

    Horovod's constructor: ``fused=True`` is refused (the fused kernel computes its own
    statistics), and so is ``fused=None`` where it would pick that kernel (Keras 2,
    tf_keras); Keras 3 has no fused kernel and no ``fused`` argument, so there False
    and None both mean the unfused computation.  Every other argument is
    ``BatchNormalization``'s.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused or (fused is None and not _KERAS3):
            raise ValueError(f"SyncBatchNormalization does not support fused={fused} "
                             "(the fused kernel computes the statistics of this rank's "
                             "batch alone); pass fused=False.")
        if not _KERAS3:
            kwargs["fused"] = fused
        super().__init__(**kwargs)

    if _KERAS3:
        def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
            weights = None if mask is None else tf.expand_dims(tf.cast(mask, inputs.dtype), -1)
            return sync_moments(inputs, self._reduction_axes, weights=weights)
    else:
        def _moments(self, inputs: Any, reduction_axes: Sequence[int],  # type: ignore[misc]
                     keep_dims: bool, mask: Any = None) -> tuple[Any, Any]:
            weights = None if mask is None else tf.expand_dims(tf.cast(mask, inputs.dtype), -1)
            return sync_moments(inputs, reduction_axes, keepdims=keep_dims, weights=weights)


try:  # saved models name it "elastic_hvd>SyncBatchNormalization"
    SyncBatchNormalization = tf.keras.utils.register_keras_serializable(  # type: ignore[misc]
        "elastic_hvd")(SyncBatchNormalization)
except (AttributeError, ValueError):  # pragma: no cover - a Keras without the registry
    pass
