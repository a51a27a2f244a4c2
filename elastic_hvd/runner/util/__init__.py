"""Stand-ins for Horovod's ``horovod.runner.util`` modules that Horovod's helpers import
(``--as-horovod`` maps them here).  A name not provided raises an AttributeError naming it."""

from ...horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.util")
