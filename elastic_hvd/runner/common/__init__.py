"""Stand-in for Horovod's ``horovod.runner.common`` package (``--as-horovod`` maps it
here), for the helpers that code written for Horovod imports from it.  A name not
provided raises an AttributeError naming it."""

from ...horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.common")
