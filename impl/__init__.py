"""MLX-backed KV caches that implement kvspec's spec.

``impl.dense.KVCache`` (Fp16, Int8), ``impl.rotating.RotatingKVCache`` and
``impl.paged.PagedKVCache`` (one sequence of a ``BlockPool``) speak mlx-lm's
cache protocol and can be used as drop-in caches for mlx-lm models. This package never imports ``fuzz`` or ``proofs``.
"""

from impl.dense import CacheSnapshot, DetachedHandle, KVCache
from impl.paged import BlockPool, PagedKVCache

__all__ = ["BlockPool", "CacheSnapshot", "DetachedHandle", "KVCache", "PagedKVCache"]
