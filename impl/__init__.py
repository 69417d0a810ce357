"""MLX-backed KV caches that implement kvspec's spec.

``impl.dense.KVCache`` (Fp16, Int8) and ``impl.rotating.RotatingKVCache``
speak mlx-lm's cache protocol and can be used as drop-in caches for mlx-lm
models. This package never imports ``fuzz`` or ``proofs``.
"""

from impl.dense import CacheSnapshot, DetachedHandle, KVCache

__all__ = ["CacheSnapshot", "DetachedHandle", "KVCache"]
