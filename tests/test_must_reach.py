"""Every coverage edge a verify campaign requires (``Kind.must_reach``) is
reached within the first ~25 examples: the rate of a campaign on a GPU,
where ``kvspec verify --device gpu`` runs about ten times fewer ops than on
the CPU in the same budget (an edge reached by chance after 200 examples
is missed there). The biases that make it so: the kind's ``sweep`` (a
field whose every value is an edge, pinned batch by batch) and a rule per
rare edge (the ring's ``reject_block``)."""

from __future__ import annotations

import pytest

from fuzz import kinds
from fuzz.campaign import Campaign

EXAMPLES = 25
CASES = [(k.kind, mode, inplace, seed) for k in kinds.KINDS.values() if k.must_reach
         for mode, inplace in k.campaigns for seed in (4, 6)]


@pytest.mark.parametrize(("kind", "mode", "inplace", "seed"), CASES)
def test_must_reach_within_few_examples(kind: str, mode: str, inplace: bool, seed: int) -> None:
    run = Campaign(kind, mode, inplace, 20261129 + seed)
    while run.report.examples < EXAMPLES and not run.failed:
        run.batch()
    assert run.report.failure is None, run.report.failure.error
    missed = [label for label in kinds.get(kind, mode).must_reach if not run.report.stats.get(label)]
    assert not missed, f"{kind}/{mode}/{inplace}: NOT REACHED in {run.report.examples} examples: {missed}"
