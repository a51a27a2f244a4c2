"""Stand-ins for Horovod's ``horovod.common`` modules that code written for Horovod
imports (``--as-horovod`` maps them here); elastic_hvd's own core is
:mod:`elastic_hvd.core`.  A name not provided raises an AttributeError naming it."""

from ..horovod_alias import not_provided

__getattr__ = not_provided("horovod.common")
