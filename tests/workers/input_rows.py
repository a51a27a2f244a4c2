"""ElasticData's other inputs, in one process (issue 44): from_dataset without reading the
dataset into memory, map=, validation_shard with load=.

    python input_rows.py

Reports, per case, the sample ids each epoch gave (as the elements themselves carry them)
and whether every element arrived with its own content.
"""

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
from elastic_hvd.tensorflow.data import DatasetRows, validation_shard  # noqa: E402

N = 70


def epochs(data, count=2):
    """[sorted ids of each epoch], checking that x == 3 * id in every element."""
    seen = []
    for _ in range(count):
        ids = []
        for x, y, weights in data.dataset:
            y = y.numpy()
            assert np.allclose(x.numpy(), 3.0 * y.reshape(-1, *[1] * (x.ndim - 1))), (x, y)
            ids += y[weights.numpy() > 0].tolist()
        seen.append(sorted(ids))
    return seen


def main():
    hvd.init()
    results = {}
    base = tf.data.Dataset.from_tensor_slices(np.arange(N, dtype=np.int64))
    # random access (range -> map): kept, read by index
    mapped = base.map(lambda i: (tf.fill([2, 3], tf.cast(3 * i, tf.float32)), i))
    data = hvd.ElasticData.from_dataset(mapped, 8, seed=4)
    results["random_access"] = {"epochs": epochs(data), "arrays": [a.shape for a in data.arrays],
                                "count": len(data)}
    # no random access (filter): spilled to a file once, read by index
    odd = mapped.filter(lambda x, i: i % 2 == 1)
    rows = DatasetRows(odd)
    data = hvd.ElasticData.from_dataset(odd, 8, seed=4)
    results["spilled"] = {"epochs": epochs(data), "count": len(data),
                          "spill_file": rows._file is not None}
    # map=: a per-sample function of TF ops over each drawn batch
    ids = np.arange(N)
    data = hvd.ElasticData((ids,), 8, seed=4,
                           map=lambda i: (tf.cast(3 * i, tf.float32) * tf.ones([4]), i))
    results["map"] = {"epochs": epochs(data)}
    # validation_shard with load=, loaded ahead
    shard = validation_shard((ids,), 16, load=lambda i: (3.0 * i.astype(np.float32), i))
    got = []
    for _ in range(2):
        for x, y in shard:
            assert np.allclose(x.numpy(), 3.0 * y.numpy())
            got.append(y.numpy().tolist())
    results["validation"] = {"batches": got}
    report.write(0, **results)


if __name__ == "__main__":
    main()
