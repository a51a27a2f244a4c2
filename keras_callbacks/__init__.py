"""Keras callbacks that react to membership changes (ranks lost or gained).

* :class:`LearningRateRescaler` — rescale the learning rate (linear, sqrt, none, or
  keep the global batch constant);
* :class:`MembershipEventLog` — JSON lines and TensorBoard scalars (the console line of
  each change comes from the core, for every script);
* :class:`ElasticCheckpoint` — atomic checkpoints by the current lowest rank, resume,
  and a final checkpoint when too few ranks are left;
* :class:`RankZeroProgbar` — the progress bar on exactly one rank;
* :class:`FaultInjection` — fires ``ELASTIC_HVD_FAULTS`` step faults (tests, demos);
* :class:`ElasticGrowth` — replace lost ranks / add new ones and hand them the live state;
* :func:`fit_elastic` — ``model.fit`` for elastic datasets (one ``fit`` per epoch).
"""

from .checkpoint import EXIT_BELOW_MIN_NP, EXIT_SAVES_FAILED, ElasticCheckpoint
from .event_log import MembershipEventLog
from .faults import FaultInjection
from .fit import fit_elastic
from .growth import ElasticGrowth
from .lr import LearningRateRescaler
from .progress import RankZeroProgbar

__all__ = ["LearningRateRescaler", "MembershipEventLog", "ElasticCheckpoint", "RankZeroProgbar",
           "FaultInjection", "ElasticGrowth", "fit_elastic", "EXIT_BELOW_MIN_NP",
           "EXIT_SAVES_FAILED"]
