"""MLX-backed KV caches that implement kvspec's spec.

``impl.dense.KVCache`` (Fp16, Int8), ``impl.turbo.TurboKVCache`` /
``impl.turbo.DelegatedKVCache`` (the Turbo modes; ``impl.turbo.make_cache``
builds any dense mode), ``impl.rotating.RotatingKVCache`` and
``impl.paged.PagedKVCache`` (one sequence of a ``BlockPool``) speak mlx-lm's
cache protocol and can be used as drop-in caches for mlx-lm models. This
package never imports ``fuzz`` or ``proofs``.
"""

from impl.dense import CacheSnapshot, DetachedHandle, KVCache
from impl.paged import BlockPool, PagedKVCache
from impl.turbo import DelegatedKVCache, TurboKVCache, make_cache

__all__ = ["BlockPool", "CacheSnapshot", "DelegatedKVCache", "DetachedHandle", "KVCache", "PagedKVCache",
           "TurboKVCache", "make_cache"]
