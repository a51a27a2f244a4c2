"""Horovod's ``hvd.SyncBatchNorm``: batch normalization over the batches of every live rank.

In training, each rank's per-channel sums of ``x`` and ``x**2`` and its count travel in
one differentiable Sum allreduce (one transaction), whose gradient is the allreduce of
the statistics' gradients: the backward pass of batch normalization over the union of the
ranks' batches.  Unlike Horovod's (GPU only), CPU tensors work too.  In evaluation with
running statistics, or alone, it is a plain batch normalization.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..basics import size
from ..core.ops import Sum
from .compression import Compression
from .mpi_ops import _compressed_allreduce


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm*d`` whose batch statistics are those of every live rank's batch
    (``num_features``: the channels ``C`` of an ``(N, C, ...)`` input)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _factor(self) -> float:
        """The running statistics' update factor (Horovod's, as ``_BatchNorm``'s)."""
        if self.momentum is not None:
            return float(self.momentum)
        tracked = self.num_batches_tracked  # cumulative moving average
        return 1.0 / float(tracked) if tracked is not None and int(tracked) > 0 else 0.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if not self.training and self.track_running_stats:
            return self._plain(input, use_batch_stats=False)
        if size() == 1:
            return self._plain(input, use_batch_stats=True)
        return self._synced(input)

    def _plain(self, input: torch.Tensor, use_batch_stats: bool) -> torch.Tensor:
        momentum = self._factor() if use_batch_stats and self.track_running_stats else 0.0
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            use_batch_stats, momentum, self.eps)

    def _synced(self, input: torch.Tensor) -> torch.Tensor:
        channels = input.size(1)
        dims = [0] + list(range(2, input.dim()))
        work = input if input.dtype in (torch.float32, torch.float64) else input.float()
        local = torch.cat([work.sum(dims), (work * work).sum(dims),
                           work.new_tensor([input.numel() // channels])])
        total = _compressed_allreduce([local], Compression.none, Sum, 1.0, 1.0,
                                      "HorovodSyncBatchNorm")[0]
        count = total[-1].detach()
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean  # biased, as in training
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (work - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)  # type: ignore[union-attr]
        if self.track_running_stats and self.running_mean is not None:
            factor = self._factor()
            with torch.no_grad():
                unbiased = var.detach() * count / max(float(count) - 1.0, 1.0)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),  # type: ignore[union-attr]
                                                       alpha=factor)
        return out.to(input.dtype)
