"""Make ``import horovod.*`` resolve to elastic_hvd, for unchanged Horovod scripts.

    import elastic_hvd.horovod_alias; elastic_hvd.horovod_alias.install()
    import horovod.tensorflow.keras as hvd      # -> elastic_hvd.tensorflow.keras
    import horovod.torch as hvd                 # -> elastic_hvd.torch

``elastic-hvd-run --as-horovod python train.py`` does the same before the script
starts.  Nothing named ``horovod`` is installed: an import hook placed first on
``sys.meta_path`` maps the module names, so it also wins over a real Horovod,
and says so.

Besides the API, the helper modules that code written for Horovod imports
(``horovod.tensorflow.util``, ``horovod.common.util``, ``horovod.runner.util.threads``,
``horovod.runner.common.util.env``)
map to elastic_hvd's stand-ins, which hold their cheap, harmless names; asking one
(or a package above it) for any other name raises an AttributeError naming it as a
Horovod internal that elastic_hvd does not provide (:func:`not_provided`).  Every
aliased package is an elastic_hvd package of the same shape, because importing
``horovod.a.b`` sets ``b`` on whatever ``horovod.a`` is.
"""

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from typing import NoReturn
from .log import get_logger

_log = get_logger(__name__)

ALIASES = {
    "horovod": "elastic_hvd",
    "horovod.tensorflow": "elastic_hvd.tensorflow",
    "horovod.tensorflow.elastic": "elastic_hvd.tensorflow.elastic",
    "horovod.tensorflow.keras": "elastic_hvd.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "elastic_hvd.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "elastic_hvd.tensorflow.keras.elastic",
    "horovod.keras": "elastic_hvd.keras",
    "horovod.keras.callbacks": "elastic_hvd.keras.callbacks",
    "horovod.keras.elastic": "elastic_hvd.keras.elastic",
    "horovod.torch": "elastic_hvd.torch",
    "horovod.torch.compression": "elastic_hvd.torch.compression",
    "horovod.torch.elastic": "elastic_hvd.torch.elastic",
    "horovod.torch.functions": "elastic_hvd.torch.functions",
    "horovod.torch.mpi_ops": "elastic_hvd.torch.mpi_ops",
    "horovod.torch.optimizer": "elastic_hvd.torch.optimizer",
    "horovod.tensorflow.util": "elastic_hvd.tensorflow.util",
    "horovod.common": "elastic_hvd.common",
    "horovod.common.util": "elastic_hvd.common.util",
    "horovod.runner": "elastic_hvd.runner",
    "horovod.runner.util": "elastic_hvd.runner.util",
    "horovod.runner.util.threads": "elastic_hvd.runner.util.threads",
    "horovod.runner.common": "elastic_hvd.runner.common",
    "horovod.runner.common.util": "elastic_hvd.runner.common.util",
    "horovod.runner.common.util.env": "elastic_hvd.runner.common.util.env",
}


def not_provided(horovod_module: str) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for the stand-in of ``horovod_module``: a name it
    lacks raises an AttributeError that names the Horovod internal."""
    def __getattr__(name: str) -> NoReturn:
        raise AttributeError(f"{horovod_module}.{name} is a part of Horovod that elastic_hvd "
                             f"does not provide")
    return __getattr__


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> ModuleSpec | None:
        if name in ALIASES:
            return importlib.util.spec_from_loader(name, self)
        if name.split(".")[0] == "horovod":
            raise ImportError(f"{name} has no elastic_hvd equivalent (horovod is aliased to "
                              f"elastic_hvd; supported: {', '.join(sorted(ALIASES))})")
        return None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return importlib.import_module(ALIASES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(quiet: bool = False) -> str:
    """Install the alias (idempotent); returns a line saying which Horovod is in use."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
    try:
        real = f"; the installed Horovod {importlib.metadata.version('horovod')} is NOT used"
    except importlib.metadata.PackageNotFoundError:
        real = ""
    message = f"elastic_hvd: `import horovod` resolves to elastic_hvd{real}"
    if not quiet:
        _log.info(message)
    return message
