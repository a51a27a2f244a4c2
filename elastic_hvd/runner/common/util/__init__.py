"""Stand-ins for Horovod's ``horovod.runner.common.util`` modules (``--as-horovod`` maps
them here).  A name not provided raises an AttributeError naming it."""

from ....horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.common.util")
