"""``horovod.keras`` for scripts that import it: ``elastic_hvd.tensorflow.keras`` with
horovod.keras's own parameter order for the optimizers."""

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..tensorflow.keras import *  # noqa: F401,F403
from ..tensorflow.keras import Adasum, load_model  # noqa: F401
# Below, horovod.keras's own modules and optimizers replace the names the * import gave.
from . import callbacks, elastic  # type: ignore[no-redef]  # noqa: F401
from ..tensorflow.keras import DistributedOptimizer as _DistributedOptimizer
from ..tensorflow.keras import PartialDistributedOptimizer as _PartialDistributedOptimizer
from ..tensorflow.ops import Average, ProcessSet, global_process_set
from ..tensorflow.compression import Compression

if TYPE_CHECKING:  # (not a public name of this module)
    from ..tensorflow.compression import Compressor


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # type: ignore[no-redef]
                         device_dense: str = "", device_sparse: str = "",
                         compression: "type[Compressor]" = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """``elastic_hvd.tensorflow.keras.DistributedOptimizer`` with horovod.keras's
    parameter order (no ``backward_passes_per_step``, ``average_aggregated_gradients``)."""
    return _DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                 sparse_as_dense, gradient_predivide_factor, op,
                                 num_groups=num_groups, groups=groups, process_set=process_set,
                                 scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # type: ignore[no-redef]
                                device_dense: str = "", device_sparse: str = "",
                                compression: "type[Compressor]" = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                groups: int | Sequence[Sequence[Any]] | None = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Iterable[Any] | None = None,
                                scale_local_gradients: bool = True) -> Any:
    """``elastic_hvd.tensorflow.keras.PartialDistributedOptimizer`` with horovod.keras's
    parameter order (no ``backward_passes_per_step``, ``average_aggregated_gradients``)."""
    return _PartialDistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, groups=groups, process_set=process_set,
        local_layers=local_layers, scale_local_gradients=scale_local_gradients)
