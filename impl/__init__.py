"""MLX-backed KV caches that implement kvspec's spec.

``impl.dense.KVCache`` (Fp16, Int8), ``impl.turbo.TurboKVCache`` /
``impl.turbo.DelegatedKVCache`` (the Turbo modes; ``impl.turbo.make_cache``
builds any dense mode) and ``impl.rotating.RotatingKVCache``
speak mlx-lm's cache protocol and can be used as drop-in caches for mlx-lm
models. This package never imports ``fuzz`` or ``proofs``.
"""

from impl.dense import CacheSnapshot, DetachedHandle, KVCache
from impl.turbo import DelegatedKVCache, TurboKVCache, make_cache

__all__ = ["CacheSnapshot", "DelegatedKVCache", "DetachedHandle", "KVCache", "TurboKVCache", "make_cache"]
