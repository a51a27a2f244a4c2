"""elastic-hvd-run, the launcher; under ``--as-horovod`` also ``horovod.runner``, whose
names it lacks raise an AttributeError naming them (see :mod:`elastic_hvd.horovod_alias`)."""

from ..horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner")
