"""Horovod's Keras callbacks (``hvd.callbacks``), for Keras 3, tf_keras and Keras 2.

Learning rates and momentum are read and set through
:mod:`elastic_hvd.tensorflow.optimizer_state`, which works for every Keras flavour;
the membership-aware callbacks live in the top-level ``keras_callbacks`` package.
"""

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from ...core import ReduceOp, runtime
from .. import broadcast_variables, layer
from . import replacement
from ..optimizer_state import (get_lr, momentum_correct, momentum_restore,
                               optimizer_variables, set_lr)
from ...common.util import is_version_greater_equal_than  # noqa: F401 (Horovod's module has it)


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Broadcast the model's and optimizer's variables from ``root_rank`` once.

    It runs at the start of training for what exists then, and again at the end
    of the first batch, when the optimizer's slots exist, as Horovod does.  Once
    only: a second ``fit()`` with the same callback (``fit_elastic`` runs one per
    epoch) does not broadcast again, so ranks that diverged are not silently
    re-synchronised (a process that joins a running job receives the live state
    instead and sets ``broadcast_done``).
    """

    joined_at: int | None

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = {id(v) for v in local_variables or []}
        self.broadcast_done = False
        self.joined_at = None  # the epoch at whose start this process replaced a lost rank
        self.duties: replacement.RankZeroDuties | None = None

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: it is this rank's own."""
        self.local_variables.add(id(var))

    def _broadcast(self) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += optimizer_variables(optimizer)
        broadcast_variables([v for v in variables if id(v) not in self.local_variables],
                            self.root_rank)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            if self.duties is None:  # every rank at its first fit (a joiner has broadcast_done)
                self.duties = replacement.RankZeroDuties(replacement.fit_callbacks(self))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True
        replacement.refill_at_step_end()  # a plain script's --respawn (see .replacement)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Where a plain script's hot spare is adopted (see :mod:`.replacement`)."""
        if self.joined_at != epoch:
            replacement.adopt_at_epoch_start(self.model, epoch)


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Average the epoch's metrics (the ``logs`` dict) over the live ranks."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = runtime.current("MetricAverageCallback").allreduce(values, op=ReduceOp.AVERAGE)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch.

    ``multiplier`` is a constant or a function of the (fractional, unless
    ``staircase``) epoch.  With ``momentum_correction`` the momentum is scaled by
    new_lr / old_lr for one batch after a change, as in Goyal et al. (2017).  The
    rate also carries the factor by which ``keras_callbacks.LearningRateRescaler``
    rescaled it after membership changes.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _steps(self) -> int:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") or 1
        return self.steps_per_epoch

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = get_lr(optimizer)
        new_lr = (self.initial_lr * self.multiplier(epoch)
                  * layer.session_state("LearningRateScheduleCallback").lr_factor)
        set_lr(optimizer, new_lr)
        if self.momentum_correction:
            momentum_correct(optimizer, old_lr, new_lr)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not self.staircase and self._in_range(self.current_epoch):
            self._adjust(self.current_epoch + batch / self._steps())

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        momentum_restore(self.model.optimizer)  # the corrected momentum served one step

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the lr from initial_lr / size to initial_lr over ``warmup_epochs`` (Goyal et al.)."""

    end_epoch: int  # warmup_epochs: never None here

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = runtime.current("LearningRateWarmupCallback").size
            epoch += 1.0 / self._steps()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and \
                runtime.current("LearningRateWarmupCallback").rank == 0:
            # Keras's verbose output (the user's ``verbose``), as its own callbacks print it
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(tf.keras.callbacks.ModelCheckpoint):
    """Keep the best model (by ``monitor``), written by the lowest live rank only."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        if filepath is None:
            filepath = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)

    def _save_model(self, *args: Any, **kwargs: Any) -> Any:
        if runtime.current("BestModelCheckpoint").rank == 0:
            return super()._save_model(*args, **kwargs)
