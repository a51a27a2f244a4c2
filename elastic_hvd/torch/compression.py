"""Gradient compression, as Horovod's ``horovod.torch.Compression`` (none, fp16)."""

from typing import Any

import torch

from ..common.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tensor.type(ctx)


class Compression:
    """Horovod's ``hvd.Compression``: ``none`` (as is) or ``fp16`` (floats travel as float16)."""

    none = NoneCompressor
    fp16 = FP16Compressor
