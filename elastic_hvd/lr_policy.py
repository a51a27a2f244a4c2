"""The learning-rate policy for the live size, framework-neutral (Keras and PyTorch apply it).

Scripts scale the learning rate with the world size at start (``lr * hvd.size()``,
Goyal et al.'s linear scaling rule).  When ranks are lost or gained the global batch
changes, so the rate follows by a factor per membership change:

* ``"linear"``: new_size / old_size;
* ``"sqrt"``: sqrt(new_size / old_size);
* ``"none"``: 1 (the rate stays);
* ``"constant_global_batch"``: 1 (the per-rank batch grows instead; Keras's
  ``LearningRateRescaler`` with its sampler).

The front ends apply the factor to their optimizer (``keras_callbacks.lr`` for Keras,
``elastic_hvd.torch``'s ``DistributedOptimizer``) and say what they do through
:func:`describe` in the change's announcement (``core.announce.effect("lr", ...)``).
"""

import math

from .core.membership import MembershipEvent

POLICIES = ("linear", "sqrt", "none", "constant_global_batch")


def check(policy: str, allowed: tuple[str, ...] = POLICIES) -> str:
    """``policy``, or ValueError naming the ``allowed`` ones."""
    if policy not in allowed:
        raise ValueError(f"lr_policy must be one of {allowed}, not {policy!r}")
    return policy


def scale_factor(policy: str, old_size: int, new_size: int) -> float:
    """The factor by which ``policy`` scales the rate when the size goes from
    ``old_size`` to ``new_size``."""
    if policy == "linear":
        return new_size / old_size
    if policy == "sqrt":
        return math.sqrt(new_size / old_size)
    return 1.0


def describe(policy: str, event: MembershipEvent, when: str = "at the next step") -> str:
    """What ``policy`` does about ``event``, for the change's announcement."""
    factor = scale_factor(policy, event.old_size, event.new_size)
    if factor == 1.0:
        return f"the learning rate stays (lr_policy {policy!r})"
    return f"the learning rate is scaled by {factor:.3g} ({policy}) {when}"
