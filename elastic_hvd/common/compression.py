"""The framework-free half of Horovod's ``Compression``: the interface and ``none``; each
front end adds its ``fp16`` (a cast in its own tensor type)."""

from typing import Any


class Compressor:
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Returns (compressed tensor, context for decompress)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor
