"""Differential fuzzing of ``impl`` against ``spec``: kvtrace traces,
lockstep replay, Hypothesis state machines, campaigns and the catalog of
injected bugs. Depends on ``spec`` and ``impl``; nothing depends on it."""
