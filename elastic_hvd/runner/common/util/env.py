"""Horovod's ``horovod.runner.common.util.env``, for its ``get_env_rank_and_size``, which
Horovod's process-set tests and scripts call before ``init()`` (``--as-horovod`` maps
the module here).  Any other name raises an AttributeError that names it as a Horovod
internal not provided.
"""

import os

from ....horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.common.util.env")


def get_env_rank_and_size() -> tuple[int, int]:
    """``(rank, size)`` of this process as the launcher set them in the environment
    (Horovod's, then Open MPI's, then PMI's variables), ``(0, 1)`` without any: the
    launch rank, which a job that lost or added ranks no longer has (ask ``hvd.rank()``)."""
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of "
                               f"{rank_var} and {size_var} found in environment")
    return 0, 1
