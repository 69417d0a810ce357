"""The corpus of planted broken targets (docs/targets.md "The corpus"):
cache classes (``classes.py``) and a kvproto/1 adapter (``kvproto_dense.py``),
each member with one planted fault the harness claims to find, plus correct
controls. ``tests/test_broken_targets.py`` runs ``kvspec fuzz --target`` on
each and requires every broken member to fail and every control to pass."""
