"""Source of a small cache package written the way a user of kvspec would
write one (docs/targets.md), kept as text: tests copy it into a package
under ``tmp_path``, outside this repository's packages, and point
``--target`` / ``--kvspec-target`` at it.

``ListCache`` is correct for the dense kind (it has no ``capacity``,
``live_len`` or ``live_start``, no ``trim_to`` and no detached handles: those
are reported as not compared and skipped). ``NegativeTrimCache`` is the
planted bug: ``trim(n)`` clamps only from above, so ``trim(-1)`` returns -1
and moves the offset over a row nobody wrote (the fault mlx-lm 0.32 has).
``CategoryCache`` refuses a bad ``trim_to`` with its own words and a
ValueError, which is the spec's category (invalid argument);
``WrongCategoryCache`` refuses it with a RuntimeError (state), which is not.
"""

CACHE_MODULE = '''
import mlx.core as mx


class Snap:
    def __init__(self, window):
        self.window = window

    def fetch(self):
        return self.window


class ListCache:
    kvspec_kind = "dense"

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.offset == 0:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys[..., : self.offset, :], keys], axis=2)
            self.values = mx.concatenate([self.values[..., : self.offset, :], values], axis=2)
        self.offset = self.keys.shape[2]
        return self.keys, self.values

    def fetch(self):
        if self.offset == 0:
            return None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n):
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def snapshot(self):
        return Snap(self.fetch())

    def restore(self, snap):
        w = snap.window
        if w is None:
            self.keys = self.values = None
            self.offset = 0
        else:
            self.keys, self.values = w
            self.offset = w[0].shape[2]


class NegativeTrimCache(ListCache):
    def trim(self, n):
        n = min(n, self.offset)
        self.offset -= n
        return n


class CategoryCache(ListCache):
    def trim_to(self, length):
        if not 0 <= length <= self.offset:
            raise ValueError(f"bad length {length}")
        return self.trim(self.offset - length)


class WrongCategoryCache(ListCache):
    def trim_to(self, length):
        if not 0 <= length <= self.offset:
            raise RuntimeError("cannot do that now")
        return self.trim(self.offset - length)


class NoKind(ListCache):
    kvspec_kind = None
'''


def write_package(root, name="usercache"):
    """Write the package ``name`` (module ``name.cache``) under ``root``;
    returns ``root`` (to put on sys.path / PYTHONPATH)."""
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache.py").write_text(CACHE_MODULE)
    return root
