"""tf.data input over :class:`elastic_hvd.sharding.ElasticSampler`.

The generator draws each batch when the training step asks for it, and the
dataset's options forbid tf.data from prefetching, so no batch planned for an
old membership is ever trained (see the sharding module).
"""

import tensorflow as tf


def elastic_dataset(sampler, load, output_signature):
    """A dataset of one epoch per iteration: ``load(ids, weights)`` makes each batch.

    ``load`` returns what Keras expects, e.g. ``(x, y, weights)``; ``weights`` are 0
    for the padding sample a rank gets when an epoch ends with fewer samples than ranks.
    """
    def generate():
        sampler.start_epoch()
        while True:
            batch = sampler.next_batch()
            if batch is None:
                return
            yield load(*batch)

    dataset = tf.data.Dataset.from_generator(generate, output_signature=output_signature)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options)
