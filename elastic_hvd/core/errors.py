"""Exceptions of elastic_hvd.

Every exception a collective raises is raised on *every* surviving rank (the
outcome of each collective is agreed on), so a script can handle them without
fearing that another rank went on without it.
"""


#: Why only the global process set exists (the message of every refusal).
NO_PROCESS_SETS = (
    "process sets other than the global one (all live ranks) are not supported by "
    "elastic_hvd: every set would need its own resilient communicator, re-derived from "
    "the repaired global one after each loss, and its own agreement on every collective; "
    "use the global process set (leave process_set= out)")

#: Why Adasum is refused.
NO_ADASUM = (
    "op=Adasum is not supported by elastic_hvd: Adasum is its own algorithm (a recursive "
    "pairwise exchange, not an allreduce) that the resilient core does not implement, and "
    "its pairing needs a power-of-2 number of ranks, which a loss breaks; use op=Average "
    "or op=Sum")


class ElasticHvdError(RuntimeError):
    """Base class of elastic_hvd's own errors."""


class NotInitializedError(ElasticHvdError, ValueError):
    """An API that needs the communicator was called before ``init()``."""

    def __init__(self, what="this call"):
        super().__init__(
            f"elastic_hvd has not been initialized; call hvd.init() before {what}.")


class RanksBelowMinimumError(ElasticHvdError):
    """Survivors of a failure fell below ``min_np``: training cannot go on.

    Raised on every survivor by the collective that noticed it, and by every
    collective after it.  The repaired communicator stays usable for a last
    checkpoint.
    """

    def __init__(self, size, min_np, lost):
        self.size, self.min_np, self.lost = size, min_np, tuple(lost)
        super().__init__(
            f"only {size} rank(s) left after losing original rank(s) {list(self.lost)}; "
            f"min_np is {min_np}")


class MismatchError(ElasticHvdError, ValueError):
    """Ranks called a collective with different shapes, dtypes, ops or roots."""

    def __init__(self, signatures):
        self.signatures = signatures
        lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(signatures))
        super().__init__("ranks disagree on the collective they called:\n" + lines)


class RemoteCollectiveError(ElasticHvdError):
    """A collective failed because of an error raised on another rank.

    ``error_types``: the names of that error's class and of its bases (empty if the
    rank was lost before it could say), so that a framework layer can tell which
    kind of error it was -- elastic_hvd.tensorflow raises a bad argument there as
    TensorFlow's InvalidArgumentError on every rank, as Horovod does.
    """

    def __init__(self, message, error_types=()):
        super().__init__(message)
        self.error_types = tuple(error_types)


class FaultInjected(ElasticHvdError):
    """Raised by fault injection when asked to raise instead of sending a signal."""


class JoinOrderError(ElasticHvdError):
    """A joining process called a collective before it received the live state."""

    def __init__(self, signature):
        super().__init__(
            f"this process was spawned into a running job and called {signature[0]!r} before "
            "receiving the live training state; a joining process must skip start-up "
            "collectives (guard them with `if not comm.joining:`) and reach training "
            "(hvd.fit or keras_callbacks.fit_elastic) first")
