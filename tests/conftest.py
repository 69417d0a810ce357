"""Test configuration: a deterministic Hypothesis profile for CI.

``derandomize`` makes every run of the suite draw the same examples, and no
example database is kept, so a CI result depends on the code alone. Campaigns
(``kvspec fuzz``) are where randomness belongs.
"""

import os

from hypothesis import HealthCheck, settings

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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
