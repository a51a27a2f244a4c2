"""A Keras progress bar on exactly one rank: whichever is rank 0 now."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from elastic_hvd.core import runtime

if TYPE_CHECKING:
    from elastic_hvd.sharding import ElasticSampler


class RankZeroProgbar(tf.keras.callbacks.ProgbarLogger):
    """Use with ``model.fit(verbose=0, callbacks=[RankZeroProgbar()])``.

    Every rank keeps the bar's state; only the rank that is rank 0 at that moment
    draws it, so the bar goes on after the death of the original rank 0.  With the
    ``sampler`` (an :class:`~elastic_hvd.sharding.ElasticSampler`) the bar knows the
    epoch's length, which Keras cannot (the dataset is a generator): it is
    corrected after every step, as the membership changes it.
    """

    def __init__(self, verbose: int = 1, sampler: "ElasticSampler | None" = None) -> None:
        super().__init__()
        self._level = verbose
        self.sampler = sampler
        self.total_epochs: int | None = None  # set by fit_elastic, which runs one fit() per epoch

    def set_params(self, params: dict[str, Any]) -> None:
        params = dict(params, verbose=self._level)
        if self.total_epochs:
            params["epochs"] = self.total_epochs
        super().set_params(params)

    def _set_target(self, steps: int) -> None:
        if self.sampler is None:
            return
        self.target = steps
        if getattr(self, "progbar", None) is not None:
            self.progbar.target = steps

    def _epoch_length(self):
        """A fresh epoch's steps at the current size (before its first step draws)."""
        sampler = self.sampler
        return -(-sampler.num_samples // (sampler.comm.size * sampler.batch_size))


def _drawn_on_rank_zero(name: str) -> Callable[..., Any]:
    """Run the hook on every rank (so each keeps the bar's state) but let it draw
    only on the rank that is rank 0 now."""
    hook_of_keras = getattr(tf.keras.callbacks.ProgbarLogger, name)

    def hook(self: RankZeroProgbar, *args: Any, **kwargs: Any) -> Any:
        level = self._level if runtime.current("RankZeroProgbar").rank == 0 else 0
        self.verbose = level
        if getattr(self, "progbar", None) is not None:
            self.progbar.verbose = level
        if self.sampler is not None and name == "on_epoch_begin":
            self._set_target(self._epoch_length())
        elif self.sampler is not None and name == "on_train_batch_end":
            self._set_target(args[0] + 1 + self.sampler.steps_left())
        return hook_of_keras(self, *args, **kwargs)
    hook.__name__ = name
    return hook


for _name in ("on_epoch_begin", "on_train_batch_end", "on_epoch_end", "on_test_batch_end",
              "on_test_end", "on_predict_batch_end", "on_predict_end"):
    if hasattr(tf.keras.callbacks.ProgbarLogger, _name):
        setattr(RankZeroProgbar, _name, _drawn_on_rank_zero(_name))
