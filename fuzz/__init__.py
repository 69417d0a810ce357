"""Differential fuzzing of ``impl`` against ``spec``: kvtrace traces,
lockstep replay, Hypothesis state machines, campaigns and the catalog of
injected bugs. Depends on ``spec`` and ``impl``; nothing depends on it."""

import warnings as _warnings

from spec.errors import RollbackWarning as _RollbackWarning

# The harness compares every trim with the spec (a refused rollback is an
# expected outcome there); the once-per-cache RollbackWarning is for decoding
# loops. The e2e scenarios that check it record it explicitly.
_warnings.filterwarnings("ignore", category=_RollbackWarning)
