"""The errors of collectives as Horovod's TensorFlow ops raise them.

Horovod's TF ops fail with TensorFlow's classes: ranks that disagree on a collective
(shape, dtype, op, root rank) get ``tf.errors.FailedPreconditionError`` (its
coordinator answers them with a precondition error: ``ErrorOp`` in
horovod/common/ops/collective_operations.cc, mapped by ``ConvertStatus`` in
horovod/tensorflow/mpi_ops.cc), bad arguments ``tf.errors.InvalidArgumentError``
(``EnqueueTensorAlltoall`` in horovod/common/operations.cc, for an alltoall without
splits whose first dimension the size does not divide).

The core (no TensorFlow) raises its own classes; :func:`for_tensorflow` turns them
into the classes here, each a subclass of *both* ours and TensorFlow's.  Raising
TensorFlow's class with ours as ``__cause__`` would not do: ``except`` looks at the
class only, so ``except hvd.MismatchError`` (elastic_hvd code, which reads
``.signatures``) would stop catching what ``except tf.errors.FailedPreconditionError``
(Horovod code) catches.  With both bases, both catch the same exception.

Inside a graph (``tf.function``, TF1 sessions) an exception raised in the op's
Python function reaches the caller as a new TF error made from its message, typed
by TensorFlow's own rule: InvalidArgument for a ValueError (which the classes for
bad arguments are), Unknown otherwise -- never FailedPrecondition, which
:mod:`.ops` therefore raises by other means (see ``ops._fail_precondition``).
"""

from collections.abc import Collection, Sequence
from typing import Any

import tensorflow as tf

from ..core import errors


def _init_tensorflow_side(exc: Exception, tf_class: Any) -> None:
    """Give ``exc`` (initialized as ours) what ``tf_class`` reads: message and code.
    OpError's ``__init__`` resets the Python ``args``, so they are put back."""
    args = exc.args
    tf_class.__init__(exc, None, None, str(args[0]) if args else "")
    exc.args = args


class MismatchError(errors.MismatchError, tf.errors.FailedPreconditionError):
    """Ranks called a collective with different shapes, dtypes, ops or roots
    (Horovod raises ``tf.errors.FailedPreconditionError``)."""

    def __init__(self, signatures: Sequence[Any], names: Sequence[str] | None = None) -> None:
        errors.MismatchError.__init__(self, signatures, names)
        _init_tensorflow_side(self, tf.errors.FailedPreconditionError)


class InvalidArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """A collective's arguments failed its checks on this rank: the ValueError the
    core raised, as Horovod's ``tf.errors.InvalidArgumentError``."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        _init_tensorflow_side(self, tf.errors.InvalidArgumentError)


class RemoteInvalidArgumentError(errors.RemoteCollectiveError, InvalidArgumentError):
    """Another rank's arguments to the collective failed its checks: raised on the
    ranks whose own arguments were fine, so that every rank raises Horovod's
    ``tf.errors.InvalidArgumentError``."""

    def __init__(self, message: str, error_types: Collection[str] = ()) -> None:
        errors.RemoteCollectiveError.__init__(self, message, error_types)
        _init_tensorflow_side(self, tf.errors.InvalidArgumentError)


def _bad_argument(class_names: Collection[str]) -> bool:
    """A ValueError other than elastic_hvd's own: what the collectives' checks raise."""
    return "ValueError" in class_names and "ElasticHvdError" not in class_names


def for_tensorflow(exc: Exception) -> Exception:
    """``exc``, raised by a collective, as the class Horovod's TF op raises (still an
    instance of its own class); other errors as they are."""
    if isinstance(exc, errors.MismatchError):
        return MismatchError(exc.signatures, exc.names)
    if isinstance(exc, errors.RemoteCollectiveError):
        return RemoteInvalidArgumentError(str(exc), exc.error_types) \
            if _bad_argument(exc.error_types) else exc
    if _bad_argument([c.__name__ for c in type(exc).__mro__]):
        return InvalidArgumentError(str(exc))
    return exc
