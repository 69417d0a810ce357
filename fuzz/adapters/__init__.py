"""Targets of other engines, each written against the target API
(``fuzz/targets.py``, docs/targets.md) exactly as a user's would be."""
