"""Learning-rate rescaling when the world changes size.

Scripts scale the learning rate with the world size at start (``lr * hvd.size()``,
Goyal et al.'s linear scaling rule).  When ranks are lost or gained the global
batch changes, so the rate must follow:

* ``"linear"`` (default): lr *= new_size / old_size;
* ``"sqrt"``: lr *= sqrt(new_size / old_size);
* ``"none"``: leave it;
* ``"constant_global_batch"``: keep lr and the global batch: the per-rank batch of the
  given :class:`~elastic_hvd.sharding.ElasticSampler` grows to ``initial global batch / size``.

The factors are :mod:`elastic_hvd.lr_policy`'s (PyTorch's DistributedOptimizer applies
them too).  The cumulative factor is the Keras layer's, kept in the training session
(``elastic_hvd.tensorflow.layer.session_state().lr_factor``),
where ``hvd.callbacks.LearningRateScheduleCallback`` / ``…WarmupCallback`` apply it
too, so a schedule that sets the rate every epoch keeps the rescaling.  With
momentum correction, momentum is scaled by new_lr / old_lr for the next step, as
the schedule callbacks do (one correction per optimizer, however many ask).
"""

from typing import TYPE_CHECKING, Any

from elastic_hvd import lr_policy
from elastic_hvd.core import announce
from elastic_hvd.lr_policy import POLICIES, scale_factor  # noqa: F401 (kc.lr.POLICIES)
from elastic_hvd.tensorflow import layer
from elastic_hvd.tensorflow.keras.callbacks import (get_lr, momentum_correct, momentum_restore,
                                                    set_lr)

from .base import LEARNING_RATE, MembershipCallback

if TYPE_CHECKING:
    from elastic_hvd.core.membership import MembershipEvent
    from elastic_hvd.sharding import ElasticSampler

class LearningRateRescaler(MembershipCallback):
    """Rescale the learning rate at each membership change by ``policy`` (see the module doc)."""

    ORDER = LEARNING_RATE

    def __init__(self, policy: str = "linear", sampler: "ElasticSampler | None" = None,
                 momentum_correction: bool = True) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if policy == "constant_global_batch" and sampler is None:
            raise ValueError("policy 'constant_global_batch' needs the ElasticSampler (sampler=)")
        self.policy, self.sampler = policy, sampler
        self.momentum_correction = momentum_correction
        self.changes: list[tuple[int, float, float]] = []  # (event sequence, lr before, lr after)
        self._global_batch: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.sampler is not None and self._global_batch is None:
            self._global_batch = self.sampler.batch_size * self.comm.size
        announce.effect("lr", self._announced)
        super().on_train_begin(logs)

    def _announced(self, event):
        """What this rescaling does about a membership change, for the console line."""
        if self.policy == "constant_global_batch":
            return (f"the per-rank batch becomes {-(-self._global_batch // event.new_size)} so "
                    "that the global batch and the learning rate stay")
        return lr_policy.describe(self.policy, event)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        momentum_restore(self.model.optimizer)  # the corrected momentum served one step
        super().on_train_batch_end(batch, logs)

    def live_state(self) -> dict[str, Any]:
        return {**super().live_state(), "global_batch": self._global_batch}

    def load_live_state(self, state: dict[str, Any]) -> None:
        super().load_live_state(state)
        self._global_batch = state["global_batch"]

    def handle(self, event: "MembershipEvent") -> None:
        optimizer = self.model.optimizer
        before = get_lr(optimizer)
        factor = scale_factor(self.policy, event.old_size, event.new_size)
        after = before * factor
        if factor != 1.0:
            set_lr(optimizer, after)
            layer.session_state().lr_factor *= factor
            if self.momentum_correction:
                momentum_correct(optimizer, before, after)
        if self.policy == "constant_global_batch":
            self.sampler.batch_size = -(-self._global_batch // event.new_size)  # type: ignore
        self.changes.append((event.sequence, before, after))
