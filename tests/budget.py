"""Example budgets that follow the loaded Hypothesis profile.

A test that sets its own ``max_examples`` (or runs a loop of drawn cases)
passes its CI budget through :func:`examples`: under the ``ci`` profile it is
unchanged, under ``HYPOTHESIS_PROFILE=mutation`` (``make mutation``,
tests/conftest.py) it shrinks in proportion to the profile's
``max_examples``, so that a mutant that survives does not pay the whole CI
budget of every test that reaches it (docs/mutation.md)."""

from hypothesis import settings

#: ``max_examples`` of the ``ci`` profile (tests/conftest.py)
CI_EXAMPLES = 60


def examples(ci_budget: int) -> int:
    """``ci_budget`` scaled by the loaded profile's ``max_examples`` over
    :data:`CI_EXAMPLES`, at least 1 and never above ``ci_budget``."""
    return max(1, min(ci_budget, ci_budget * settings.default.max_examples // CI_EXAMPLES))


def reduced() -> bool:
    """Whether the loaded profile runs fewer examples than ``ci`` (the
    mutation profile): a test with a time budget then runs a fixed amount
    of work instead, so that its verdict on a mutant does not depend on the
    machine's load."""
    return settings.default.max_examples < CI_EXAMPLES
