"""elastic_hvd: Horovod-compatible data-parallel training that survives rank loss in place.

Layers: :mod:`elastic_hvd.core` (MPI/ULFM, no TensorFlow), ``elastic_hvd.tensorflow``
(TF ops), ``elastic_hvd.tensorflow.keras`` (Keras), :mod:`elastic_hvd.runner` (launcher).
"""

__version__ = "0.1.0"
