"""MLX-backed KV caches that implement kvspec's spec.

``kvspec.impl.dense.KVCache`` (Fp16, Int8), ``kvspec.impl.turbo.TurboKVCache`` /
``kvspec.impl.turbo.DelegatedKVCache`` (the Turbo modes; ``kvspec.impl.turbo.make_cache``
builds any dense mode), ``kvspec.impl.rotating.RotatingKVCache`` and
``kvspec.impl.paged.PagedKVCache`` (one sequence of a ``BlockPool``) speak mlx-lm's
cache protocol and can be used as drop-in caches for mlx-lm models. This
package never imports ``fuzz`` or ``proofs``.
"""

# the folder is the package kvspec.impl (pyproject.toml maps it): imported as `impl` it would be a
# second copy of it, beside the one the rest of kvspec uses
if __name__ != "kvspec.impl":
    raise ImportError(f"{__name__}: this folder is the package kvspec.impl; import kvspec.impl")


from kvspec.impl.dense import CacheSnapshot, DetachedHandle, KVCache
from kvspec.impl.paged import BlockPool, PagedKVCache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache, make_cache

__all__ = ["BlockPool", "CacheSnapshot", "DelegatedKVCache", "DetachedHandle", "KVCache", "PagedKVCache",
           "TurboKVCache", "make_cache"]
