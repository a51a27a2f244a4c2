"""``hvd.fit``: training that survives rank loss, in one call a Keras user knows.

Why: elastic training needs a sampler, a dataset drawing from it, one
``model.fit`` per epoch (``keras_callbacks.fit_elastic``) and half a dozen
callbacks in a working order -- broadcast, learning-rate rescaling, event log,
metric averaging, checkpoint, growth, a progress bar on one rank.  ``fit``
assembles them; a callback of one of those kinds that the caller passes replaces
the default one, the caller's others run after them.  A process spawned into a
running job (``--respawn``) takes the live state inside ``fit``: the script needs
no guard for it.
"""

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from ...core import runtime
from ...core.announce import stdout_is_terminal
from ..data import ElasticData, validation_shard
from .callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback

_C = TypeVar("_C")


def fit(model: Any, data: ElasticData, epochs: int = 1, *, initial_epoch: int = 0,
        callbacks: Iterable[Any] = (), checkpoint_dir: str | None = None,
        events: str | None = None, lr_policy: str = "linear",
        validation_data: Sequence[Any] | None = None, verbose: int | None = None,
        **kwargs: Any) -> Any:
    """Train ``model`` (compiled with ``hvd.DistributedOptimizer``) on ``data`` (an
    :class:`~elastic_hvd.tensorflow.data.ElasticData`, whose ``batch_size`` is per rank,
    as in Horovod: a step trains that many samples on each live rank) for ``epochs``;
    returns Keras' ``History``.

    ``checkpoint_dir``: resume from and save to it every epoch (a job that falls
    below ``min_np`` saves and exits with status 3); before training, rank 0 says where
    it resumes and how many epochs are left, and if the checkpoint has all ``epochs``
    trained, says so and ends the process here with status 0 (a rerun of a finished
    job must not pass for a run that trained); ``events``: a JSON-lines log of
    membership changes (for TensorBoard scalars of them, pass a
    ``keras_callbacks.MembershipEventLog(path, log_dir=...)`` in ``callbacks``
    instead); ``lr_policy``: ``"linear"``, ``"sqrt"``, ``"none"`` or
    ``"constant_global_batch"`` (see ``keras_callbacks.LearningRateRescaler``);
    ``validation_data``: a tuple of arrays, split across the live ranks and averaged;
    ``verbose``: 0 (silent), 1 (a progress bar) or 2 (one line per epoch), shown by the
    current rank 0; by default 1 when the output goes to a terminal, else 2 (a bar's
    redraws would fill a log file).  Other keyword arguments go to ``model.fit``.
    """
    import keras_callbacks as kc  # the callbacks' package builds on this one

    runtime.current("hvd.fit")
    if verbose is None:
        verbose = 1 if stdout_is_terminal() else 2
    given = list(callbacks)

    def given_one(kind: type[_C]) -> _C | None:
        return next((c for c in given if isinstance(c, kind)), None)

    checkpoint = given_one(kc.ElasticCheckpoint)
    if checkpoint is None and checkpoint_dir is not None:
        checkpoint = kc.ElasticCheckpoint(checkpoint_dir, sampler=data.sampler)
        resumed_at = checkpoint.restore(model, epochs)
        if checkpoint.resumed is not None and resumed_at >= epochs:
            runtime.exit_with(0)  # nothing left to train (rank 0 said so); on every rank
        initial_epoch = max(initial_epoch, resumed_at)
    rescaler = given_one(kc.LearningRateRescaler) or kc.LearningRateRescaler(
        lr_policy, sampler=data.sampler)
    log = given_one(kc.MembershipEventLog)
    if log is None and events is not None:
        log = kc.MembershipEventLog(events)
    if log is not None and log.rescaler is None:
        log.rescaler = rescaler  # its lr_after is the rescaled rate
    if log is not None and checkpoint is not None and checkpoint.resumed is not None:
        log.record_resume(checkpoint.resumed)
    defaults = [
        given_one(BroadcastGlobalVariablesCallback) or BroadcastGlobalVariablesCallback(0),
        given_one(kc.FaultInjection) or kc.FaultInjection(), rescaler,
        *([log] if log is not None else []),
        given_one(MetricAverageCallback) or MetricAverageCallback(),
        *([checkpoint] if checkpoint is not None else []),
        given_one(kc.ElasticGrowth) or kc.ElasticGrowth(data.sampler),
        *([given_one(kc.RankZeroProgbar) or kc.RankZeroProgbar(verbose, sampler=data.sampler)]
          if verbose else []),
    ]
    everything = defaults + [c for c in given if not any(c is d for d in defaults)]
    if validation_data is not None:
        kwargs["validation_data"] = validation_shard(validation_data, data.sampler.batch_size)
    stopping = checkpoint.final_on_failure() if checkpoint is not None else \
        contextlib.nullcontext()
    with stopping:
        return kc.fit_elastic(model, data.dataset, epochs, initial_epoch=initial_epoch,
                              callbacks=everything, verbose=0, **kwargs)
