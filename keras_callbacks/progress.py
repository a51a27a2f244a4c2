"""A Keras progress bar on exactly one rank: whichever is rank 0 now."""

import tensorflow as tf

from elastic_hvd.core import runtime


class RankZeroProgbar(tf.keras.callbacks.ProgbarLogger):
    """Use with ``model.fit(verbose=0, callbacks=[RankZeroProgbar()])``.

    Every rank keeps the bar's state; only the rank that is rank 0 at that moment
    draws it, so the bar goes on after the death of the original rank 0.
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


def _drawn_on_rank_zero(name):
    """Run the hook on every rank (so each keeps the bar's state) but let it draw
    only on the rank that is rank 0 now."""
    hook_of_keras = getattr(tf.keras.callbacks.ProgbarLogger, name)

    def hook(self, *args, **kwargs):
        level = self._level if runtime.current("RankZeroProgbar").rank == 0 else 0
        self.verbose = level
        if getattr(self, "progbar", None) is not None:
            self.progbar.verbose = level
        return hook_of_keras(self, *args, **kwargs)
    hook.__name__ = name
    return hook


for _name in ("on_epoch_begin", "on_train_batch_end", "on_epoch_end", "on_test_batch_end",
              "on_test_end", "on_predict_batch_end", "on_predict_end"):
    if hasattr(tf.keras.callbacks.ProgbarLogger, _name):
        setattr(RankZeroProgbar, _name, _drawn_on_rank_zero(_name))
