"""One order of the collectives of a graph, the same on every rank.

Each collective is a kernel that blocks until the other ranks run the same
collective.  TF's executor starts independent ops in any order, on several threads:
two allgathers fetched in one ``session.run`` may start in one order on rank 0 and
in the other on rank 1, and each rank then waits in a different collective
(``MismatchError``).  Horovod's kernels are asynchronous and matched by name;
kernels of ``tf.numpy_function`` are not: a kernel waiting for its turn holds an
inter-op thread, and when every thread of every rank waits for a collective that
no other rank has started (two threads here, nine collectives), nothing moves.
(Measured: matching by name with waiting kernels hung this way at once.)  So the
order is fixed in the graph, before the executor sees it:

* ``tf.function`` (and the conds and loops in it): TF's automatic control
  dependencies already chain every stateful op without resource inputs in creation
  order (``last_write_to_resource[None]`` in ``auto_control_deps.py``); nothing to add.
* a plain (TF1) graph: each new collective gets a control dependency on the latest
  collective of the graph that it may force to run: one whose ancestors need
  nothing that the new one does not need already (no placeholder, iterator or
  other stateful op of its own; variables, constants and the legacy random ops are
  free).  Fetching the new collective then runs that earlier one too, but never
  consumes an input or needs a feed it would not have.  A legacy random op
  (``tf.random.uniform``, ``tf.random.normal``, ...) keeps its generator in its own
  kernel: forcing it only draws numbers that nobody fetched and moves its own
  stream on, the same on every rank (Horovod's "fused" tests feed each collective
  from one).  Ops of a ``tf.random.Generator`` share a generator's state with other
  ops and are not free.  Collectives fed from different placeholders or iterators
  stay unordered (fetching them in one run can still mismatch), and so do
  collectives inside ``tf.compat.v1.while_loop``.
* except broadcasts into variables (``broadcast_variables``, and the ``broadcast_``,
  ``broadcast_global_variables``, hook and callbacks built on it): a script runs
  one by itself, to make the ranks' variables equal.  In the chain, every fetch of
  a later collective would broadcast the variables again (each step of a training
  op built after it; Horovod's successive ``broadcast_`` fetches: 48 would run 1176
  broadcasts), and the broadcast would run an earlier training op's gradient
  reduction.  So a broadcast into variables only follows another one, built before
  it with no collective of the graph run in between (built together, they may be
  fetched together); fetched in one run with other collectives, it is not ordered
  with them.

Every rank builds the same graph and runs the same collectives, so creation order
-- hence the chain -- and the count of runs are the same on every rank.  Eager code
runs collectives in program order.
"""

import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import tensorflow as tf

from . import layer

#: Held while a graph's collective runs: unordered ones never share MPI from two threads.
lock = threading.Lock()

_FREE = frozenset(("Const", "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp",
                   "Identity", "Fill", "NoOp"))
_FEEDS = frozenset(("Placeholder", "PlaceholderV2"))
#: Stateful only through a generator of their own kernel (see the module docstring).
_OWN_RANDOM = frozenset(("RandomUniform", "RandomUniformInt", "RandomStandardNormal",
                         "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomGamma",
                         "RandomPoisson", "RandomPoissonV2", "RandomShuffle", "Multinomial"))


def needed() -> bool:
    """Whether a collective built now must be chained: in a plain (TF1) graph, not
    in a function graph (whose automatic control dependencies order it already)."""
    graph = tf.compat.v1.get_default_graph()
    return (layer.state().order_graph_collectives
            and not getattr(graph, "building_function", False))


def _ancestors(ops: Iterable[Any]) -> dict[str, Any]:
    seen, todo = {}, list(ops)
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen[op.name] = op
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def _needs(ancestors: dict[str, Any], collectives: Collection[str]) -> set[str]:
    """Names of the ops among ``ancestors`` that make running them more than a
    computation: feeds and stateful ops (not variables, not a random op's own
    generator, not our own collectives)."""
    return {name for name, op in ancestors.items()
            if name not in collectives and op.type not in _FREE and op.type not in _OWN_RANDOM
            and (op.type in _FEEDS or op._is_stateful)}


class _Chain:
    """A graph's collectives in creation order, and how many times any of them ran."""

    collectives: list["Collective"]
    runs: int

    def __init__(self) -> None:
        self.collectives, self.runs = [], 0


class Collective:
    """A collective being built in a TF1 graph, as the graph's chain sees it.

    ``into_variables``: a broadcast into variables (see the module docstring)."""

    chain: _Chain
    #: The op of its py_func, once recorded (None before).
    op: Any

    def __init__(self, into_variables: bool = False) -> None:
        graph = tf.compat.v1.get_default_graph()
        # Kept on the graph (not in a module-level map, whose entries the ops would keep
        # alive through op.graph): it goes when the graph goes.
        self.chain = getattr(graph, "_elastic_hvd_chain", None)  # type: ignore[assignment]
        if self.chain is None:
            self.chain = graph._elastic_hvd_chain = _Chain()
        self.into_variables = into_variables
        self.built_at = self.chain.runs
        self.op = None

    def predecessor(self, inputs: Sequence[Any]) -> Any:
        """The collective this one, with ``inputs``, must follow, or None."""
        chain = self.chain.collectives
        if not chain:
            return None
        graph = tf.compat.v1.get_default_graph()
        mine = _ancestors([t.op for t in inputs])
        names = {c.op.name for c in chain}
        context = getattr(graph, "_get_control_flow_context", lambda: None)()
        if context is not None:  # a TF1 cond or while_loop: edges may not cross its frame
            return None
        for previous in reversed(chain):
            if previous.op.name in mine:
                return None  # already ordered by data
            if previous.op._control_flow_context is not None:
                continue
            if previous.into_variables != self.into_variables or (
                    self.into_variables and previous.built_at != self.chain.runs):
                continue
            if _needs(_ancestors([previous.op]), names) <= set(mine):
                return previous.op
        return None

    def record(self, op: Any) -> None:
        """This collective is ``op`` (its py_func): the latest of its graph."""
        self.op = op
        self.chain.collectives.append(self)

    def ran(self) -> None:
        """Called by its kernel, each time it runs."""
        self.chain.runs += 1
