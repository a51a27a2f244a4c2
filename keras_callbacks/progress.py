"""A Keras progress bar on exactly one rank: whichever is rank 0 now."""

import tensorflow as tf

from elastic_hvd.core import runtime


class RankZeroProgbar(tf.keras.callbacks.ProgbarLogger):
    """Use with ``model.fit(verbose=0, callbacks=[RankZeroProgbar()])``.

    Every rank keeps the bar's state; only the rank that is rank 0 at that moment
    draws it, so the bar survives the death of the original rank 0.
    """

    def __init__(self, verbose=1):
        super().__init__()
        self._level = verbose
        self.total_epochs = None  # set by fit_elastic, which runs one fit() per epoch

    def set_params(self, params):
        params = dict(params, verbose=self._level)
        if self.total_epochs:
            params["epochs"] = self.total_epochs
        super().set_params(params)


def _only_on_rank_zero(name):
    draw = getattr(tf.keras.callbacks.ProgbarLogger, name)

    def hook(self, *args, **kwargs):
        if runtime.current("RankZeroProgbar").rank == 0:
            return draw(self, *args, **kwargs)
        return None
    hook.__name__ = name
    return hook


for _name in ("on_epoch_begin", "on_train_batch_end", "on_epoch_end", "on_test_batch_end", "on_test_end",
              "on_predict_batch_end", "on_predict_end"):
    if hasattr(tf.keras.callbacks.ProgbarLogger, _name):
        setattr(RankZeroProgbar, _name, _only_on_rank_zero(_name))
