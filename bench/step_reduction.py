"""One step's gradient reduction alone: 200 tensors (100 of 64x64, 100 of 64) reduced by
``ops.reduce_together(..., commit=True)`` -- what a ``model.fit`` step with 200 variables
runs -- inside a ``tf.function``, 300 steps, median of 5; rank 0 prints microseconds per
step and the library it imported.

    elastic-hvd-run -np 2 python bench/step_reduction.py
    elastic-hvd-run -np 2 -x PYTHONPATH=T python bench/step_reduction.py   # tree T's library
                                                                             # (run it from T)
"""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import elastic_hvd.tensorflow as hvd  # noqa: E402
from elastic_hvd.tensorflow import ops  # noqa: E402


def main():
    hvd.init()
    tensors = [tf.ones([64, 64]) for _ in range(100)] + [tf.ones([64]) for _ in range(100)]
    step = tf.function(lambda: ops.reduce_together([tensors], [], hvd.Sum, commit=True))
    for _ in range(20):
        step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(300):
            step()
        times.append((time.perf_counter() - start) / 300 * 1e6)
    if hvd.rank() == 0:
        print(f"step_reduction ({os.path.dirname(os.path.dirname(hvd.__file__))}): "
              f"{statistics.median(times):.0f} us per step", flush=True)


if __name__ == "__main__":
    main()
