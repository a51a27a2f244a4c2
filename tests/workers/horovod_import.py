"""A Horovod script's opening, as users write it (the rest never runs without Horovod):
launched without --as-horovod where Horovod is not installed, its import fails
(tests/test_launcher_flags.py; tests/workers/horovod_script.py is a whole one)."""

import horovod.tensorflow.keras as hvd

hvd.init()
