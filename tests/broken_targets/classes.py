"""Cache classes for ``kvspec fuzz --target tests.broken_targets.classes:NAME``
(docs/targets.md "The corpus of broken targets"): two correct controls
(:class:`DenseControl`, a small dense cache in MLX written the way a user
would; :class:`RingControl`, this project's ``RotatingKVCache`` declared as
a target) and one subclass per planted fault, each changing one method.

Windows are ``(keys, values)`` MLX arrays ``[B, H, n, D]`` (``Dk`` for
keys, ``Dv`` for values) in the dtype handed in."""

from __future__ import annotations

import mlx.core as mx

from kvspec.impl.rotating import RotatingKVCache


class Snap:
    """A copied snapshot: ``fetch()`` is the window it was taken of."""

    def __init__(self, window, offset):
        self.window, self.offset = window, offset

    def fetch(self):
        return self.window


class DenseControl:
    """A dense cache (docs/dense.md, mode fp16) by concatenation: logical
    trim, copied snapshots, no preallocation (``capacity`` is not an
    attribute, so it is not compared)."""

    kvspec_kind = "dense"
    #: class-level defaults the instance overwrites (the observables must be
    #: read from the instance: a harness reading the class sees only these)
    live_start = 0

    def __init__(self, step=256):
        self.keys = self.values = None
        self.offset = 0
        self.live_len = 0

    def _set(self, keys, values):
        self.keys, self.values = keys, values
        self.offset = self.live_len = 0 if keys is None else keys.shape[2]

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self._set(keys, values)
        else:
            self._set(mx.concatenate([self.keys[..., : self.offset, :], keys], axis=2),
                      mx.concatenate([self.values[..., : self.offset, :], values], axis=2))
        return self.keys, self.values

    def fetch(self):
        if self.offset == 0:
            return None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n):
        n = max(0, min(n, self.offset))
        self.offset -= n
        self.live_len = self.offset
        return n

    def trim_to(self, length):
        if not 0 <= length <= self.offset:
            raise ValueError(f"trim_to: length must be in [0, {self.offset}], got {length}")
        return self.trim(self.offset - length)

    def snapshot(self):
        w = self.fetch()
        return Snap(None if w is None else (mx.array(w[0]), mx.array(w[1])), self.offset)

    def restore(self, snap):
        self._set(*(snap.window or (None, None)))


class TrimDropsOldest(DenseControl):
    """trim(n) drops the oldest n rows instead of the newest (wrong rows after trim)."""

    def trim(self, n):
        n = max(0, min(n, self.offset))
        if n:
            self._set(self.keys[..., n: self.offset, :], self.values[..., n: self.offset, :])
        return n


class OffsetNotLowered(DenseControl):
    """trim_to lowers the live length but not the offset (wrong offset)."""

    def trim_to(self, length):
        if not 0 <= length <= self.offset:
            raise ValueError("bad length")
        n = self.offset - length
        self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]
        self.live_len = length
        return n

    def fetch(self):
        return None if self.live_len == 0 else (self.keys[..., : self.live_len, :], self.values[..., : self.live_len, :])


class LiveStartOnInstance(DenseControl):
    """live_start counts the rows trimmed so far, on the instance only; the
    class attribute stays 0 (observables read from the class pass it)."""

    def trim(self, n):
        removed = super().trim(n)
        self.live_start = getattr(self, "live_start", 0) + removed
        return removed


class LiveLenStale(DenseControl):
    """live_len is not lowered by trim (wrong live window length)."""

    def trim(self, n):
        before = self.live_len
        removed = super().trim(n)
        self.live_len = before
        return removed


class ValuesWithKeysHeadDim(DenseControl):
    """V rows kept in a buffer as wide as the keys' head dim: columns past
    Dk come back as zeros (only when Dv > Dk)."""

    def update_and_fetch(self, keys, values):
        dk, dv = keys.shape[-1], values.shape[-1]
        if dv > dk:
            values = mx.concatenate([values[..., :dk], mx.zeros((*values.shape[:-1], dv - dk), values.dtype)], -1)
        return super().update_and_fetch(keys, values)


class Bf16ThroughF16(DenseControl):
    """bfloat16 rows stored through float16 (wide rows overflow to inf)."""

    def update_and_fetch(self, keys, values):
        if keys.dtype == mx.bfloat16:
            keys, values = (x.astype(mx.float16).astype(mx.bfloat16) for x in (keys, values))
        return super().update_and_fetch(keys, values)


class F32ThroughBf16(DenseControl):
    """float32 rows stored through bfloat16 (the low mantissa bits are lost)."""

    def update_and_fetch(self, keys, values):
        if keys.dtype == mx.float32:
            keys, values = (x.astype(mx.bfloat16).astype(mx.float32) for x in (keys, values))
        return super().update_and_fetch(keys, values)


class BatchRowsOfFirst(DenseControl):
    """Every sequence of a batch gets sequence 0's rows (batch > 1 only)."""

    def update_and_fetch(self, keys, values):
        keys, values = (mx.broadcast_to(x[:1], x.shape) for x in (keys, values))
        return super().update_and_fetch(keys, values)


class RefusesEmptyTrim(DenseControl):
    """Refuses trim(0), which the spec runs (a no-op returning 0)."""

    def trim(self, n):
        if n == 0:
            raise ValueError("trim: n must be positive")
        return super().trim(n)


class SnapshotAliases(DenseControl):
    """snapshot() returns a view of the live cache, not of its rows then."""

    def snapshot(self):
        return self


class RestoreForgets(DenseControl):
    """restore() does nothing."""

    def restore(self, snap):
        return None


class RingControl(RotatingKVCache):
    """This project's sliding-window cache (docs/rotating.md), as a target."""

    kvspec_kind = "rotating"


class RingMaskWideWindow(RingControl):
    """make_mask answers for a window one row narrower than the ring when the
    ring is 8 rows or wider."""

    def make_mask(self, N, window_size=None, return_array=False):
        if window_size is None and self.max_size >= 8:
            window_size = self.max_size - 1
        return super().make_mask(N, window_size=window_size, return_array=return_array)


class RingKeyError(RingControl):
    """A rollback beyond what the ring can undo raises KeyError (a crash)
    where the spec refuses with StateError."""

    def trim_to(self, length):
        if 0 <= length <= self.offset and self.offset - length > self.trimmable_rows():
            raise KeyError(length)
        return super().trim_to(length)


class TrimZeroDropsBuffer(DenseControl):
    """A trim to zero rows deletes the buffers' attribute; the next append
    reads it (an AttributeError in the class's own code, a crash)."""

    def trim(self, n):
        removed = super().trim(n)
        if self.offset == 0:
            del self.keys
        return removed


class TrimToKeyError(DenseControl):
    """trim_to a length outside [0, offset] looks the length up in a dict
    of kept lengths and raises KeyError (a crash) where the spec refuses
    with InvalidArgumentError."""

    def trim_to(self, length):
        if not 0 <= length <= self.offset:
            return {}[length]
        return super().trim_to(length)


class OffsetFloat(DenseControl):
    """Reports ``offset`` as a float (3.0 where 3 rows were seen; rows,
    trims and live_len right): equal to 3, but a slice bound or an
    ``mx.arange`` of positions a model builds from it raises or goes
    fractional."""

    def __init__(self, step=256):
        super().__init__(step)
        self.__dict__["offset"] = 0.0

    def __setattr__(self, name, value):
        super().__setattr__(name, float(value) if name == "offset" else value)

    def __getattribute__(self, name):
        # the class's own methods compute with the int; readers see the float
        if name == "offset" and _caller_is_own():
            return int(object.__getattribute__(self, "__dict__")["offset"])
        return object.__getattribute__(self, name)


def _caller_is_own():
    import sys

    return sys._getframe(2).f_code.co_filename == __file__


class LiveLenRaisesWhenEmpty(DenseControl):
    """live_len is a property that divides by the offset: raises
    ZeroDivisionError on an empty cache (a crash while being read)."""

    live_len = property(lambda self: self.offset * self.offset // self.offset,
                        lambda self, v: None)


class LiveLenOfNoneBuffer(DenseControl):
    """live_len reads the buffer's length: an AttributeError (``None.shape``)
    on a cache with no buffer (fresh, or restored from an empty snapshot)."""

    live_len = property(lambda self: min(self.offset, self.keys.shape[2]), lambda self, v: None)
