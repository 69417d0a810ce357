"""Test configuration: a deterministic Hypothesis profile for CI.

``derandomize`` makes every run of the suite draw the same examples, and no
example database is kept, so a CI result depends on the code alone. Campaigns
(``kvspec fuzz``) are where randomness belongs.

``HYPOTHESIS_PROFILE=mutation`` (set by ``make mutation``) is the same
profile without the shrink phase: a mutant is killed by the first failing
example, and minimising that example only costs time per mutant (it is what
made most mutmut runs hit their timeout).
"""

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    stateful_step_count=30,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
settings.register_profile(
    "mutation", settings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter):
    """Say which engines the recorded transformers traces were replayed on
    (tests/test_transformers_traces.py): ours always, transformers where
    PyTorch is installed."""
    import sys

    mod = sys.modules.get("tests.test_transformers_traces")
    if mod is None or not any(mod.DONE.values()):
        return
    on = f"and against transformers ({mod.DONE['transformers']})" if mod.DONE["transformers"] else (
        "only (PyTorch/transformers not installed: optional extra 'transformers')")
    terminalreporter.write_line(f"kvspec: recorded transformers traces replayed against our caches "
                                f"({mod.DONE['ours']}) {on}")
