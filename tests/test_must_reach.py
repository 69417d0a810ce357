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


#: catalog bugs whose edge is rare under random ops: their biasing rule
#: must make every seed catch them within a few dozen examples (before the
#: rules, on seeds 1-3: old_regrow_guard 182, 15, 270 examples;
#: inplace_after_trim 32, 81, 5)
FAST = ("old_regrow_guard", "inplace_after_trim")


@pytest.mark.parametrize("name", FAST)
def test_rare_edge_bugs_are_caught_within_40_examples(name: str, tmp_path) -> None:
    from fuzz.bugs import by_name
    from fuzz.campaign import catch_bug

    bug = by_name(name)
    examples = []
    for seed in (1, 2, 3):
        caught, _seconds, n, _path, alarm = catch_bug(bug, seed, 60, tmp_path, shrink=False)
        assert caught and alarm is None, (seed, n, alarm)
        examples.append(n)
    assert max(examples) <= 40, examples
